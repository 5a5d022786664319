"""The README is executable documentation: its commands are CI's, its tour runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kvbank.service.launch import NodeProcess

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
DEFAULT_URL = "http://127.0.0.1:7410"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_has_exactly_two_setup_commands() -> None:
    shell = _blocks("sh")
    assert len(shell) == 2, "the README's set-up is two commands: serve and test"
    assert shell[0].strip().endswith("kvbank serve"), "the first command starts the node"
    assert "pytest" in shell[1]


def test_readme_test_command_is_what_ci_runs() -> None:
    """CI runs the README's test command, and besides it only scripts of ``.ci/``: before
    it, the system packages the tests need that pip cannot bring (``.ci/chromium``); after
    it, the engine suites (``.ci/<engine>``, each building the venv its engine needs)."""
    test_cmd = _blocks("sh")[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line for line in ci.splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert commands.count(test_cmd) == 1, "CI runs the README's test command, once"
    for other in (c for c in commands if c != test_cmd):
        script = other.split()[0]
        assert script.startswith(".ci/") and (ROOT / script).is_file(), other


def test_readme_first_command_serves_the_embedded_default(tmp_path: Path) -> None:
    """``kvbank serve`` with no flags: 127.0.0.1, the cache dir, sized budgets. (The port is
    moved off 7410 through KVBANK_PORT so a test never collides with a running node.)"""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "KVBANK_PORT": "0"}
    res = subprocess.run([sys.executable, "-m", "kvbank.cli", "serve", "--print-config"], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert 'bind = "127.0.0.1"' in res.stdout and f'data_dir = "{tmp_path / "kvbank"}"' in res.stdout
    node = NodeProcess.start([], env=env)
    try:
        assert node.url.startswith("http://127.0.0.1:")
        ready = "".join(node.lines)
        assert str(tmp_path / "kvbank") in ready and "host tier" in ready and "disk tier" in ready
    finally:
        assert node.stop() == 0


def test_readme_tour_runs(tmp_path: Path) -> None:
    """The tour is code a reader can paste: it must run as written (the Client part against
    a node started here, at its own port instead of the default one)."""
    embedded, served = _blocks("python")
    res = subprocess.run(
        [sys.executable, "-c", embedded], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert DEFAULT_URL in served
    node = NodeProcess.start(["--data-dir", str(tmp_path / "node"), "--host-bytes", "64M",
                              "--disk-bytes", "256M", "--device-bytes", "0"])
    try:
        res = subprocess.run(
            [sys.executable, "-c", served.replace(DEFAULT_URL, node.url)], cwd=tmp_path,
            capture_output=True, text=True, timeout=120, check=False,
        )
    finally:
        assert node.stop() == 0
    assert res.returncode == 0, res.stderr
