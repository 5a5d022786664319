"""The state the store's parts share, and the small rules over it.

:class:`StoreState` holds the row index, the memory pools (fastest first, typed fields
``device`` and ``host``), the frame stores below them (``frames``, fastest first: the disk
tier, whose rows the index tracks, then the remote tiers, ``below``), the slot ledger
(:class:`~.residency.Residency`), page locks, admin pins, the change feed, counters and
the mover's queue. Everything in it is guarded
by ``lock`` (the store lock of :mod:`kvbank.tiers.lockorder`) unless a field says so.
``changes`` counts events that can create work for the mover (a publish, an unlock, a
settled job): the mover re-evaluates its O(rows) pressure test only when it moved.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from kvbank.codec import DTYPE_CODES, MAX_PAGE_BYTES
from kvbank.config import BankConfig
from kvbank.errors import InvalidInput, PageSizeMismatch, RowLocked, TierUnavailable
from kvbank.tiers.base import FrameStore, SlotPool
from kvbank.tiers.device import DevicePool
from kvbank.tiers.host import HostSlab
from kvbank.tiers.index import DEV, DISK, HOST, KIND_OF_BIT, RowIndex
from kvbank.tiers.lockorder import Rank, make_lock
from kvbank.tiers.store import policy
from kvbank.tiers.store.copier import Copier
from kvbank.tiers.store.events import EventFeed
from kvbank.tiers.store.residency import Residency
from kvbank.tiers.store.rowlocks import PageLocks, RowPins
from kvbank.tiers.store.types import Job, JobKind

logger = logging.getLogger("kvbank.tiers.store.store")

MAX_PAGE = MAX_PAGE_BYTES  # the one page limit (sizes are uint32 in the index)
DISK_RETRY_S = 5.0  # after a failed disk write, memory tiers run host-only this long


class Counters:
    __slots__ = ("admitted_bytes", "corrupt", "demoted_bytes", "demotions", "evictions", "hits", "misses",
                 "promoted_bytes", "promotions", "rejected_bytes", "victims_first", "victims_reused")

    def __init__(self) -> None:
        self.hits = self.misses = self.evictions = self.demotions = self.promotions = 0
        self.corrupt = 0  # memory copies dropped: their bytes no longer matched their checksum
        # Rows the eviction rule took out of the tier (dropped or demoted), by reason: a
        # row never reused, or a reused one that aged out (its head start spent).
        self.victims_first = self.victims_reused = 0
        self.admitted_bytes = 0  # page bytes of puts stored into the tier
        self.rejected_bytes = 0  # page bytes of puts refused for want of room
        # Page bytes of the demotions by the tier they went to, of the promotions by the
        # tier they came from (indexed by TierKind rank).
        self.demoted_bytes = [0] * len(KIND_OF_BIT)
        self.promoted_bytes = [0] * len(KIND_OF_BIT)

    def demoted(self, to: int, size: int) -> None:
        """Count a row of ``size`` page bytes moved (or copied, then dropped) to tier ``to``."""
        self.demotions += 1
        self.demoted_bytes[KIND_OF_BIT[to].rank] += size

    def promoted(self, src: int, size: int) -> None:
        """Count a row of ``size`` page bytes copied into the tier from tier ``src``."""
        self.promotions += 1
        self.promoted_bytes[KIND_OF_BIT[src].rank] += size

    def victim(self, ix: RowIndex, rid: int) -> None:
        """Count a row the eviction rule chose, by reason."""
        if int(ix.freq[rid]) >= policy.REUSED:
            self.victims_reused += 1
        else:
            self.victims_first += 1


class StoreState:
    def __init__(self, config: BankConfig, *, device: DevicePool | None, host: HostSlab | None,
                 frames: list[FrameStore], copier: Copier,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock  # row ages (admin listings); deadlines use time.monotonic
        self.lock = make_lock(Rank.STORE, "TieredStore._lock")
        self.cond = threading.Condition(self.lock)  # type: ignore[arg-type]
        # The mover's disk lock: every disk mutation of the store takes it (lock order:
        # disk_lock, then lock; see kvbank.tiers.lockorder).
        self.disk_lock = make_lock(Rank.MOVER_DISK, "Mover.disk_lock")
        self.closed = False
        self.notes: list[str] = []
        self.disk_error: str | None = None
        self.disk_error_at = 0.0  # time.monotonic() of the last disk write that failed
        self.counters = {DEV: Counters(), HOST: Counters(), DISK: Counters()}
        self.puts = self.gets = self.hits = self.misses = 0
        self.device = device
        self.host = host
        self.pools: dict[int, SlotPool] = {}  # fastest first
        if device is not None:
            self.pools[DEV] = device
        if host is not None:
            self.pools[HOST] = host
        # The frame stores below the pools, fastest first. The first is the disk: the index
        # tracks its rows (the DISK bit). The others lie below it and the index never
        # tracks theirs: rows the disk evicts spill into the next one down, and a read
        # every local tier missed asks them in order.
        self.frames: tuple[FrameStore, ...] = tuple(frames)
        self.has_disk = bool(self.frames)
        self.below: tuple[FrameStore, ...] = self.frames[1:]
        # The local tiers a read asks, fastest first: only these count its hits and misses,
        # so every read is counted once per tier it reached and a disabled tier counts none.
        self.read_bits: tuple[int, ...] = (*(b for b in (DEV, HOST) if b in self.pools),
                                           *((DISK,) if self.has_disk else ()))
        self.remote_hits = 0  # local misses the remote tier answered
        max_off = max((p.allocator.space_bytes for p in self.pools.values()), default=0)
        self.ix = RowIndex(max_off, clock)
        self.locks = PageLocks()
        self.pins = RowPins(config.pin_budget)
        self.events = EventFeed()
        self.res = Residency(self.ix, self.pools, self.events, self.pins)
        self.copier = copier
        # the mover's queue (guarded by lock; the mover thread pops it)
        self.jobs: collections.deque[Job] = collections.deque()
        self.queued = {DEV: 0, HOST: 0}  # bytes queued to leave each memory tier
        self.busy = False  # the mover is executing a job
        self.mover_dead = False  # set if the mover died of a bug: waiters must not hang
        self.purge_pending = False
        self.changes = 0
        self.settled = 0  # jobs finished: what a put waiting for room waits on

    # -- rules -------------------------------------------------------------------------

    def notify(self) -> None:
        """Something changed that may give the mover or a waiter work (caller holds lock)."""
        self.changes += 1
        self.cond.notify_all()

    def check_open(self) -> None:
        if self.closed:
            raise TierUnavailable("store: closed")
        if self.mover_dead:
            raise TierUnavailable("store: the background mover died; see the log")

    def pool(self, bit: int, what: str) -> SlotPool:
        pool = self.pools.get(bit)
        if pool is None:
            raise TierUnavailable(f"{what}: the {KIND_OF_BIT[bit].value} tier is off")
        return pool

    def disk(self) -> FrameStore:
        """The frame store the index's DISK bit names (the first of ``frames``): a row
        marked on disk, or a write to disk, implies it; ``TierUnavailable`` without one."""
        if not self.frames:
            raise TierUnavailable("store: the disk tier is off")
        return self.frames[0]

    def dtype_code(self, dtype: str) -> int:
        # Checked up front even without a disk tier: a row must always be demotable.
        if not isinstance(dtype, str) or dtype not in DTYPE_CODES:
            raise InvalidInput(f"dtype: unknown dtype {dtype!r}; known: {sorted(DTYPE_CODES)}")
        return self.ix.dtype_code(dtype)

    def check_writable(self, name: bytes, size: int, holder: str | None) -> None:
        if self.locks.locked_by_other(name, holder):
            raise RowLocked(f"row {name.hex()[:16]}…: locked by {sorted(self.locks.holders(name))}")
        if name in self.pins:
            # A pinned row stays where it is; a new copy would go wherever there is room
            # (host while the device is full) and the old tiers' copies would go.
            raise RowLocked(f"row {name.hex()[:16]}…: pinned; unpin it to overwrite")
        rid = self.ix.ids.get(name)
        if rid is not None and int(self.ix.size[rid]) != size:
            raise PageSizeMismatch(
                f"data: {size} bytes, but row {name.hex()[:16]}… holds {int(self.ix.size[rid])}")

    def queue_purge(self, names: list[bytes]) -> None:
        self.jobs.append(Job(JobKind.PURGE, names=tuple(names)))
        self.notify()

    def remove_row(self, rid: int) -> None:
        """Drop a row from every tier (the disk copy via a purge job)."""
        name = self.res.remove_row(rid)
        if name is not None:
            self.queue_purge([name])

    def release(self, bit: int, off: int) -> None:
        """Drop a hold on a slot (see Residency.release)."""
        self.res.release(bit, off)

    def note_disk_error(self, msg: str) -> None:
        if self.disk_error is None:
            logger.warning("store: disk tier degraded: %s; memory tiers go on host-only, "
                           "dropping their coldest unwritten rows, and retry the disk "
                           "every %.0f s", msg, DISK_RETRY_S)
        self.disk_error = msg
        self.disk_error_at = time.monotonic()

    def disk_degraded(self) -> bool:
        """A disk write failed in the last ``DISK_RETRY_S``: memory victims that would
        need one are dropped instead (host-only), so puts keep working on a full disk.
        After that a victim is queued for the disk again: the retry."""
        return self.disk_error is not None and (
            time.monotonic() - self.disk_error_at < DISK_RETRY_S)

    def victims(self, bit: int, need: int, cls: int | None = None) -> list[int]:
        """The policy's victims in tier ``bit``: never locked, pinned or busy rows."""
        ix = self.ix
        keep = [rid for name in (*self.locks.names(), *self.pins.names())
                if (rid := ix.ids.get(name)) is not None]
        busy = {off for (b, off) in self.res.busy if b == bit}
        if bit == DISK:
            def charge(rid: int) -> int:
                return int(ix.size[rid])  # frames are roughly raw size; writes re-check
        else:
            pool = self.pools[bit]
            mem_off = self.res.mem_off

            def charge(rid: int) -> int:
                return pool.capacity(mem_off(rid, bit))
        return policy.victims(ix, bit, need, keep=keep, busy_offs=busy,
                              host_copy=self.res.host_copy, charge=charge, cls=cls,
                              first_k=policy.LRU_FIRST_K, rule=self.config.eviction_policy)


def deadline_after(timeout_s: float | None, default: float) -> float:
    """A monotonic deadline ``timeout_s`` (or ``default``) seconds from now."""
    if timeout_s is None:
        timeout_s = default
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not timeout_s >= 0:
        raise InvalidInput(f"timeout_s: expected seconds >= 0, got {timeout_s!r}")
    return time.monotonic() + float(timeout_s)
