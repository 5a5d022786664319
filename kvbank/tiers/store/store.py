"""The tiered store: one node's rows across memory pools over frame stores.

Parts (one module each; plain data plus functions, owned by the store lock, except the
mover, which owns the disk lock):

==============  ======================================================================
module          owns
==============  ======================================================================
``types``       public values (stats, health, ``RowInfo``, ``EvictResult``, events), jobs
``state``       the shared state: index, pools, frame stores, tables, counters, queue
``residency``   the slot ledger; the only code that adds/removes rows and frees slots
``pagelocks``   page locks (per holder, counted) and admin pins (budgeted)
``locktable``   ``store.locks``: the page-lock operations under the store lock
``policy``      victim choice: prefix-aware LRU as a pure function over the index
``placement``   which slot a row gets; making room; waiting (with a deadline)
``copier``      every byte copy between tiers (the seam tests inject); the copy lanes
``reserve``     the host budget claimed and pre-faulted at open (``reserve_host``)
``mover``       the background thread: device→host copies, disk demotions, purges
``writes``      put and commit: fill a private slot, publish it (write-through to disk)
``reads``       get: copy out, promote a disk row into host, drop corrupt rows
``staging``     bring rows into one memory kind for leases (one row, or a batch)
``memory``      ``store.host`` / ``store.device``: reserve, commit, abort, stage, view
``admin``       scan, evict, pin, unpin, touch, read_frame
``events``      the bounded change feed (PUBLISHED / WITHDRAWN, overflow counted)
``persist``     recovery from disk at open, write-back of memory rows at close
``check``       the consistency checker
==============  ======================================================================

The tiers: memory pools (:class:`~kvbank.tiers.base.SlotPool`), fastest first — the
device pool, then the host slab — over an ordered list of frame stores
(:class:`~kvbank.tiers.base.FrameStore`): the disk tier, whose rows the index tracks, then
the remote tiers (``remote_url``, by scheme), which take the disk's evictions and answer
reads every local tier missed. A row's tier bits in the index are
``1 << TierKind.rank``. ``put`` writes into the fastest pool with a free slot; rows move
down under pressure (high/low watermarks): device → host (a copy by the mover),
host → disk (a codec frame), disk → dropped. Reads promote a disk row into host. LRU with
prefix awareness; locked and pinned rows are never victims.

Lock order — a thread holding one of these may take only those below it, never above
(checked on every acquire when ``kvbank.tiers.lockorder`` checking is on, as in the test
suite)::

    Lender._lock  →  Mover.disk_lock  →  TieredStore lock  →  DiskTier._lock

No copy, disk read, decode or mover wait runs under the store lock: each operation plans
under it (claims and holds slots), copies outside it, and publishes under it again,
re-checking that the row is unchanged. Waits are condition predicates with deadlines
(``wait_timeout_s``, or ``timeout_s=``): ``Busy`` when one passes, ``TierFull`` when
nothing more can be freed. ``flush(timeout_s)`` and ``close`` are bounded.

Lifecycle: ``TieredStore(config)`` (opens the tiers, recovers the disk index, starts the
mover and its codec workers) → any thread calls the methods → ``close()`` (idempotent:
refuses new calls, stops the mover after its current job, runs queued purges, writes
memory-only rows to disk unless ``persist=False`` — hottest first, within the disk budget
and a deadline — then unlinks the shared memory and closes LMDB).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from kvbank.config import BankConfig
from kvbank.errors import ConfigError, InvalidInput, RowLocked, TierUnavailable
from kvbank.results import (
    EventKind,
    EvictResult,
    HealthState,
    RowEvent,
    RowInfo,
    StoreHealth,
    StoreStats,
    TierHealth,
    TierStats,
)
from kvbank.tiers.base import Buffer, FrameStore, TierKind, as_bytes_view, check_name, check_names
from kvbank.tiers.device import DevicePool, device_budget
from kvbank.tiers.host import HostSlab
from kvbank.tiers.index import DEV, DISK, HOST, KIND_OF_BIT, tier_bit
from kvbank.tiers.schemes import open_remote
from kvbank.tiers.store import admin, placement, reads, writes
from kvbank.tiers.store import persist as persistence
from kvbank.tiers.store.check import check
from kvbank.tiers.store.copier import Copier, Lanes, default_copy_threads
from kvbank.tiers.store.events import DEFAULT_EVENT_CAPACITY
from kvbank.tiers.store.inplace import DeviceOps, HostOps
from kvbank.tiers.store.locktable import LockTable
from kvbank.tiers.store.mover import Mover, default_encode_workers
from kvbank.tiers.store.reserve import Reservation, start_reservation
from kvbank.tiers.store.state import StoreState, deadline_after

if TYPE_CHECKING:
    from kvbank.tiers.disk import CompactReport

logger = logging.getLogger("kvbank.tiers.store.store")
# locate's tier codes: 0 = absent, then the fastest tier holding the row
_TIER_OF_CODE: tuple[TierKind | None, ...] = (None, TierKind.DEVICE, TierKind.HOST, TierKind.DISK)

DEFAULT_CLOSE_DEADLINE_S = 30.0  # how long close() may spend writing dirty rows to disk

__all__ = [
    "DEFAULT_CLOSE_DEADLINE_S", "Copier", "EventKind", "EvictResult", "HealthState",
    "RowEvent", "RowInfo", "StoreHealth", "StoreStats", "TierHealth", "TierStats",
    "TieredStore", "default_encode_workers",
]


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class TieredStore:
    """Rows of one node across device, host and disk tiers. Thread-safe.

    Public surface: ``put``, ``put_many``, ``get_into``, ``get_many_into``, ``delete``, ``locate``, ``residency``,
    ``scan``, ``evict``, ``pin``, ``unpin``, ``touch``, ``take_events``, ``read_frame``,
    ``flush``, ``stats``, ``health``, ``check_invariants``, ``close``; and the
    namespaces ``locks`` (page locks), ``host`` and ``device`` (in-place slots).
    """

    reservation: Reservation | None  # the host budget pre-faulting (``reserve_host``)

    def __init__(self, config: BankConfig, *, encode_workers: int | None = None,
                 copier: Copier | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 event_capacity: int = DEFAULT_EVENT_CAPACITY) -> None:
        threads = config.copy_threads or default_copy_threads()
        if encode_workers is None:
            encode_workers = min(threads, default_encode_workers())
        if isinstance(encode_workers, bool) or not isinstance(encode_workers, int) \
                or encode_workers < 1:
            raise InvalidInput(f"encode_workers: expected an integer >= 1, got {encode_workers!r}")
        if isinstance(event_capacity, bool) or not isinstance(event_capacity, int) \
                or event_capacity < 1:
            raise InvalidInput(f"event_capacity: expected an integer >= 1, got {event_capacity!r}")
        self.config = config
        notes: list[str] = []
        disk_created = False
        device: DevicePool | None = None
        host: HostSlab | None = None
        frames: list[FrameStore] = []
        try:
            dev_budget, why_off = device_budget(config)
            if dev_budget > 0:
                device = DevicePool(dev_budget, config.device)
            else:
                notes.append(why_off)
                # Off on purpose (device_bytes 0), or by default on a machine with no GPU
                # (no budget was asked for): a state, said at info. Off although a budget
                # was asked for, or a GPU is there: degraded, a warning.
                asked = config.device_bytes is not None and config.device_bytes > 0
                log = logger.warning if asked or (config.device_bytes is None and _has_cuda()) else logger.info
                log("%s", why_off)
            if config.host_bytes > 0:
                host = HostSlab(config.host_bytes)
            if config.data_dir is not None and config.disk_bytes > 0:
                from kvbank.tiers.disk import DiskTier

                disk = DiskTier(config.data_dir, config.disk_bytes, sync=config.disk_sync,
                                salvage=config.disk_salvage)
                frames.append(disk)
                if disk.salvaged is not None:
                    notes.append(disk.salvaged.summary())
                disk_created = disk.created
                remote = open_remote(config, notes)  # the coldest frame store, below the disk
                if remote is not None:
                    frames.append(remote)
            if device is None and host is None and not frames:
                raise ConfigError(
                    "host_bytes: the store has no tier: host_bytes is 0, the device tier is "
                    f"off ({notes[0] if notes else 'device_bytes 0'}) and there is no disk "
                    "tier (data_dir unset or disk_bytes 0)", field="host_bytes")
            st = StoreState(config, device=device, host=host, frames=frames,
                            copier=copier or Copier(), clock=clock)
            st.notes.extend(notes)
            st.events.capacity = event_capacity
            persistence.recover(st)
            # Last: nothing after it may fail, so the thread never outlives a failed open.
            self.reservation = (start_reservation(host, config)
                                if config.reserve_host and host is not None else None)
        except BaseException:
            _close_tiers(device, host, frames)
            raise
        self._st = st
        self.disk_created = disk_created  # the disk tier found no data.mdb at open
        self._lanes = Lanes(threads)  # a batch's copies and codec work
        self._mover = Mover(st, encode_workers)
        self.locks = LockTable(st)
        self.host = HostOps(st, self._mover, self._lanes)
        self.device = DeviceOps(st, self._mover, self._lanes)
        self._mover.start()

    def _deadline(self, timeout_s: float | None) -> float:
        return deadline_after(timeout_s, self.config.wait_timeout_s)

    # -- rows --------------------------------------------------------------------------

    def put(self, name: bytes, data: Buffer, *, dtype: str = "uint8",
            parent: bytes | None = None, timeout_s: float | None = None) -> None:
        """Store a row (visible when this returns). ``RowLocked`` if the name is locked,
        ``PageSizeMismatch`` if it holds a row of another size, ``TierFull`` if no tier
        has room, ``Busy`` if making room outlasted the deadline."""
        writes.put(self._st, self._mover, name, data, dtype, parent, self._deadline(timeout_s))

    def put_many(self, rows: Sequence[tuple[bytes, Buffer, bytes | None]], *,
                 dtype: str = "uint8", timeout_s: float | None = None) -> list[bool]:
        """Store ``(name, data, parent)`` rows as one batch (copies and encodes on the copy
        threads, disk frames in one transaction): per row True, or False when a lock holds
        its name. Other refusals as :meth:`put` raise; each row is then stored whole or
        not at all."""
        return writes.put_many(self._st, self._mover, self._lanes,
                               [(n, as_bytes_view(d), p) for n, d, p in rows], dtype,
                               self._deadline(timeout_s))

    def get_many_into(self, names: Sequence[bytes],
                      outs: Sequence[memoryview | bytearray]) -> list[int | None]:
        """:meth:`get_into` for a batch (copies and decodes on the copy threads): per row
        its size, or ``None`` on a miss."""
        return reads.get_many_into(self._st, self._lanes, names, outs)

    def get_into(self, name: bytes, out: memoryview | bytearray) -> int | None:
        """Copy a row into ``out``; its size, or ``None`` on a miss. Touches LRU and
        promotes a disk row to host."""
        return reads.get_into(self._st, name, out)

    def recall_into(self, name: bytes, out: memoryview | bytearray) -> int | None:
        """Copy a row from the remote tiers only (counted nowhere: see
        :func:`~kvbank.tiers.store.reads.recall_into`); its size, or ``None``."""
        return reads.recall_into(self._st, name, out)

    def count_reads(self, tiers: Sequence[TierKind | None]) -> None:
        """Count reads served in place (a READ lease's rows): per row the tier that served
        it, or ``None`` for a miss, as :meth:`get_into` counts its own reads."""
        reads.count_reads(self._st, [0 if t is None else tier_bit(t) for t in tiers])

    def delete(self, name: bytes) -> bool:
        """Remove a row from every tier; ``False`` if absent, ``RowLocked`` if locked."""
        check_name(name)
        st = self._st
        with st.lock:
            st.check_open()
            if name in st.locks:
                raise RowLocked(f"row {name.hex()[:16]}…: locked by {sorted(st.locks.holders(name))}")
            rid = st.ix.ids.get(name)
            if rid is None:
                return False
            st.remove_row(rid)
            return True

    @property
    def has_remote(self) -> bool:
        """Whether a remote tier lies below the disk."""
        return bool(self._st.below)

    def remote_has(self, names: Sequence[bytes]) -> list[bool]:
        """Whether a remote tier holds each row (one round trip each, outside the store
        lock); all ``False`` without a remote tier or while it is unreachable (its
        health says why): a lookup there never turns a local answer into an error."""
        found = [False] * len(names)
        if not names:
            return found
        for remote in self._st.below:
            try:
                found = [f or bool(x) for f, x in zip(found, remote.contains_many(names),
                                                      strict=True)]
            except TierUnavailable as exc:
                logger.debug("store: remote lookup of %d rows failed: %s", len(names), exc)
        return found

    def locate(self, names: Sequence[bytes]) -> list[TierKind | None]:
        """The fastest tier holding each row (``None`` = absent). Touches nothing."""
        check_names(names)
        st = self._st
        with st.lock:
            st.check_open()
            # One C pass over the names, one numpy pass over their tier bits: a match
            # locates every page of a prompt (1,000 rows: 0.4 ms a row at a time).
            rids = np.fromiter(map(st.ix.ids.get, names, repeat(-1)), np.int64, len(names))
            bits = st.ix.where[rids]
        code = np.where(rids < 0, 0, np.where(bits & DEV, 1, np.where(bits & HOST, 2, 3)))
        return list(map(_TIER_OF_CODE.__getitem__, code.tolist()))

    def residency(self, names: Sequence[bytes]) -> list[frozenset[TierKind]]:
        """Every tier holding a copy of each row (empty = absent). Touches nothing."""
        st = self._st
        with st.lock:
            st.check_open()
            ids, where = st.ix.ids, st.ix.where
            out: list[frozenset[TierKind]] = []
            for name in names:
                rid = ids.get(check_name(name))
                w = 0 if rid is None else int(where[rid])
                out.append(frozenset(k for b, k in KIND_OF_BIT.items() if w & b))
            return out

    # -- admin and fleet ---------------------------------------------------------------

    def count(self, prefix: bytes = b"") -> int:
        """How many rows' names start with ``prefix`` (a bisect, not a scan). Pure."""
        return admin.count(self._st, prefix)

    def scan(self, prefix: bytes = b"", *, after: bytes | None = None,
             limit: int) -> list[RowInfo]:
        """Rows whose name starts with ``prefix``, in name order, after the cursor
        ``after`` (the last name of the previous page), at most ``limit``. Pure."""
        return admin.scan(self._st, prefix, after, limit)

    def evict(self, names: Sequence[bytes]) -> EvictResult:
        """Drop rows from every tier; locked or pinned rows are reported, not evicted."""
        return admin.evict(self._st, names)

    def pin(self, names: Sequence[bytes]) -> tuple[bytes, ...]:
        """Keep rows where they are (never evicted or demoted) within ``pin_bytes``
        (``PinBudgetExceeded``, nothing pinned); the names not stored."""
        return admin.pin(self._st, names)

    def unpin(self, names: Sequence[bytes]) -> None:
        admin.unpin(self._st, names)

    def touch(self, names: Sequence[bytes]) -> int:
        """Record recency without reading; how many of the rows are stored."""
        return admin.touch(self._st, names)

    def take_events(self, max_events: int | None = None) -> list[RowEvent]:
        """Rows PUBLISHED and WITHDRAWN since the last call, oldest first; an OVERFLOW
        event first when some were lost (resync with ``scan``). The feed records from the
        first call on: take once, ``scan`` what is there, then follow."""
        if max_events is not None and (isinstance(max_events, bool)
                                       or not isinstance(max_events, int) or max_events < 0):
            raise InvalidInput(f"max_events: expected an integer >= 0, got {max_events!r}")
        with self._st.lock:
            return self._st.events.take(max_events)

    def read_frame(self, name: bytes) -> bytes | None:
        """A row's encoded codec frame, not decoded; ``None`` on a miss."""
        return admin.read_frame(self._st, name)

    def compact_disk(self) -> CompactReport | None:
        """Compact the disk tier now; what it did, or ``None`` without a disk tier."""
        return admin.compact_disk(self._st)

    # -- the mover, introspection ------------------------------------------------------

    def refuses(self, size: int) -> str | None:
        """Why no tier could ever hold a row of ``size`` bytes, or None (layouts are
        checked against this when registered)."""
        with self._st.lock:
            return placement.refuses(self._st, size)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the mover is idle (``Busy`` at the deadline)."""
        self._mover.flush(self._deadline(timeout_s))

    def stats(self) -> StoreStats:
        st = self._st
        with st.lock:
            ix = st.ix
            where = ix.where[: ix.high]
            tiers: list[TierStats] = []
            for bit in (DEV, HOST, DISK):
                c = st.counters[bit]
                rows = int(np.count_nonzero(where & bit))
                # memory: copies dropped because their bytes no longer matched their
                # checksum (every serve path's verification ends in quarantine_host)
                corrupt = c.corrupt
                if bit == DISK:
                    disk = st.disk() if st.has_disk else None
                    enabled = disk is not None
                    used = alloc = disk.used_bytes if disk else 0
                    budget = disk.budget_bytes if disk else 0
                    corrupt = disk.corrupt_rows if disk else 0
                else:
                    pool = st.pools.get(bit)
                    enabled = pool is not None
                    used = pool.used_bytes if pool else 0
                    alloc = pool.allocated_bytes if pool else 0
                    budget = pool.budget if pool else 0
                raw = int(ix.size[: ix.high][(where & bit) != 0].sum(dtype=np.int64))
                tiers.append(TierStats(KIND_OF_BIT[bit], enabled, rows, used, alloc, budget,
                                       c.hits, c.misses, c.evictions, c.demotions,
                                       c.promotions, corrupt, raw, victims_first=c.victims_first,
                                       victims_reused=c.victims_reused,
                                       admitted_bytes=c.admitted_bytes,
                                       rejected_bytes=c.rejected_bytes,
                                       demoted_bytes=tuple(c.demoted_bytes),
                                       promoted_bytes=tuple(c.promoted_bytes)))
            return StoreStats(tuple(tiers), len(ix), len(st.locks), len(st.res.reserved),
                              len(st.jobs), sum(st.queued.values()), st.puts, st.gets,
                              st.hits, st.misses, len(st.pins), st.pins.nbytes,
                              st.events.dropped, st.remote_hits)

    def note(self, text: str) -> None:
        """Add a line to the health notes (a tier's own when it starts with its kind);
        said until the store closes."""
        with self._st.lock:
            self._st.notes.append(text)

    def health(self) -> StoreHealth:
        st = self._st
        with st.lock:
            mover = self._mover.thread.is_alive() and not st.closed
            tiers: list[TierHealth] = []
            for bit in (DEV, HOST, DISK):
                kind = KIND_OF_BIT[bit]
                enabled = st.has_disk if bit == DISK else bit in st.pools
                if not enabled:
                    why = next((n for n in st.notes if n.startswith(kind.value)), "not configured")
                    tiers.append(TierHealth(kind, False, HealthState.OFF, why))
                elif bit == DISK and st.disk_error is not None:
                    tiers.append(TierHealth(kind, True, HealthState.DEGRADED, st.disk_error))
                else:  # a salvage at open is said here until the next open
                    said = next((n for n in st.notes if n.startswith(kind.value)), "")
                    tiers.append(TierHealth(kind, True, HealthState.OK, said))
            ok = mover and all(t.state is not HealthState.DEGRADED for t in tiers)
            notes = list(st.notes)
            for remote in st.below:  # each remote tier counts its own failed writes
                faults = remote.health()
                if faults.failed_writes:
                    notes.append(f"remote tier: {faults.failed_writes} failed writes; last: "
                                 f"{faults.last_error}")
            return StoreHealth(ok, tuple(tiers), mover, tuple(notes))

    @property
    def closed(self) -> bool:
        return self._st.closed

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (see ``.check``).

        Takes the disk lock first: a write-through put holds it from its disk commit to
        its index update, and between the two the disk has a row the index does not."""
        with self._st.disk_lock, self._st.lock:
            problems = check(self._st)
        if problems:
            raise AssertionError(problems[0])

    # -- close -------------------------------------------------------------------------

    def close(self, *, persist: bool = True,
              deadline_s: float = DEFAULT_CLOSE_DEADLINE_S) -> None:
        """Close the store: new calls are refused, the mover stops (queued moves are
        cancelled, queued purges still run), then, with ``persist`` and a disk tier, every
        memory row without a disk copy is written to disk, hottest first, within the disk
        budget and ``deadline_s`` seconds (a warning names what was left). Finally the
        shared memory is unlinked and LMDB closed. ``persist=False`` drops dirty rows, as
        a crash would. Idempotent."""
        if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) \
                or not deadline_s >= 0:
            raise InvalidInput(f"deadline_s: expected seconds >= 0, got {deadline_s!r}")
        deadline = time.monotonic() + deadline_s
        st = self._st
        with st.lock:
            if st.closed:
                return
            st.closed = True
            st.cond.notify_all()
        # The mover ends after its current job; bounded so close cannot hang on it.
        if not self._mover.stop(max(deadline_s, 0.0) + self.config.wait_timeout_s):
            logger.warning("store: the mover is still running at close; tiers left open")
            return
        try:
            if st.has_disk and not st.mover_dead:
                for job in list(st.jobs):
                    self._mover.purge(job)
                st.jobs.clear()
                if persist:
                    persistence.write_back(st, self._mover, deadline, deadline_s)
        finally:
            if self._mover.encoder is not None:
                self._mover.encoder.shutdown(wait=True)
            self._lanes.close()
            if self.reservation is not None:
                self.reservation.stop()  # before the segment is unmapped
            _close_tiers(st.device, st.host, st.frames)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_tiers(device: DevicePool | None, host: HostSlab | None,
                 frames: Sequence[FrameStore]) -> None:
    for pool in (device, host):
        if pool is not None:
            pool.close()
    for fs in frames:
        fs.close()
