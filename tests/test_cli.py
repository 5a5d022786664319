"""The kvbank command as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

from kvbank import __version__

ROW_FIELDS = ["suite", "case", "metric", "value", "baseline", "baseline_value", "ratio"]


def _kvbank(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbank.cli", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )


def test_cli_version_and_help() -> None:
    res = _kvbank("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"kvbank {__version__}"
    res = _kvbank("--help")
    assert res.returncode == 0
    for word in ("bench", "demo"):
        assert word in res.stdout


def test_cli_bench_keys_json_prints_one_row_per_case() -> None:
    res = _kvbank("bench", "keys", "--json", "--quick")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["case"] for r in rows] == ["chain-128k", "chain-128k-list"]
    for r in rows:
        assert list(r) == ROW_FIELDS
        assert r["suite"] == "keys" and r["metric"] == "pages/s"
        assert r["value"] > 0 and r["baseline_value"] > 0
        assert abs(r["ratio"] - r["value"] / r["baseline_value"]) < 1e-3


def test_cli_unknown_suite_is_a_usage_error() -> None:
    res = _kvbank("bench", "nonsense")
    assert res.returncode == 2
    assert "invalid choice" in res.stderr
