"""``kvbank bench service``: the issue's case names, exactly, each with its same-run baseline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CASES = ["fetch-remote", "put-remote", "fetch-local", "put-local", "fetch-local-check", "checksum",
         "check-floor", "match-1000", "match-1000-keys", "match-1000-8clients", "match-1000-8banks", "fetch-prefix-252",
         "fetch-remote-16"]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a hang guard only: ~1 min on a quiet machine, 5 min and more beside other loads
def test_bench_service_prints_one_row_per_case_with_its_baseline() -> None:
    res = subprocess.run([sys.executable, "-m", "kvbank.cli", "bench", "service", "--json", "--quick"],
                         capture_output=True, text=True, timeout=1100, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["case"] for r in rows] == CASES
    for r in rows:
        assert r["suite"] == "service" and r["value"] > 0 and r["baseline_value"] > 0
        assert abs(r["ratio"] - r["value"] / r["baseline_value"]) < 1e-3
