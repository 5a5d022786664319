"""The lender: leases on rows in place, page locks, expiry and the reaper.

Primitives (value objects in :mod:`kvbank.lender.base`):

- :meth:`Lender.lend` — a ``NAMED`` lease on rows, ``READ`` or ``WRITE``, in ``HOST`` or
  ``DEVICE`` memory, for ``ttl_s`` seconds (default ``config.lease_ttl_s``, at most
  ``config.max_lease_ttl_s``). :meth:`Lender.lend_all` — an ``ALL`` lease describing a
  tier's pools (no rows named, nothing locked) for a transfer engine's registration.
- :meth:`Lender.renew`, :meth:`Lender.release`, :meth:`Lender.commit` (WRITE: only the
  rows that arrived whole become visible; the other reserved slots go back).
- :meth:`Lender.finish_read` / :meth:`Lender.read_into` — the second expiry check: a read
  through a lease counts only if the lease was still live when the read *completed*;
  bytes read under an expired lease are not used (:class:`~kvbank.errors.LeaseExpired`).

Lifecycle::

    lend ──► read / fill in place ──► release (READ)  or  commit(arrived) (WRITE)
      │                │
      └── renew        └── deadline passes ──► expired: the reaper (a thread every
                                               config.reaper_interval_s, plus a lazy
                                               check on every lender call) drops the
                                               page locks and returns reserved slots

Page locks: a READ lease locks its present rows in the store (``holder = lease id``), so
the store never evicts, moves or overwrites them while the lease lives. A WRITE lease
holds invisible reserved slots that nothing can evict. Existence checks (the store's
``locate``, the bank's ``match``) never lend, lock or renew (Mooncake#2187).

Conflict rule, per row name — a readers/writer rule over the names a lease *lists*:
any number of READ leases may share a name; a WRITE lease excludes every other lease on
that name, READ or WRITE. A lend that breaks the rule raises
:class:`~kvbank.errors.LeaseConflict` and changes nothing. (A reader of a row being
filled learns it now rather than seeing a miss; two writers never race for one slot.)

A WRITE lease reserves a slot only for rows not already stored (those are listed
``PRESENT``); a row someone else stored before the commit keeps its bytes (equal names
are interchangeable bytes) and the reserved slot goes back.

Thread-safety: one re-entrant lock guards the lender's tables; the store has its own and
the lender always takes its lock first. Bulk copies in :meth:`read_into` run outside the
lender's lock — which is exactly why the completion check exists.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbank.config import BankConfig
from kvbank.errors import (
    InvalidInput,
    LeaseConflict,
    LeaseExpired,
    LeaseNotFound,
)
from kvbank.keys import ROW_NAME_BYTES
from kvbank.lender.base import (
    CommitResult,
    Delivery,
    DeviceLocation,
    HostLocation,
    Lease,
    LeaseMode,
    LeaseRow,
    LendingStore,
    Location,
    MemoryKind,
    PageShape,
    Selection,
)
from kvbank.tiers.base import DeviceSlot, HostSlot
from kvbank.tiers.host import SHM_DIR

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Clock = Callable[[], float]  # monotonic seconds
Describe = Callable[[bytes], PageShape | None]  # row name -> its page's size and regions
Slot = HostSlot | DeviceSlot

# what lending produced: rows, names locked, slots, WRITE chain parents
_Parts = tuple[tuple[LeaseRow, ...], tuple[bytes, ...], dict[bytes, Slot], dict[bytes, bytes | None]]

_TOMBSTONES = 4096  # ended lease ids remembered, so a late call says why (expired/released)


@dataclass(slots=True)
class _Held:
    """The lender's record of one live lease."""

    lease: Lease  # the snapshot last handed out
    deadline: float
    locked: tuple[bytes, ...]  # READ: rows locked in the store under this lease's id
    slots: dict[bytes, Slot] = field(default_factory=dict)  # READ staged / WRITE reserved
    parents: dict[bytes, bytes | None] = field(default_factory=dict)  # WRITE: chain parents


