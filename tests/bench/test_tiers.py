"""The tiers bench suite runs and yields well-formed rows with same-run baselines."""

from __future__ import annotations

import json

from kvbank.bench.tiers import run


def test_bench_tiers_quick_rows() -> None:
    rows = list(run(quick=True))
    cases = {r.case for r in rows}
    assert {"host-put", "host-get", "disk-get-warm", "demote", "stage-host-many-64"} <= cases
    assert any(c.startswith("evict-") for c in cases)
    assert any(c.startswith("index-bytes-per-row") for c in cases)
    for r in rows:
        assert r.suite == "tiers" and r.value > 0 and r.baseline_value > 0
        assert abs(r.ratio - r.value / r.baseline_value) < 1e-3
        assert json.loads(r.to_json())["case"] == r.case
