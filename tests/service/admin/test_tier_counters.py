"""The eviction counters on ``/admin/tiers`` and ``/metrics``: bytes admitted per tier,
and the eviction rule's victims by reason."""

from __future__ import annotations

from pathlib import Path

from tests.service.admin_app import PAGE, auth, fill, served


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
