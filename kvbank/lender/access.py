"""Reading and filling a lease's rows in place (mixed into
:class:`~kvbank.lender.lender.Lender`, which holds the lease table).

- :meth:`~LeaseAccess.view` / :meth:`~LeaseAccess.device_view` — a row's bytes where the
  lease holds them (READ: verified against the row's checksum first; WRITE: to fill);
- :meth:`~LeaseAccess.read_into` / :meth:`~LeaseAccess.read` — a copy, valid only if the
  lease outlived it;
- :meth:`~LeaseAccess.write` — a WRITE lease's slot filled under the lender's lock;
- :meth:`~LeaseAccess.check_live` — the completion check after a read in place;
- :meth:`~LeaseAccess.checksums` — what a reader that copies the rows verifies against.

A READ row whose bytes no longer match its checksum raises :class:`CorruptPage` and is
noted on the lease (:class:`_Held`), so its host copy is dropped when the lease ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

from kvbank.errors import CorruptPage, InvalidInput
from kvbank.lender import reads, writes
from kvbank.lender.base import HostLocation, Lease, LeaseMode, LendingStore
from kvbank.lender.reads import Slot
from kvbank.tiers.base import DeviceSlot, HostSlot

if TYPE_CHECKING:
    import _thread
    import threading

    import torch

    from kvbank.tiers.lockorder import OrderedLock


@dataclass(slots=True)
class _Held:
    """The lender's record of one live lease."""

    lease: Lease  # the snapshot last handed out
    deadline: float
    names: tuple[bytes, ...]  # the names the lease lists (its rows', in order)
    locked: tuple[bytes, ...]  # READ: rows locked in the store under this lease's id
    slots: dict[bytes, Slot] = field(default_factory=dict)  # READ staged / WRITE reserved
    parents: dict[bytes, bytes | None] = field(default_factory=dict)  # WRITE: chain parents
    changed: set[bytes] = field(default_factory=set)  # READ: rows that failed their checksum


class LeaseAccess:
    """A lender's reads and writes through its leases (see the module docstring)."""

    if TYPE_CHECKING:  # the lender's (Lender): its lock, clock, store and lease table
        _lock: OrderedLock | threading.RLock | _thread.LockType
        _clock: Callable[[], float]
        _store: LendingStore
        _held: dict[str, _Held]

        def _live(self, lease_id: str, now: float, *, end: bool = True) -> _Held: ...

    def _slot(self, lease_id: str, name: bytes) -> tuple[Lease, Slot]:
        if type(name) is not bytes:
            raise InvalidInput(f"name: expected a row name (bytes), got {type(name).__name__}")
        with self._lock:
            held = self._live(lease_id, self._clock(), end=False)
            slot = held.slots.get(name)
            if slot is None:
                raise InvalidInput(
                    f"name: row {bytes(name).hex()[:16]}… has no bytes in lease {lease_id} "
                    "(not listed, missing, or already stored)"
                )
            return held.lease, slot

    def view(self, lease_id: str, name: bytes) -> memoryview:
        """The row's host bytes in place (READ: read them; WRITE: fill them).

        Valid only while the lease lives; call :meth:`check_live` after reading. A READ
        row is verified first: bytes that no longer match the row's checksum raise
        :class:`CorruptPage` (the row is a miss; its host copy is dropped when the lease
        ends).
        """
        lease, slot = self._slot(lease_id, name)
        if not isinstance(slot, HostSlot):
            raise InvalidInput(f"lease_id: {lease_id} is a DEVICE lease; use device_view")
        view = self._store.host.view(slot)
        if lease.mode is LeaseMode.READ and not self._store.host.verify(name, view):
            view.release()
            self._changed(lease_id, name)
        return view

    def _changed(self, lease_id: str, name: bytes) -> NoReturn:
        """Note a READ row whose bytes failed their checksum (dropped at the lease's end)."""
        with self._lock:
            held = self._held.get(lease_id)
            if held is not None:
                held.changed.add(name)
        raise CorruptPage(f"row {name.hex()[:16]}…: its host bytes changed since commit "
                          "(checksum); not served, and dropped")

    def checksums(self, lease_id: str) -> dict[bytes, int]:
        """The checksum of each row of a READ HOST lease (a row with none recorded is
        left out): what a reader that copies the rows verifies its copies against."""
        with self._lock:
            lease = self._live(lease_id, self._clock(), end=False).lease
        names = [r.name for r in lease.rows if isinstance(r.location, HostLocation)]
        if lease.mode is not LeaseMode.READ or not names:
            return {}
        sums = self._store.host.checksums(names)
        return {n: v for n, v in zip(names, sums, strict=True) if v is not None}

    def device_view(self, lease_id: str, name: bytes) -> torch.Tensor:
        """The row's device bytes in place (a uint8 tensor)."""
        _, slot = self._slot(lease_id, name)
        if not isinstance(slot, DeviceSlot):
            raise InvalidInput(f"lease_id: {lease_id} is a HOST lease; use view")
        return self._store.device.view(slot)

    def check_live(self, lease_id: str) -> None:
        """Check that the lease is still live now that a read completed.

        Raises :class:`LeaseExpired` (or :class:`LeaseNotFound` if it was released): the
        bytes read may be reclaimed memory and must not be used (Mooncake#4239).
        """
        with self._lock:
            self._live(lease_id, self._clock(), end=False)

    def read_into(self, lease_id: str, name: bytes, out: memoryview | bytearray) -> int:
        """Copy a leased row into ``out``; the byte count, valid only because the lease was
        still live when the copy completed (else :class:`LeaseExpired`)."""
        lease, slot = self._slot(lease_id, name)
        size = reads.copy_out(self._store, slot, name, out)
        if (lease.mode is LeaseMode.READ and isinstance(slot, HostSlot)
                and not self._store.host.verify(name, memoryview(out).cast("B")[:size])):
            self._changed(lease_id, name)
        self.check_live(lease_id)
        return size

    def read(self, lease_id: str, name: bytes) -> bytes:
        """The leased row's bytes, returned only if the lease outlived the copy."""
        _, slot = self._slot(lease_id, name)
        buf = bytearray(slot.size)
        self.read_into(lease_id, name, buf)
        return bytes(buf)

    def write(self, lease_id: str, name: bytes, data: bytes | bytearray | memoryview) -> None:
        """Fill a WRITE lease's reserved slot (an in-process convenience over :meth:`view`).

        The copy runs under the lender's lock, unlike a read's: a write has no completion
        check to fall back on. Were the lease reaped between the liveness check and the
        copy, its slot would go back to the store and could already hold another row,
        whose bytes the late copy would overwrite."""
        src = memoryview(data).cast("B")
        with self._lock:
            lease, slot = self._slot(lease_id, name)
            if lease.mode is not LeaseMode.WRITE:
                raise InvalidInput(f"lease_id: {lease_id} is a READ lease; it cannot be written")
            writes.fill(self._store, slot, name, src)


__all__ = ["LeaseAccess"]
