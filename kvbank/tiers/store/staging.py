"""Staging: bring a row into one memory tier for in-place access, and publish it.

Each stage is plan → copy → publish: under the store lock it claims a private slot (and
holds the source slot), the copy runs with no lock held (device ↔ host through the
:class:`~.copier.Copier`, or a frame decoded from disk), and under the lock again the
copy becomes the row's second (clean) copy only if the row is unchanged; otherwise the
slot goes back and the stage looks again.

:func:`stage_host_many` does it for a lease's rows at once: one planning pass claims every
host slot the rows need (all or nothing: ``TierFull``), the copies run outside the lock
(disk decodes on the codec workers), one pass publishes. When a copy fails after some
rows were published, those copies are given back unless somebody staged, read, locked or
unlocked the row since (it may be another holder's slot, so it stays).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from kvbank.codec import checksum
from kvbank.errors import CorruptPage, TierFull
from kvbank.tiers.allocator import slot_class
from kvbank.tiers.base import DeviceSlot, HostSlot, check_name, check_names
from kvbank.tiers.host import HostSlab
from kvbank.tiers.index import DEV, DISK, HOST
from kvbank.tiers.store.placement import alloc_for_stage, alloc_waiting
from kvbank.tiers.store.reads import drop_corrupt
from kvbank.tiers.store.state import StoreState

logger = logging.getLogger("kvbank.tiers.store.store")


@dataclass(slots=True)
class Staging:
    """One row of a batch that needs a new host slot (mutable: filled as it goes)."""

    name: bytes
    rid: int
    size: int
    src: int  # DEV (copy across) or DISK (decode); 0 once the row is found changed
    stamp: int  # the LRU stamp set when planned: a disk row is published only if unchanged
    off: int = -1  # the private host slot
    src_off: int = -1  # the device slot read from (src == DEV)
    held: bool = False  # src_off is held
    n: int | None = None  # bytes that arrived whole (None: the disk had no frame)
    corrupt: bool = False
    checksum: int | None = None  # of the private slot's bytes once filled
    # Set when published: the row's LRU stamp and lock holders at that moment. A rollback
    # gives the copy back only if both are unchanged.
    published_at: int = -1
    holders: dict[str, int] | None = None


def stage(st: StoreState, name: bytes, bit: int, deadline: float) -> HostSlot | DeviceSlot | None:
    """Bring ``name`` into memory tier ``bit``; its slot, or None on a miss."""
    check_name(name)
    pool = st.pool(bit, "stage")
    ix, res = st.ix, st.res
    other = HOST if bit == DEV else DEV
    with st.lock:
        st.check_open()
        rid = ix.ids.get(name)
        if rid is None:
            return None
        ix.touch(rid)
        size = int(ix.size[rid])
        if int(ix.where[rid]) & bit:
            return pool.slot(res.mem_off(rid, bit), size)
        off = alloc_for_stage(st, bit, size, deadline, "stage")
        where = int(ix.where[rid])
        if ix.ids.get(name) != rid or where & bit or not where & (other | DISK):
            res.free_slot(bit, off)  # changed while we waited for room: look again
            src = -1
        else:
            src = other if where & other else DISK
            stamp = int(ix.atime[rid])
            src_off = res.mem_off(rid, other) if src == other else -1
            res.hold(bit, off)
            if src == other:
                res.hold(other, src_off)
    if src < 0:
        return stage(st, name, bit, deadline)
    n: int | None = size
    sum_: int | None = None
    try:
        if src == DISK:
            try:
                n = st.copier.from_frames(st.disk(), name, pool, off, size)
            except CorruptPage as exc:
                logger.warning("store: row %s… failed its checks on disk, dropped: %s",
                               name.hex()[:16], exc)
                drop_corrupt(st, name, rid)
                n = None
        else:
            assert st.host is not None and st.device is not None
            host_off, dev_off = (off, src_off) if bit == HOST else (src_off, off)
            st.copier.between(st.host, host_off, st.device, dev_off, size, to_host=bit == HOST)
        if bit == HOST and n == size:
            sum_ = _slot_checksum(st, off, size)
    except BaseException:
        with st.lock:
            res.release(bit, off)
            if src == other:
                res.release(other, src_off)
            res.free_slot(bit, off)
        raise
    with st.lock:
        res.release(bit, off)
        where = int(ix.where[rid]) if ix.ids.get(name) == rid else 0
        if src == other:
            res.release(other, src_off)
            ok = bool(where & other) and not where & bit and res.mem_off(rid, other) == src_off
            if ok and not st.closed and _adopt_checksum(st, rid, sum_):
                if bit == DEV:
                    res.host_copy[rid] = src_off
                    ix.set_off(rid, off)
                else:
                    res.host_copy[rid] = off
                ix.where[rid] = where | bit
                st.counters[bit].promoted(other, size)
                return pool.slot(off, size)
        elif (n == size and where == DISK and int(ix.atime[rid]) == stamp
              and not st.closed and _adopt_checksum(st, rid, sum_)):
            ix.set_off(rid, off)
            ix.where[rid] = DISK | bit
            st.counters[bit].promoted(DISK, size)
            return pool.slot(off, size)
        res.free_slot(bit, off)
        if src == DISK and n is None:
            return None
    return stage(st, name, bit, deadline)  # the row changed meanwhile: look again


def stage_host_many(st: StoreState, names: Sequence[bytes], encoder: ThreadPoolExecutor | None,
                    deadline: float) -> list[HostSlot | None]:
    check_names(names)
    names = list(names)
    st.pool(HOST, "stage")
    pool = st.host
    assert pool is not None
    if not names:
        return []
    ix, res = st.ix, st.res
    plan: list[Staging] = []
    with st.lock:
        st.check_open()
        found = {n: rid for n in names if (rid := ix.ids.get(n)) is not None}
        rids = np.fromiter(found.values(), np.int64, len(found))
        stamps = ix.touch_many(rids)  # in the order given, like one stage per row
        cold = np.flatnonzero((ix.where[rids] & HOST) == 0)
        if cold.size == 0:
            return res.host_slots(names, pool.segment)
        found_names = list(found)
        for j in cold.tolist():
            rid = int(rids[j])
            where = int(ix.where[rid])
            plan.append(Staging(found_names[j], rid, int(ix.size[rid]),
                                DEV if where & DEV else DISK, int(stamps[j])))
        _claim(st, pool, plan, deadline)
    try:
        _fill(st, pool, plan, encoder)
    except BaseException:
        with st.lock:
            for s in plan:
                _release(st, s)
                res.free_slot(HOST, s.off)
        raise
    retry: list[bytes] = []
    corrupt: list[Staging] = []
    published: list[Staging] = []
    with st.lock:
        for s in plan:
            _release(st, s)
            if _publish(st, s):
                s.published_at = int(ix.atime[s.rid])
                s.holders = dict(st.locks.holders(s.name))
                published.append(s)
                continue
            res.free_slot(HOST, s.off)
            if s.corrupt:
                corrupt.append(s)
            elif s.src == 0 or s.n is not None:
                retry.append(s.name)  # the row changed meanwhile: stage it again
        if not retry and not corrupt:
            st.check_open()
            return res.host_slots(names, pool.segment)
    for s in corrupt:
        drop_corrupt(st, s.name, s.rid)
    try:
        for name in retry:
            stage(st, name, HOST, deadline)
    except BaseException:
        with st.lock:  # all or nothing: give back the copies this call added...
            for s in published:
                if _still_ours(st, s):
                    res.drop_copy(s.rid, HOST)
        raise
    with st.lock:
        st.check_open()
        return res.host_slots(names, pool.segment)


def _still_ours(st: StoreState, s: Staging) -> bool:
    """Whether a copy this batch published is still only this batch's: the same row in
    the same host slot, and since the publish nobody has staged or read it (its LRU stamp
    is unchanged) nor locked or unlocked it."""
    ix, rid = st.ix, s.rid
    return (ix.ids.get(s.name) == rid and bool(int(ix.where[rid]) & HOST)
            and st.res.mem_off(rid, HOST) == s.off
            and int(ix.atime[rid]) == s.published_at
            and st.locks.holders(s.name) == s.holders)


def _claim(st: StoreState, pool: HostSlab, plan: list[Staging], deadline: float) -> None:
    """Claim (and hold) a private host slot for every planned row, or none of them
    (``TierFull``); hold the device copies that will be read. Waiting for the mover
    releases the lock, so device sources are looked up afterwards."""
    res, ix = st.res, st.ix
    claimed: list[Staging] = []
    try:
        for s in plan:
            if not pool.fits(s.size):
                raise TierFull(f"stage: a {s.size}-byte row exceeds the host budget")
            off = alloc_waiting(st, HOST, s.size, deadline)
            if off is None:
                need = sum(slot_class(p.size) for p in plan)
                raise TierFull(
                    f"stage: no room for {len(plan)} rows ({need} bytes) in the host tier "
                    f"(used {pool.used_bytes} of {pool.budget}); the rest is locked, "
                    "pinned, reserved or being read")
            s.off = off
            res.hold(HOST, off)
            claimed.append(s)
    except BaseException:
        for s in claimed:
            res.release(HOST, s.off)
            res.free_slot(HOST, s.off)
        raise
    for s in plan:
        if s.src != DEV:
            continue
        where = int(ix.where[s.rid])
        if ix.ids.get(s.name) == s.rid and where & DEV and not where & HOST:
            s.src_off = res.mem_off(s.rid, DEV)
            res.hold(DEV, s.src_off)
            s.held = True
        else:
            s.src = 0  # moved while we waited for room: staged again afterwards


def _fill(st: StoreState, pool: HostSlab, plan: list[Staging],
          encoder: ThreadPoolExecutor | None) -> None:
    """Copy each planned row into its private slot (no store lock held). Disk rows are
    decoded on the codec workers (zstd releases the GIL); device rows are copied as one
    batch meanwhile."""
    from_disk = [s for s in plan if s.src == DISK]
    decodes: list[Future[None]] = []
    if encoder is not None and len(from_disk) > 1:
        decodes = [encoder.submit(_read_into_slot, st, pool, s) for s in from_disk]
        from_disk = []
    try:
        for s in from_disk:
            _read_into_slot(st, pool, s)
        from_dev = [s for s in plan if s.src == DEV]
        if from_dev:
            # One batch: queued together, one wait (while the decodes run on the workers).
            assert st.device is not None
            st.copier.between_many(pool, st.device, [(s.off, s.src_off, s.size) for s in from_dev],
                                   to_host=True)
            for s in from_dev:
                s.n = s.size
    finally:
        wait(decodes)  # every decode is done with its slot before anyone frees it
    for f in decodes:
        f.result()  # raise the first failure
    for s in plan:
        if s.n == s.size:
            s.checksum = _slot_checksum(st, s.off, s.size)


def _slot_checksum(st: StoreState, off: int, size: int) -> int:
    """The checksum of a private host slot just filled (no lock held)."""
    assert st.host is not None  # staged into host only with a host tier
    view = st.host.view(off, size)
    try:
        return checksum(view)
    finally:
        view.release()


def _adopt_checksum(st: StoreState, rid: int, got: int | None) -> bool:
    """Record a new host copy's checksum (store lock held); False when the row already
    has one that differs (the copy's bytes are not the row's: it is not published)."""
    if got is None:
        return True
    want = st.ix.get_checksum(rid)
    if want is None:
        st.ix.set_checksum(rid, got)
        return True
    if want != got:
        logger.warning("store: row %s…: a host copy differs from its checksum; not used",
                       (st.ix.names[rid] or b"").hex()[:16])
    return want == got


def _read_into_slot(st: StoreState, pool: HostSlab, s: Staging) -> None:
    try:
        s.n = st.copier.from_frames(st.disk(), s.name, pool, s.off, s.size)
    except CorruptPage as exc:
        logger.warning("store: row %s… failed its checks on disk, dropped: %s",
                       s.name.hex()[:16], exc)
        s.corrupt = True


def _release(st: StoreState, s: Staging) -> None:
    st.res.release(HOST, s.off)
    if s.held:
        st.res.release(DEV, s.src_off)
        s.held = False


def _publish(st: StoreState, s: Staging) -> bool:
    """Make a filled private slot the row's host copy if the row is unchanged."""
    ix = st.ix
    if st.closed or s.src == 0 or s.n != s.size or ix.ids.get(s.name) != s.rid:
        return False
    rid = s.rid
    where = int(ix.where[rid])
    if where & HOST:
        return False
    if not _adopt_checksum(st, rid, s.checksum):
        s.corrupt = True  # dropped (its disk copy, if that was the source), not retried
        return False
    if s.src == DEV:
        # The source slot was held: an overwrite or a move gives the row another one.
        if not where & DEV or ix.get_off(rid) != s.src_off:
            return False
        st.res.host_copy[rid] = s.off
    else:
        if where != DISK or int(ix.atime[rid]) != s.stamp:
            return False
        ix.set_off(rid, s.off)
    ix.where[rid] = where | HOST
    st.counters[HOST].promoted(s.src, s.size)
    return True
