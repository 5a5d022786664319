"""Throwaway local Redis processes for the fleet benchmark (and its cluster tests).

``RedisProc.start()`` is one private ``redis-server`` on a free loopback port with
persistence off; ``kill()`` is SIGKILL (a crash), ``restart()`` starts it again, empty, on
the same port; ``stop()`` ends it by pid. The test scaffolding
(:mod:`kvbank.testing.servers`) reuses it; bench code never imports the tests' helpers.

``RedisClusterProcs.start(masters=3, replicas=0)`` starts ``masters * (1 + replicas)``
``redis-server --cluster-enabled yes`` processes on free loopback ports (each port and
its bus port, +10000, checked free), joins them with ``redis-cli --cluster create`` and
waits until every node says ``cluster_state:ok`` with all 16,384 slots and, with
replicas, every replica's link is up (about 2 s; see redis-fleet.md 1). ``stop()`` ends
each process by pid (SIGTERM, SIGKILL after 5 s) and removes the directory.
``kill_master_of(key)`` SIGKILLs the master owning a key's slot (a failover test).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


class MissingBinary(RuntimeError):
    """redis-server or redis-cli is not installed."""


INSTALL_HINT = (
    "redis-server not found on PATH; install it (Debian/Ubuntu: `apt-get install "
    "redis-server`, macOS: `brew install redis`) to run the Redis tests and benchmarks"
)


@dataclass
class RedisProc:
    """One private redis-server on loopback (persistence off); ``stop()`` ends it by pid."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, timeout_s: float = 10) -> RedisProc:
        binary = shutil.which("redis-server")
        if binary is None:
            raise MissingBinary(INSTALL_HINT)
        workdir = Path(tempfile.mkdtemp(prefix="kvbank-redis-"))
        for _ in range(5):  # a port can be taken between choosing it and the bind
            port = _free_pair()
            proc = _spawn(binary, port, workdir)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and proc.poll() is None:
                if _info(port, "PING") == "PONG":
                    return cls(port, workdir, proc)
                time.sleep(0.02)
            proc.kill()
            proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
        raise RuntimeError(f"redis-server did not answer PING within {timeout_s}s")

    def _wait_ping(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while _info(self.port, "PING") != "PONG":
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"redis-server on {self.port} did not answer PING")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL (a Redis crash); :meth:`restart` brings it back on the same port."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def restart(self, timeout_s: float = 10) -> None:
        """Start again on the same port, empty (persistence is off), once PING answers."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise MissingBinary(INSTALL_HINT)
        self.kill()
        self.proc = _spawn(binary, self.port, self.workdir)
        self._wait_ping(timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _spawn(binary: str, port: int, workdir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                             str(workdir), "--save", "", "--appendonly", "no",
                             "--protected-mode", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


NODE_TIMEOUT_MS = 2000  # a failover takes about twice this


def free_pairs(n: int) -> list[int]:
    """``n`` distinct loopback ports, each with its cluster bus port (+10000), free now."""
    out: list[int] = []
    while len(out) < n:
        p = _free_pair()
        if p not in out:
            out.append(p)
    return out


def _free_pair() -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _cli(*args: str, timeout: float = 30) -> str:
    binary = shutil.which("redis-cli")
    if binary is None:
        raise MissingBinary("redis-cli not found on PATH (it comes with redis-server)")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout,
                          check=True).stdout


@dataclass
class RedisClusterProcs:
    ports: list[int]
    workdir: str
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def seeds(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    @classmethod
    def start(cls, masters: int = 3, replicas: int = 0, timeout_s: float = 30,
              ports: Sequence[int] = ()) -> RedisClusterProcs:
        """The cluster, on ``ports`` when given (one per process, each with its bus port
        +10000 free: a test can name a cluster's seeds before it exists)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise MissingBinary("redis-server not found on PATH")
        workdir = tempfile.mkdtemp(prefix="kvbank-cluster-")
        self = cls([], workdir)
        try:
            want = list(ports)
            for _ in range(masters * (1 + replicas)):
                port = want.pop(0) if want else _free_pair()
                self.ports.append(port)
                self.procs[port] = subprocess.Popen(
                    [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
                     "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                     "--save", "", "--appendonly", "no",
                     "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                     "--cluster-require-full-coverage", "no",
                     "--repl-diskless-sync-delay", "0"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout_s
            for port in self.ports:
                while _info(port, "PING") != "PONG":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cluster node {port} did not answer PING")
                    time.sleep(0.02)
            _cli("--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                 "--cluster-replicas", str(replicas), "--cluster-yes")
            while not self._ready(replicas > 0):
                if time.monotonic() > deadline:
                    raise RuntimeError("cluster did not become ready")
                time.sleep(0.05)
            return self
        except BaseException:
            self.stop()
            raise

    def _ready(self, with_replicas: bool) -> bool:
        for port in self.ports:
            info = _info(port, "CLUSTER", "INFO")
            if ("cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info
                    or f"cluster_known_nodes:{len(self.ports)}" not in info):
                return False
            if with_replicas:
                rep = _info(port, "INFO", "replication")
                if "role:slave" in rep and "master_link_status:up" not in rep:
                    return False
        return True

    def master_of(self, key: bytes) -> int:
        """The port of the master that owns ``key``'s slot now (0: none while a failover
        settles)."""
        from kvbank.tiers.redis_client import key_slot

        slot = key_slot(key)
        alive = next(p for p in self.ports if self.procs[p].poll() is None)
        for line in _info(alive, "CLUSTER", "NODES").splitlines():
            parts = line.split()
            if "master" not in parts[2] or "fail" in parts[2]:
                continue
            for rng in parts[8:]:
                lo, _, hi = rng.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return int(parts[1].split(":")[1].split("@")[0])
        return 0

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _info(port: int, *cmd: str) -> str:
    """One command over a raw socket (no client library needed to watch the nodes)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall((f"*{len(cmd)}\r\n" + "".join(
                f"${len(c)}\r\n{c}\r\n" for c in cmd)).encode())
            data = b""
            s.settimeout(1)
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                if data.startswith(b"+") and data.endswith(b"\r\n"):
                    return data[1:-2].decode()
                if data.startswith(b"$"):
                    head, _, body = data.partition(b"\r\n")
                    if len(body) >= int(head[1:]) + 2:
                        return body[: int(head[1:])].decode()
                if data.startswith(b"-"):
                    return data.decode()
    except OSError:
        return ""
    return data.decode(errors="replace")
