"""`kvbank demo`, the README's first command, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_runs_end_to_end_through_the_disk_tier(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvbank.cli", "demo", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "resume at token 960" in out
    assert "bytes identical to what was stored: True" in out
    assert "resume at 992 of 1000" in out
    assert "resume at 32 (NO_SNAPSHOT)" in out
    assert "invariants hold" in out
    assert (tmp_path / "data.mdb").exists() or any(tmp_path.rglob("*.mdb"))
