"""The README is executable documentation: its commands are CI's, its tour runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_has_exactly_two_setup_commands() -> None:
    shell = _blocks("sh")
    assert len(shell) == 2, "the README's set-up is two commands: serve and test"
    assert "kvbank" in shell[0] and "pytest" in shell[1]


def test_readme_test_command_is_what_ci_runs() -> None:
    test_cmd = _blocks("sh")[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [line for line in ci.splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert commands == [test_cmd]


def test_readme_tour_runs(tmp_path: Path) -> None:
    """The concept tour is code a reader can paste: it must run as written."""
    (code,) = _blocks("python")
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
