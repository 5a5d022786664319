"""Real servers for tests: free loopback ports and a private ``redis-server``.

Tests never use a machine's shared Redis: each session starts its own ``redis-server`` on
a free 127.0.0.1 port with persistence off, and stops it by pid. The process is the
benchmark's own (:class:`kvbank.procs.RedisProc`): one starter for both, and
the dependency points from the tests' helpers to the benchmarks, never back. Where the
binary is missing the tests that need it skip with a message saying how to install it —
except under ``CI=true``, where a missing binary is a failure, so a CI machine without
Redis can never pass by skipping.
"""

from __future__ import annotations

import os
import shutil
import socket

from kvbank.procs import INSTALL_HINT, MissingBinary, RedisProc

__all__ = ["INSTALL_HINT", "MissingBinary", "RedisServer", "free_port", "in_ci", "redis_binary"]

RedisServer = RedisProc  # a private redis-server process on loopback; ``stop()`` by pid


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")
