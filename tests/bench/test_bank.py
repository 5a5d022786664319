"""The bank bench suite prints every case of its contract with same-run baselines."""

from __future__ import annotations

import json

from kvbank.bench import SUITES
from kvbank.bench.bank import run

CASES = ("bank-put-host", "bank-fetch-host", "bank-put-disk-durable", "bank-fetch-disk",
         "bank-disk-footprint-bf16", "bank-disk-encode-only", "bank-disk-decode-only",
         "bank-put-disk", "disk-get-warm-vs-raw", "disk-put-durable-vs-fdatasync")


def test_bench_bank_quick_rows() -> None:
    assert SUITES["bank"] == "kvbank.bench.bank"
    rows = list(run(quick=True))
    assert [r.case for r in rows if not r.case.endswith("-real")] == list(CASES)
    assert [r.case for r in rows if r.case.endswith("-real")] == [c + "-real" for c in CASES]
    for r in rows:
        assert r.suite == "bank" and r.value > 0 and r.baseline_value > 0
        assert abs(r.ratio - r.value / r.baseline_value) < 1e-3
        assert json.loads(r.to_json())["case"] == r.case
        if r.case.startswith("bank-disk-footprint"):
            assert r.metric == "x" and r.baseline_value == 1.0
            assert r.value < 0.75  # bf16 pages are byte-plane frames (uint8 ones are ~0.78)
        else:
            assert r.metric == "GB/s"
