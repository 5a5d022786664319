"""The reuse audit's quarantine on a bank (``bank.audit``): a mismatch report stops the
layout's rows being served (match and presence find none, a fetch of an earlier match
delivers none), other layouts are untouched, an operator's clear serves them again, and
with a disk tier the quarantine survives a restart."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbank import Bank, BankConfig, full_attention
from kvbank.bank.quarantine import QUARANTINE_FILE
from kvbank.errors import ConfigError, InvalidInput, TierUnavailable, UnknownLayout

FA = full_attention("audit@1", num_layers=1, num_kv_heads=2, head_dim=64)  # 16 tokens a page
OTHER = full_attention("audit-other@1", num_layers=1, num_kv_heads=2, head_dim=64)
P = FA.tokens_per_page
PAGE = FA.group_page_bytes[0]
TOKENS = list(range(5 * P + 1))


def pages(n: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, PAGE), dtype=np.uint8))


def open_bank(data: Path | None = None) -> Bank:
    disk = {"data_dir": data, "disk_bytes": "64M"} if data is not None else {}
    b = Bank.open(BankConfig(), host_bytes="16M", device_bytes=0, **disk)
    b.register(FA)
    b.register(OTHER)
    return b


def stored(bank: Bank) -> None:
    for layout in (FA, OTHER):
        bank.put(layout.layout_id, TOKENS[: 5 * P], group=0, pages=pages(5, 1))


def test_mismatch_quarantines_the_layout_until_cleared() -> None:
    with open_bank() as bank:
        stored(bank)
        before = bank.match(FA.layout_id, TOKENS)
        assert before.resume.tokens == 5 * P
        assert bank.audit.report(FA.layout_id, ok=True, pages=5, error=1e-7, tolerance=1e-3) is False
        assert bank.audit.report(FA.layout_id, ok=False, pages=5, error=0.8, tolerance=1e-3,
                                 detail="layer 0 KEY differs") is True
        assert bank.match(FA.layout_id, TOKENS).resume.tokens == 0
        assert bank.presence(FA.layout_id, TOKENS).tokens == 0
        got = bank.fetch(before, out=bank.out_buffers(before))  # a match taken before
        assert got.resume.tokens == 0 and not any(got.delivered)
        assert bank.fetch_prefix(FA.layout_id, TOKENS).tokens == 0
        assert bank.match(OTHER.layout_id, TOKENS).resume.tokens == 5 * P  # untouched
        [entry] = bank.audit.entries()
        assert (entry.layout_id, entry.mismatches, entry.detail) == (FA.layout_id, 1, "layer 0 KEY differs")
        bank.audit.report(FA.layout_id, ok=False, error=math.inf, tolerance=1e-3)
        assert bank.audit.entries()[0].mismatches == 2
        n = bank.audit.counts()
        assert (n.ok, n.mismatched, n.quarantined) == (1, 2, 1)
        assert len(bank.admin.rows(FA.layout_id)) == 5  # kept for the operator, not served
        assert bank.audit.clear(FA.layout_id) is True
        assert bank.audit.clear(FA.layout_id) is False
        assert bank.match(FA.layout_id, TOKENS).resume.tokens == 5 * P
        assert bank.fetch_prefix(FA.layout_id, TOKENS).tokens == 5 * P


def test_report_refuses_bad_input_and_unknown_layouts() -> None:
    with open_bank() as bank:
        with pytest.raises(InvalidInput, match="layout_id"):
            bank.audit.report(FA.layout_id[:16], ok=False)
        with pytest.raises(InvalidInput, match="ok"):
            bank.audit.report(FA.layout_id, ok=0)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput, match="error"):
            bank.audit.report(FA.layout_id, ok=False, error=-1.0)
        with pytest.raises(UnknownLayout):
            bank.audit.report(bytes(32), ok=False)
        assert bank.audit.entries() == ()
    with pytest.raises(TierUnavailable, match="closed"):
        bank.audit.entries()


def test_quarantine_survives_a_restart_and_a_damaged_file_is_refused(tmp_path: Path) -> None:
    with open_bank(tmp_path) as bank:
        stored(bank)
        bank.audit.report(FA.layout_id, ok=False, error=0.5, tolerance=1e-3, detail="wrong weights")
    assert oct((tmp_path / QUARANTINE_FILE).stat().st_mode & 0o777) == "0o600"
    with open_bank(tmp_path) as bank:
        assert [e.detail for e in bank.audit.entries()] == ["wrong weights"]
        assert bank.match(FA.layout_id, TOKENS).resume.tokens == 0
        assert bank.match(OTHER.layout_id, TOKENS).resume.tokens == 5 * P
        bank.audit.clear(FA.layout_id)
    with open_bank(tmp_path) as bank:
        assert bank.audit.entries() == ()
        assert bank.match(FA.layout_id, TOKENS).resume.tokens == 5 * P
    (tmp_path / QUARANTINE_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="damaged"):
        Bank.open(BankConfig(), host_bytes="16M", device_bytes=0, data_dir=tmp_path, disk_bytes="64M")
