"""Persistence: the index rebuilt from disk at open, memory rows written back at close.

- :func:`recover` — every row the disk tier checked at open goes into the index, oldest
  write first (the write clock gives the LRU order), with its parent links.
- :func:`write_back` — at a graceful close, every memory row without a disk copy (write-
  back's dirty rows) is encoded on the codec workers and written, hottest first, within
  the disk budget (evicting only disk rows used longer ago) and a deadline. The frames
  the workers have ready are written together, at least ``WRITE_BACK_GROUP_MIN`` (waited
  for) and up to ``WRITE_BACK_GROUP`` rows in one LMDB transaction (one fsync instead of
  one per row); a group that does not fit the
  budget whole is written row by row. Write clocks keep the LRU order for the restart. The
  store is closed meanwhile, so nothing else
  changes the index; the disk lock orders the writes.
"""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass

import numpy as np

from kvbank import progress
from kvbank.errors import TierFull
from kvbank.tiers.base import FrameWrite
from kvbank.tiers.index import DEV, DISK, HOST
from kvbank.tiers.store.mover import WINDOW_PER_WORKER, Mover
from kvbank.tiers.store.state import StoreState

logger = logging.getLogger("kvbank.tiers.store.store")

# Rows per write-back transaction, at most: a close of a full host tier commits a few
# hundred frames, and each commit is an fsync; 32 frames of 2 MiB pages are ~45 MB.
WRITE_BACK_GROUP = 32
WRITE_BACK_GROUP_BYTES = 64 << 20
# Rows a write-back transaction waits for before it commits (fewer only at the end, or
# at the byte cap): a commit's fsync costs more than the encodes of a few more frames,
# which the workers run while the previous group commits.
WRITE_BACK_GROUP_MIN = 8


def recover(st: StoreState) -> None:
    if not st.has_disk:
        return
    disk, ix = st.disk(), st.ix
    pending: list[tuple[int, bytes]] = []
    for row in sorted(disk.scan(), key=lambda r: r.seq):  # oldest write first
        rid = ix.add(row.name, row.raw_len, ix.dtype_code(row.dtype), -1)
        ix.where[rid] = DISK
        if row.parent is not None:
            pending.append((rid, row.parent))
    for rid, parent in pending:
        pid = ix.ids.get(parent)
        if pid is not None and pid != rid:
            ix.parent[rid] = pid
    if len(ix):
        logger.debug("store: recovered %d rows from %s", len(ix), st.config.data_dir)


@dataclass(frozen=True, slots=True)
class _Dirty:
    """A memory-only row to write at close, its slot held meanwhile."""

    rid: int
    name: bytes
    bit: int
    off: int
    size: int
    dtype: str
    parent: bytes | None
    stamp: int


