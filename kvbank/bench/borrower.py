"""A borrowing process for cross-process lease tests and the lender benchmark.

Run ``python -m kvbank.bench.borrower``; it reads one JSON command per line on
stdin and answers one JSON line on stdout. Leases arrive in their wire form (``kvbank.wire.to_dict``) —
plain fields, no pickle — and the segments are mapped by name with
:class:`~kvbank.client.shm.Borrower` (each segment once, for the process's life).

Commands:

- ``{"op": "read", "lease": {...}}`` → ``{"ok": true, "digests": {name_hex: sha256_hex}}``
  for every READY row, each copied into a preallocated buffer and checked against the
  lease's deadline when the copy completed.
- ``{"op": "fill", "lease": {...}, "rows": [name_hex, ...], "seed": n}`` → fills those
  RESERVED rows in place with :func:`pattern` bytes; ``{"ok": true, "arrived": [...]}``.
- ``{"op": "bench", "leases": [{...}, ...], "repeat": n}`` → per repetition, seconds to
  copy every leased row into one preallocated buffer (``ours``) and to memcpy the same
  number of bytes between the same kind of buffers (``base``), interleaved.
- ``{"op": "exit"}``.

Errors answer ``{"ok": false, "error": <class name>, "message": ...}``.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kvbank import wire
from kvbank.client.shm import Borrower
from kvbank.errors import KvbankError
from kvbank.lender.base import Delivery, HostLocation, Lease


def pattern(name: bytes, seed: int, size: int) -> bytes:
    """Deterministic page bytes for a row (tests compare them on both sides)."""
    block = hashlib.sha256(name + seed.to_bytes(8, "little")).digest()
    return (block * (size // len(block) + 1))[:size]


def _read(b: Borrower, lease: Lease) -> dict[str, Any]:
    sizes = [r.location.size for r in lease.rows if isinstance(r.location, HostLocation)]
    buf = bytearray(max(sizes, default=0))
    digests: dict[str, str] = {}
    for row in lease.rows:
        if row.delivery is not Delivery.READY:
            continue
        n = b.read_into(lease, row.name, buf)
        digests[row.name.hex()] = hashlib.sha256(memoryview(buf)[:n]).hexdigest()
    return {"ok": True, "digests": digests}


def _fill(b: Borrower, lease: Lease, rows: list[str], seed: int) -> dict[str, Any]:
    arrived: list[str] = []
    for hexname in rows:
        name = bytes.fromhex(hexname)
        view = b.view(lease, name)
        view[:] = pattern(name, seed, len(view))
        view.release()
        arrived.append(hexname)
    b.check(lease)  # filled before the deadline, or the owner must not commit them
    return {"ok": True, "arrived": arrived}


def _bench(b: Borrower, leases: list[Lease], repeat: int) -> dict[str, Any]:
    rows = [(lease, r) for lease in leases for r in lease.rows if isinstance(r.location, HostLocation)]
    total = sum(r.location.size for _, r in rows if r.location is not None)
    dst = np.empty(total, np.uint8)  # preallocated and pre-faulted: page faults cost 10x
    dst.fill(0)
    src = np.empty(total, np.uint8)
    src.fill(1)
    for lease in leases:  # map every segment before timing
        for r in lease.rows:
            if isinstance(r.location, HostLocation):
                b.segment(r.location.segment)
    ours: list[float] = []
    base: list[float] = []
    for _ in range(repeat + 1):  # the first round warms up and is dropped
        t0 = time.perf_counter()
        pos = 0
        for lease in leases:
            for r in lease.rows:
                loc = r.location
                if not isinstance(loc, HostLocation):
                    continue
                seg = b.segment(loc.segment)
                dst[pos : pos + loc.size] = np.frombuffer(seg, np.uint8, loc.size, loc.offset)
                pos += loc.size
            b.check(lease)  # the copies count only if the lease outlived them
        t1 = time.perf_counter()
        np.copyto(dst, src)
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        base.append(t2 - t1)
    return {"ok": True, "bytes": total, "ours": ours[1:], "base": base[1:]}


def serve(stdin: Any = None, stdout: Any = None) -> None:
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    with Borrower(writable=True) as b:
        for line in stdin:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "exit":
                break
            try:
                if op == "ping":  # ready: imports done, the command loop running
                    reply: dict[str, Any] = {"ok": True}
                elif op == "read":
                    reply = _read(b, wire.from_dict(Lease, cmd["lease"]))
                elif op == "fill":
                    reply = _fill(b, wire.from_dict(Lease, cmd["lease"]), cmd["rows"], int(cmd["seed"]))
                elif op == "bench":
                    leases = [wire.from_dict(Lease, d) for d in cmd["leases"]]
                    reply = _bench(b, leases, int(cmd["repeat"]))
                else:
                    reply = {"ok": False, "error": "InvalidInput", "message": f"op: {op!r}"}
            except KvbankError as exc:
                reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
            stdout.write(json.dumps(reply) + "\n")
            stdout.flush()


class BorrowerProcess:
    """The owner's handle on a borrower: a fresh interpreter (never a fork of live state)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbank.bench.borrower"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def wait_ready(self) -> None:
        """Return once the borrower answers (a fresh interpreter imports torch first:
        5-9 s on a loaded machine), so a lease lent next is not spent on its start."""
        if not self.call("ping")["ok"]:
            raise RuntimeError("borrower: no answer to ping")

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one command, wait for its answer."""
        if self.proc.stdin is None or self.proc.stdout is None:
            raise RuntimeError("borrower: pipes closed")
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"borrower: exited with {self.proc.wait()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def kill(self) -> None:
        """SIGKILL: the borrower dies without a word to the owner."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._close_pipes()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.call_exit()
        self.proc.wait(timeout=30)
        self._close_pipes()

    def call_exit(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.flush()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()

    def __enter__(self) -> BorrowerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.close()
        else:
            self._close_pipes()


if __name__ == "__main__":
    serve()
