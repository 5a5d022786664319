"""Hostile settings and input are typed errors naming the field, at construction.

Regression tests for issue 9: on the landed code (5ba5ecc) every case below leaked a
builtin (``TypeError``, torch's ``RuntimeError``, ``NotImplementedError``), opened a
bank that could store nothing, created ``./lmdb``, or took ``True`` as token 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvbank import Bank, BankConfig, full_attention
from kvbank.errors import ConfigError, InvalidInput, InvalidTokens, KvbankError, LayoutError
from kvbank.keys import tokens_to_bytes

BAD_SETTINGS: list[tuple[dict[str, Any], str]] = [
    ({"host_bytes": 1.5}, "host_bytes"),
    ({"host_bytes": None}, "host_bytes"),
    ({"disk_bytes": None}, "disk_bytes"),
    ({"device_fraction": "0.5"}, "device_fraction"),
    ({"high_watermark": "0.9"}, "high_watermark"),
    ({"low_watermark": float("nan")}, "low_watermark"),
    ({"hots_bytes": 1}, "hots_bytes"),
    ({"device": "banana", "device_bytes": 1 << 20}, "device"),
    ({"device": 3}, "device"),
    ({"data_dir": ""}, "data_dir"),
    ({"data_dir": 7}, "data_dir"),
    ({"write_policy": 3}, "write_policy"),
    ({"disk_salvage": "yes"}, "disk_salvage"),
]


@pytest.mark.parametrize(("settings", "field"), BAD_SETTINGS, ids=lambda v: str(v))
def test_bad_settings_are_config_errors_naming_the_field(
        settings: dict[str, Any], field: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # data_dir="" used to create ./lmdb here
    with pytest.raises(ConfigError) as opened:
        Bank.open(BankConfig(), **settings)
    assert opened.value.field == field
    with pytest.raises(ConfigError) as replaced:
        BankConfig().replace(**settings)
    assert replaced.value.field == field
    assert not (tmp_path / "lmdb").exists()


def test_from_env_with_an_unknown_override_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="host_bytes"):
        BankConfig.from_env({}, hots_bytes="1G")


def test_a_bank_with_no_tier_is_refused_at_open() -> None:
    """It used to open, then fail at the first put with an empty reason."""
    with pytest.raises(ConfigError, match="no tier") as err:
        Bank.open(BankConfig(), host_bytes=0, device_bytes=0)
    assert err.value.field == "host_bytes"


def test_a_layout_whose_page_no_tier_can_hold_is_refused_at_register() -> None:
    """Accepted before, it failed only at put."""
    big = full_attention("big@1", num_layers=8, num_kv_heads=8, head_dim=128)  # 512 KiB pages
    with Bank.open(BankConfig(), host_bytes="64K", device_bytes=0) as bank:
        with pytest.raises(LayoutError, match="fits no tier") as err:
            bank.register(big)
        assert err.value.field == "groups[0]"
        small = full_attention("small@1", num_layers=1, num_kv_heads=1, head_dim=8)
        bank.register(small)  # a page that fits is still fine


@pytest.mark.parametrize("tokens", [[1, True, 3], (False, 2), [True] * 16])
def test_bool_token_ids_are_refused(tokens: Any) -> None:
    with pytest.raises(InvalidTokens, match="bool"):
        tokens_to_bytes(tokens)
    assert tokens_to_bytes([0, 1, 2]) == b"\0\0\0\0\1\0\0\0\2\0\0\0"  # 0 and 1 are ids


def test_meta_tensor_pages_are_a_typed_error_naming_the_field() -> None:
    fa = full_attention("meta@1", num_layers=1, num_kv_heads=1, head_dim=8)
    page = fa.group_page_bytes[0]
    with Bank.open(BankConfig(), host_bytes="1M", device_bytes=0) as bank:
        lid = bank.register(fa)
        pages = torch.empty((1, page), dtype=torch.uint8, device="meta")
        with pytest.raises(InvalidInput) as err:
            bank.put(lid, list(range(fa.tokens_per_page)), group=0, pages=pages)
        assert err.value.field == "pages"
        with pytest.raises(KvbankError):
            bank.put(lid, [True] * fa.tokens_per_page, group=0,
                     pages=torch.zeros((1, page), dtype=torch.uint8))
        assert bank.stats().store.rows == 0