def write_back(st: StoreState, mover: Mover, deadline: float, deadline_s: float) -> None:
    disk, encoder = st.disk(), mover.encoder
    assert encoder is not None  # made with the disk tier
    ix = st.ix
    with st.lock:
        n = ix.high
        where = ix.where[:n]
        dirty = np.flatnonzero(((where & (DEV | HOST)) != 0) & ((where & DISK) == 0))
        order = dirty[np.argsort(ix.atime[dirty], kind="stable")[::-1]].tolist()
        rows: list[_Dirty] = []
        for rid in order:
            bit = HOST if int(ix.where[rid]) & HOST else DEV  # host: no device copy-out
            off = st.res.mem_off(rid, bit)
            st.res.hold(bit, off)
            name = ix.names[rid]
            assert name is not None
            rows.append(_Dirty(rid, name, bit, off, int(ix.size[rid]),
                               ix.dtypes[int(ix.dtype[rid])], ix.parent_name(rid),
                               int(ix.atime[rid])))
    if not rows:
        return
    seq0 = disk.seq  # the hottest row, written first, gets the highest write clock
    depth = max(WRITE_BACK_GROUP, WINDOW_PER_WORKER * mover.workers)
    window: collections.deque[tuple[int, Future[bytes]]] = collections.deque()
    nxt = written = 0
    why = ""
    shown = progress.bar(len(rows), "writing memory rows to disk", unit="row")
    try:
        while nxt < len(rows) or window:
            while nxt < len(rows) and len(window) < depth:
                r = rows[nxt]
                window.append((nxt, encoder.submit(st.copier.encode, disk, st.pools[r.bit],
                                                   r.off, r.size, r.dtype)))
                nxt += 1
            # The next WRITE_BACK_GROUP_MIN frames in order (waited for), then every
            # following one already encoded: the group grows with what the workers made
            # while the last commit ran, and a slow encode never shrinks it to a row or
            # two a transaction (an fsync each), which a loaded machine's scheduling did.
            group: list[tuple[int, bytes]] = []
            size = 0
            while window and len(group) < WRITE_BACK_GROUP and size < WRITE_BACK_GROUP_BYTES \
                    and (len(group) < WRITE_BACK_GROUP_MIN or window[0][1].done()):
                i, fut = window.popleft()
                group.append((i, fut.result()))
                size += len(group[-1][1])
            if time.monotonic() > deadline:
                why = f"the {deadline_s:g} s close deadline passed"
                break
            done, why = _write_group(st, mover, rows, group, seq0)
            written += done
            shown.update(done)
            if why:
                break
    except TierFull as exc:
        why = str(exc)
    finally:
        shown.close()
        wait([f for _, f in window])
        with st.lock:
            for r in rows:
                st.res.release(r.bit, r.off)
    if why:
        logger.warning("store: close wrote %d of %d memory-only rows to disk; the other "
                       "%d are dropped: %s", written, len(rows), len(rows) - written, why)
    else:
        logger.debug("store: close wrote %d memory-only rows to disk", written)


def _write_group(st: StoreState, mover: Mover, rows: list[_Dirty],
                 group: list[tuple[int, bytes]], seq0: int) -> tuple[int, str]:
    """Write ``(row index, frame)`` pairs, hottest first; how many were written, and why
    the rest were not ("" when all were). Row ``i`` gets write clock ``seq0 + len(rows) -
    i``. One :meth:`~kvbank.tiers.base.FrameStore.write_frames` (a transaction on LMDB)
    when the whole group fits the budget; else one write per row, each making its own
    room."""
    disk, ix = st.disk(), st.ix
    top = seq0 + len(rows)
    with st.disk_lock:
        if len(group) > 1 and _room(
                st, mover, sum(len(f) for _, f in group), min(rows[i].stamp for i, _ in group)):
            # write_frames numbers its rows upward from ``seq``: coldest first.
            coldest_first = group[::-1]
            disk.write_frames([FrameWrite(rows[i].name, f, rows[i].size, rows[i].dtype, rows[i].parent)
                         for i, f in coldest_first], seq=top - coldest_first[0][0], replace=True)
            with st.lock:
                for i, _ in group:
                    ix.where[rows[i].rid] = int(ix.where[rows[i].rid]) | DISK
            return len(group), ""
        done = 0
        for i, frame in group:
            r = rows[i]
            if not _room(st, mover, len(frame), r.stamp):
                return done, "the disk budget holds only rows used more recently"
            disk.write_frame(r.name, frame, raw_len=r.size, dtype=r.dtype, parent=r.parent,
                             seq=top - i, replace=True)
            with st.lock:
                ix.where[r.rid] = int(ix.where[r.rid]) | DISK
            done += 1
        return done, ""


def _room(st: StoreState, mover: Mover, frame_len: int, stamp: int) -> bool:
    """Make room for a ``frame_len`` frame of a row used at ``stamp`` by evicting disk
    rows used before it (caller holds the disk lock); False if that is not enough."""
    disk = st.disk()
    over = disk.used_bytes + frame_len - disk.budget_bytes
    if over <= 0:
        return True
    with st.lock:
        names = mover.evict_disk(over, older_than=stamp)
    if names:
        disk.delete_many(names)
    return disk.used_bytes + frame_len <= disk.budget_bytes
