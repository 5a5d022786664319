"""Fixtures for the SGLang backend tests: a real ``kvbank serve`` and SGLang processes.

The tests need SGLang in their venv; without it every test here skips with the recipe
below (``KVBANK_REQUIRE_SGLANG=1``, as ``.ci/sglang`` sets, turns the skip into a failure).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SGLANG_HINT = ("SGLang is not installed in this venv. Set it up with .ci/sglang (a venv with "
               "torch==2.13.0+cpu, sglang==0.5.23 installed --no-deps and the few packages "
               ".ci/sglang names), then run pytest tests/integrations/sglang with that venv's python")
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
HERE = Path(__file__).parent


def require_sglang() -> None:
    """Skip (or, under KVBANK_REQUIRE_SGLANG=1, fail) when SGLang is missing."""
    if HAVE_SGLANG:
        return
    if os.environ.get("KVBANK_REQUIRE_SGLANG") == "1":
        pytest.fail(SGLANG_HINT)
    pytest.skip(SGLANG_HINT, allow_module_level=True)


class Engine:
    """A :mod:`driver` process: SGLang's controller with the kvbank backend attached
    (``hybrid``: its ``HybridCacheController`` over a KV and a Mamba pool)."""

    def __init__(self, url: str, model: str, log: Path, *, hybrid: bool = False) -> None:
        self._err = open(log, "w")  # noqa: SIM115 - closed in close()
        self.log = log
        arg = {"url": url, "model": model, "hybrid": hybrid}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "driver.py"), json.dumps(arg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
            env={**os.environ, "PYTHONPATH": str(HERE.parents[2])})
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                doc: dict[str, Any] = json.loads(line[7:])
                return doc
        raise RuntimeError("driver exited: " + self.log.read_text()[-4000:])

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)
        finally:
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None:
                    f.close()
            self._err.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    require_sglang()
    from kvbank.service.launch import NodeProcess

    n = NodeProcess.start(["--data-dir", str(tmp_path / "node"), "--host-bytes", "64M",
                           "--disk-bytes", "128M", "--device-bytes", "0"])
    try:
        yield n
    finally:
        n.stop()
