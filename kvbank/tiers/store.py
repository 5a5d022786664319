"""The tiered store: one node's rows across the device pool, the host slab and the disk.

Primitives: :class:`TieredStore` over up to three tiers (:mod:`.device`, :mod:`.host`,
:mod:`.disk`), a compact :class:`~kvbank.tiers.index.RowIndex`, page locks, host/device
slot reservations for in-place leases, and one background *mover* thread.

Placement. ``put`` writes a row into the fastest tier with a free slot: device, then host.
When both are full it makes room in the host tier (below) and, if nothing there can be
evicted (everything locked), writes straight to the disk. A row is visible when ``put``
returns, never before; the bytes are copied into a private slot outside the store lock and
published under it.

Eviction. Per tier, LRU by a logical clock stamped on every put and get, with prefix
awareness: a row is never chosen as a victim while one of its children (rows put with
``parent=`` this row) is in the same tier and evictable, so a chain is evicted from its
tail and the longest usable prefixes stay. Locked rows, reserved slots and slots being
copied are never chosen. Rows leave the last tier (disk, or host when there is no disk)
for good; that is an *eviction*. Leaving an upper tier is a *demotion*.

Movement. Each tier has a byte budget with high/low watermarks: when a tier's use passes
``high_watermark`` the mover demotes victims until it is back at ``low_watermark``:
device → host (a copy), host → disk (a codec frame written by the disk tier), disk →
dropped. A host row that already has a disk copy (write-through, or promoted from disk)
is *clean* and is dropped from host without any I/O. Demotions to disk are encoded on a
few codec worker threads (``encode_workers``) and written by the mover thread alone, in
queue order, at most ``movement_queue_bytes`` queued at a time, so a put never waits for the
disk unless the host is full and the queue has to drain (backpressure). Reads promote:
a row served from disk is copied into a host slot (keeping its disk copy: clean).

Locks. ``lock(names, holder)`` counts per holder; a locked row is never evicted, demoted,
overwritten or deleted (``RowLocked``). Names may be locked before they exist (a write
lease). ``stage_host``/``stage_device`` bring a row into memory and return its slot for
in-place reads; ``reserve_*``/``commit_*``/``abort_*`` give a writer a private slot that
it fills in place and then publishes.

Write policy. Write-back (default): rows reach the disk when demoted. Write-through: every
put and commit is also written to the disk, durably (``disk_sync``), before it returns.

Durability. Only the disk tier persists (a graceful ``close`` first writes the memory
rows there). Reopening the same ``data_dir`` recovers every
row committed to disk, with its size, parent and an LRU order from its last write.
Disk mutations (the mover's writes and purges, write-through puts) are serialised by one
disk lock and checked against the index under the store lock, so a stale frame never
outlives an overwrite in the index.

Failures. A full disk or LMDB map is ``TierFull`` to the put that needed it; upper tiers
keep serving and ``health()`` reports the degraded state. When the last tier is full and
nothing is evictable, ``put`` raises ``TierFull``.

Lifecycle: ``TieredStore(config)`` (opens the tiers, recovers the disk index, starts the
mover and its codec workers) → any thread calls the methods → ``close()`` (idempotent:
refuses new calls, stops the mover after its current job, runs queued purges, writes
memory-only rows to disk unless ``persist=False`` — hottest first, within the disk budget
and a deadline — then unlinks the shared memory and closes LMDB).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from kvbank.codec import DTYPE_CODES
from kvbank.config import BankConfig, WritePolicy
from kvbank.errors import (
    CorruptPage,
    InvalidInput,
    PageSizeMismatch,
    RowLocked,
    TierError,
    TierFull,
    TierUnavailable,
)
from kvbank.tiers.base import (
    Buffer,
    DeviceSlot,
    HostSlot,
    TierKind,
    as_bytes_view,
    as_out_view,
    check_name,
)
from kvbank.tiers.device import DevicePool, device_budget
from kvbank.tiers.host import HostSlab
from kvbank.tiers.index import DEV, DISK, HOST, MOVING, OFF_SHIFT, RowIndex
from kvbank.tiers.slots import PAGE_ALIGN, SMALL_ALIGN, slot_class

if TYPE_CHECKING:
    from kvbank.tiers.disk import DiskTier

logger = logging.getLogger(__name__)

_KINDS = {DEV: TierKind.DEVICE, HOST: TierKind.HOST, DISK: TierKind.DISK}
_BITS = {v: k for k, v in _KINDS.items()}
_RANK = {DEV: 0, HOST: 1, DISK: 2}
_MAX_PAGE = 2**32 - 1  # sizes are uint32 in the index
_WAIT_S = 0.05  # re-check period of a put waiting for the mover
DEFAULT_CLOSE_DEADLINE_S = 30.0  # how long close() may spend writing dirty rows to disk
_LRU_FIRST_K = 64  # victims ordered in the first chunk at least (see _lru_order)
_WINDOW_PER_WORKER = 2  # encodes in flight per worker: one running, one ready to write


def default_encode_workers() -> int:
    """Threads that encode demotions (zstd and the plane split release the GIL)."""
    return min(2, os.cpu_count() or 1)

Pool = HostSlab | DevicePool
SlotKey = tuple[int, int]  # (tier bit, slot offset)
Window = collections.deque[tuple["_Job", "Future[bytes]"]]  # demotions being encoded, FIFO


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counters of one tier since the store opened (rows/bytes are current)."""

    kind: TierKind
    enabled: bool
    rows: int
    used_bytes: int  # slot capacity in use (memory tiers) or frame bytes (disk)
    allocated_bytes: int  # memory held: claimed chunks, or the frame bytes on disk
    budget_bytes: int
    hits: int
    misses: int
    evictions: int  # rows dropped out of the store from this tier
    demotions: int  # rows moved (or copied, then dropped) to a lower tier
    promotions: int  # rows copied into this tier from a lower one on read
    corrupt_rows: int


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of the store's counters."""

    tiers: tuple[TierStats, ...]  # fastest first, enabled or not
    rows: int
    locked_names: int
    reserved_slots: int
    queued_jobs: int
    queued_bytes: int
    puts: int
    gets: int
    hits: int
    misses: int

    def tier(self, kind: TierKind) -> TierStats:
        return next(t for t in self.tiers if t.kind is kind)


@dataclass(frozen=True, slots=True)
class TierHealth:
    kind: TierKind
    enabled: bool
    state: str  # "ok", "off", "degraded"
    detail: str


@dataclass(frozen=True, slots=True)
class StoreHealth:
    ok: bool  # every enabled tier ok and the mover running
    tiers: tuple[TierHealth, ...]
    mover_running: bool
    notes: tuple[str, ...]


@dataclass(slots=True)
class _Job:
    """A demotion of one memory row to disk, or a purge of stale disk names."""

    kind: str  # "demote" | "purge"
    bit: int = 0
    rid: int = -1
    name: bytes = b""
    off: int = -1
    size: int = 0
    names: tuple[bytes, ...] = ()
    evict: bool = False  # a disk eviction batch (the planner waits for it)


@dataclass(slots=True)
class _Staging:
    """One row of a :meth:`TieredStore.stage_host_many` batch that needs a new host slot."""

    name: bytes
    rid: int
    size: int
    src: int  # DEV (copy across) or DISK (decode); 0 once the row is found changed
    stamp: int  # the LRU stamp set when planned: a disk row is published only if unchanged
    off: int = -1  # the private host slot
    src_off: int = -1  # the device slot read from (src == DEV)
    pinned: bool = False  # src_off is pinned
    n: int | None = None  # bytes that arrived whole (None: the disk had no frame)
    corrupt: bool = False
    # Set when published: the row's LRU stamp and lock holders at that moment. A rollback
    # gives the copy back only if both are unchanged: a stage (or read) by anyone touches
    # the row, and a lock taken since may be a holder that relies on this slot.
    published_at: int = -1
    holders: dict[str, int] | None = None


class _Counters:
    __slots__ = ("demotions", "evictions", "hits", "misses", "promotions")

    def __init__(self) -> None:
        self.hits = self.misses = self.evictions = self.demotions = self.promotions = 0


