"""``kvbank bench kernels`` and ``kvbank bench e2e``: the case names the issue fixed, every
row with a baseline measured in the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbank.bench import SUITES, kernels

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ["suite", "case", "metric", "value", "baseline", "baseline_value", "ratio"]


def test_bench_kernels_rows_name_the_contract_cases() -> None:
    rows = list(kernels.run(quick=True))
    cases = [r.case for r in rows]
    assert {"gather", "scatter"} <= set(cases)
    assert {"gather-split", "gather-fused", "scatter-split", "scatter-fused"} <= set(cases)
    for r in rows:
        assert r.suite == "kernels" and r.metric == "GB/s"
        assert r.value > 0 and r.baseline_value > 0
        assert r.ratio == pytest.approx(r.value / r.baseline_value, rel=1e-3, abs=1e-4)  # rounded to 4 places
    # The contract rows report the slower pool shape.
    by = {r.case: r for r in rows}
    for case in ("gather", "scatter"):
        assert by[case].ratio == min(by[f"{case}-split"].ratio, by[f"{case}-fused"].ratio)


@pytest.mark.slow
def test_bench_e2e_json_prints_the_three_cases() -> None:
    assert SUITES["e2e"] == "kvbank.bench.e2e"
    proc = subprocess.run(
        [sys.executable, "-m", "kvbank.cli", "bench", "e2e", "--json", "--quick"],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
        timeout=280, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in rows] == ["ttft-hit-4k", "ttft-miss-4k", "store-overhead-4k"]
    for r in rows:
        assert list(r) == FIELDS
        assert r["suite"] == "e2e" and r["metric"] == "s"
        assert r["value"] > 0 and r["baseline_value"] > 0
