"""Reads: copy a row into a caller's buffer, promoting a disk row into host.

Plan under the store lock (look the row up, stamp its LRU, hold its memory slot), copy
with no lock held, settle under the lock. A disk read decodes straight from LMDB into the
caller's buffer, then the bytes are copied into a free host slot (a clean copy) if there
is room without waiting for the disk. A frame that fails its checks is dropped and the
read is a miss; a row purged between lookup and read is a miss too (counters say so).
A copy out of a host slot is verified against the row's checksum: bytes that changed
since commit (another process of the segment's uid wrote them) are a miss, and the host
copy is dropped (:func:`quarantine_host`).

A batch (:func:`get_many_into`) plans every row under one lock, then copies and decodes
on the copy lanes (each row as :func:`get_into` would), and settles under one lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvbank.codec import checksum
from kvbank.errors import CorruptPage, InvalidInput, TierError
from kvbank.tiers.base import as_out_view, check_name
from kvbank.tiers.index import DEV, DISK, HOST
from kvbank.tiers.store.copier import Lanes
from kvbank.tiers.store.placement import band, reclaim
from kvbank.tiers.store.state import StoreState

logger = logging.getLogger("kvbank.tiers.store.store")


def get_into(st: StoreState, name: bytes, out: memoryview | bytearray) -> int | None:
    """The local tiers, then (on a miss, when configured) the remote tiers below them."""
    n = _get_local(st, name, out)
    if n is None and st.below:
        with st.lock:
            known = name in st.ix.ids  # a local row purged meanwhile is a miss, not remote
        if not known:
            n = _read_remote(st, name, as_out_view(out))
    return n


def _get_local(st: StoreState, name: bytes, out: memoryview | bytearray) -> int | None:
    check_name(name)
    dst = as_out_view(out)
    ix = st.ix
    with st.lock:
        st.check_open()
        st.gets += 1
        rid = ix.ids.get(name)
        if rid is None:
            count_miss(st)
            return None
        size = int(ix.size[rid])
        if dst.nbytes < size:
            raise InvalidInput(f"out: {dst.nbytes} bytes, the row holds {size}")
        stamp = ix.touch(rid)
        where = int(ix.where[rid])
        bit = DEV if where & DEV else HOST if where & HOST else DISK
        count_passed(st, bit)
        if bit != DISK:
            st.counters[bit].hits += 1
            st.hits += 1
            off = st.res.mem_off(rid, bit)
            st.res.hold(bit, off)
        want = ix.get_checksum(rid) if bit == HOST else None
    if bit != DISK:
        try:
            st.copier.read(st.pools[bit], off, size, dst)
        finally:
            with st.lock:
                st.release(bit, off)
        if want is not None and checksum(dst[:size]) != want:
            quarantine_host(st, [name])
            return None
        return size
    return _read_disk(st, name, rid, stamp, size, dst)


@dataclass(frozen=True, slots=True)
class _Read:
    """One planned row of a batch read."""

    name: bytes
    rid: int
    stamp: int
    size: int
    bit: int
    off: int  # the held memory slot; -1 for a disk row
    dst: memoryview
    checksum: int | None  # a host row's, to verify the copy against


def get_many_into(st: StoreState, lanes: Lanes, names: Sequence[bytes],
                  outs: Sequence[memoryview | bytearray]) -> list[int | None]:
    """:func:`get_into` for several rows at once: per row, its size or ``None``."""
    if len(names) != len(outs):
        raise InvalidInput(f"outs: {len(outs)} buffers for {len(names)} names")
    dsts = [as_out_view(o) for o in outs]
    for name in names:
        check_name(name)
    ix = st.ix
    plan: list[_Read | None] = []
    with st.lock:
        st.check_open()
        for i, name in enumerate(names):  # sizes first: a refusal holds nothing
            rid = ix.ids.get(name)
            if rid is not None and dsts[i].nbytes < int(ix.size[rid]):
                raise InvalidInput(f"outs[{i}]: {dsts[i].nbytes} bytes, the row holds "
                                   f"{int(ix.size[rid])}")
        for name, dst in zip(names, dsts, strict=True):
            st.gets += 1
            rid = ix.ids.get(name)
            if rid is None:
                count_miss(st)
                plan.append(None)
                continue
            size = int(ix.size[rid])
            stamp = ix.touch(rid)
            where = int(ix.where[rid])
            bit = DEV if where & DEV else HOST if where & HOST else DISK
            count_passed(st, bit)
            off = -1
            if bit != DISK:
                st.counters[bit].hits += 1
                st.hits += 1
                off = st.res.mem_off(rid, bit)
                st.res.hold(bit, off)
            plan.append(_Read(name, rid, stamp, size, bit, off, dst,
                              ix.get_checksum(rid) if bit == HOST else None))

    changed: list[bytes] = []  # host rows whose copy failed its checksum

    def one(r: _Read | None) -> int | None:
        if r is None:
            return None
        if r.bit == DISK:
            return _read_disk(st, r.name, r.rid, r.stamp, r.size, r.dst)
        st.copier.read(st.pools[r.bit], r.off, r.size, r.dst)
        if r.checksum is not None and checksum(r.dst[: r.size]) != r.checksum:
            changed.append(r.name)
            return None
        return r.size

    try:
        got = lanes.map(one, plan)
    finally:
        with st.lock:
            for r in plan:
                if r is not None and r.bit != DISK:
                    st.release(r.bit, r.off)
    if changed:
        quarantine_host(st, changed)
    return got


def _read_disk(st: StoreState, name: bytes, rid: int, stamp: int, size: int,
               dst: memoryview) -> int | None:
    try:
        n = st.disk().read_into(name, dst, expect=size)
    except CorruptPage as exc:
        logger.warning("store: row %s… failed its checks on disk, dropped: %s",
                       name.hex()[:16], exc)
        drop_corrupt(st, name, rid)
        n = None
    with st.lock:  # counted once the outcome is known: hit, or miss (corrupt or purged)
        if n is None or n != size:
            st.misses += 1
            st.counters[DISK].misses += 1
            return None
        st.hits += 1
        st.counters[DISK].hits += 1
    _promote(st, name, rid, stamp, size, dst)
    return n


def _read_remote(st: StoreState, name: bytes, dst: memoryview, *, count: bool = True) -> int | None:
    """A miss in every local tier, read from the remote tiers in order (not promoted: the
    fleet index, not this read, decides what a node keeps). A damaged frame is dropped and
    a miss; an unreachable remote tier is a miss too (its health says why). ``count=False``:
    a recall, whose row counts when it is served (:func:`count_reads`), not here."""
    n: int | None = None
    for remote in st.below:
        try:
            n = remote.read_into(name, dst)
        except CorruptPage as exc:
            logger.warning("store: row %s… failed its checks in the remote tier, dropped: %s",
                           name.hex()[:16], exc)
            remote.drop_corrupt(name)
            n = None
        except TierError as exc:
            logger.debug("store: remote read of %s… failed: %s", name.hex()[:16], exc)
            n = None
        if n is not None:
            break
    if n is not None and count:
        with st.lock:  # the local miss was answered after all (each local tier missed)
            st.misses -= 1
            st.hits += 1
            st.remote_hits += 1
    return n


def recall_into(st: StoreState, name: bytes, out: memoryview | bytearray) -> int | None:
    """A row read from the remote tiers only, counted nowhere: a served node recalls rows
    for a match and counts each one when a fetch serves it (one read, counted once)."""
    check_name(name)
    with st.lock:
        st.check_open()
    return _read_remote(st, name, as_out_view(out), count=False) if st.below else None


def count_reads(st: StoreState, bits: Sequence[int]) -> None:
    """Reads served without :func:`get_into` (a node's READ leases on a fetch's rows),
    counted as it would count them: per row its tier bit (a hit there, a miss in each
    faster tier) or 0 (a miss in every tier asked)."""
    with st.lock:
        for bit in bits:
            st.gets += 1
            if not bit:
                count_miss(st)
                continue
            count_passed(st, bit)
            st.counters[bit].hits += 1
            st.hits += 1


def count_miss(st: StoreState) -> None:
    """A read no local tier holds: a miss in the store and in every tier it asked
    (caller holds the lock)."""
    st.misses += 1
    for b in st.read_bits:
        st.counters[b].misses += 1


def count_passed(st: StoreState, bit: int) -> None:
    """A read answered from tier ``bit``: a miss in each faster tier it asked first
    (caller holds the lock; the hit is counted once the copy's outcome is known)."""
    for b in st.read_bits:
        if b == bit:
            break
        st.counters[b].misses += 1


def drop_corrupt(st: StoreState, name: bytes, rid: int) -> None:
    """Delete a row whose frame failed its checks (counted by the disk tier); its
    memory copies, if any, stay. A lock does not protect corrupt bytes."""
    disk = st.disk()
    with st.disk_lock:
        with st.lock:
            ix = st.ix
            current = ix.ids.get(name) == rid and bool(int(ix.where[rid]) & DISK)
            if current:
                ix.where[rid] = int(ix.where[rid]) & ~DISK
                if not int(ix.where[rid]):
                    st.res.forget_row(rid)
        if current:
            disk.drop_corrupt(name)


def _promote(st: StoreState, name: bytes, rid: int, stamp: int, size: int,
             src: memoryview) -> None:
    """Copy a row just read from disk into a host slot (a clean copy), if there is room
    without waiting for the disk."""
    host = st.host
    with st.lock:
        if host is None or st.closed or not host.fits(size):
            return
        off = host.alloc(size)
        if off is None:
            reclaim(st, HOST, max(size, band(st, HOST)), queue=False)
            off = host.alloc(size)
            if off is None:
                return
        st.res.hold(HOST, off)
    sum_ = checksum(src[:size])  # the bytes just decoded (and checked) in private memory
    try:
        st.copier.fill(host, off, src[:size])
    finally:
        with st.lock:
            st.res.release(HOST, off)
            ix = st.ix
            if (ix.ids.get(name) == rid and int(ix.atime[rid]) == stamp
                    and int(ix.where[rid]) == DISK and not st.closed):
                ix.set_off(rid, off)
                ix.set_checksum(rid, sum_)
                ix.where[rid] = DISK | HOST
                st.counters[HOST].promoted(DISK, size)
            elif not st.closed:
                host.free(off)


def quarantine_host(st: StoreState, names: Sequence[bytes]) -> list[bytes]:
    """Check the host copies of ``names`` against their checksums and drop those that no
    longer match and no lease or pin holds; the names dropped (counted as the host
    tier's ``corrupt``). Each slot is held while it is hashed, with no lock held."""
    host = st.host
    if host is None:
        return []
    plan: list[tuple[bytes, int, int, int, int]] = []  # name, rid, off, size, checksum
    with st.lock:
        if st.closed:
            return []
        ix, res = st.ix, st.res
        for name in dict.fromkeys(names):
            rid = ix.ids.get(name)
            if rid is None or not int(ix.where[rid]) & HOST:
                continue
            want = ix.get_checksum(rid)
            if want is None:
                continue
            off = res.mem_off(rid, HOST)
            res.hold(HOST, off)
            plan.append((name, rid, off, int(ix.size[rid]), want))
    bad: list[tuple[bytes, int, int, int]] = []
    dropped: list[bytes] = []
    try:
        for name, rid, off, size, want in plan:
            view = host.view(off, size)
            try:
                if checksum(view) != want:
                    bad.append((name, rid, off, want))
            finally:
                view.release()
    finally:
        with st.lock:
            ix, res = st.ix, st.res
            for _, _, off, _, _ in plan:
                st.release(HOST, off)
            for name, rid, off, want in bad:
                if (ix.ids.get(name) != rid or not int(ix.where[rid]) & HOST
                        or res.mem_off(rid, HOST) != off or ix.get_checksum(rid) != want
                        or name in st.locks or name in st.pins):
                    continue  # replaced, moved, or held: its next read checks it again
                res.drop_copy(rid, HOST)
                if not int(ix.where[rid]):
                    res.forget_row(rid)
                st.counters[HOST].corrupt += 1
                dropped.append(name)
                logger.warning("store: row %s…: host copy dropped, its bytes changed since "
                               "commit", name.hex()[:16])
            if dropped:
                st.notify()
    return dropped
