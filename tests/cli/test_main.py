"""The kvbank command as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    for word in ("serve", "bench", "demo"):
        assert word in res.stdout


def test_cli_help_and_version_import_no_torch_and_no_http_stack() -> None:
    """--help and --version must answer at once: nothing heavy is imported for them."""
    code = ("import sys\nfrom kvbank import cli\n"
            "try:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'numpy', 'uvicorn', 'fastapi', 'httpx',"
            " 'kvbank.bank.bank') if m in sys.modules]\n"
            "print('heavy=' + ','.join(heavy))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "heavy="


def test_cli_bare_kvbank_prints_help_and_exits_2() -> None:
    res = _kvbank()
    assert res.returncode == 2
    assert "usage: kvbank" in res.stderr and "serve" in res.stderr


def test_cli_every_subcommand_says_what_it_does() -> None:
    for command in ("serve", "bench", "demo"):
        res = _kvbank(command, "--help")
        assert res.returncode == 0, res.stderr
        lines = res.stdout.split("\n\n")
        assert len(lines) >= 2 and len(lines[1].strip()) > 20, f"{command} --help has no description"
    res = _kvbank("serve", "--help")
    assert "quarter of" in res.stdout and "available memory" in res.stdout  # how budgets are sized


def test_cli_serve_print_config_is_toml_of_the_effective_settings(tmp_path: Path) -> None:
    import tomllib

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "KVBANK_PORT": "7999"}
    res = subprocess.run([sys.executable, "-m", "kvbank.cli", "serve", "--print-config", "--host-bytes", "96M"],
                         capture_output=True, text=True, timeout=60, check=False, env=env)
    assert res.returncode == 0, res.stderr
    doc = tomllib.loads(res.stdout)
    assert doc["port"] == 7999 and doc["bind"] == "127.0.0.1"
    assert doc["bank"]["host_bytes"] == 96 << 20 and doc["bank"]["data_dir"] == str(tmp_path / "kvbank")


def test_cli_serve_bad_setting_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    res = _kvbank("serve", "--print-config", "--port", "99999")
    assert res.returncode == 2 and "port" in res.stderr


def test_cli_serve_never_reads_a_prefix_as_another_setting() -> None:
    """Regression: ``--device cpu`` was taken for ``--device-bytes cpu`` (argparse's
    abbreviations), a setting the user never named."""
    res = _kvbank("serve", "--print-config", "--device", "cpu")
    assert res.returncode == 2
    assert "unrecognized arguments: --device cpu" in res.stderr
    assert "device_bytes" not in res.stderr


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