class Lender:
    """Leases over a :class:`~kvbank.lender.base.LendingStore`. See the module docstring."""

    def __init__(
        self,
        store: LendingStore,
        config: BankConfig,
        *,
        clock: Clock = time.monotonic,
        describe: Describe | None = None,
        reaper: bool = True,
    ) -> None:
        self._store = store
        self._config = config
        self._clock = clock
        self._describe: Describe = describe or (lambda name: None)
        self._host_segment: str | None = None
        self._lock = threading.RLock()
        self._held: dict[str, _Held] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap; stale entries skipped lazily
        self._readers: dict[bytes, set[str]] = {}  # name -> READ lease ids listing it
        self._writer: dict[bytes, str] = {}  # name -> the WRITE lease id listing it
        self._ended: OrderedDict[str, str] = OrderedDict()  # id -> "expired" | "released" …
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.expired_count = 0
        if reaper:
            self._thread = threading.Thread(
                target=self._reaper_loop, name="kvbank-lease-reaper", daemon=True
            )
            self._thread.start()

    # ---- validation --------------------------------------------------------------------

    def _ttl(self, ttl_s: float | None) -> float:
        if ttl_s is None:
            return float(self._config.lease_ttl_s)
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise InvalidInput(f"ttl_s: must be a positive number of seconds, got {ttl_s!r}")
        if ttl_s > self._config.max_lease_ttl_s:
            raise InvalidInput(
                f"ttl_s: {ttl_s} exceeds max_lease_ttl_s {self._config.max_lease_ttl_s}"
            )
        return float(ttl_s)

    @staticmethod
    def _enum(value: object, cls: type[MemoryKind] | type[LeaseMode], what: str) -> None:
        if not isinstance(value, cls):
            raise InvalidInput(f"{what}: expected a {cls.__name__}, got {value!r}")

    @staticmethod
    def _names(names: Sequence[bytes]) -> tuple[bytes, ...]:
        if isinstance(names, (bytes, bytearray, str)) or not isinstance(names, Sequence):
            raise InvalidInput(f"names: expected a sequence of row names, got {type(names).__name__}")
        if not names:
            raise InvalidInput("names: a NAMED lease needs at least one row name")
        for i, n in enumerate(names):
            if type(n) is not bytes or len(n) != ROW_NAME_BYTES:
                got = len(n) if isinstance(n, (bytes, bytearray, memoryview)) else type(n).__name__
                raise InvalidInput(f"names[{i}]: expected a {ROW_NAME_BYTES}-byte row name, got {got}")
        out = tuple(names)
        if len(set(out)) != len(out):
            raise InvalidInput("names: a row name is listed twice")
        return out

    def _check_open(self) -> None:
        if self._closed:
            from kvbank.errors import TierUnavailable

            raise TierUnavailable("lender: closed")

    # ---- lending -----------------------------------------------------------------------

    def lend(
        self,
        names: Sequence[bytes],
        *,
        kind: MemoryKind = MemoryKind.HOST,
        mode: LeaseMode = LeaseMode.READ,
        ttl_s: float | None = None,
    ) -> Lease:
        """A NAMED lease on ``names``. Rows held only on disk are staged into host first."""
        self._enum(kind, MemoryKind, "kind")
        self._enum(mode, LeaseMode, "mode")
        ttl = self._ttl(ttl_s)
        rows = self._names(names)
        # Rows of one namespace and group share a shape: describe each pair once.
        memo: dict[bytes, PageShape | None] = {}
        shapes: list[PageShape | None] = []
        for n in rows:
            k = n[:16] + n[48:50]  # namespace(16) ‖ page key(32) ‖ group(2) ‖ shards
            if k not in memo:
                memo[k] = self._describe(n)
            shapes.append(memo[k])
        if mode is LeaseMode.WRITE:
            for i, s in enumerate(shapes):
                if s is None:
                    raise InvalidInput(
                        f"names[{i}]: no registered layout describes this row, so its page "
                        "size is unknown; name rows through the bank (row_names / match)"
                    )
        with self._lock:
            self._check_open()
            now = self._clock()
            self._reap_locked(now)
            self._check_conflicts(rows, mode)
            lease_id = uuid.uuid4().hex
            if mode is LeaseMode.READ:
                out, locked, slots, parents = self._lend_read(lease_id, rows, shapes, kind)
            else:
                out, locked, slots, parents = self._lend_write(lease_id, rows, shapes, kind)
            deadline = now + ttl
            lease = self._snapshot(lease_id, kind, mode, Selection.NAMED, deadline, out)
            self._held[lease_id] = _Held(lease, deadline, locked, slots, parents)
            heapq.heappush(self._deadlines, (deadline, lease_id))
            for n in rows:
                if mode is LeaseMode.READ:
                    self._readers.setdefault(n, set()).add(lease_id)
                else:
                    self._writer[n] = lease_id
        logger.debug("lent %s %s %s: %d rows, ttl %.3fs", lease_id, kind.name, mode.name, len(rows), ttl)
        return lease

    def _check_conflicts(self, rows: Sequence[bytes], mode: LeaseMode) -> None:
        for n in rows:
            w = self._writer.get(n)
            if w is not None:
                raise LeaseConflict(
                    f"names: row {n.hex()[:16]}… is held by WRITE lease {w}; "
                    f"a {mode.name} lease cannot share it"
                )
            if mode is LeaseMode.WRITE and self._readers.get(n):
                r = next(iter(self._readers[n]))
                raise LeaseConflict(
                    f"names: row {n.hex()[:16]}… is held by READ lease {r}; "
                    "a WRITE lease excludes readers"
                )

    def _lend_read(
        self, lease_id: str, rows: tuple[bytes, ...], shapes: list[PageShape | None], kind: MemoryKind
    ) -> _Parts:
        # Lock what locate reports present *before* staging: a row evicted between the two
        # calls then stages as None and is listed MISSING, never handed out half-moved.
        where = self._store.locate(list(rows))
        present = [n for n, w in zip(rows, where, strict=True) if w is not None]
        if present:
            self._store.lock(present, lease_id)
        slots: dict[bytes, Slot] = {}
        out: list[LeaseRow] = []
        try:
            for n, w, shape in zip(rows, where, shapes, strict=True):
                slot: Slot | None = None
                if w is not None:
                    slot = (
                        self._store.stage_host(n)
                        if kind is MemoryKind.HOST
                        else self._store.stage_device(n)
                    )
                regions = shape.regions if shape is not None else ()
                if slot is None:
                    out.append(LeaseRow(n, False, None, regions, Delivery.MISSING))
                    continue
                slots[n] = slot
                out.append(LeaseRow(n, True, self._location(slot), regions, Delivery.READY))
        except BaseException:
            self._store.unlock_all(lease_id)
            raise
        gone = [n for n in present if n not in slots]
        if gone:
            self._store.unlock(gone, lease_id)
        locked = tuple(n for n in rows if n in slots)
        return tuple(out), locked, slots, {}

    def _lend_write(
        self, lease_id: str, rows: tuple[bytes, ...], shapes: list[PageShape | None], kind: MemoryKind
    ) -> _Parts:
        where = self._store.locate(list(rows))
        slots: dict[bytes, Slot] = {}
        parents: dict[bytes, bytes | None] = {}
        out: list[LeaseRow] = []
        prev: bytes | None = None
        try:
            for n, w, shape in zip(rows, where, shapes, strict=True):
                if shape is None:  # pragma: no cover - refused in lend()
                    raise InvalidInput("names: undescribed row in a WRITE lease")
                # A chain listed in order: a row's parent (for prefix-aware eviction) is the
                # previous row of the same namespace and group in this lease.
                parents[n] = prev if prev is not None and prev[:16] == n[:16] and prev[-6:] == n[-6:] else None
                prev = n
                if w is not None:
                    out.append(LeaseRow(n, True, None, shape.regions, Delivery.PRESENT))
                    continue
                slot: Slot = (
                    self._store.reserve_host(shape.size, lease_id)
                    if kind is MemoryKind.HOST
                    else self._store.reserve_device(shape.size, lease_id)
                )
                slots[n] = slot
                out.append(LeaseRow(n, False, self._location(slot), shape.regions, Delivery.RESERVED))
        except BaseException:
            self._abort_slots(slots)
            raise
        return tuple(out), (), slots, parents

    def lend_all(
        self,
        *,
        kind: MemoryKind = MemoryKind.HOST,
        mode: LeaseMode = LeaseMode.READ,
        ttl_s: float | None = None,
    ) -> Lease:
        """An ALL lease: the tier's pools, for registering them once with a transfer engine.

        It names no rows and locks nothing; rows are still read or filled through NAMED
        leases, which is what keeps them in place.
        """
        self._enum(kind, MemoryKind, "kind")
        self._enum(mode, LeaseMode, "mode")
        ttl = self._ttl(ttl_s)
        with self._lock:
            pools = self._pool_locations(kind)
            self._check_open()
            now = self._clock()
            self._reap_locked(now)
            lease_id = uuid.uuid4().hex
            deadline = now + ttl
            lease = self._snapshot(lease_id, kind, mode, Selection.ALL, deadline, (), pools)
            self._held[lease_id] = _Held(lease, deadline, ())
            heapq.heappush(self._deadlines, (deadline, lease_id))
        return lease

    def _pool_locations(self, kind: MemoryKind) -> tuple[Location, ...]:
        """The tier's pools as whole-segment locations.

        The store names its host segment only inside the slots it hands out, so the lender
        learns it from one smallest reservation, given back at once, and reads the segment's
        size from ``/dev/shm``. The store does not enumerate its device pools (chunk tensors
        come and go), so an ALL lease of DEVICE memory is refused.
        """
        if kind is MemoryKind.DEVICE:
            raise InvalidInput(
                "kind: an ALL lease of DEVICE memory needs the store to enumerate its device "
                "pools, which it does not; lend DEVICE rows by name"
            )
        if self._host_segment is None:
            probe = self._store.reserve_host(1, "kvbank-lender-probe")
            self._store.abort_host(probe)
            self._host_segment = probe.segment
        size = os.stat(SHM_DIR / self._host_segment).st_size
        return (HostLocation(self._host_segment, 0, size),)

    def _snapshot(
        self,
        lease_id: str,
        kind: MemoryKind,
        mode: LeaseMode,
        selection: Selection,
        deadline: float,
        rows: tuple[LeaseRow, ...],
        pools: tuple[Location, ...] = (),
    ) -> Lease:
        wall = time.time() + (deadline - self._clock())
        return Lease(lease_id, kind, mode, selection, deadline, wall, rows, pools)

    def _location(self, slot: Slot) -> Location:
        if isinstance(slot, HostSlot):
            return HostLocation(slot.segment, slot.offset, slot.size)
        return DeviceLocation(slot.pool, slot.device, slot.offset, slot.size, self._ipc(slot))

    def _ipc(self, slot: DeviceSlot) -> bytes | None:
        """The CUDA IPC memory handle of the slot's pool (None off CUDA).

        The same handle torch.multiprocessing shares; a peer opens it and adds ``offset``.
        """
        if not slot.device.startswith("cuda"):
            return None
        storage = self._store.device_view(slot).untyped_storage()
        handle = storage._share_cuda_()[1]  # type: ignore[no-untyped-call]  # (device, handle, …)
        return bytes(handle)

    # ---- the lease table ---------------------------------------------------------------

    def _live(self, lease_id: str, now: float) -> _Held:
        """The live lease ``lease_id``; reaps it and raises if its deadline has passed."""
        if not isinstance(lease_id, str):
            raise InvalidInput(f"lease_id: expected a string, got {type(lease_id).__name__}")
        held = self._held.get(lease_id)
        if held is None:
            why = self._ended.get(lease_id)
            if why == "expired":
                raise LeaseExpired(f"lease_id: lease {lease_id} expired")
            raise LeaseNotFound(
                f"lease_id: no live lease {lease_id}" + (f" ({why})" if why else "")
            )
        if held.deadline <= now:
            self._end_locked(lease_id, "expired")
            raise LeaseExpired(f"lease_id: lease {lease_id} expired")
        return held

    def lease(self, lease_id: str) -> Lease:
        """The live lease's current snapshot."""
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            return self._live(lease_id, now).lease

    def renew(self, lease_id: str, ttl_s: float | None = None) -> Lease:
        """Extend a live lease to ``now + ttl_s``. An expired lease cannot be revived."""
        ttl = self._ttl(ttl_s)
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            held = self._live(lease_id, now)
            held.deadline = now + ttl
            old = held.lease
            held.lease = self._snapshot(
                old.id, old.kind, old.mode, old.selection, held.deadline, old.rows, old.pools
            )
            heapq.heappush(self._deadlines, (held.deadline, lease_id))
            return held.lease

    def release(self, lease_id: str) -> bool:
        """End a lease: drop its locks, return unused slots (a WRITE lease publishes nothing).

        ``True`` if it was live; ``False`` if it had already expired (release after a
        failure is always safe). An id never lent raises :class:`LeaseNotFound`.
        """
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            if lease_id in self._held:
                if self._held[lease_id].deadline <= now:
                    self._end_locked(lease_id, "expired")
                    return False
                self._end_locked(lease_id, "released")
                return True
            if self._ended.get(lease_id) == "expired":
                return False
            raise LeaseNotFound(f"lease_id: no live lease {lease_id}")

    def commit(self, lease_id: str, arrived: Sequence[bytes] | Sequence[bool]) -> CommitResult:
        """Publish the WRITE lease's rows that arrived whole; return the others' slots.

        ``arrived`` is the names that arrived, or one bool per lease row (in row order).
        The lease ends. Committing an expired lease publishes nothing (LeaseExpired).
        """
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            held = self._live(lease_id, now)
            lease = held.lease
            if lease.mode is not LeaseMode.WRITE or lease.selection is not Selection.NAMED:
                raise InvalidInput(f"lease_id: {lease_id} is a {lease.mode.name} {lease.selection.name} lease; only NAMED WRITE leases commit")
            got = self._arrived(lease, arrived)
            committed: list[bytes] = []
            discarded: list[bytes] = []
            already: list[bytes] = []
            pending = dict(held.slots)
            try:
                for row in lease.rows:
                    slot = pending.get(row.name)
                    if slot is None:
                        continue  # PRESENT at lend: nothing was reserved
                    if row.name not in got:
                        discarded.append(row.name)
                        continue
                    if self._store.locate([row.name])[0] is not None:
                        already.append(row.name)  # equal names are equal bytes: keep theirs
                        continue
                    parent = held.parents.get(row.name)
                    if isinstance(slot, HostSlot):
                        self._store.commit_host(row.name, slot, parent=parent)
                    else:
                        self._store.commit_device(row.name, slot, parent=parent)
                    del held.slots[row.name]  # published: the store owns it now
                    committed.append(row.name)
            finally:
                # Every slot not published goes back, whatever happened above.
                self._end_locked(lease_id, "committed")
        logger.debug("commit %s: %d committed, %d discarded", lease_id, len(committed), len(discarded))
        return CommitResult(lease_id, tuple(committed), tuple(discarded), tuple(already))

    @staticmethod
    def _arrived(lease: Lease, arrived: Sequence[bytes] | Sequence[bool]) -> set[bytes]:
        if hasattr(arrived, "tolist") and not isinstance(arrived, (bytes, bytearray)):
            arrived = arrived.tolist()  # a numpy or torch bool mask
        if isinstance(arrived, (bytes, str)) or not isinstance(arrived, Sequence):
            raise InvalidInput(f"arrived: expected names or a mask, got {type(arrived).__name__}")
        items = list(arrived)
        if items and all(isinstance(a, bool) for a in items):
            if len(items) != len(lease.rows):
                raise InvalidInput(f"arrived: mask of {len(items)} for {len(lease.rows)} lease rows")
            return {r.name for r, a in zip(lease.rows, items, strict=True) if a}
        listed = set(lease.names)
        out: set[bytes] = set()
        for i, a in enumerate(items):
            if type(a) is not bytes or a not in listed:
                raise InvalidInput(f"arrived[{i}]: not a row name of lease {lease.id}")
            out.add(a)
        return out

    # ---- reads through a lease -----------------------------------------------------------

    def _slot(self, lease_id: str, name: bytes) -> tuple[Lease, Slot]:
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            held = self._live(lease_id, now)
            slot = held.slots.get(name)
            if slot is None:
                raise InvalidInput(
                    f"name: row {bytes(name).hex()[:16]}… has no bytes in lease {lease_id} "
                    "(not listed, missing, or already stored)"
                )
            return held.lease, slot

    def view(self, lease_id: str, name: bytes) -> memoryview:
        """The row's host bytes in place (READ: read them; WRITE: fill them).

        Valid only while the lease lives; call :meth:`finish_read` after reading.
        """
        _, slot = self._slot(lease_id, name)
        if not isinstance(slot, HostSlot):
            raise InvalidInput(f"lease_id: {lease_id} is a DEVICE lease; use device_view")
        return self._store.host_view(slot)

    def device_view(self, lease_id: str, name: bytes) -> torch.Tensor:
        """The row's device bytes in place (a uint8 tensor)."""
        _, slot = self._slot(lease_id, name)
        if not isinstance(slot, DeviceSlot):
            raise InvalidInput(f"lease_id: {lease_id} is a HOST lease; use view")
        return self._store.device_view(slot)

    def finish_read(self, lease_id: str) -> None:
        """Check that the lease is still live now that a read completed.

        Raises :class:`LeaseExpired` (or :class:`LeaseNotFound` if it was released): the
        bytes read may be reclaimed memory and must not be used (Mooncake#4239).
        """
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            self._live(lease_id, now)

    def read_into(self, lease_id: str, name: bytes, out: memoryview | bytearray) -> int:
        """Copy a leased row into ``out``; the byte count, valid only because the lease was
        still live when the copy completed (else :class:`LeaseExpired`)."""
        _, slot = self._slot(lease_id, name)
        dst = memoryview(out).cast("B")
        if len(dst) < slot.size:
            raise InvalidInput(f"out: {len(dst)} bytes, the row holds {slot.size}")
        if isinstance(slot, HostSlot):
            with self._store.host_view(slot) as src:  # released at once: the slab may close
                dst[: slot.size] = src
        else:
            import torch

            dev = self._store.device_view(slot)[: slot.size]
            torch.frombuffer(dst, dtype=torch.uint8, count=slot.size).copy_(dev)
        self.finish_read(lease_id)
        return slot.size

    def read(self, lease_id: str, name: bytes) -> bytes:
        """The leased row's bytes, returned only if the lease outlived the copy."""
        _, slot = self._slot(lease_id, name)
        buf = bytearray(slot.size)
        self.read_into(lease_id, name, buf)
        return bytes(buf)

    def write(self, lease_id: str, name: bytes, data: bytes | bytearray | memoryview) -> None:
        """Fill a WRITE lease's reserved slot (an in-process convenience over :meth:`view`)."""
        lease, slot = self._slot(lease_id, name)
        if lease.mode is not LeaseMode.WRITE:
            raise InvalidInput(f"lease_id: {lease_id} is a READ lease; it cannot be written")
        src = memoryview(data).cast("B")
        if len(src) != slot.size:
            from kvbank.errors import PageSizeMismatch

            raise PageSizeMismatch(f"data: {len(src)} bytes, the row's page is {slot.size}")
        if isinstance(slot, HostSlot):
            with self._store.host_view(slot) as dst:
                dst[:] = src
        else:
            import torch

            self._store.device_view(slot)[: slot.size].copy_(
                torch.frombuffer(bytearray(src), dtype=torch.uint8)
            )

    # ---- expiry ------------------------------------------------------------------------

    def reap(self) -> int:
        """End every lease whose deadline has passed; returns how many."""
        with self._lock:
            return self._reap_locked(self._clock())

    def _reap_locked(self, now: float) -> int:
        n = 0
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, lease_id = heapq.heappop(heap)
            held = self._held.get(lease_id)
            # Renewal pushes a new entry; this one is stale unless it is the live deadline.
            if held is not None and held.deadline == deadline:
                self._end_locked(lease_id, "expired")
                n += 1
        return n

    def _end_locked(self, lease_id: str, why: str) -> None:
        held = self._held.pop(lease_id)
        if why == "expired":
            self.expired_count += 1
            logger.debug("lease %s expired", lease_id)
        for n in held.lease.names:
            readers = self._readers.get(n)
            if readers is not None:
                readers.discard(lease_id)
                if not readers:
                    del self._readers[n]
            if self._writer.get(n) == lease_id:
                del self._writer[n]
        try:
            if held.locked:
                self._store.unlock_all(lease_id)
            if held.lease.mode is LeaseMode.WRITE:
                self._abort_slots(held.slots)
        finally:
            self._ended[lease_id] = why
            while len(self._ended) > _TOMBSTONES:
                self._ended.popitem(last=False)

    def _abort_slots(self, slots: dict[bytes, Slot]) -> None:
        for slot in slots.values():
            if isinstance(slot, HostSlot):
                self._store.abort_host(slot)
            else:
                self._store.abort_device(slot)
        slots.clear()

    def _reaper_loop(self) -> None:
        interval = float(self._config.reaper_interval_s)
        while not self._stop.wait(interval):
            n = self.reap()
            if n:
                logger.debug("reaper: %d leases expired", n)

    # ---- introspection -----------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def live_ids(self) -> tuple[str, ...]:
        with self._lock:
            self._reap_locked(self._clock())
            return tuple(self._held)

    def check_invariants(self) -> None:
        """The lease table, the conflict maps and the store's page locks agree."""
        with self._lock:
            readers: dict[bytes, set[str]] = {}
            writer: dict[bytes, str] = {}
            for lid, h in self._held.items():
                lease = h.lease
                if lease.selection is Selection.ALL:
                    continue
                for n in lease.names:
                    if lease.mode is LeaseMode.READ:
                        readers.setdefault(n, set()).add(lid)
                    else:
                        if n in writer:
                            raise AssertionError(f"two WRITE leases list {n.hex()}")
                        writer[n] = lid
                for n in h.locked:
                    if not self._store.is_locked(n):
                        raise AssertionError(f"lease {lid}: row {n.hex()} is not locked")
                for row in lease.rows:
                    expect = row.delivery in (Delivery.READY, Delivery.RESERVED)
                    if expect != (row.name in h.slots):
                        raise AssertionError(f"lease {lid}: row {row.name.hex()} slot/delivery")
            if readers != self._readers or writer != self._writer:
                raise AssertionError("conflict maps disagree with the lease table")
            for n in set(readers) & set(writer):
                raise AssertionError(f"row {n.hex()} is held by a reader and a writer")

    def close(self) -> None:
        """Stop the reaper and end every lease (locks dropped, reserved slots returned)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self._closed:
                return
            for lid in list(self._held):
                self._end_locked(lid, "released")
            self._closed = True
