"""The borrower's side of a HOST lease, in another process.

A lease crosses the process boundary as plain JSON (:meth:`Lease.to_json`): segment
names, offsets and sizes, never pickled objects. :class:`Borrower` maps each shared-memory
segment once through :func:`kvbank.tiers.host.map_segment` (the one segment mapper and
name check, shared with :class:`kvbank.tiers.host.SlotMapping`; plain ``os.open`` +
:mod:`mmap`, so no resource tracker unlinks the owner's segment) and hands out views of
the leased rows.

Lifecycle in the borrowing process::

    lease = Lease.from_json(text)          # sent by the owner
    with Borrower() as b:
        n = b.read_into(lease, name, out)  # copy, then check the deadline again
        b.view(lease, name)[:] = page      # WRITE lease: fill in place; the owner commits

The deadline check at completion uses ``lease.expires_at`` on ``time.monotonic`` —
CLOCK_MONOTONIC, shared by every process of a Linux host, which is the lender's default
clock. The owner still enforces expiry on its side (:meth:`Lender.finish_read`).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from types import TracebackType

from kvbank.errors import InvalidInput, LeaseExpired
from kvbank.lender.base import HostLocation, Lease, MemoryKind
from kvbank.tiers.host import map_segment


class Borrower:
    """Maps the host segments of leases (each once) and reads or fills rows in place."""

    def __init__(self, *, writable: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self._writable = writable
        self._clock = clock
        self._maps: dict[str, mmap.mmap] = {}
        self._views: dict[str, memoryview] = {}

    def segment(self, name: str) -> memoryview:
        """The whole segment ``name``, mapped on first use."""
        mv = self._views.get(name)
        if mv is not None:
            return mv
        mm = map_segment(name, writable=self._writable)
        self._maps[name] = mm
        mv = self._views[name] = memoryview(mm)
        return mv

    def _location(self, lease: Lease, name: bytes) -> HostLocation:
        if lease.kind is not MemoryKind.HOST:
            raise InvalidInput(f"lease: {lease.id} is a {lease.kind.name} lease, not HOST")
        try:
            row = lease.row(name)
        except KeyError:
            raise InvalidInput(f"name: row {name.hex()[:16]}… is not in lease {lease.id}") from None
        if not isinstance(row.location, HostLocation):
            raise InvalidInput(f"name: row {name.hex()[:16]}… has no bytes in lease {lease.id}")
        return row.location

    def view(self, lease: Lease, name: bytes) -> memoryview:
        """The row's bytes in place; valid while the lease lives."""
        loc = self._location(lease, name)
        seg = self.segment(loc.segment)
        if loc.offset + loc.size > len(seg):
            raise InvalidInput(f"lease: row at {loc.offset}+{loc.size} is beyond segment {loc.segment}")
        return seg[loc.offset : loc.offset + loc.size]

    def check(self, lease: Lease) -> None:
        """Raise :class:`LeaseExpired` if ``lease``'s deadline has passed."""
        if self._clock() >= lease.expires_at:
            raise LeaseExpired(f"lease_id: lease {lease.id} expired")

    def read_into(self, lease: Lease, name: bytes, out: memoryview | bytearray) -> int:
        """Copy the row into ``out``; its size, only if the lease was live when the copy
        completed (bytes copied from an expired lease may be reclaimed memory)."""
        src = self.view(lease, name)
        dst = memoryview(out).cast("B")
        if len(dst) < len(src):
            raise InvalidInput(f"out: {len(dst)} bytes, the row holds {len(src)}")
        dst[: len(src)] = src
        self.check(lease)
        return len(src)

    def close(self) -> None:
        """Unmap every segment. Views handed out must no longer be used."""
        for mv in self._views.values():
            mv.release()
        for mm in self._maps.values():
            mm.close()
        self._views.clear()
        self._maps.clear()

    def __enter__(self) -> Borrower:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
