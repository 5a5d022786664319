"""Bounded dirty age for write-back: memory rows older than ``dirty_expire_s`` reach disk.

Like the kernel's ``dirty_expire_centisecs``: in write-back mode a row reaches disk only
when it is demoted, so an idle bank kept its acknowledged rows in memory alone and a
``kill -9`` lost them. The mover sweeps every ``dirty_expire_s / 2`` seconds: the rows that
were memory-only at the previous sweep and still are get written to disk, and keep their
memory copy (they become clean: later evictions drop them without a write). A crash
therefore loses at most the puts of the last ``dirty_expire_s`` seconds.

Primitives: :class:`DirtySweep` (the mover's schedule and the previous sweep's names);
:func:`write_clean` (encode a memory row through the same path as ``read_frame``, with its
slot held; commit under the disk lock; mark it on disk only if the index still holds
that row in memory, else delete the frame it wrote).

Lifecycle: made by the mover when the store has a disk tier, write-back policy and a
``dirty_expire_s``; ``due``/``wait_s`` feed the mover's wait; ``run`` on the mover thread.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from kvbank.codec import frame_info
from kvbank.errors import TierError
from kvbank.tiers.base import FrameWrite
from kvbank.tiers.index import DEV, DISK, HOST
from kvbank.tiers.store import admin
from kvbank.tiers.store.state import StoreState

logger = logging.getLogger("kvbank.tiers.store.store")

SWEEP_GROUP = 64  # rows a sweep writes in one transaction (one fsync)


class DirtySweep:
    """When the next sweep is due, and which rows were dirty at the last one."""

    def __init__(self, st: StoreState, expire_s: float) -> None:
        self.st = st
        self.interval = expire_s / 2  # dirty at two sweeps in a row: older than interval
        self._next = time.monotonic() + self.interval
        self._prev: set[bytes] = set()
        self.written = 0  # rows this sweep wrote, for tests and stats

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def wait_s(self) -> float:
        return max(0.0, self._next - time.monotonic())

    def run(self) -> int:
        """Write the rows dirty at both this sweep and the last (no lock held on entry)."""
        st = self.st
        with st.lock:
            self._next = time.monotonic() + self.interval
            if st.closed:
                return 0
            ix = st.ix
            where = ix.where[: ix.high]
            rids = np.flatnonzero(((where & (DEV | HOST)) != 0) & ((where & DISK) == 0))
            now = {n for n in (ix.names[int(r)] for r in rids) if n is not None}
            old, self._prev = sorted(now & self._prev), now
        n = 0
        for i in range(0, len(old), SWEEP_GROUP):
            batch = old[i : i + SWEEP_GROUP]
            try:
                n += write_clean_many(st, batch)
            except TierError as exc:  # a full disk, a closing store: the next sweep retries
                logger.info("store: dirty-age write of %s… stopped: %s", batch[0].hex()[:16], exc)
                break
        self.written += n
        return n


def write_clean(st: StoreState, name: bytes) -> int:
    """Write a memory-only row to disk and keep its memory copy; 1 if written."""
    return write_clean_many(st, [name])


def write_clean_many(st: StoreState, names: list[bytes]) -> int:
    """Write memory-only rows to disk in one transaction (one durable commit: a commit
    per row could not keep up with puts, and the dirty age grew without bound) and keep
    their memory copies; how many were written."""
    disk = st.disk()
    encoded: list[tuple[bytes, bytes, int]] = []
    for name in names:
        frame = admin.read_frame(st, name)  # holds the slot while it encodes
        if frame is not None:
            encoded.append((name, frame, frame_info(frame).raw_len))
    if not encoded:
        return 0
    ix = st.ix
    with st.disk_lock:
        todo: list[tuple[FrameWrite, int]] = []  # with the row id it was checked for
        room = disk.budget_bytes - disk.used_bytes
        with st.lock:
            st.check_open()
            for name, frame, raw_len in encoded:
                rid = ix.ids.get(name)
                if rid is None or int(ix.size[rid]) != raw_len:
                    continue
                where = int(ix.where[rid])
                if where & DISK or not where & (DEV | HOST):
                    continue  # written (or demoted) meanwhile
                if len(frame) > room:
                    break  # never evict older rows to make room for a copy of a memory row
                room -= len(frame)
                todo.append((FrameWrite(name, frame, raw_len, ix.dtypes[int(ix.dtype[rid])],
                                        ix.parent_name(rid)), rid))
        if not todo:
            return 0
        disk.write_frames([w for w, _ in todo], replace=True)  # the disk's group commit
        written = 0
        stale: list[bytes] = []
        with st.lock:
            for w, rid in todo:
                same = ix.ids.get(w.name) == rid and int(ix.size[rid]) == w.raw_len
                where = int(ix.where[rid]) if same else 0
                if same and where & (DEV | HOST) and not where & DISK:
                    ix.where[rid] = where | DISK
                    written += 1
                else:
                    stale.append(w.name)
        if stale:
            disk.delete_many(stale)  # the rows changed meanwhile: no frame the index lacks
    return written
