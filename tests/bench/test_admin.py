"""``kvbank bench admin``: the suite is registered and its rows-list case prints the
contract name with a baseline measured in the same run (a small bank here)."""

from __future__ import annotations

from kvbank.bench import SUITES, admin


def test_bench_admin_rows_list_row() -> None:
    assert SUITES["admin"] == "kvbank.bench.admin"
    r = admin._rows_list(2_000, 1)
    assert (r.suite, r.case, r.metric) == ("admin", "rows-list-1m", "ms")
    assert r.value > 0 and r.baseline_value > 0 and "2,000 rows" in r.baseline
    assert abs(r.ratio - r.value / r.baseline_value) < 1e-3
