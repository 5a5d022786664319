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
                                               check on every command) drops the page
                                               locks and returns reserved slots; lookups
                                               (lease, live_ids, finish_read, views)
                                               report expiry but change nothing

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
the lender always takes its lock first (the order is in :mod:`kvbank.tiers.lockorder`).
The lender lock is held only over its tables: a lend claims its names in the conflict
tables, stages its rows (disk reads, copies, waits for room) with no lender lock held,
then publishes the lease; a commit takes its lease out of the tables, then publishes the
rows. Bulk copies in :meth:`read_into` run outside the lender's lock — which is exactly
why the completion check exists.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from operator import is_
from typing import TYPE_CHECKING, cast

from kvbank.config import BankConfig
from kvbank.errors import (
    InvalidInput,
    LeaseConflict,
    LeaseExpired,
    LeaseNotFound,
    TierUnavailable,
)
from kvbank.keys import ROW_NAME_BYTES, same_chain, shape_key
from kvbank.lender.base import (
    CommitResult,
    Delivery,
    DeviceLocation,
    Lease,
    LeaseMode,
    LeaseRow,
    LendingStore,
    Location,
    MemoryKind,
    PageShape,
    Region,
    Selection,
    lease_rows,
)
from kvbank.tiers.base import DeviceSlot, HostSlot
from kvbank.tiers.lockorder import Rank, make_lock

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Clock = Callable[[], float]  # monotonic seconds
# row name -> its page's size and regions. It must depend only on the name's namespace
# and group (the lender keeps each answer found per pair; a bank's _describe does).
Describe = Callable[[bytes], PageShape | None]
Slot = HostSlot | DeviceSlot

# what lending produced: rows, names locked, slots, WRITE chain parents
_Parts = tuple[tuple[LeaseRow, ...], tuple[bytes, ...], dict[bytes, Slot], dict[bytes, bytes | None]]

_TOMBSTONES = 4096  # ended lease ids remembered, so a late call says why (expired/released)
_SHAPES = 4096  # (namespace, group) shapes remembered; a bank has a handful per layout
_shape_key = shape_key  # namespace ‖ group: one page shape (keys owns the anatomy)
_NO_REGIONS: tuple[Region, ...] = ()


