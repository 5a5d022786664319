"""The eviction counters on ``/admin/tiers`` and ``/metrics``: bytes admitted per tier,
the eviction rule's victims by reason, and the page bytes moved between tiers."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.service.admin_app import FA, PAGE, P, auth, fill, served


def test_admitted_bytes_and_victims_by_reason_are_served(tmp_path: Path) -> None:
    with served(None) as (client, node):
        fill(node.bank, 5, seed=1)
        tiers = {t["kind"]: t for t in client.get("/admin/tiers", headers=auth()).json()["tiers"]}
        host = tiers["HOST"]
        assert host["admitted_bytes"] == 5 * PAGE
        assert host["rejected_bytes"] == host["victims_first_time"] == host["victims_reused"] == 0
        text = client.get("/metrics", headers=auth()).text
    assert f'kvbank_tier_admitted_bytes_total{{tier="host"}} {float(5 * PAGE)}' in text
    assert 'kvbank_tier_victims_total{reason="first_time",tier="host"} 0.0' in text
    assert 'kvbank_tier_rejected_bytes_total{tier="host"} 0.0' in text


def test_bytes_moved_between_tiers_are_served(tmp_path: Path) -> None:
    """A host budget of a few pages forces demotions to disk; a read of a demoted row
    promotes it back. Each counts its rows' page bytes on its pair of tiers, the same on
    ``/admin/tiers`` and ``/metrics``."""
    with served(tmp_path, host_bytes=16 * PAGE) as (client, node):
        fill(node.bank, 40, seed=2)
        assert client.post("/admin/flush", json={"timeout_s": 30}, headers=auth()).status_code == 200
        m = node.bank.match(FA.layout_id, list(range(20_000, 20_000 + P + 1)))  # the first row: on disk
        assert node.bank.fetch(m, out={0: torch.zeros((1, PAGE), dtype=torch.uint8)}).complete
        tiers = {t["kind"]: t for t in client.get("/admin/tiers", headers=auth()).json()["tiers"]}
        text = client.get("/metrics", headers=auth()).text
    host, disk = tiers["HOST"], tiers["DISK"]
    assert host["demotions"] > 0 and host["promotions"] == 1
    assert host["demoted_bytes"] == {"DISK": host["demotions"] * PAGE}
    assert host["promoted_bytes"] == {"DISK": PAGE}
    assert disk["demoted_bytes"] == disk["promoted_bytes"] == {}
    assert f'kvbank_tier_moved_bytes_total{{from="host",to="disk"}} {float(host["demotions"] * PAGE)}' in text
    assert f'kvbank_tier_moved_bytes_total{{from="disk",to="host"}} {float(PAGE)}' in text
