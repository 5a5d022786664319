"""Placement: which memory slot a new or staged row gets, and making room for it.

- :func:`alloc_memory` — a private slot for a new row: device, then host; when both are
  full it makes room in host, waiting (up to a deadline) for the mover if the victims are
  dirty; ``(DISK, None)`` means straight to disk.
- :func:`alloc_waiting` / :func:`alloc_for_stage` — a slot in one memory tier, evicting
  LRU victims and waiting on the condition ``settled`` (a mover job finished) while dirty
  ones are on their way down; :class:`~kvbank.errors.Busy` at the deadline.
- :func:`reclaim` / :func:`take_out` — take victims out of a tier: dropped at once when
  that needs no I/O (a clean copy, nothing below), else queued for the mover (a device
  row copied to host, a memory row encoded to disk). No copy runs here: every caller
  holds the store lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvbank.codec import MAX_PAGE_BYTES
from kvbank.errors import Busy, TierFull
from kvbank.tiers.allocator import slot_class
from kvbank.tiers.index import DEV, DISK, HOST, KIND_OF_BIT, MOVING
from kvbank.tiers.store.state import StoreState
from kvbank.tiers.store.types import Job, JobKind


def band(st: StoreState, bit: int) -> int:
    """Bytes between the high and the low watermark of a memory tier."""
    budget = st.pools[bit].budget
    return int(budget * (st.config.high_watermark - st.config.low_watermark))


def take_out(st: StoreState, bit: int, rid: int) -> bool:
    """Take a victim out of memory tier ``bit``: True when its slot was freed at once,
    False when a job was queued (the slot is freed when the mover settles it)."""
    ix, res = st.ix, st.res
    where = int(ix.where[rid])
    size = int(ix.size[rid])
    st.counters[bit].victim(ix, rid)
    if bit == DEV and where & HOST:  # a host copy exists (staged): drop the device one
        res.drop_copy(rid, DEV)
        st.counters[DEV].demoted(HOST, size)
        return True
    name = ix.names[rid]
    assert name is not None  # a live id has a name
    if bit == DEV and st.host is not None:
        host_off = st.host.alloc(size)
        if host_off is not None:  # copied by the mover, outside the store lock
            off = ix.get_off(rid)
            ix.flags[rid] |= MOVING
            res.hold(DEV, off)
            res.hold(HOST, host_off)
            st.queued[DEV] += size
            st.jobs.append(Job(JobKind.COPY_DOWN, bit=DEV, rid=rid, name=name, off=off,
                               size=size, dst_off=host_off))
            st.notify()
            return False
    if where & DISK:  # clean: the disk holds the same bytes
        res.drop_copy(rid, bit)
        st.counters[bit].demoted(DISK, size)
        return True
    if not st.has_disk or st.disk_degraded():
        # Nothing below, or a disk that refuses writes (full): the row leaves the store,
        # as it would from a store without a disk tier; the rows on disk stay.
        st.counters[bit].evictions += 1
        st.remove_row(rid)
        return True
    off = res.mem_off(rid, bit)
    ix.flags[rid] |= MOVING
    res.hold(bit, off)
    st.queued[bit] += size
    st.jobs.append(Job(JobKind.DEMOTE, bit=bit, rid=rid, name=name, off=off, size=size))
    st.notify()
    return False


def reclaim(st: StoreState, bit: int, need: int, *, queue: bool = True,
            cls: int | None = None) -> int:
    """Free ``need`` bytes of tier ``bit`` (minus bytes already queued); the bytes freed
    at once. With ``queue=False`` only victims that need no I/O are taken; with ``cls``
    only rows of that slot class."""
    if cls is None:
        need -= st.queued.get(bit, 0)
    if need <= 0:
        return 0
    freed = 0
    room = st.config.movement_queue_bytes - sum(st.queued.values())
    pool = st.pools[bit]
    ix = st.ix
    for rid in st.victims(bit, need, cls):
        cap = pool.capacity(st.res.mem_off(rid, bit))
        clean = bool(int(ix.where[rid]) & DISK) or not st.has_disk or (
            bit == DEV and st.host is not None) or st.disk_degraded()
        if not clean and (not queue or room <= 0):
            continue
        if take_out(st, bit, rid):
            freed += cap
        elif not (bit == DEV and st.host is not None):
            room -= int(ix.size[rid])
    return freed


def alloc_waiting(st: StoreState, bit: int, size: int, deadline: float) -> int | None:
    """Allocate in tier ``bit``, evicting LRU victims and waiting for the mover while it
    moves dirty ones; None when nothing more can be freed, ``Busy`` at the deadline."""
    pool = st.pools[bit]
    off = pool.alloc(size)
    while off is None:
        reclaim(st, bit, max(size, band(st, bit)))
        off = pool.alloc(size)
        if off is None:
            # LRU victims of other size classes may not free a slot of this one.
            reclaim(st, bit, size, cls=slot_class(size))
            off = pool.alloc(size)
        if off is not None or not st.queued[bit] or st.disk_error is not None:
            break
        left = deadline - time.monotonic()
        # Dirty victims are on their way down: wait for the mover to settle one.
        if left <= 0 or not st.cond.wait_for(_settled_since(st, st.settled), timeout=left):
            raise Busy(f"store: waited past the deadline for room for {size} bytes in the "
                       f"{KIND_OF_BIT[bit].value} tier ({st.queued[bit]} bytes still queued "
                       "for the mover)")
        st.check_open()
        off = pool.alloc(size)
    return off


def _settled_since(st: StoreState, seen: int) -> Callable[[], bool]:
    return lambda: st.settled != seen or st.closed or st.mover_dead


def alloc_memory(st: StoreState, size: int, deadline: float) -> tuple[int, int | None]:
    """A private slot for a new row: (tier bit, offset), or (DISK, None) when the row
    must go straight to disk. Makes room in host when every memory tier is full."""
    for bit, pool in st.pools.items():
        if pool.fits(size):
            off = pool.alloc(size)
            if off is not None:
                return bit, off
    host = st.host
    if host is not None and host.fits(size):
        off = alloc_waiting(st, HOST, size, deadline)
        if off is not None:
            return HOST, off
    if st.has_disk:
        return DISK, None
    if host is not None:
        st.counters[HOST].rejected_bytes += size
    raise TierFull(
        f"store: no room for a {size}-byte row: "
        + ", ".join(f"{KIND_OF_BIT[b].value} {p.used_bytes}/{p.budget} bytes"
                    for b, p in st.pools.items())
        + "; nothing evictable (locked, pinned, reserved or being read)")


def refuses(st: StoreState, size: int) -> str | None:
    """Why no tier could ever hold a row of ``size`` bytes (even empty), or None."""
    if any(pool.fits(size) for pool in st.pools.values()):
        return None
    if st.has_disk and size <= MAX_PAGE_BYTES:
        return None
    tiers = [f"{KIND_OF_BIT[b].value} (budget {p.budget})" for b, p in st.pools.items()]
    if st.has_disk:
        tiers.append(f"disk (at most {MAX_PAGE_BYTES} bytes a row)")
    return f"a {size}-byte row fits no tier: " + (", ".join(tiers) or "none is enabled")


def alloc_for_stage(st: StoreState, bit: int, size: int, deadline: float, what: str) -> int:
    """A free slot in memory tier ``bit`` for staging or a reservation, or ``TierFull``."""
    pool = st.pools[bit]
    kind = KIND_OF_BIT[bit].value
    if not pool.fits(size):
        raise TierFull(f"{what}: {size} bytes exceed the {kind} budget {pool.budget}")
    off = alloc_waiting(st, bit, size, deadline)
    if off is None:
        raise TierFull(f"{what}: no room for {size} bytes in the {kind} tier "
                       f"(used {pool.used_bytes} of {pool.budget}); the rest is locked, "
                       "pinned, reserved or being read")
    return off