@dataclass(slots=True)
class _Held:
    """The lender's record of one live lease."""

    lease: Lease  # the snapshot last handed out
    deadline: float
    names: tuple[bytes, ...]  # the names the lease lists (its rows', in order)
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
        wall_clock: Clock = time.time,
        describe: Describe | None = None,
        reaper: bool = True,
    ) -> None:
        self._store = store
        self._config = config
        self._clock = clock
        self._wall = wall_clock  # epoch seconds: only a lease's expires_wall reads it
        self._describe: Describe = describe or (lambda name: None)
        # (namespace, group) -> shape. Only shapes found are kept: a namespace the describer
        # does not know yet may be registered later, a known one never changes.
        self._shapes: dict[tuple[bytes, bytes], PageShape] = {}
        self._lock = make_lock(Rank.LENDER, "Lender._lock", reentrant=True)
        self._held: dict[str, _Held] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap; stale entries skipped lazily
        # name -> how many live READ leases list it. A count, not a set of ids: lend and
        # release touch each name once at C speed; the conflict message finds an id the
        # slow way, on the error path only.
        self._readers: Counter[bytes] = Counter()
        self._writer: dict[bytes, str] = {}  # name -> the WRITE lease id listing it
        self._ended: OrderedDict[str, str] = OrderedDict()  # id -> "expired" | "released" …
        # lends between their plan and their publish: id -> (names, mode), claimed above
        self._pending: dict[str, tuple[tuple[bytes, ...], LeaseMode]] = {}
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
        out = tuple(names)
        # Whole-sequence checks at C speed; the per-name loop runs only to name the culprit.
        if set(map(type, out)) != {bytes} or set(map(len, out)) != {ROW_NAME_BYTES}:
            for i, n in enumerate(out):
                if type(n) is not bytes or len(n) != ROW_NAME_BYTES:
                    got = len(n) if isinstance(n, (bytes, bytearray, memoryview)) else type(n).__name__
                    raise InvalidInput(f"names[{i}]: expected a {ROW_NAME_BYTES}-byte row name, got {got}")
        if len(set(out)) != len(out):
            raise InvalidInput("names: a row name is listed twice")
        return out

    def _shapes_of(self, rows: tuple[bytes, ...], mode: LeaseMode) -> list[PageShape | None]:
        """Each row's page shape (None: no registered layout describes it).

        Rows of one namespace and group share a shape: a lease of one chain costs one
        lookup, and a WRITE lease refuses a row no layout describes (its size is unknown).
        """
        keys = list(map(_shape_key, rows))
        if keys.count(keys[0]) == len(keys):  # one chain, the common case
            shapes = [self._shape(keys[0], rows[0])] * len(keys)
        else:
            shapes = [self._shape(k, n) for k, n in zip(keys, rows, strict=True)]
        if mode is LeaseMode.WRITE and None in shapes:
            raise InvalidInput(
                f"names[{shapes.index(None)}]: no registered layout describes this row, so its "
                "page size is unknown; name rows through the bank (row_names / match)"
            )
        return shapes

    def _shape(self, key: tuple[bytes, bytes], name: bytes) -> PageShape | None:
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._describe(name)
            if shape is not None:  # kept only once found: a namespace may be declared later
                if len(self._shapes) >= _SHAPES:
                    self._shapes.clear()
                self._shapes[key] = shape
        return shape

    def _check_open(self) -> None:
        if self._closed:
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
        shapes = self._shapes_of(rows, mode)
        lease_id = os.urandom(16).hex()  # as unguessable as uuid4, a fifth of its cost
        # Plan under the lender lock: the readers/writer rule is checked and the names are
        # claimed, so a concurrent lend sees them. Stage (disk reads, device copies, waits
        # for room) with no lender lock held; publish under it again.
        with self._lock:
            self._check_open()
            now = self._clock()
            self._reap_locked(now)
            self._check_conflicts(rows, mode)
            self._claim(lease_id, rows, mode)
        try:
            if mode is LeaseMode.READ:
                out, locked, slots, parents = self._lend_read(lease_id, rows, shapes, kind)
            else:
                out, locked, slots, parents = self._lend_write(lease_id, rows, shapes, kind)
        except BaseException:
            with self._lock:
                self._unclaim(lease_id, rows, mode)
            raise
        with self._lock:
            if self._closed:  # closed while staging: give everything back
                self._unclaim(lease_id, rows, mode)
                self._release_store(lease_id, bool(locked), mode, slots)
                raise TierUnavailable("lender: closed")
            # The claim in the conflict maps becomes the lease's own entry there.
            del self._pending[lease_id]
            deadline = self._clock() + ttl
            lease = self._snapshot(lease_id, kind, mode, Selection.NAMED, deadline, out)
            self._held[lease_id] = _Held(lease, deadline, rows, locked, slots, parents)
            heapq.heappush(self._deadlines, (deadline, lease_id))
        logger.debug("lent %s %s %s: %d rows, ttl %.3fs", lease_id, kind.name, mode.name, len(rows), ttl)
        return lease

    def _claim(self, lease_id: str, rows: tuple[bytes, ...], mode: LeaseMode) -> None:
        """Hold ``rows`` in the conflict maps while a lend stages them (caller locks)."""
        self._pending[lease_id] = (rows, mode)
        if mode is LeaseMode.READ:
            self._readers.update(rows)
        else:
            self._writer.update(dict.fromkeys(rows, lease_id))

    def _unclaim(self, lease_id: str, rows: tuple[bytes, ...], mode: LeaseMode) -> None:
        """Undo :meth:`_claim` for a lend that failed (caller locks)."""
        del self._pending[lease_id]
        if mode is LeaseMode.READ:
            readers = self._readers
            counts = list(map(readers.pop, rows))
            if max(counts) > 1:
                for n, k in zip(rows, counts, strict=True):
                    if k > 1:
                        readers[n] = k - 1
        else:
            for n in rows:
                del self._writer[n]

    def _check_conflicts(self, rows: tuple[bytes, ...], mode: LeaseMode) -> None:
        """Raise LeaseConflict if the readers/writer rule refuses ``rows`` to ``mode``.

        The tables are checked as whole sets; the names are looked at one by one only to
        word the error.
        """
        writer, readers = self._writer, self._readers
        if writer and not writer.keys().isdisjoint(rows):
            n = next(n for n in rows if n in writer)
            raise LeaseConflict(
                f"names: row {n.hex()[:16]}… is held by WRITE lease {writer[n]}; "
                f"a {mode.name} lease cannot share it"
            )
        if mode is LeaseMode.WRITE and readers and not readers.keys().isdisjoint(rows):
            n = next(n for n in rows if n in readers)
            r = next((lid for lid, h in self._held.items()
                      if h.lease.mode is LeaseMode.READ and n in h.names),
                     next((lid for lid, (ns, _) in self._pending.items() if n in ns), "?"))
            raise LeaseConflict(
                f"names: row {n.hex()[:16]}… is held by READ lease {r}; "
                "a WRITE lease excludes readers"
            )

    def _lend_read(
        self, lease_id: str, rows: tuple[bytes, ...], shapes: list[PageShape | None], kind: MemoryKind
    ) -> _Parts:
        # Lock what locate reports present *before* staging: a row evicted between the two
        # calls then stages as None and is listed MISSING, never handed out half-moved.
        store = self._store
        where = store.locate(rows)
        present = rows if None not in where else [n for n, w in zip(rows, where, strict=True) if w is not None]
        staged: list[HostSlot | None] | list[DeviceSlot | None] = []
        if present:
            store.locks.lock(present, lease_id)
            try:
                if kind is MemoryKind.HOST:
                    staged = store.host.stage_many(present)  # one pass for the whole lease
                else:
                    staged = [store.device.stage(n) for n in present]
            except BaseException:
                store.locks.unlock_all(lease_id)
                raise
        n_rows = len(rows)
        regions = _regions(shapes)
        if kind is MemoryKind.HOST and len(staged) == n_rows and not any(map(_is_none, staged)):
            # Every row staged, the common case: a host slot is its lease location as it
            # stands (HostLocation is HostSlot), and the rows are built column by column.
            host = cast("list[HostSlot]", staged)
            out = lease_rows(rows, repeat(True, n_rows), host, regions, repeat(_READY, n_rows))
            return out, rows, dict(zip(rows, host, strict=True)), {}
        slots: dict[bytes, Slot] = {
            n: s for n, s in zip(present, staged, strict=True) if s is not None
        }
        if len(slots) < len(present):  # evicted between the locate and the lock
            store.locks.unlock([n for n in present if n not in slots], lease_id)
        got = list(map(slots.get, rows))
        out = lease_rows(
            rows,
            [s is not None for s in got],
            [None if s is None else self._location(s) for s in got],
            regions,
            [_MISSING if s is None else _READY for s in got],
        )
        return out, tuple(slots), slots, {}

    def _lend_write(
        self, lease_id: str, rows: tuple[bytes, ...], shapes: list[PageShape | None], kind: MemoryKind
    ) -> _Parts:
        where = self._store.locate(rows)
        parents: dict[bytes, bytes | None] = {}
        prev: bytes | None = None
        described: list[PageShape] = []
        for n, shape in zip(rows, shapes, strict=True):
            if shape is None:  # pragma: no cover - refused in lend()
                raise InvalidInput("names: undescribed row in a WRITE lease")
            described.append(shape)
            # A chain listed in order: a row's parent (for prefix-aware eviction) is the
            # previous row of the same namespace and group in this lease.
            parents[n] = prev if prev is not None and same_chain(prev, n) else None
            prev = n
        todo = [i for i, w in enumerate(where) if w is None]
        # one reservation call for the lease's rows (all or none)
        pool = self._store.host if kind is MemoryKind.HOST else self._store.device
        got: Sequence[Slot] = pool.reserve_many([described[i].size for i in todo], lease_id)
        slots: dict[bytes, Slot] = {rows[i]: slot for i, slot in zip(todo, got, strict=True)}
        try:
            out = [LeaseRow(n, True, None, shape.regions, Delivery.PRESENT) if w is not None
                   else LeaseRow(n, False, self._location(slots[n]), shape.regions, Delivery.RESERVED)
                   for n, w, shape in zip(rows, where, described, strict=True)]
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
            lease_id = os.urandom(16).hex()
            deadline = now + ttl
            lease = self._snapshot(lease_id, kind, mode, Selection.ALL, deadline, (), pools)
            self._held[lease_id] = _Held(lease, deadline, (), ())
            heapq.heappush(self._deadlines, (deadline, lease_id))
        return lease

    def _pool_locations(self, kind: MemoryKind) -> tuple[Location, ...]:
        """The tier's pools as whole-segment locations.

        HOST: the store's host segment (``host_segment``: name, 0, mapped size). The store
        does not enumerate its device pools (chunk tensors come and go), so an ALL lease of
        DEVICE memory is refused, as is a HOST one when the host tier is off.
        """
        if kind is MemoryKind.DEVICE:
            raise InvalidInput(
                "kind: an ALL lease of DEVICE memory needs the store to enumerate its device "
                "pools, which it does not; lend DEVICE rows by name"
            )
        segment = self._store.host.segment
        if segment is None:
            raise TierUnavailable("lend_all: the host tier is off")
        return (segment,)

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
        wall = self._wall() + (deadline - self._clock())
        return Lease(lease_id, kind, mode, selection, deadline, wall, rows, pools)

    def _location(self, slot: Slot) -> Location:
        if isinstance(slot, HostSlot):
            return slot  # HostLocation is HostSlot
        return DeviceLocation(slot.pool, slot.device, slot.offset, slot.size, self._ipc(slot))

    def _ipc(self, slot: DeviceSlot) -> bytes | None:
        """The CUDA IPC memory handle of the slot's pool (None off CUDA).

        The same handle torch.multiprocessing shares; a peer opens it and adds ``offset``.
        """
        if not slot.device.startswith("cuda"):
            return None
        storage = self._store.device.view(slot).untyped_storage()
        handle = storage._share_cuda_()[1]  # type: ignore[no-untyped-call]  # (device, handle, …)
        return bytes(handle)

    # ---- the lease table ---------------------------------------------------------------

    def _live(self, lease_id: str, now: float, *, end: bool = True) -> _Held:
        """The live lease ``lease_id``; raises if its deadline has passed, and then (with
        ``end``, for commands) ends it. Lookups pass ``end=False``: they change nothing."""
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
            if end:
                self._end_locked(lease_id, "expired")
            raise LeaseExpired(f"lease_id: lease {lease_id} expired")
        return held

    def lease(self, lease_id: str) -> Lease:
        """The live lease's current snapshot. A lookup: it reaps nothing."""
        with self._lock:
            return self._live(lease_id, self._clock(), end=False).lease

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

        ``True`` if it was live; ``False`` if it had already ended — expired, released,
        committed, or ended by close — so release in a ``finally`` is always safe. An id
        never lent (or ended too long ago to be remembered) raises :class:`LeaseNotFound`.
        """
        if not isinstance(lease_id, str):
            raise InvalidInput(f"lease_id: expected a string, got {type(lease_id).__name__}")
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            held = self._held.get(lease_id)
            if held is not None:
                if held.deadline <= now:
                    self._end_locked(lease_id, "expired")
                    return False
                self._end_locked(lease_id, "released")
                return True
            if lease_id in self._ended:
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
            # From here the lease is this call's: ended in the tables (no reaper, release
            # or second commit can touch its slots), published with no lender lock held.
            self._detach_locked(lease_id, "committed")
        committed: list[bytes] = []
        discarded: list[bytes] = []
        already: list[bytes] = []
        pending = dict(held.slots)
        try:
            arrived = [r.name for r in lease.rows if r.name in pending and r.name in got]
            discarded = [r.name for r in lease.rows if r.name in pending and r.name not in got]
            where = self._store.locate(arrived) if arrived else []
            host: list[tuple[bytes, HostSlot, str, bytes | None]] = []
            device: list[tuple[bytes, DeviceSlot, str, bytes | None]] = []
            for name, w in zip(arrived, where, strict=True):
                if w is not None:
                    already.append(name)  # equal names are equal bytes: keep theirs
                    continue
                slot = pending[name]
                shape = self._shape(_shape_key(name), name)
                dtype, parent = shape.dtype if shape is not None else "uint8", held.parents.get(name)
                if isinstance(slot, HostSlot):
                    host.append((name, slot, dtype, parent))
                else:
                    device.append((name, slot, dtype, parent))
            # One batch per memory kind, published in order: on a refusal the rows before
            # it are the store's, the rest go back below with every unpublished slot.
            try:
                if host:
                    self._store.host.commit_many(host, committed)
                if device:
                    self._store.device.commit_many(device, committed)
            finally:
                for name in committed:
                    del held.slots[name]  # published: the store owns it now
        finally:
            # Every slot not published goes back, whatever happened above.
            self._release_store(lease_id, False, LeaseMode.WRITE, held.slots)
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

        Valid only while the lease lives; call :meth:`finish_read` after reading.
        """
        _, slot = self._slot(lease_id, name)
        if not isinstance(slot, HostSlot):
            raise InvalidInput(f"lease_id: {lease_id} is a DEVICE lease; use device_view")
        return self._store.host.view(slot)

    def device_view(self, lease_id: str, name: bytes) -> torch.Tensor:
        """The row's device bytes in place (a uint8 tensor)."""
        _, slot = self._slot(lease_id, name)
        if not isinstance(slot, DeviceSlot):
            raise InvalidInput(f"lease_id: {lease_id} is a HOST lease; use view")
        return self._store.device.view(slot)

    def finish_read(self, lease_id: str) -> None:
        """Check that the lease is still live now that a read completed.

        Raises :class:`LeaseExpired` (or :class:`LeaseNotFound` if it was released): the
        bytes read may be reclaimed memory and must not be used (Mooncake#4239).
        """
        with self._lock:
            self._live(lease_id, self._clock(), end=False)

    def read_into(self, lease_id: str, name: bytes, out: memoryview | bytearray) -> int:
        """Copy a leased row into ``out``; the byte count, valid only because the lease was
        still live when the copy completed (else :class:`LeaseExpired`)."""
        _, slot = self._slot(lease_id, name)
        dst = memoryview(out).cast("B")
        if len(dst) < slot.size:
            raise InvalidInput(f"out: {len(dst)} bytes, the row holds {slot.size}")
        if isinstance(slot, HostSlot):
            with self._store.host.view(slot) as src:  # released at once: the slab may close
                dst[: slot.size] = src
        else:
            import torch

            from kvbank.kernels.faults import TORCH_ERRORS, torch_fault

            dev = self._store.device.view(slot)[: slot.size]
            try:
                torch.frombuffer(dst, dtype=torch.uint8, count=slot.size).copy_(dev)
            except TORCH_ERRORS as exc:
                raise torch_fault(f"reading leased row {name.hex()[:16]}…", exc) from exc
        self.finish_read(lease_id)
        return slot.size

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
            if len(src) != slot.size:
                from kvbank.errors import PageSizeMismatch

                raise PageSizeMismatch(f"data: {len(src)} bytes, the row's page is {slot.size}")
            if isinstance(slot, HostSlot):
                with self._store.host.view(slot) as dst:
                    dst[:] = src
            else:
                import torch

                from kvbank.kernels.faults import TORCH_ERRORS, torch_fault

                try:
                    self._store.device.view(slot)[: slot.size].copy_(
                        torch.frombuffer(bytearray(src), dtype=torch.uint8))
                except TORCH_ERRORS as exc:
                    raise torch_fault(f"writing leased row {name.hex()[:16]}…", exc) from exc

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
        """End a lease: out of the tables, its locks and slots back to the store."""
        held = self._detach_locked(lease_id, why)
        self._release_store(lease_id, bool(held.locked), held.lease.mode, held.slots)

    def _detach_locked(self, lease_id: str, why: str) -> _Held:
        """Take a lease out of the lender's tables (caller holds the lender lock)."""
        held = self._held.pop(lease_id)
        if why == "expired":
            self.expired_count += 1
            logger.debug("lease %s expired", lease_id)
        if held.lease.selection is Selection.NAMED:
            if held.lease.mode is LeaseMode.READ:
                # Take every name out at C speed; put back the few other leases still read.
                readers = self._readers
                counts = list(map(readers.pop, held.names))
                if max(counts) > 1:
                    for n, k in zip(held.names, counts, strict=True):
                        if k > 1:
                            readers[n] = k - 1
            else:
                for n in held.names:
                    del self._writer[n]
        self._ended[lease_id] = why
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)
        return held

    def _release_store(self, lease_id: str, locked: bool, mode: LeaseMode,
                       slots: dict[bytes, Slot]) -> None:
        """Give a lease's page locks and unpublished slots back to the store (quick table
        updates in the store; no staging or disk I/O)."""
        try:
            if locked:
                self._store.locks.unlock_all(lease_id)
        finally:
            if mode is LeaseMode.WRITE:
                self._abort_slots(slots)

    def _abort_slots(self, slots: dict[bytes, Slot]) -> None:
        for slot in slots.values():
            if isinstance(slot, HostSlot):
                self._store.host.abort(slot)
            else:
                self._store.device.abort(slot)
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
        """Ids of the leases whose deadline has not passed. A lookup: it reaps nothing."""
        with self._lock:
            now = self._clock()
            return tuple(lid for lid, h in self._held.items() if h.deadline > now)

    def check_invariants(self) -> None:
        """The lease table, the conflict maps and the store's page locks agree."""
        with self._lock:
            readers: Counter[bytes] = Counter()
            writer: dict[bytes, str] = {}
            for lid, (names, mode) in self._pending.items():
                if mode is LeaseMode.READ:
                    readers.update(names)
                else:
                    writer.update(dict.fromkeys(names, lid))
            for lid, h in self._held.items():
                lease = h.lease
                if lease.selection is Selection.ALL:
                    continue
                if h.names != lease.names:
                    raise AssertionError(f"lease {lid}: names table differs from its rows")
                for n in lease.names:
                    if lease.mode is LeaseMode.READ:
                        readers[n] += 1
                    else:
                        if n in writer:
                            raise AssertionError(f"two WRITE leases list {n.hex()}")
                        writer[n] = lid
                for n in h.locked:
                    if not self._store.locks.is_locked(n):
                        raise AssertionError(f"lease {lid}: row {n.hex()} is not locked")
                for row in lease.rows:
                    expect = row.delivery in (Delivery.READY, Delivery.RESERVED)
                    if expect != (row.name in h.slots):
                        raise AssertionError(f"lease {lid}: row {row.name.hex()} slot/delivery")
            if dict(readers) != dict(self._readers) or writer != self._writer:
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



_READY = Delivery.READY
_MISSING = Delivery.MISSING
_is_none = partial(is_, None)  # by identity: `None in slots` would call each slot's __eq__


def _regions(shapes: list[PageShape | None]) -> Iterable[tuple[Region, ...]]:
    """The regions column of a lease's rows (one shared tuple for a chain)."""
    first = shapes[0]
    if shapes.count(first) == len(shapes):
        return repeat(_NO_REGIONS if first is None else first.regions, len(shapes))
    return [_NO_REGIONS if p is None else p.regions for p in shapes]
