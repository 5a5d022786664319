"""The fleet bench prints the case names the issue fixes, with baselines from the same run."""

from __future__ import annotations

import shutil

import pytest

from kvbank.bench import fleet
from kvbank.testing.servers import in_ci


def test_bench_fleet_cases_without_nodes() -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        if in_ci():
            pytest.fail("CI=true but redis-server / redis-cli are not installed")
        pytest.skip("redis-server and redis-cli are needed")
    rows = [*fleet._lookup_rows(quick=True), fleet._remote_get(quick=True),
            fleet._index_bytes(quick=True)]
    assert [r.case for r in rows] == ["match-1000-fleet", "match-1000-cluster", "remote-get",
                                      "index-bytes-per-row-redis"]
    for r in rows:
        assert r.suite == "fleet" and r.value > 0 and r.baseline_value > 0
    assert 100 < rows[-1].value < 400  # bytes per indexed row: a packed string, not a set
