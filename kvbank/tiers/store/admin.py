"""The operations an admin API and the fleet call: list, evict, pin, touch, read a frame.

- :func:`scan` — rows in name order by prefix, a page at a time (cursor = last name):
  one bisect into the index's ordered names and the page's rows read, all under the store
  lock, O(log n + page). Never takes a page lock or changes recency.
- :func:`evict` — drop rows from every tier; locked and pinned rows are reported, not
  evicted.
- :func:`pin` / :func:`unpin` — pinned rows are never victims (never evicted or demoted
  out of their tier), within the ``pin_bytes`` budget (``PinBudgetExceeded``).
- :func:`touch` — record recency without reading.
- :func:`read_frame` — a row's encoded codec frame without decoding it: a disk row's
  frame as stored, a memory-only row encoded on demand with its dtype.
- :func:`compact_disk` — the disk tier's compaction (older-layout rows and sparse
  segments into fresh segments); rows stay where the index says (on disk), so no store
  lock is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvbank.codec import DEFAULT_LEVEL, encode
from kvbank.errors import CorruptPage, InvalidInput
from kvbank.keys import ROW_NAME_BYTES
from kvbank.results import EvictResult, RowInfo
from kvbank.tiers.base import check_name
from kvbank.tiers.index import DEV, DISK, HOST, KIND_OF_BIT
from kvbank.tiers.store.reads import drop_corrupt
from kvbank.tiers.store.state import StoreState

if TYPE_CHECKING:
    from kvbank.tiers.disk import CompactReport

MAX_SCAN_LIMIT = 10_000


def _names(names: Sequence[bytes]) -> list[bytes]:
    if isinstance(names, (bytes, bytearray, str)) or not isinstance(names, Sequence):
        raise InvalidInput(f"names: expected a sequence of row names, got {type(names).__name__}")
    return [check_name(n) for n in names]


def count(st: StoreState, prefix: bytes) -> int:
    if not isinstance(prefix, bytes) or len(prefix) > ROW_NAME_BYTES:
        raise InvalidInput(f"prefix: expected at most {ROW_NAME_BYTES} bytes, got {prefix!r}")
    with st.lock:
        st.check_open()
        return st.ix.ordered.count(prefix)


def scan(st: StoreState, prefix: bytes, after: bytes | None, limit: int) -> list[RowInfo]:
    if not isinstance(prefix, bytes) or len(prefix) > ROW_NAME_BYTES:
        raise InvalidInput(f"prefix: expected at most {ROW_NAME_BYTES} bytes, got {prefix!r}")
    if after is not None:
        check_name(after)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_SCAN_LIMIT:
        raise InvalidInput(f"limit: expected an integer in [1, {MAX_SCAN_LIMIT}], got {limit!r}")
    out: list[RowInfo] = []
    with st.lock:
        st.check_open()
        ix = st.ix
        for name in ix.ordered.page(prefix, after, limit):
            rid = ix.ids[name]
            where = int(ix.where[rid])
            out.append(RowInfo(name, int(ix.size[rid]),
                               frozenset(k for b, k in KIND_OF_BIT.items() if where & b),
                               ix.age_s(rid), frozenset(st.locks.holders(name)),
                               name in st.pins))
    return out


def evict(st: StoreState, names: Sequence[bytes]) -> EvictResult:
    names = _names(names)
    evicted: list[bytes] = []
    locked: list[bytes] = []
    missing: list[bytes] = []
    pinned: list[bytes] = []
    with st.lock:
        st.check_open()
        for name in dict.fromkeys(names):
            rid = st.ix.ids.get(name)
            if rid is None:
                missing.append(name)
            elif name in st.locks:
                locked.append(name)
            elif name in st.pins:
                pinned.append(name)
            else:
                st.remove_row(rid)
                evicted.append(name)
        st.notify()
    return EvictResult(tuple(evicted), tuple(locked), tuple(missing), tuple(pinned))


def pin(st: StoreState, names: Sequence[bytes]) -> tuple[bytes, ...]:
    """Pin the present rows (all or none); the names that are not stored."""
    names = _names(names)
    with st.lock:
        st.check_open()
        ix = st.ix
        rows = {n: int(ix.size[rid]) for n in names if (rid := ix.ids.get(n)) is not None}
        st.pins.add(rows)
        return tuple(n for n in dict.fromkeys(names) if n not in rows)


def unpin(st: StoreState, names: Sequence[bytes]) -> None:
    names = _names(names)
    with st.lock:
        for name in names:
            st.pins.drop(name)
        st.notify()


def touch(st: StoreState, names: Sequence[bytes]) -> int:
    """Stamp the present rows as just used, in the order given; how many were present."""
    names = _names(names)
    with st.lock:
        st.check_open()
        ix = st.ix
        rids = list(dict.fromkeys(rid for n in names if (rid := ix.ids.get(n)) is not None))
        if rids:
            ix.touch_many(np.asarray(rids, dtype=np.int64))
        return len(rids)


def read_frame(st: StoreState, name: bytes) -> bytes | None:
    check_name(name)
    ix, res = st.ix, st.res
    with st.lock:
        st.check_open()
        rid = ix.ids.get(name)
        if rid is None:
            return None
        where = int(ix.where[rid])
        size = int(ix.size[rid])
        dtype = ix.dtypes[int(ix.dtype[rid])]
        bit = HOST if where & HOST else DEV if where & DEV else DISK
        if bit != DISK and not where & DISK:
            off = res.mem_off(rid, bit)
            res.hold(bit, off)
    if where & DISK:
        try:
            frame = st.disk().read_frame(name)
        except CorruptPage:
            drop_corrupt(st, name, rid)
            return None
        return frame
    try:
        pool = st.pools[bit]
        if st.has_disk:
            return st.copier.encode(st.disk(), pool, off, size, dtype)
        buf = memoryview(bytearray(size))
        st.copier.read(pool, off, size, buf)
        return encode(buf, dtype, level=DEFAULT_LEVEL)
    finally:
        with st.lock:
            st.release(bit, off)


def compact_disk(st: StoreState) -> CompactReport | None:
    """Compact the disk tier (see :meth:`~kvbank.tiers.disk.DiskTier.compact`); ``None``
    when the store has no disk tier of segments."""
    from kvbank.tiers.disk import DiskTier  # the store opens it lazily too (no LMDB otherwise)

    st.check_open()
    if not st.has_disk:
        return None
    disk = st.disk()
    return disk.compact() if isinstance(disk, DiskTier) else None
