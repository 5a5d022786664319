"""The lender bench's lease-overhead case runs through the Bank API alone and yields a
well-formed row with a same-run baseline."""

from __future__ import annotations

import json

from kvbank.bench.lender import _lend_release


def test_bench_lender_lend_release_row() -> None:
    r = _lend_release(quick=True)
    assert (r.suite, r.case, r.metric) == ("lender", "lend-release-ops", "leases/s")
    assert r.value > 0 and r.baseline_value > 0
    assert abs(r.ratio - r.value / r.baseline_value) < 1e-3
    assert json.loads(r.to_json())["case"] == "lend-release-ops"
