"""Real servers for tests: free loopback ports and a private ``redis-server``.

Tests never use a machine's shared Redis: each session starts its own ``redis-server`` on
a free 127.0.0.1 port with persistence off, and stops it by pid. Where the binary is
missing the tests that need it skip with a message saying how to install it — except
under ``CI=true``, where a missing binary is a failure, so a CI machine without Redis
can never pass by skipping.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = (
    "redis-server not found on PATH; install it (Debian/Ubuntu: `apt-get install "
    "redis-server`, macOS: `brew install redis`) to run the Redis tests"
)


class MissingBinary(RuntimeError):
    """A binary the tests need is not installed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@dataclass
class RedisServer:
    """A private redis-server process on loopback; ``stop()`` ends it by pid."""

    port: int
    pid: int
    workdir: Path
    _proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, timeout_s: float = 10.0) -> RedisServer:
        binary = redis_binary()
        if binary is None:
            raise MissingBinary(INSTALL_HINT)
        workdir = Path(tempfile.mkdtemp(prefix="kvbank-redis-"))
        for _ in range(5):  # a port can be taken between free_port() and bind
            port = free_port()
            proc = subprocess.Popen(
                [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                 "--appendonly", "no", "--dir", str(workdir), "--protected-mode", "yes"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and proc.poll() is None:
                if _ping(port):
                    return cls(port, proc.pid, workdir, proc)
                time.sleep(0.02)
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
        raise RuntimeError(f"redis-server did not answer PING within {timeout_s}s")

    def stop(self) -> None:
        if self._proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self._proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False