class TieredStore:
    """Rows of one node across device, host and disk tiers. Thread-safe."""

    def __init__(self, config: BankConfig, *, encode_workers: int | None = None) -> None:
        if encode_workers is None:
            encode_workers = default_encode_workers()
        if isinstance(encode_workers, bool) or not isinstance(encode_workers, int) \
                or encode_workers < 1:
            raise InvalidInput(f"encode_workers: expected an integer >= 1, got {encode_workers!r}")
        self.config = config
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._disk_lock = threading.Lock()  # serialises every disk mutation (see docstring)
        self._closed = False
        self._notes: list[str] = []
        self._disk_error: str | None = None
        self._counters = {DEV: _Counters(), HOST: _Counters(), DISK: _Counters()}
        self._puts = self._gets = self._hits = self._misses = 0

        self._pools: dict[int, Pool] = {}
        dev_budget, why_off = device_budget(config)
        if dev_budget > 0:
            self._pools[DEV] = DevicePool(dev_budget, config.device)
        else:
            self._notes.append(why_off)
            # Switched off on purpose is a state change; off for want of a GPU is degraded.
            log = logger.info if config.device_bytes == 0 else logger.warning
            log("%s", why_off)
        if config.host_bytes > 0:
            self._pools[HOST] = HostSlab(config.host_bytes)
        self._disk: DiskTier | None = None
        try:
            if config.data_dir is not None and config.disk_bytes > 0:
                from kvbank.tiers.disk import DiskTier

                self._disk = DiskTier(config.data_dir, config.disk_bytes, sync=config.disk_sync)
            max_off = max((p.allocator.space_bytes for p in self._pools.values()), default=0)
            self._ix = RowIndex(max_off)
            self._recover()
        except BaseException:
            self._close_tiers()
            raise

        self._pins: dict[SlotKey, int] = {}  # slots being copied outside the lock
        self._zombies: set[SlotKey] = set()  # slots removed from the index while pinned
        self._reserved: dict[SlotKey, tuple[str, int]] = {}  # write-lease slots: holder, size
        self._dual: dict[int, int] = {}  # row id -> host offset, for rows in DEVICE and HOST
        self._locks: dict[bytes, dict[str, int]] = {}
        self._held: dict[str, dict[bytes, int]] = {}
        self._jobs: collections.deque[_Job] = collections.deque()
        self._queued = {DEV: 0, HOST: 0}  # bytes queued for demotion per tier
        self._busy = False  # the mover is executing a job
        self._mover_dead = False  # set if the mover died of a bug: waiters must not hang
        self._purge_pending = False
        # Encoding (and batch-stage decoding) runs here; disk writes stay on the mover.
        self._workers = encode_workers
        self._encoder: ThreadPoolExecutor | None = None
        if self._disk is not None:
            self._encoder = ThreadPoolExecutor(encode_workers, thread_name_prefix="kvbank-codec")
        self._mover = threading.Thread(target=self._run_mover, name="kvbank-mover", daemon=True)
        self._mover.start()

    # ==================================================================================
    # recovery

    def _recover(self) -> None:
        if self._disk is None:
            return
        ix = self._ix
        pending: list[tuple[int, bytes]] = []
        rows = sorted(self._disk.scan(), key=lambda r: r.seq)
        for row in rows:  # oldest write first: the rank of the write is the LRU stamp
            rid = ix.add(row.name, row.raw_len, ix.dtype_code(row.dtype), -1)
            ix.where[rid] = DISK
            if row.parent is not None:
                pending.append((rid, row.parent))
        for rid, parent in pending:
            pid = ix.ids.get(parent)
            if pid is not None and pid != rid:
                ix.parent[rid] = pid
        if len(ix):
            logger.debug("store: recovered %d rows from %s", len(ix), self.config.data_dir)

    # ==================================================================================
    # small helpers (callers hold self._lock unless said otherwise)

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("store: closed")
        if self._mover_dead:
            raise TierUnavailable("store: the background mover died; see the log")

    def _mem_off(self, rid: int, bit: int) -> int:
        if bit == HOST and rid in self._dual:
            return self._dual[rid]
        return self._ix.get_off(rid)

    def _free_slot(self, bit: int, off: int) -> None:
        key = (bit, off)
        if key in self._pins:
            self._zombies.add(key)  # freed by the last unpin
        else:
            self._pools[bit].free(off)

    def _pin(self, bit: int, off: int) -> None:
        key = (bit, off)
        self._pins[key] = self._pins.get(key, 0) + 1

    def _unpin(self, bit: int, off: int) -> None:
        key = (bit, off)
        left = self._pins[key] - 1
        if left:
            self._pins[key] = left
            return
        del self._pins[key]
        if key in self._zombies:
            self._zombies.discard(key)
            self._pools[bit].free(off)

    def _fail_slot(self, bit: int, off: int, reserve: tuple[str, int] | None) -> None:
        """A private slot whose publish failed: back to its reservation, or freed."""
        if reserve is not None and not self._closed:
            self._reserved[(bit, off)] = reserve
        else:
            self._free_slot(bit, off)

    def _owned(self, bit: int, off: int) -> bool:
        """Whether a slot is already a row's, reserved, or waiting to be freed."""
        key = (bit, off)
        if key in self._reserved or key in self._zombies:
            return True
        ix = self._ix
        n = ix.high
        enc = off if ix.wide else off >> OFF_SHIFT
        hits = np.flatnonzero((ix.off[:n] == enc) & ((ix.where[:n] & bit) != 0))
        return any(self._mem_off(int(r), bit) == off for r in hits.tolist())

    def _drop_copy(self, rid: int, bit: int) -> None:
        """Forget the row's copy in one memory tier (the row may live on elsewhere)."""
        ix = self._ix
        off = self._mem_off(rid, bit)
        self._free_slot(bit, off)
        where = int(ix.where[rid]) & ~bit
        ix.where[rid] = where
        if rid in self._dual:
            host_off = self._dual.pop(rid)
            if bit == DEV:
                ix.set_off(rid, host_off)  # the host copy becomes the primary offset

    def _remove_row(self, rid: int) -> None:
        """Drop a row from every tier (the disk copy via a purge job)."""
        ix = self._ix
        where = int(ix.where[rid])
        name = ix.names[rid]
        for bit in (DEV, HOST):
            if where & bit:
                self._drop_copy(rid, bit)
        if where & DISK and name is not None:
            self._queue_purge([name])
        ix.remove(rid)

    def _queue_purge(self, names: list[bytes]) -> None:
        self._jobs.append(_Job("purge", names=tuple(names)))
        self._cond.notify_all()

    def _locked_by_other(self, name: bytes, holder: str | None) -> bool:
        held = self._locks.get(name)
        if not held:
            return False
        return holder is None or any(h != holder for h in held)

    def _dtype_code(self, dtype: str) -> int:
        # Checked up front even without a disk tier: a row must always be demotable.
        if not isinstance(dtype, str) or dtype not in DTYPE_CODES:
            raise InvalidInput(f"dtype: unknown dtype {dtype!r}; known: {sorted(DTYPE_CODES)}")
        return self._ix.dtype_code(dtype)

    def _pool(self, bit: int, what: str) -> Pool:
        pool = self._pools.get(bit)
        if pool is None:
            raise TierUnavailable(f"{what}: the {_KINDS[bit].value} tier is off")
        return pool

    # ==================================================================================
    # victim selection and room making

    def _victims(self, bit: int, need: int, cls: int | None = None) -> list[int]:
        """Row ids to take out of tier ``bit`` to free ``need`` bytes: LRU order, tails of
        chains before their prefixes, never locked, pinned or moving rows. With ``cls``
        only rows in slots of that capacity (so that each victim frees a usable slot).
        Sorts only the oldest candidates it walks (see :meth:`_lru_order`)."""
        ix = self._ix
        n = ix.high
        if n == 0 or need <= 0:
            return []
        where = ix.where[:n]
        cand = ((where & bit) != 0) & ((ix.flags[:n] & MOVING) == 0)
        # Rows that must stay: locked names, slots being copied, and (in DEVICE) rows
        # whose host copy is the DEVICE row itself -- handled by _mem_off.
        keep: list[int] = []
        for name in self._locks:
            rid = ix.ids.get(name)
            if rid is not None:
                keep.append(rid)
        pinned_offs = {off for (b, off) in self._pins if b == bit}
        if pinned_offs:
            # Compare the encoded offsets in one pass. A staged row in both memory tiers
            # keeps its device offset in `off`; a numeric clash only keeps a row longer.
            enc = [o if ix.wide else o >> OFF_SHIFT for o in pinned_offs]
            cand &= ~np.isin(ix.off[:n], np.asarray(enc, dtype=ix.off.dtype))
            if bit == HOST:
                keep.extend(rid for rid, hoff in self._dual.items() if hoff in pinned_offs)
        if keep:
            cand[np.asarray(keep, dtype=np.int64)] = False
        idx = np.flatnonzero(cand)
        if cls is not None and idx.size:
            size = ix.size[idx].astype(np.int64)
            align = np.where(size >= PAGE_ALIGN, PAGE_ALIGN, SMALL_ALIGN)
            same = (-(-size // align) * align) == cls
            cand[idx[~same]] = False
            idx = idx[same]
        if idx.size == 0:
            return []
        parents = ix.parent[idx]
        blockers = np.bincount(parents[parents >= 0], minlength=n)
        blockers[~cand] = 0  # only evictable rows are blocked
        order = self._lru_order(idx, need)
        parent_of = ix.parent
        out: list[int] = []
        taken: set[int] = set()
        deferred: set[int] = set()
        freed = 0
        pools = self._pools
        for rid in order:
            if freed >= need:
                break
            if rid in taken:
                continue
            if blockers[rid] > 0:
                deferred.add(rid)
                continue
            cur = rid
            while True:  # take cur, then walk up while its parent became a free tail
                taken.add(cur)
                out.append(cur)
                freed += self._charge(bit, cur, pools)
                p = int(parent_of[cur])
                if p < 0 or not cand[p]:
                    break
                blockers[p] -= 1
                if blockers[p] > 0 or p not in deferred or freed >= need:
                    break
                deferred.discard(p)
                cur = p
        return out

    def _lru_order(self, idx: npt.NDArray[np.int64], need: int) -> Iterator[int]:
        """The candidate ids ``idx``, oldest stamp first, sorting only what the caller
        consumes: ``np.argpartition`` takes the k oldest (k from the bytes needed, with
        room for chain prefixes the caller defers), sorts those, and k grows 4x while the
        caller wants more. Live stamps are unique (a clock), so the chunks concatenate to
        exactly the full sort's order. Cost: O(candidates) per chunk, not a full sort."""
        stamps = self._ix.atime[idx]
        sample = idx[:: max(1, idx.size // 4096)]  # the mean row size, from a strided sample
        avg = max(1.0, float(self._ix.size[sample].mean()))
        k = max(_LRU_FIRST_K, 2 * int(need / avg) + 1)
        while idx.size:
            if idx.size <= k:
                yield from idx[np.argsort(stamps, kind="stable")].tolist()
                return
            part = np.argpartition(stamps, k - 1)
            head, rest = part[:k], part[k:]
            yield from idx[head[np.argsort(stamps[head], kind="stable")]].tolist()
            idx, stamps = idx[rest], stamps[rest]
            k *= 4

    def _charge(self, bit: int, rid: int, pools: dict[int, Pool]) -> int:
        size = int(self._ix.size[rid])
        if bit == DISK:
            return size  # frames are roughly raw size; the disk budget check re-reads usage
        return pools[bit].capacity(self._mem_off(rid, bit))

    def _take_out(self, bit: int, rid: int) -> bool:
        """Move a victim out of memory tier ``bit`` now if that needs no I/O; else queue
        a demotion job. True when the slot was freed at once."""
        ix = self._ix
        where = int(ix.where[rid])
        if bit == DEV and where & HOST:  # a host copy exists (staged): drop the device one
            self._drop_copy(rid, DEV)
            self._counters[DEV].demotions += 1
            return True
        if bit == DEV and HOST in self._pools:
            host = self._pools[HOST]
            size = int(ix.size[rid])
            host_off = host.alloc(size)
            if host_off is not None:
                dev_off = ix.get_off(rid)
                dev = self._pools[DEV]
                assert isinstance(dev, DevicePool) and isinstance(host, HostSlab)
                dst = torch.from_numpy(host.numpy()[host_off : host_off + size])
                dst.copy_(dev.tensor(dev_off, size))  # device -> host, a fast memory copy
                self._free_slot(DEV, dev_off)
                ix.set_off(rid, host_off)
                ix.where[rid] = (where & ~DEV) | HOST
                self._counters[DEV].demotions += 1
                return True
        if where & DISK:  # clean: the disk holds the same bytes
            self._drop_copy(rid, bit)
            self._counters[bit].demotions += 1
            return True
        if self._disk is None:  # nothing below: the row leaves the store
            self._counters[bit].evictions += 1
            self._remove_row(rid)
            return True
        name = ix.names[rid]
        assert name is not None
        off = self._mem_off(rid, bit)
        size = int(ix.size[rid])
        ix.flags[rid] |= MOVING
        self._pin(bit, off)
        self._queued[bit] += size
        self._jobs.append(_Job("demote", bit=bit, rid=rid, name=name, off=off, size=size))
        self._cond.notify_all()
        return False

    def _reclaim(self, bit: int, need: int, *, queue: bool = True,
                 cls: int | None = None) -> int:
        """Free ``need`` bytes of tier ``bit`` (minus bytes already queued); the bytes
        freed at once. With ``queue=False`` only victims that need no I/O are taken;
        with ``cls`` only rows of that slot class."""
        if cls is None:
            need -= self._queued.get(bit, 0)
        if need <= 0:
            return 0
        freed = 0
        room = self.config.movement_queue_bytes - sum(self._queued.values())
        pool = self._pools[bit]
        for rid in self._victims(bit, need, cls):
            cap = pool.capacity(self._mem_off(rid, bit))
            clean = bool(int(self._ix.where[rid]) & DISK) or self._disk is None or (
                bit == DEV and HOST in self._pools)
            if not clean and (not queue or room <= 0):
                continue
            if self._take_out(bit, rid):
                freed += cap
            else:
                room -= int(self._ix.size[rid])
        return freed

    def _alloc_memory(self, size: int, *, wait: bool) -> tuple[int, int | None]:
        """A private slot for a new row: (tier bit, offset), or (DISK, None) when the row
        must go straight to disk. Makes room in host when every memory tier is full."""
        for bit in (DEV, HOST):
            pool = self._pools.get(bit)
            if pool is not None and pool.fits(size):
                off = pool.alloc(size)
                if off is not None:
                    return bit, off
        host = self._pools.get(HOST)
        if host is not None and host.fits(size):
            off = self._alloc_waiting(HOST, size) if wait else None
            if off is not None:
                return HOST, off
        if self._disk is not None:
            return DISK, None
        raise TierFull(
            f"store: no room for a {size}-byte row: "
            + ", ".join(f"{_KINDS[b].value} {p.used_bytes}/{p.budget} bytes"
                        for b, p in self._pools.items())
            + "; nothing evictable (locked, reserved or being read)")

    def _band(self, bit: int) -> int:
        """Bytes between the high and the low watermark of a memory tier."""
        budget = self._pools[bit].budget
        return int(budget * (self.config.high_watermark - self.config.low_watermark))

    # ==================================================================================
    # put / get / delete

    def put(
        self,
        name: bytes,
        data: Buffer,
        *,
        dtype: str = "uint8",
        parent: bytes | None = None,
    ) -> None:
        """Store a row (visible when this returns). ``RowLocked`` if the name is locked,
        ``PageSizeMismatch`` if it holds a row of another size, ``TierFull`` if no tier
        has room."""
        check_name(name)
        if parent is not None:
            check_name(parent)
        src = as_bytes_view(data)
        size = src.nbytes
        if size == 0 or size > _MAX_PAGE:
            raise InvalidInput(f"data: page size must be in [1, {_MAX_PAGE}], got {size}")
        with self._lock:
            self._check_open()
            code = self._dtype_code(dtype)
            self._check_writable(name, size, None)
            bit, off = self._alloc_memory(size, wait=True)
            if off is not None:
                self._pin(bit, off)  # private until published; pinning keeps it off lists
        try:
            if off is not None:
                self._pools[bit].write(off, src)
            self._publish(name, size, code, parent, bit, off, src, holder=None)
        finally:
            if off is not None:
                with self._lock:
                    self._unpin(bit, off)

    def _check_writable(self, name: bytes, size: int, holder: str | None) -> None:
        if self._locked_by_other(name, holder):
            raise RowLocked(f"row {name.hex()[:16]}…: locked by {sorted(self._locks[name])}")
        rid = self._ix.ids.get(name)
        if rid is not None and int(self._ix.size[rid]) != size:
            raise PageSizeMismatch(
                f"data: {size} bytes, but row {name.hex()[:16]}… holds {int(self._ix.size[rid])}")

    def _publish(
        self,
        name: bytes,
        size: int,
        code: int,
        parent: bytes | None,
        bit: int,
        off: int | None,
        src: memoryview,
        *,
        holder: str | None,
        reserve: tuple[str, int] | None = None,
    ) -> None:
        """Make a filled private slot (or a disk-only write) the row's current copy.
        On failure nothing changed, and the slot is given back (or, for a commit, stays
        reserved: ``reserve`` = (holder, size))."""
        to_disk = off is None or (
            self.config.write_policy is WritePolicy.WRITE_THROUGH and self._disk is not None)
        if not to_disk:
            with self._lock:
                self._commit_locked(name, size, code, parent, bit, off, holder, on_disk=False,
                                    reserve=reserve)
            return
        disk = self._disk
        assert disk is not None  # off is None only when there is a disk tier
        try:
            frame = disk.frame(src, self._ix.dtypes[code])
            with self._disk_lock:
                with self._lock:
                    self._check_open()
                    self._check_writable(name, size, holder)
                    parent_name = parent if parent is not None and parent in self._ix.ids else None
                self._make_disk_room(len(frame))
                disk.write_frame(name, frame, raw_len=size, dtype=self._ix.dtypes[code],
                                 parent=parent_name, replace=True)
                with self._lock:
                    if self._disk_error is not None:
                        logger.warning("store: disk tier writes again")
                    self._disk_error = None
                    self._commit_locked(name, size, code, parent, bit, off, holder,
                                        on_disk=True, reserve=reserve)
        except BaseException as exc:
            with self._lock:
                if isinstance(exc, TierFull | TierUnavailable) and not self._closed:
                    self._note_disk_error(str(exc))
                if off is not None and not self._owned(bit, off):
                    self._fail_slot(bit, off, reserve)
            raise

    def _commit_locked(
        self,
        name: bytes,
        size: int,
        code: int,
        parent: bytes | None,
        bit: int,
        off: int | None,
        holder: str | None,
        *,
        on_disk: bool,
        reserve: tuple[str, int] | None,
    ) -> None:
        ix = self._ix
        try:
            self._check_open()
            self._check_writable(name, size, holder)  # again: a lock may have come meanwhile
        except BaseException:
            if off is not None:
                self._fail_slot(bit, off, reserve)
            raise
        rid = ix.ids.get(name)
        if rid is None:
            pid = ix.ids.get(parent, -1) if parent is not None and parent != name else -1
            rid = ix.add(name, size, code, pid)
        else:
            where = int(ix.where[rid])
            for b in (DEV, HOST):
                if where & b:
                    self._drop_copy(rid, b)
            if where & DISK and not on_disk:
                self._queue_purge([name])  # the disk copy is stale now
            ix.where[rid] = 0
            ix.flags[rid] = 0  # a demotion in flight sees the new offset and backs off
            ix.dtype[rid] = code
            ix.touch(rid)
        where = DISK if on_disk else 0
        if off is not None:
            ix.set_off(rid, off)
            where |= bit
        ix.where[rid] = where
        self._puts += 1
        self._cond.notify_all()

    def get_into(self, name: bytes, out: memoryview | bytearray) -> int | None:
        """Copy a row into ``out``; its size, or ``None`` on a miss. Touches LRU and
        promotes a disk row to host."""
        check_name(name)
        dst = as_out_view(out)
        with self._lock:
            self._check_open()
            self._gets += 1
            rid = self._ix.ids.get(name)
            if rid is None:
                self._misses += 1
                for c in self._counters.values():
                    c.misses += 1
                return None
            size = int(self._ix.size[rid])
            if dst.nbytes < size:
                raise InvalidInput(f"out: {dst.nbytes} bytes, the row holds {size}")
            stamp = self._ix.touch(rid)
            where = int(self._ix.where[rid])
            bit = DEV if where & DEV else HOST if where & HOST else DISK
            for b in (DEV, HOST):
                if b == bit:
                    break
                self._counters[b].misses += 1
            self._counters[bit].hits += 1
            self._hits += 1
            if bit != DISK:
                off = self._mem_off(rid, bit)
                self._pin(bit, off)
        if bit != DISK:
            try:
                self._pools[bit].read_into(off, size, dst)
            finally:
                with self._lock:
                    self._unpin(bit, off)
            return size
        return self._read_disk(name, rid, stamp, size, dst)

    def _read_disk(self, name: bytes, rid: int, stamp: int, size: int, dst: memoryview) -> int | None:
        disk = self._disk
        assert disk is not None
        try:
            n = disk.read_into(name, dst, expect=size)
        except CorruptPage as exc:
            logger.warning("store: row %s… failed its checks on disk, dropped: %s",
                           name.hex()[:16], exc)
            self._drop_corrupt(name, rid)
            with self._lock:
                self._hits -= 1
                self._misses += 1
            return None
        if n is None or n != size:
            with self._lock:  # purged between the index lookup and the read: a miss
                self._hits -= 1
                self._misses += 1
            return None
        self._promote(name, rid, stamp, size, dst)
        return n

    def _drop_corrupt(self, name: bytes, rid: int) -> None:
        """Delete a row whose frame failed its checks (counted by the disk tier); its
        memory copies, if any, stay. A lock does not protect corrupt bytes."""
        disk = self._disk
        assert disk is not None
        with self._disk_lock:
            with self._lock:
                ix = self._ix
                current = ix.ids.get(name) == rid and bool(int(ix.where[rid]) & DISK)
                if current:
                    ix.where[rid] = int(ix.where[rid]) & ~DISK
                    if not int(ix.where[rid]):
                        ix.remove(rid)
            if current:
                disk.drop_corrupt(name)

    def _promote(self, name: bytes, rid: int, stamp: int, size: int, src: memoryview) -> None:
        """Copy a row just read from disk into a host slot (a clean copy), if there is
        room without waiting for the disk."""
        with self._lock:
            host = self._pools.get(HOST)
            if host is None or self._closed or not host.fits(size):
                return
            off = host.alloc(size)
            if off is None:
                self._reclaim(HOST, max(size, self._band(HOST)), queue=False)
                off = host.alloc(size)
                if off is None:
                    return
            self._pin(HOST, off)
        try:
            host.write(off, src[:size])
        finally:
            with self._lock:
                self._unpin(HOST, off)
                ix = self._ix
                if (ix.ids.get(name) == rid and int(ix.atime[rid]) == stamp
                        and int(ix.where[rid]) == DISK and not self._closed):
                    ix.set_off(rid, off)
                    ix.where[rid] = DISK | HOST
                    self._counters[HOST].promotions += 1
                elif not self._closed:
                    host.free(off)

    def delete(self, name: bytes) -> bool:
        """Remove a row from every tier; ``False`` if absent, ``RowLocked`` if locked."""
        check_name(name)
        with self._lock:
            self._check_open()
            if self._locks.get(name):
                raise RowLocked(f"row {name.hex()[:16]}…: locked by {sorted(self._locks[name])}")
            rid = self._ix.ids.get(name)
            if rid is None:
                return False
            self._remove_row(rid)
            return True

    def locate(self, names: Sequence[bytes]) -> list[TierKind | None]:
        """The fastest tier holding each row (``None`` = absent). Touches nothing."""
        with self._lock:
            self._check_open()
            ids, where = self._ix.ids, self._ix.where
            out: list[TierKind | None] = []
            for name in names:
                rid = ids.get(check_name(name))
                if rid is None:
                    out.append(None)
                    continue
                w = int(where[rid])
                out.append(TierKind.DEVICE if w & DEV else TierKind.HOST if w & HOST
                           else TierKind.DISK)
            return out

    def residency(self, names: Sequence[bytes]) -> list[frozenset[TierKind]]:
        """Every tier holding a copy of each row (empty = absent). Touches nothing."""
        with self._lock:
            self._check_open()
            ids, where = self._ix.ids, self._ix.where
            out: list[frozenset[TierKind]] = []
            for name in names:
                rid = ids.get(check_name(name))
                w = 0 if rid is None else int(where[rid])
                out.append(frozenset(k for b, k in _KINDS.items() if w & b))
            return out

    def contains(self, names: Sequence[bytes]) -> list[bool]:
        """Presence of each row. Touches nothing."""
        return [t is not None for t in self.locate(names)]

    def size_of(self, name: bytes) -> int | None:
        with self._lock:
            self._check_open()
            rid = self._ix.ids.get(check_name(name))
            return None if rid is None else int(self._ix.size[rid])

    # ==================================================================================
    # locks

    def lock(self, names: Sequence[bytes], holder: str) -> None:
        """Lock rows for ``holder`` (counted: n locks need n unlocks)."""
        names = [check_name(n) for n in names]
        if not isinstance(holder, str) or not holder:
            raise InvalidInput(f"holder: expected a non-empty string, got {holder!r}")
        with self._lock:
            self._check_open()
            mine = self._held.setdefault(holder, {})
            for name in names:
                per = self._locks.setdefault(name, {})
                per[holder] = per.get(holder, 0) + 1
                mine[name] = mine.get(name, 0) + 1

    def unlock(self, names: Sequence[bytes], holder: str) -> None:
        """Give back locks; ``InvalidInput`` (and nothing changed) if ``holder`` does not
        hold one of them."""
        names = [check_name(n) for n in names]
        with self._lock:
            mine = self._held.get(holder, {})
            need = collections.Counter(names)
            for name, k in need.items():
                if mine.get(name, 0) < k:
                    raise InvalidInput(
                        f"unlock: holder {holder!r} holds {mine.get(name, 0)} lock(s) on row "
                        f"{name.hex()[:16]}…, asked to release {k}")
            for name, k in need.items():
                self._release_lock(name, holder, k)
            self._cond.notify_all()

    def unlock_all(self, holder: str) -> None:
        """Give back every lock of ``holder``."""
        with self._lock:
            for name, k in list(self._held.get(holder, {}).items()):
                self._release_lock(name, holder, k)
            self._cond.notify_all()

    def _release_lock(self, name: bytes, holder: str, k: int) -> None:
        mine = self._held[holder]
        per = self._locks[name]
        left = per[holder] - k
        if left:
            per[holder] = left
            mine[name] = left
            return
        del per[holder]
        del mine[name]
        if not per:
            del self._locks[name]
        if not mine:
            del self._held[holder]

    def is_locked(self, name: bytes) -> bool:
        with self._lock:
            return check_name(name) in self._locks

    # ==================================================================================
    # in-place access: host

    def stage_host(self, name: bytes) -> HostSlot | None:
        """Bring a row into the host tier (from device or disk) and return its slot;
        ``None`` on a miss. The caller locks the row first so that it stays there."""
        return self._stage(name, HOST)  # type: ignore[return-value]

    def stage_device(self, name: bytes) -> DeviceSlot | None:
        """Bring a row into the device tier (from host or disk) and return its slot."""
        return self._stage(name, DEV)  # type: ignore[return-value]

    def stage_host_many(self, names: Sequence[bytes]) -> list[HostSlot | None]:
        """:meth:`stage_host` for many rows (a lease): the same slots and misses, in one
        planning pass under the store lock that claims every host slot the rows need,
        the copies (device → host, disk decode) outside the lock, and one publishing pass.

        All or nothing: when the host tier cannot hold every present row, ``TierFull`` is
        raised and no row is left staged that was not in host before (rows evicted to make
        room stay evicted; they were unlocked). The caller locks the rows first. When a
        copy fails after some rows were published, the error propagates and those copies
        are given back, except one that somebody staged, read, locked or unlocked in the
        meantime: it may be another holder's slot, so it stays (a clean host copy)."""
        names = [check_name(n) for n in names]
        pool = self._pool(HOST, "stage")
        assert isinstance(pool, HostSlab)
        if not names:
            return []
        plan: list[_Staging] = []
        with self._lock:
            self._check_open()
            ix = self._ix
            found = {n: rid for n in names if (rid := ix.ids.get(n)) is not None}
            rids = np.fromiter(found.values(), np.int64, len(found))
            stamps = ix.touch_many(rids)  # in the order given, like one stage_host per row
            cold = np.flatnonzero((ix.where[rids] & HOST) == 0)
            if cold.size == 0:
                return self._host_slots_locked(names)
            found_names = list(found)
            for j in cold.tolist():
                rid = int(rids[j])
                where = int(ix.where[rid])
                plan.append(_Staging(found_names[j], rid, int(ix.size[rid]),
                                     DEV if where & DEV else DISK, int(stamps[j])))
            self._claim_stage_slots(pool, plan)
        try:
            self._fill_stage_slots(pool, plan)
        except BaseException:
            with self._lock:
                for st in plan:
                    self._release_staging(st)
                    self._free_slot(HOST, st.off)
            raise
        retry: list[bytes] = []
        corrupt: list[_Staging] = []
        published: list[_Staging] = []
        with self._lock:
            for st in plan:
                self._release_staging(st)
                if self._publish_staging(st):
                    st.published_at = int(self._ix.atime[st.rid])
                    st.holders = dict(self._locks.get(st.name, {}))
                    published.append(st)
                    continue
                self._free_slot(HOST, st.off)
                if st.corrupt:
                    corrupt.append(st)
                elif st.src == 0 or st.n is not None:
                    retry.append(st.name)  # the row changed meanwhile: stage it again
            if not retry and not corrupt:
                self._check_open()
                return self._host_slots_locked(names)
        for st in corrupt:
            self._drop_corrupt(st.name, st.rid)
        try:
            for name in retry:
                self._stage(name, HOST)
        except BaseException:
            with self._lock:  # all or nothing: give back the copies this call added...
                for st in published:
                    if self._still_ours(st):
                        self._drop_copy(st.rid, HOST)
            raise
        with self._lock:
            self._check_open()
            return self._host_slots_locked(names)

    def _still_ours(self, st: _Staging) -> bool:
        """Whether a copy this batch published is still only this batch's (caller holds
        the lock): the same row in the same host slot, and since the publish nobody has
        staged or read it (its LRU stamp is unchanged) nor locked or unlocked it. Another
        holder may have been handed this slot: then the copy stays, it is theirs too."""
        ix = self._ix
        rid = st.rid
        return (ix.ids.get(st.name) == rid and bool(int(ix.where[rid]) & HOST)
                and self._mem_off(rid, HOST) == st.off
                and int(ix.atime[rid]) == st.published_at
                and self._locks.get(st.name, {}) == st.holders)

    def _claim_stage_slots(self, pool: HostSlab, plan: list[_Staging]) -> None:
        """Claim (and pin) a private host slot for every planned row, or none of them
        (``TierFull``); pin the device copies that will be read. Caller holds the lock;
        waiting for the mover releases it, so device sources are looked up afterwards."""
        claimed: list[_Staging] = []
        try:
            for st in plan:
                if not pool.fits(st.size):
                    raise TierFull(f"stage: a {st.size}-byte row exceeds the host budget")
                off = self._alloc_waiting(HOST, st.size)
                if off is None:
                    need = sum(slot_class(s.size) for s in plan)
                    raise TierFull(
                        f"stage: no room for {len(plan)} rows ({need} bytes) in the host tier "
                        f"(used {pool.used_bytes} of {pool.budget}); the rest is locked, "
                        "reserved or being read")
                st.off = off
                self._pin(HOST, off)
                claimed.append(st)
        except BaseException:
            for st in claimed:
                self._unpin(HOST, st.off)
                self._free_slot(HOST, st.off)
            raise
        ix = self._ix
        for st in plan:
            if st.src != DEV:
                continue
            if ix.ids.get(st.name) == st.rid and int(ix.where[st.rid]) & DEV \
                    and not int(ix.where[st.rid]) & HOST:
                st.src_off = self._mem_off(st.rid, DEV)
                self._pin(DEV, st.src_off)
                st.pinned = True
            else:
                st.src = 0  # moved while we waited for room: staged again afterwards

    def _fill_stage_slots(self, pool: HostSlab, plan: list[_Staging]) -> None:
        """Copy each planned row into its private slot (no store lock held). Disk rows
        are decoded on the codec workers (zstd releases the GIL)."""
        from_disk = [st for st in plan if st.src == DISK]
        decodes: list[Future[None]] = []
        encoder = self._encoder
        if encoder is not None and len(from_disk) > 1:
            decodes = [encoder.submit(self._read_into_slot, pool, st) for st in from_disk]
            from_disk = []
        try:
            for st in from_disk:
                self._read_into_slot(pool, st)
            for st in plan:
                if st.src == DEV:
                    dev = self._pools[DEV]
                    assert isinstance(dev, DevicePool)
                    dst = torch.from_numpy(pool.numpy()[st.off : st.off + st.size])
                    dst.copy_(dev.tensor(st.src_off, st.size))
                    st.n = st.size
        finally:
            wait(decodes)  # every decode is done with its slot before anyone frees it
        for f in decodes:
            f.result()  # raise the first failure

    def _read_into_slot(self, pool: HostSlab, st: _Staging) -> None:
        disk = self._disk
        assert disk is not None
        view = pool.view(st.off, st.size)
        try:
            st.n = disk.read_into(st.name, view, expect=st.size)
        except CorruptPage as exc:
            logger.warning("store: row %s… failed its checks on disk, dropped: %s",
                           st.name.hex()[:16], exc)
            st.corrupt = True
        finally:
            view.release()

    def _release_staging(self, st: _Staging) -> None:
        self._unpin(HOST, st.off)
        if st.pinned:
            self._unpin(DEV, st.src_off)
            st.pinned = False

    def _publish_staging(self, st: _Staging) -> bool:
        """Make a filled private slot the row's host copy if the row is unchanged."""
        ix = self._ix
        if self._closed or st.src == 0 or st.n != st.size or ix.ids.get(st.name) != st.rid:
            return False
        rid = st.rid
        where = int(ix.where[rid])
        if where & HOST:
            return False
        if st.src == DEV:
            # The source slot was pinned: an overwrite or a move gives the row another one.
            if not where & DEV or ix.get_off(rid) != st.src_off:
                return False
            self._dual[rid] = st.off
        else:
            if where != DISK or int(ix.atime[rid]) != st.stamp:
                return False
            ix.set_off(rid, st.off)
        ix.where[rid] = where | HOST
        self._counters[HOST].promotions += 1
        return True

    def _host_slots_locked(self, names: Sequence[bytes]) -> list[HostSlot | None]:
        ix = self._ix
        pool = self._pools[HOST]
        assert isinstance(pool, HostSlab)
        rids = [ix.ids.get(n, -1) for n in names]
        arr = np.asarray(rids, dtype=np.int64)
        safe = np.maximum(arr, 0)
        in_host = ((ix.where[safe] & HOST) != 0) & (arr >= 0)
        offs = ix.off[safe].astype(np.int64)
        if not ix.wide:
            offs <<= OFF_SHIFT
        sizes = ix.size[safe].tolist()
        dual, seg = self._dual, pool.segment
        out: list[HostSlot | None] = []
        for rid, hit, off, size in zip(rids, in_host.tolist(), offs.tolist(), sizes, strict=True):
            # A row staged from device keeps its host offset in _dual (`off` is the device's).
            out.append(HostSlot(seg, dual.get(rid, off), size) if hit else None)
        return out

    def _stage(self, name: bytes, bit: int) -> HostSlot | DeviceSlot | None:
        check_name(name)
        pool = self._pool(bit, "stage")
        with self._lock:
            self._check_open()
            rid = self._ix.ids.get(name)
            if rid is None:
                return None
            self._ix.touch(rid)
            where = int(self._ix.where[rid])
            size = int(self._ix.size[rid])
            if where & bit:
                return self._slot_of(bit, self._mem_off(rid, bit), size)
            if where & (DEV | HOST):  # the other memory tier: copy across, keep both
                other = HOST if bit == DEV else DEV
                off = self._alloc_for_stage(bit, size)
                src_off = self._mem_off(rid, other)
                self._copy_between(other, src_off, bit, off, size)
                if bit == DEV:
                    self._dual[rid] = src_off
                    self._ix.set_off(rid, off)
                else:
                    self._dual[rid] = off
                self._ix.where[rid] = where | bit
                self._counters[bit].promotions += 1
                return self._slot_of(bit, off, size)
            stamp = int(self._ix.atime[rid])
        # on disk only: read it into a private slot, then publish the clean copy
        disk = self._disk
        assert disk is not None
        with self._lock:
            off = self._alloc_for_stage(bit, size)
            self._pin(bit, off)
        try:
            buf = pool.view(off, size) if isinstance(pool, HostSlab) else memoryview(bytearray(size))
            try:
                n = disk.read_into(name, buf, expect=size)
            except CorruptPage as exc:
                logger.warning("store: row %s… failed its checks on disk, dropped: %s",
                               name.hex()[:16], exc)
                self._drop_corrupt(name, rid)
                n = None
            if n is not None and isinstance(pool, DevicePool):
                pool.write(off, buf)
            if isinstance(pool, HostSlab):
                buf.release()
        except BaseException:
            with self._lock:
                self._unpin(bit, off)
                self._free_slot(bit, off)
            raise
        with self._lock:
            self._unpin(bit, off)
            ix = self._ix
            if n == size and ix.ids.get(name) == rid and int(ix.atime[rid]) == stamp \
                    and int(ix.where[rid]) == DISK:
                ix.set_off(rid, off)
                ix.where[rid] = DISK | bit
                self._counters[bit].promotions += 1
                return self._slot_of(bit, off, size)
            self._free_slot(bit, off)
            if n is None:
                return None
        return self._stage(name, bit)  # the row changed meanwhile: look again

    def _alloc_for_stage(self, bit: int, size: int) -> int:
        """A free slot in memory tier ``bit`` (caller holds the lock), making room and
        waiting for queued demotions like a reservation does."""
        pool = self._pools[bit]
        if not pool.fits(size):
            raise TierFull(f"stage: a {size}-byte row exceeds the {_KINDS[bit].value} budget")
        off = self._alloc_waiting(bit, size)
        if off is None:
            raise TierFull(f"stage: no room for {size} bytes in the {_KINDS[bit].value} tier "
                           f"(used {pool.used_bytes} of {pool.budget}); the rest is locked, "
                           "reserved or being read")
        return off

    def _alloc_waiting(self, bit: int, size: int) -> int | None:
        """Allocate in tier ``bit``, evicting LRU victims and waiting for the mover while
        it demotes dirty ones; None when nothing more can be freed."""
        pool = self._pools[bit]
        off = pool.alloc(size)
        while off is None:
            self._reclaim(bit, max(size, self._band(bit)))
            off = pool.alloc(size)
            if off is None:
                # LRU victims of other size classes may not free a slot of this one.
                self._reclaim(bit, size, cls=slot_class(size))
                off = pool.alloc(size)
            if off is not None or not self._queued[bit] or self._disk_error is not None:
                break
            self._cond.wait(_WAIT_S)  # dirty victims are on their way down
            self._check_open()
            off = pool.alloc(size)
        return off

    def _copy_between(self, src_bit: int, src_off: int, dst_bit: int, dst_off: int,
                      size: int) -> None:
        host = self._pools[HOST]
        dev = self._pools[DEV]
        assert isinstance(host, HostSlab) and isinstance(dev, DevicePool)
        host_t = torch.from_numpy(host.numpy()[: host.allocator.space_bytes])
        h = host_t[dst_off if dst_bit == HOST else src_off:][:size]
        d = dev.tensor(dst_off if dst_bit == DEV else src_off, size)
        if dst_bit == HOST:
            h.copy_(d)
        else:
            d.copy_(h)

    def _slot_of(self, bit: int, off: int, size: int) -> HostSlot | DeviceSlot:
        pool = self._pools[bit]
        return pool.slot(off, size)

    def reserve_host(self, size: int, holder: str) -> HostSlot:
        """A private host slot for a write lease: counts against the budget, invisible
        to readers, never evicted. ``TierFull`` if there is no room after eviction."""
        return self._reserve(HOST, size, holder)  # type: ignore[return-value]

    def reserve_device(self, size: int, holder: str) -> DeviceSlot:
        return self._reserve(DEV, size, holder)  # type: ignore[return-value]

    def _reserve(self, bit: int, size: int, holder: str) -> HostSlot | DeviceSlot:
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= _MAX_PAGE:
            raise InvalidInput(f"size: must be an integer in [1, {_MAX_PAGE}], got {size!r}")
        if not isinstance(holder, str) or not holder:
            raise InvalidInput(f"holder: expected a non-empty string, got {holder!r}")
        pool = self._pool(bit, "reserve")
        with self._lock:
            self._check_open()
            if not pool.fits(size):
                raise TierFull(f"reserve: {size} bytes exceed the {_KINDS[bit].value} budget "
                               f"{pool.budget}")
            off = self._alloc_waiting(bit, size)
            if off is None:
                raise TierFull(f"reserve: no room for {size} bytes in the {_KINDS[bit].value} "
                               f"tier (used {pool.used_bytes} of {pool.budget}); the rest is "
                               "locked, reserved or being read")
            self._reserved[(bit, off)] = (holder, size)
            return self._slot_of(bit, off, size)

    def _reserved_off(self, bit: int, slot: HostSlot | DeviceSlot) -> tuple[int, str]:
        if bit == HOST:
            if not isinstance(slot, HostSlot):
                raise InvalidInput(f"slot: expected a HostSlot, got {type(slot).__name__}")
            pool = self._pool(HOST, "slot")
            assert isinstance(pool, HostSlab)
            if slot.segment != pool.segment:
                raise InvalidInput(f"slot.segment: {slot.segment!r} is not this store's")
            off = slot.offset
        else:
            if not isinstance(slot, DeviceSlot):
                raise InvalidInput(f"slot: expected a DeviceSlot, got {type(slot).__name__}")
            dev = self._pool(DEV, "slot")
            assert isinstance(dev, DevicePool)
            off = dev.offset_of(slot)
        hit = self._reserved.get((bit, off))
        if hit is None:
            raise InvalidInput(f"slot: offset {off} is not a reserved slot (committed, "
                               "aborted or never reserved)")
        if hit[1] != slot.size:
            raise InvalidInput(f"slot.size: {slot.size}, reserved {hit[1]}")
        return off, hit[0]

    def commit_host(self, name: bytes, slot: HostSlot, *, dtype: str = "uint8",
                    parent: bytes | None = None) -> None:
        """Publish a reserved slot's bytes as row ``name`` (an unlocked older copy, or one
        locked only by the reserving holder, is replaced)."""
        self._commit(HOST, name, slot, dtype, parent)

    def commit_device(self, name: bytes, slot: DeviceSlot, *, dtype: str = "uint8",
                      parent: bytes | None = None) -> None:
        self._commit(DEV, name, slot, dtype, parent)

    def _commit(self, bit: int, name: bytes, slot: HostSlot | DeviceSlot, dtype: str,
                parent: bytes | None) -> None:
        check_name(name)
        if parent is not None:
            check_name(parent)
        with self._lock:
            self._check_open()
            off, holder = self._reserved_off(bit, slot)
            size = slot.size
            code = self._dtype_code(dtype)
            self._check_writable(name, size, holder)  # failing here keeps the reservation
            del self._reserved[(bit, off)]
            self._pin(bit, off)
        src: memoryview
        pool = self._pools[bit]
        if isinstance(pool, HostSlab):
            src = pool.view(off, size)
        else:
            needs_bytes = self.config.write_policy is WritePolicy.WRITE_THROUGH and self._disk
            src = (pool.tensor(off, size).cpu().numpy().data if needs_bytes
                   else memoryview(b""))
        try:
            self._publish(name, size, code, parent, bit, off, src, holder=holder,
                          reserve=(holder, size))
        finally:
            if isinstance(pool, HostSlab):
                src.release()
            with self._lock:
                self._unpin(bit, off)

    def abort_host(self, slot: HostSlot) -> None:
        """Give a reserved host slot back."""
        self._abort(HOST, slot)

    def abort_device(self, slot: DeviceSlot) -> None:
        self._abort(DEV, slot)

    def _abort(self, bit: int, slot: HostSlot | DeviceSlot) -> None:
        with self._lock:
            self._check_open()
            off, _ = self._reserved_off(bit, slot)
            del self._reserved[(bit, off)]
            self._free_slot(bit, off)
            self._cond.notify_all()

    @property
    def host_segment(self) -> HostSlot | None:
        """The whole host segment as one location (name, 0, mapped size), for leases that
        map it once; ``None`` when the host tier is off."""
        pool = self._pools.get(HOST)
        if not isinstance(pool, HostSlab) or pool.allocator.space_bytes == 0:
            return None
        return HostSlot(pool.segment, 0, pool.allocator.space_bytes)

    def host_view(self, slot: HostSlot) -> memoryview:
        """The owner-side view of a host slot's bytes (release it when done)."""
        pool = self._pool(HOST, "host_view")
        assert isinstance(pool, HostSlab)
        if not isinstance(slot, HostSlot) or slot.segment != pool.segment:
            raise InvalidInput(f"slot: not a slot of segment {pool.segment}")
        with self._lock:
            self._check_open()
            if not pool.allocator.is_slot(slot.offset) or slot.size > pool.capacity(slot.offset):
                raise InvalidInput(f"slot: offset {slot.offset} size {slot.size} is not a slot")
            return pool.view(slot.offset, slot.size)

    def device_view(self, slot: DeviceSlot) -> torch.Tensor:
        """A uint8 tensor view of a device slot."""
        pool = self._pool(DEV, "device_view")
        assert isinstance(pool, DevicePool)
        with self._lock:
            self._check_open()
            off = pool.offset_of(slot)
            if not pool.allocator.is_slot(off) or slot.size > pool.capacity(off):
                raise InvalidInput(f"slot: offset {slot.offset} size {slot.size} is not a slot")
            return pool.tensor(off, slot.size)

    # ==================================================================================
    # the mover

    def _pressure(self) -> bool:
        high = self.config.high_watermark
        for bit in (DEV, HOST):
            pool = self._pools.get(bit)
            if (pool is not None and pool.used_bytes - self._queued[bit] > high * pool.budget
                    and self._victims(bit, 1)):
                return True
        disk = self._disk
        return bool(disk is not None and not self._purge_pending
                    and disk.used_bytes > high * disk.budget_bytes and self._disk_rows_evictable())

    def _disk_rows_evictable(self) -> bool:
        return bool(self._victims(DISK, 1))

    def _plan(self) -> None:
        low = self.config.low_watermark
        high = self.config.high_watermark
        for bit in (DEV, HOST):
            pool = self._pools.get(bit)
            if pool is not None and pool.used_bytes - self._queued[bit] > high * pool.budget:
                self._reclaim(bit, int(pool.used_bytes - low * pool.budget))
        disk = self._disk
        if disk is not None and not self._purge_pending and disk.used_bytes > high * disk.budget_bytes:
            names = self._evict_disk(disk.used_bytes - int(low * disk.budget_bytes))
            if names:
                self._purge_pending = True
                self._jobs.append(_Job("purge", names=tuple(names), evict=True))

    def _evict_disk(self, frame_bytes: int, *, older_than: int | None = None) -> list[bytes]:
        """Take LRU rows off the disk in the index (the caller deletes their frames);
        ``frame_bytes`` is scaled to raw bytes by the current compression ratio. With
        ``older_than``, stop at the first victim used at or after that stamp."""
        disk = self._disk
        assert disk is not None
        ix = self._ix
        n = ix.high
        raw_on_disk = int(ix.size[:n][(ix.where[:n] & DISK) != 0].sum(dtype=np.int64))
        ratio = raw_on_disk / max(1, disk.used_bytes)
        names: list[bytes] = []
        for rid in self._victims(DISK, int(frame_bytes * ratio) + 1):
            if older_than is not None and int(ix.atime[rid]) >= older_than:
                break
            name = ix.names[rid]
            assert name is not None
            names.append(name)
            where = int(ix.where[rid])
            self._counters[DISK].evictions += 1
            if where & (DEV | HOST):  # a memory copy stays; only the disk copy goes
                ix.where[rid] = where & ~DISK
            else:
                ix.remove(rid)
        return names

    def _make_disk_room(self, frame_len: int) -> None:
        """Evict from disk now so that a ``frame_len`` write fits the budget (the caller
        holds the disk lock). Goes down to the low watermark to amortise the scan."""
        disk = self._disk
        assert disk is not None
        over = disk.used_bytes + frame_len - disk.budget_bytes
        if over <= 0:
            return
        with self._lock:
            names = self._evict_disk(over + self._disk_band())
        if names:
            disk.delete_many(names)

    def _disk_band(self) -> int:
        disk = self._disk
        assert disk is not None
        return int(disk.budget_bytes * (self.config.high_watermark - self.config.low_watermark))

    def _run_mover(self) -> None:
        # Demotions are encoded on the codec workers, up to a small window ahead, and
        # written here one by one in queue order: the disk lock, the index check and the
        # order of writes and purges are those of a single mover thread.
        window: Window = collections.deque()
        while True:
            fut: Future[bytes] | None = None
            with self._lock:
                while not self._jobs and not window and not self._closed and not self._pressure():
                    self._cond.wait()
                if self._closed:
                    self._cancel_jobs(window)
                    self._busy = False
                    self._cond.notify_all()
                    return
                if not self._jobs and not window:
                    self._plan()
                self._fill_window(window)
                if window:
                    job, fut = window.popleft()
                elif self._jobs:
                    job = self._jobs.popleft()  # a purge, after every demotion queued before it
                else:
                    self._cond.wait(_WAIT_S)  # pressure without a plan: victims pinned
                    continue
                self._busy = True
            try:
                if fut is not None:
                    self._finish_demote(job, fut)
                else:
                    self._purge(job)
            except TierError as exc:
                logger.warning("store: mover job %s failed: %s", job.kind, exc)
                with self._lock:
                    self._note_disk_error(str(exc))
            except BaseException:
                logger.exception("store: mover crashed")  # never silent: health reports it
                with self._lock:
                    self._notes.append("mover crashed; see the log")
                    self._mover_dead = True
                    self._cond.notify_all()
                wait([f for _, f in window])  # their slots stay pinned; close() unmaps them
                raise
            finally:
                with self._lock:
                    self._busy = bool(window)  # popped jobs in flight still count as busy
                    self._cond.notify_all()

    def _fill_window(self, window: Window) -> None:
        """Start encoding the demotions at the head of the queue (caller holds the lock).
        A purge at the head waits until the demotions before it are written."""
        encoder = self._encoder
        depth = _WINDOW_PER_WORKER * self._workers
        while encoder is not None and self._jobs and self._jobs[0].kind == "demote" \
                and len(window) < depth:
            job = self._jobs.popleft()
            dtype = self._ix.dtypes[int(self._ix.dtype[job.rid])]
            window.append((job, encoder.submit(self._encode, job, dtype)))

    def _encode(self, job: _Job, dtype: str) -> bytes:
        """A demotion's frame, from its pinned slot (on a codec worker, no lock held)."""
        return self._encode_slot(job.bit, job.off, job.size, dtype)

    def _encode_slot(self, bit: int, off: int, size: int, dtype: str) -> bytes:
        """The frame of a pinned memory slot's bytes (no lock held)."""
        disk = self._disk
        assert disk is not None
        pool = self._pools[bit]
        if isinstance(pool, HostSlab):
            view = pool.view(off, size)
            try:
                return disk.frame(view, dtype)
            finally:
                view.release()
        return disk.frame(pool.tensor(off, size).cpu().numpy().data, dtype)

    def _cancel_jobs(self, window: Window) -> None:
        # The encodes read pinned slots: let them finish before the slots can go.
        wait([f for _, f in window])
        for job, _ in window:
            self._end_demote(job, written=False)
        window.clear()
        for job in self._jobs:
            if job.kind == "demote":
                self._end_demote(job, written=False)
        # Purges stay queued: close() runs them, so a deleted row never comes back.
        purges = [job for job in self._jobs if job.kind == "purge"]
        self._jobs.clear()
        self._jobs.extend(purges)

    def _note_disk_error(self, msg: str) -> None:
        if self._disk_error is None:
            logger.warning("store: disk tier degraded: %s", msg)
        self._disk_error = msg

    def _end_demote(self, job: _Job, *, written: bool) -> bool:
        """Settle a demotion under the lock; True when the row's copy moved to disk."""
        ix = self._ix
        self._queued[job.bit] -= job.size
        self._unpin(job.bit, job.off)
        rid = job.rid
        same = (ix.ids.get(job.name) == rid and int(ix.where[rid]) & job.bit
                and self._mem_off(rid, job.bit) == job.off and int(ix.flags[rid]) & MOVING)
        if same:
            ix.flags[rid] = int(ix.flags[rid]) & ~MOVING
            if written:
                ix.where[rid] = int(ix.where[rid]) | DISK
                if job.name not in self._locks:  # a lock taken meanwhile keeps the copy
                    self._drop_copy(rid, job.bit)
                    self._counters[job.bit].demotions += 1
        return bool(same)

    def _finish_demote(self, job: _Job, encoded: Future[bytes]) -> None:
        """Write an encoded demotion if its row is still the one that was queued."""
        disk = self._disk
        assert disk is not None
        try:
            frame = encoded.result()
        except BaseException:
            with self._lock:
                self._end_demote(job, written=False)
            raise
        with self._disk_lock:
            with self._lock:
                ix = self._ix
                valid = (ix.ids.get(job.name) == job.rid and int(ix.flags[job.rid]) & MOVING
                         and self._mem_off(job.rid, job.bit) == job.off)
                dtype = ix.dtypes[int(ix.dtype[job.rid])]
                parent = ix.parent_name(job.rid)
            if not valid:
                with self._lock:
                    self._end_demote(job, written=False)
                return
            try:
                self._make_disk_room(len(frame))
                disk.write_frame(job.name, frame, raw_len=job.size, dtype=dtype, parent=parent,
                                 replace=True)
            except BaseException:
                with self._lock:
                    self._end_demote(job, written=False)
                raise
            with self._lock:
                if self._disk_error is not None:
                    logger.warning("store: disk tier writes again")
                self._disk_error = None
                moved = self._end_demote(job, written=True)
                rid = self._ix.ids.get(job.name)
                stale = not moved and (rid is None or not int(self._ix.where[rid]) & DISK)
            if stale:  # overwritten or deleted while we wrote: the frame is stale
                disk.delete_many([job.name])

    def _purge(self, job: _Job) -> None:
        disk = self._disk
        if disk is None:
            return
        with self._disk_lock:
            with self._lock:
                ids, where = self._ix.ids, self._ix.where
                names = [n for n in job.names
                         if (rid := ids.get(n)) is None or not int(where[rid]) & DISK]
            try:
                if names:
                    disk.delete_many(names)
            finally:
                if job.evict:
                    with self._lock:
                        self._purge_pending = False

    def flush(self) -> None:
        """Wait until the mover is idle: no queued job and no tier above its watermark
        with something it can move."""
        with self._lock:
            while (self._jobs or self._busy or (self._disk_error is None and self._pressure())) \
                    and not self._closed:
                self._cond.notify_all()
                self._cond.wait(_WAIT_S)

    # ==================================================================================
    # introspection

    def stats(self) -> StoreStats:
        with self._lock:
            ix = self._ix
            n = ix.high
            where = ix.where[:n]
            tiers: list[TierStats] = []
            for bit in (DEV, HOST, DISK):
                c = self._counters[bit]
                rows = int(np.count_nonzero(where & bit))
                if bit == DISK:
                    disk = self._disk
                    enabled = disk is not None
                    used = disk.used_bytes if disk else 0
                    alloc = used
                    budget = disk.budget_bytes if disk else 0
                    corrupt = disk.corrupt_rows if disk else 0
                else:
                    pool = self._pools.get(bit)
                    enabled = pool is not None
                    used = pool.used_bytes if pool else 0
                    alloc = pool.allocated_bytes if pool else 0
                    budget = pool.budget if pool else 0
                    corrupt = 0
                tiers.append(TierStats(_KINDS[bit], enabled, rows, used, alloc, budget, c.hits,
                                       c.misses, c.evictions, c.demotions, c.promotions, corrupt))
            return StoreStats(tuple(tiers), len(ix), len(self._locks), len(self._reserved),
                              len(self._jobs), sum(self._queued.values()), self._puts,
                              self._gets, self._hits, self._misses)

    def health(self) -> StoreHealth:
        with self._lock:
            mover = self._mover.is_alive() and not self._closed
            tiers: list[TierHealth] = []
            for bit in (DEV, HOST, DISK):
                kind = _KINDS[bit]
                enabled = (self._disk is not None) if bit == DISK else bit in self._pools
                if not enabled:
                    why = next((n for n in self._notes if n.startswith(kind.value)), "not configured")
                    tiers.append(TierHealth(kind, False, "off", why))
                elif bit == DISK and self._disk_error is not None:
                    tiers.append(TierHealth(kind, True, "degraded", self._disk_error))
                else:
                    tiers.append(TierHealth(kind, True, "ok", ""))
            ok = mover and all(t.state != "degraded" for t in tiers)
            return StoreHealth(ok, tuple(tiers), mover, tuple(self._notes))

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant: index vs tiers, budgets,
        slot accounting, locks, tier overlap, sizes."""
        with self._lock:
            self._check_invariants_locked()

    def _check_invariants_locked(self) -> None:
        ix = self._ix
        n = ix.high
        seen: dict[SlotKey, bytes] = {}
        charged = {DEV: 0, HOST: 0}
        disk_names: set[bytes] = set()
        for name, rid in ix.ids.items():
            tag = f"row {name.hex()[:16]}… (id {rid})"
            if ix.names[rid] != name:
                raise AssertionError(f"{tag}: names[{rid}] is {ix.names[rid]!r}")
            where = int(ix.where[rid])
            size = int(ix.size[rid])
            if where == 0 or where & ~(DEV | HOST | DISK):
                raise AssertionError(f"{tag}: tier bits {where:#x}")
            if size <= 0:
                raise AssertionError(f"{tag}: size {size}")
            if where & DEV and where & HOST and rid not in self._dual:
                raise AssertionError(f"{tag}: in device and host without a staged copy")
            if rid in self._dual and not (where & DEV and where & HOST):
                raise AssertionError(f"{tag}: a staged second copy but bits {where:#x}")
            for bit in (DEV, HOST):
                if not where & bit:
                    continue
                pool = self._pools.get(bit)
                if pool is None:
                    raise AssertionError(f"{tag}: in the {_KINDS[bit].value} tier, which is off")
                off = self._mem_off(rid, bit)
                if not pool.allocator.is_slot(off):
                    raise AssertionError(f"{tag}: {_KINDS[bit].value} offset {off} is not a slot")
                if pool.capacity(off) < size:
                    raise AssertionError(f"{tag}: slot capacity {pool.capacity(off)} < {size}")
                if (bit, off) in seen:
                    raise AssertionError(f"{tag}: shares {_KINDS[bit].value} slot {off} "
                                         f"with {seen[(bit, off)].hex()[:16]}…")
                if (bit, off) in self._zombies:
                    raise AssertionError(f"{tag}: its slot {off} is waiting to be freed")
                seen[(bit, off)] = name
                charged[bit] += pool.capacity(off)
            if where & DISK:
                if self._disk is None:
                    raise AssertionError(f"{tag}: on disk, but there is no disk tier")
                disk_names.add(name)
            moving = bool(int(ix.flags[rid]) & MOVING)
            queued = any(j.kind == "demote" and j.rid == rid for j in self._jobs)
            if moving and not queued and not self._busy:
                raise AssertionError(f"{tag}: marked moving with no demotion job")
            p = int(ix.parent[rid])
            if p >= 0 and p >= n:
                raise AssertionError(f"{tag}: parent id {p} out of range")
        for rid in range(n):
            if ix.names[rid] is None and int(ix.where[rid]):
                raise AssertionError(f"id {rid}: removed but has tier bits {int(ix.where[rid])}")
        for key, (holder, _size) in self._reserved.items():
            if key in seen:
                raise AssertionError(f"reserved slot {key} of {holder!r} also holds a row")
            charged[key[0]] += self._pools[key[0]].capacity(key[1])
        for key in self._zombies:
            if key not in self._pins:
                raise AssertionError(f"slot {key}: waits to be freed but nothing copies it")
            charged[key[0]] += self._pools[key[0]].capacity(key[1])
        for key in self._pins:  # private slots of puts/stages in flight
            if key not in seen and key not in self._zombies and key not in self._reserved:
                charged[key[0]] += self._pools[key[0]].capacity(key[1])
        for bit, pool in self._pools.items():
            pool.allocator.check()
            if pool.used_bytes != charged[bit]:
                raise AssertionError(f"{_KINDS[bit].value} tier: {pool.used_bytes} bytes in use, "
                                     f"rows/reservations account for {charged[bit]}")
            if pool.allocated_bytes > pool.budget:
                raise AssertionError(f"{_KINDS[bit].value} tier: holds {pool.allocated_bytes} "
                                     f"bytes, budget {pool.budget}")
        for name, per in self._locks.items():
            for holder, k in per.items():
                if k <= 0 or self._held.get(holder, {}).get(name) != k:
                    raise AssertionError(f"lock on {name.hex()[:16]}… by {holder!r}: count {k} "
                                         "does not match the holder's table")
        for holder, mine in self._held.items():
            for name, k in mine.items():
                if self._locks.get(name, {}).get(holder) != k:
                    raise AssertionError(f"holder {holder!r}: lock table and row locks differ")
        if self._disk is not None and not self._jobs and not self._busy:
            self._disk.check()
            on_disk = set(self._disk.names())
            missing = disk_names - on_disk
            if missing:
                raise AssertionError(f"{len(missing)} rows marked on disk are not in LMDB, "
                                     f"e.g. {next(iter(missing)).hex()[:16]}…")
            extra = on_disk - set(ix.ids)
            if extra:
                raise AssertionError(f"{len(extra)} rows in LMDB are not in the index, "
                                     f"e.g. {next(iter(extra)).hex()[:16]}…")
            for name in on_disk - disk_names:
                rid = ix.ids[name]
                raise AssertionError(f"row {name.hex()[:16]}…: in LMDB but its index bits are "
                                     f"{int(ix.where[rid]):#x} (a stale frame)")

    # ==================================================================================
    # close

    def close(self, *, persist: bool = True,
              deadline_s: float = DEFAULT_CLOSE_DEADLINE_S) -> None:
        """Close the store: new calls are refused, the mover stops (queued demotions are
        cancelled, queued purges still run), then, with ``persist`` and a disk tier, every
        memory row without a disk copy (write-back's dirty rows) is written to disk,
        hottest first, within the disk budget (evicting older disk rows by the usual
        rules) and within ``deadline_s`` seconds (a warning names what was left).
        Finally the shared memory is unlinked and LMDB closed. ``persist=False`` drops
        dirty rows, as a crash would. Idempotent."""
        if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) \
                or not deadline_s >= 0:
            raise InvalidInput(f"deadline_s: expected seconds >= 0, got {deadline_s!r}")
        deadline = time.monotonic() + deadline_s
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._mover.join()
        try:
            if self._disk is not None and not self._mover_dead:
                for job in list(self._jobs):
                    self._purge(job)
                self._jobs.clear()
                if persist:
                    self._persist_dirty(deadline, deadline_s)
        finally:
            if self._encoder is not None:
                self._encoder.shutdown(wait=True)
            self._close_tiers()

    def _persist_dirty(self, deadline: float, deadline_s: float) -> None:
        """Write every memory-only row to disk, hottest first (close() holds the store
        closed, so nothing else changes the index; the disk lock orders the writes)."""
        disk, encoder = self._disk, self._encoder
        assert disk is not None and encoder is not None
        ix = self._ix
        with self._lock:
            n = ix.high
            where = ix.where[:n]
            dirty = np.flatnonzero(((where & (DEV | HOST)) != 0) & ((where & DISK) == 0))
            order = dirty[np.argsort(ix.atime[dirty], kind="stable")[::-1]].tolist()
            rows: list[tuple[int, bytes, int, int, int, str, bytes | None, int]] = []
            for rid in order:
                bit = HOST if int(ix.where[rid]) & HOST else DEV  # host: no device copy-out
                off = self._mem_off(rid, bit)
                self._pin(bit, off)
                name = ix.names[rid]
                assert name is not None
                rows.append((rid, name, bit, off, int(ix.size[rid]),
                             ix.dtypes[int(ix.dtype[rid])], ix.parent_name(rid),
                             int(ix.atime[rid])))
        if not rows:
            return
        # Write clocks keep the LRU order across the restart: the hottest row, written
        # first, gets the highest.
        seq0 = disk.seq
        depth = _WINDOW_PER_WORKER * self._workers
        window: collections.deque[tuple[int, Future[bytes]]] = collections.deque()
        nxt = written = 0
        why = ""
        try:
            while nxt < len(rows) or window:
                while nxt < len(rows) and len(window) < depth:
                    _, _, bit, off, size, dtype, _, _ = rows[nxt]
                    window.append((nxt, encoder.submit(self._encode_slot, bit, off, size, dtype)))
                    nxt += 1
                i, fut = window.popleft()
                frame = fut.result()
                if time.monotonic() > deadline:
                    why = f"the {deadline_s:g} s close deadline passed"
                    break
                rid, name, _, _, size, dtype, parent, stamp = rows[i]
                with self._disk_lock:
                    if not self._persist_room(len(frame), stamp):
                        why = "the disk budget holds only rows used more recently"
                        break
                    disk.write_frame(name, frame, raw_len=size, dtype=dtype, parent=parent,
                                     seq=seq0 + len(rows) - i, replace=True)
                    with self._lock:
                        ix.where[rid] = int(ix.where[rid]) | DISK
                written += 1
        except TierFull as exc:
            why = str(exc)
        finally:
            wait([f for _, f in window])
            with self._lock:
                for _, _, bit, off, _, _, _, _ in rows:
                    self._unpin(bit, off)
        if why:
            logger.warning("store: close wrote %d of %d memory-only rows to disk; the other "
                           "%d are dropped: %s", written, len(rows), len(rows) - written, why)
        else:
            logger.debug("store: close wrote %d memory-only rows to disk", written)

    def _persist_room(self, frame_len: int, stamp: int) -> bool:
        """Make room for a ``frame_len`` frame of a row used at ``stamp`` by evicting disk
        rows used before it (caller holds the disk lock); False if that is not enough."""
        disk = self._disk
        assert disk is not None
        over = disk.used_bytes + frame_len - disk.budget_bytes
        if over <= 0:
            return True
        with self._lock:
            names = self._evict_disk(over, older_than=stamp)
        if names:
            disk.delete_many(names)
        return disk.used_bytes + frame_len <= disk.budget_bytes

    def _close_tiers(self) -> None:
        for pool in getattr(self, "_pools", {}).values():
            pool.close()
        if getattr(self, "_disk", None) is not None:
            assert self._disk is not None
            self._disk.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
