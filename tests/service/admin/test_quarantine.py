"""The reuse audit on a real served node: an engine's mismatch report (``client.audit``,
``POST /v1/audit``) quarantines the layout — the node's matches find none of its rows, a
health note and the metrics say so, the admin lists it — until an operator clears it
(``kvbank admin quarantine --clear``); an ok report changes nothing."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvbank import Client, full_attention
from kvbank.cli import main
from kvbank.errors import InvalidInput, UnknownLayout
from kvbank.service.launch import NodeProcess
from tests.service.conftest import admin_headers

FA = full_attention("audit-served@1", num_layers=1, num_kv_heads=2, head_dim=64)  # 16 tokens a page
OTHER = full_attention("audit-served-other@1", num_layers=1, num_kv_heads=2, head_dim=64)
P = FA.tokens_per_page
TOKENS = list(range(4 * P + 1))


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_mismatch_report_quarantines_the_layout_until_an_operator_clears_it(
        node: NodeProcess, capsys: pytest.CaptureFixture[str]) -> None:
    head = admin_headers(node)
    pages = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (4, FA.group_page_bytes[0]), dtype=np.uint8))
    with Client(node.url) as c:
        for layout in (FA, OTHER):
            c.register(layout)
            c.put(layout.layout_id, TOKENS[: 4 * P], group=0, pages=pages)
        assert c.match(FA.layout_id, TOKENS).resume.tokens == 4 * P
        assert c.audit.report(FA.layout_id, ok=True, pages=4, error=1e-7, tolerance=1e-3) is False
        assert c.match(FA.layout_id, TOKENS).resume.tokens == 4 * P
        assert c.audit.report(FA.layout_id, ok=False, pages=4, error=float("inf"), tolerance=1e-3,
                              detail="group 0 layer 0 KEY: relative error inf") is True
        assert c.match(FA.layout_id, TOKENS).resume.tokens == 0
        assert c.fetch_prefix(FA.layout_id, TOKENS).tokens == 0
        assert c.match(OTHER.layout_id, TOKENS).resume.tokens == 4 * P
        with pytest.raises(UnknownLayout):
            c.audit.report(bytes(32), ok=False)
        with pytest.raises(InvalidInput):
            c.audit.report(FA.layout_id[:8], ok=False)

        health = httpx.get(f"{node.url}/admin/health", headers=head).json()
        assert any(r.startswith(f"audit: layout {FA.layout_id.hex()} quarantined") for r in health["degraded"])
        got = samples(httpx.get(f"{node.url}/metrics", headers=head).text)
        assert got[("kvbank_audits_total", (("result", "ok"),))] == 1
        assert got[("kvbank_audits_total", (("result", "mismatch"),))] == 1
        assert got[("kvbank_quarantined_layouts", ())] == 1
        doc = httpx.get(f"{node.url}/admin/quarantine", headers=head).json()
        assert [e["layout_id"] for e in doc["layouts"]] == [FA.layout_id.hex()]
        assert doc["layouts"][0]["error"] is None  # inf crosses as null
        assert httpx.get(f"{node.url}/admin/quarantine").status_code == 401

        token = ["--token", head["Authorization"].split()[1]]
        assert main(["admin", "--url", node.url, *token, "quarantine"]) == 0
        assert FA.layout_id.hex() in capsys.readouterr().out
        assert main(["admin", "--url", node.url, *token, "quarantine", "--clear", FA.layout_id.hex()]) == 0
        assert main(["admin", "--url", node.url, *token, "--json", "quarantine"]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["layouts"] == []
        assert main(["admin", "--url", node.url, *token, "quarantine", "--clear", FA.layout_id.hex()]) == 1
        assert c.match(FA.layout_id, TOKENS).resume.tokens == 4 * P
        health = httpx.get(f"{node.url}/admin/health", headers=head).json()
        assert not any(r.startswith("audit:") for r in health["degraded"])
