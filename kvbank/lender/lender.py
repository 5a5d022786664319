"""The lender: leases on rows in place, page locks, expiry and the reaper.

Primitives (value objects in :mod:`kvbank.lender.base`):

- :meth:`Lender.lend` — a ``NAMED`` lease on rows, ``READ`` or ``WRITE``, in ``HOST`` or
  ``DEVICE`` memory, for ``ttl_s`` seconds (default ``config.lease_ttl_s``, at most
  ``config.max_lease_ttl_s``). :meth:`Lender.lend_all` — an ``ALL`` lease describing a
  tier's pools (no rows named, nothing locked) for a transfer engine's registration.
- :meth:`Lender.renew`, :meth:`Lender.release`, :meth:`Lender.commit` (WRITE: only the
  rows that arrived whole become visible; the other reserved slots go back).
- :meth:`Lender.check_live` / :meth:`Lender.read_into` — the second expiry check: a read
  through a lease counts only if the lease was still live when the read *completed*;
  bytes read under an expired lease are not used (:class:`~kvbank.errors.LeaseExpired`).
  These and the other reads and fills through a lease are :mod:`kvbank.lender.access`'s.

Lifecycle::

    lend ──► read / fill in place ──► release (READ)  or  commit(arrived) (WRITE)
      │                │
      └── renew        └── deadline passes ──► expired: the reaper (a thread every
                                               config.reaper_interval_s, plus a lazy
                                               check on every command) drops the page
                                               locks and returns reserved slots; lookups
                                               (lease, live_ids, check_live, views)
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
The rule's tables are :mod:`kvbank.lender.conflicts`.

A WRITE lease reserves a slot only for rows not already stored (those are listed
``PRESENT``); a row someone else stored before the commit keeps its bytes (equal names
are interchangeable bytes) and the reserved slot goes back. What a WRITE lease does in
the store (reserve, fill, publish) is :mod:`kvbank.lender.writes`.

Thread-safety: one re-entrant lock guards the lender's tables; the store has its own and
the lender always takes its lock first (the order is in :mod:`kvbank.tiers.lockorder`).
The lender lock is held only over its tables: a lend claims its names in the conflict
tables, stages its rows (disk reads, copies, waits for room) with no lender lock held,
then publishes the lease; a commit takes its lease out of the tables, then publishes the
rows. Bulk copies in :meth:`read_into` run outside the lender's lock — which is exactly
why the completion check exists.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvbank import checks
from kvbank.config import BankConfig
from kvbank.errors import (
    InvalidInput,
    LeaseExpired,
    LeaseNotFound,
    TierError,
    TierUnavailable,
)
from kvbank.keys import ROW_NAME_BYTES, shape_key
from kvbank.lender import reads, writes
from kvbank.lender.access import LeaseAccess, _Held
from kvbank.lender.base import (
    CommitResult,
    Delivery,
    Lease,
    LeaseMode,
    LeaseRow,
    LendingStore,
    Location,
    MemoryKind,
    PageShape,
    Selection,
)
from kvbank.lender.conflicts import Conflicts
from kvbank.lender.reads import Slot
from kvbank.tiers.lockorder import Rank, make_lock

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

Clock = Callable[[], float]  # monotonic seconds
# row name -> its page's size and regions. It must depend only on the name's namespace
# and group (the lender keeps each answer found per pair; a bank's _describe does).
Describe = Callable[[bytes], PageShape | None]

_TOMBSTONES = 4096  # ended lease ids remembered, so a late call says why (expired/released)
_SHAPES = 4096  # (namespace, group) shapes remembered; a bank has a handful per layout
_shape_key = shape_key  # namespace ‖ group: one page shape (keys owns the anatomy)


class Lender(LeaseAccess):
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
        self._conflicts = Conflicts()  # the readers/writer rule over live and pending names
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
        ttl = checks.seconds(ttl_s, "ttl_s", positive=True)
        if ttl > self._config.max_lease_ttl_s:
            raise InvalidInput(
                f"ttl_s: {ttl_s} exceeds max_lease_ttl_s {self._config.max_lease_ttl_s}"
            )
        return ttl

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
        absent: bool = False,
    ) -> Lease:
        """A NAMED lease on ``names``. Rows held only on disk are staged into host first.

        ``absent=True`` (WRITE only): the caller located ``names`` a moment ago and found
        none stored, so the reservation does not look them up again; a row stored in
        between is found at commit and kept (equal names are equal bytes)."""
        self._enum(kind, MemoryKind, "kind")
        self._enum(mode, LeaseMode, "mode")
        if absent and mode is not LeaseMode.WRITE:
            raise InvalidInput("absent: only a WRITE lease reserves rows known to be absent")
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
            self._conflicts.check(rows, mode, self._reader_of)
            self._conflicts.claim(lease_id, rows, mode)
        try:
            if mode is LeaseMode.READ:
                out, locked, slots, parents = reads.stage(self._store, lease_id, rows, shapes, kind)
            else:
                out, locked, slots, parents = writes.reserve(self._store, lease_id, rows, shapes, kind,
                                                             absent=absent)
        except BaseException:
            with self._lock:
                self._conflicts.unclaim(lease_id, rows, mode)
            raise
        with self._lock:
            if self._closed:  # closed while staging: give everything back
                self._conflicts.unclaim(lease_id, rows, mode)
                self._release_store(lease_id, bool(locked), mode, slots)
                raise TierUnavailable("lender: closed")
            # The claim in the conflict maps becomes the lease's own entry there.
            self._conflicts.settle(lease_id)
            deadline = self._clock() + ttl
            lease = self._snapshot(lease_id, kind, mode, Selection.NAMED, deadline, out)
            self._held[lease_id] = _Held(lease, deadline, rows, locked, slots, parents)
            heapq.heappush(self._deadlines, (deadline, lease_id))
        logger.debug("lent %s %s %s: %d rows, ttl %.3fs", lease_id, kind.name, mode.name, len(rows), ttl)
        return lease

    def _reader_of(self, name: bytes) -> str | None:
        """A live READ lease listing ``name`` (the conflict message's culprit)."""
        return next((lid for lid, h in self._held.items()
                     if h.lease.mode is LeaseMode.READ and name in h.names), None)

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

    def commit(self, lease_id: str, arrived: Sequence[bytes] | Sequence[bool],
               sums: Mapping[bytes, int] | None = None) -> CommitResult:
        """Publish the WRITE lease's rows that arrived whole; return the others' slots.

        ``arrived`` is the names that arrived, or one bool per lease row (in row order).
        The lease ends. Committing an expired lease publishes nothing (LeaseExpired).
        ``sums``: host rows' checksums as the writer hashed its copies (recorded, not
        computed again: ``HostSlots.commit_many``).
        """
        with self._lock:
            now = self._clock()
            self._reap_locked(now)
            held = self._live(lease_id, now)
            lease = held.lease
            if lease.mode is not LeaseMode.WRITE or lease.selection is not Selection.NAMED:
                raise InvalidInput(f"lease_id: {lease_id} is a {lease.mode.name} "
                                   f"{lease.selection.name} lease; only NAMED WRITE leases commit")
            got = writes.arrived_names(lease, arrived)
            # From here the lease is this call's: ended in the tables (no reaper, release
            # or second commit can touch its slots), published with no lender lock held.
            self._detach_locked(lease_id, "committed")
        result = writes.publish(self._store, lease, held.slots, held.parents, got,
                                lambda name: self._shape(_shape_key(name), name), sums)
        logger.debug("commit %s: %d committed, %d discarded",
                     lease_id, len(result.committed), len(result.discarded))
        return result

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
        if held.changed:  # unlocked now: drop the host copies that still fail
            with contextlib.suppress(TierError):  # closing: the rows go with the store
                self._store.host.quarantine(sorted(held.changed))

    def _detach_locked(self, lease_id: str, why: str) -> _Held:
        """Take a lease out of the lender's tables (caller holds the lender lock)."""
        held = self._held.pop(lease_id)
        if why == "expired":
            self.expired_count += 1
            logger.debug("lease %s expired", lease_id)
        if held.lease.selection is Selection.NAMED:
            self._conflicts.drop(held.names, held.lease.mode)
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
                writes.abort_slots(self._store, slots)

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
            named = [(lid, h) for lid, h in self._held.items()
                     if h.lease.selection is not Selection.ALL]
            for lid, h in named:
                lease = h.lease
                if h.names != lease.names:
                    raise AssertionError(f"lease {lid}: names table differs from its rows")
                for n in h.locked:
                    if not self._store.locks.is_locked(n):
                        raise AssertionError(f"lease {lid}: row {n.hex()} is not locked")
                for row in lease.rows:
                    expect = row.delivery in (Delivery.READY, Delivery.RESERVED)
                    if expect != (row.name in h.slots):
                        raise AssertionError(f"lease {lid}: row {row.name.hex()} slot/delivery")
            self._conflicts.check_invariants((lid, h.names, h.lease.mode) for lid, h in named)

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
