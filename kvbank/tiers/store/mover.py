"""The mover: one background thread that moves rows down the tiers.

It owns ``disk_lock`` (every disk mutation of the store takes it, so writes, purges and
their index checks are those of one writer), the job queue's execution, and the codec
workers. Jobs (:class:`~.types.Job`):

- ``COPY_DOWN`` — a device row into the host slot claimed when it was queued: the copy
  runs with no lock held, the result is published under the store lock if the row is
  still the one queued;
- ``DEMOTE`` — a memory row encoded on a codec worker (a small window ahead, in queue
  order) and written to disk by the mover alone — the demotions already encoded at the
  head of the window in one transaction (group commit) — then its memory copy dropped;
- ``PURGE`` — stale disk names deleted, after every job queued before it.

Its wait is a condition predicate: work queued, close, or (only when ``changes`` moved
since the last look) a tier above its high watermark with something movable. ``flush``
waits, up to a deadline, until the queue is empty and nothing is over a watermark.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import numpy as np

from kvbank.codec import checksum, frame_info
from kvbank.codec.frame import parse_fast
from kvbank.config import WritePolicy
from kvbank.errors import Busy, CorruptPage, TierError
from kvbank.tiers.base import FrameWrite
from kvbank.tiers.index import DEV, DISK, HOST, MOVING
from kvbank.tiers.store.placement import reclaim
from kvbank.tiers.store.reads import quarantine_host
from kvbank.tiers.store.state import StoreState
from kvbank.tiers.store.types import Job, JobKind

if TYPE_CHECKING:
    from kvbank.tiers.store.dirty import DirtySweep

logger = logging.getLogger("kvbank.tiers.store.store")

WINDOW_PER_WORKER = 2  # encodes in flight per worker: one running, one ready to write
GROUP_COMMIT = 16  # most encoded demotions written in one transaction
Window = collections.deque[tuple[Job, "Future[bytes]"]]  # demotions being encoded, FIFO


def _dirty_sweep(st: StoreState) -> DirtySweep | None:
    expire = st.config.dirty_expire_s
    if not st.has_disk or not expire or st.config.write_policy is not WritePolicy.WRITE_BACK:
        return None
    from kvbank.tiers.store.dirty import DirtySweep  # imports admin, which needs no mover

    return DirtySweep(st, expire)


def default_encode_workers() -> int:
    """Threads that encode demotions (zstd and the plane split release the GIL)."""
    return min(2, os.cpu_count() or 1)


class Mover:
    def __init__(self, st: StoreState, workers: int) -> None:
        self.st = st
        self.disk_lock = st.disk_lock
        self.workers = workers
        self.encoder: ThreadPoolExecutor | None = None
        if st.has_disk:
            self.encoder = ThreadPoolExecutor(workers, thread_name_prefix="kvbank-codec")
        self._seen = -1  # st.changes at the last pressure test that found nothing to do
        self.dirty = _dirty_sweep(st)
        self.thread = threading.Thread(target=self._run, name="kvbank-mover", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # -- planning (caller holds the store lock) ----------------------------------------

    def pressure(self) -> bool:
        st = self.st
        high = st.config.high_watermark
        for bit, pool in st.pools.items():
            if pool.used_bytes - st.queued[bit] > high * pool.budget and st.victims(bit, 1):
                return True
        if not st.has_disk or st.purge_pending:
            return False
        disk = st.disk()
        return disk.used_bytes > high * disk.budget_bytes and bool(st.victims(DISK, 1))

    def _has_work(self) -> bool:
        st = self.st
        if st.jobs or st.closed:
            return True
        if st.changes == self._seen:
            return False
        self._seen = st.changes
        return self.pressure()

    def _plan(self) -> None:
        st = self.st
        low, high = st.config.low_watermark, st.config.high_watermark
        for bit, pool in st.pools.items():
            if pool.used_bytes - st.queued[bit] > high * pool.budget:
                reclaim(st, bit, int(pool.used_bytes - low * pool.budget))
        disk = st.disk() if st.has_disk else None
        if disk is not None and not st.purge_pending and disk.used_bytes > high * disk.budget_bytes:
            names = self.evict_disk(disk.used_bytes - int(low * disk.budget_bytes))
            if names:
                st.purge_pending = True
                st.jobs.append(Job(JobKind.PURGE, names=tuple(names), evict=True))

    def evict_disk(self, frame_bytes: int, *, older_than: int | None = None) -> list[bytes]:
        """Take LRU rows off the disk in the index (the caller deletes their frames);
        ``frame_bytes`` is scaled to raw bytes by the current compression ratio. With
        ``older_than``, stop at the first victim used at or after that stamp."""
        st = self.st
        disk = st.disk()
        ix = st.ix
        n = ix.high
        raw_on_disk = int(ix.size[:n][(ix.where[:n] & DISK) != 0].sum(dtype=np.int64))
        ratio = raw_on_disk / max(1, disk.used_bytes)
        names: list[bytes] = []
        for rid in st.victims(DISK, int(frame_bytes * ratio) + 1):
            if older_than is not None and int(ix.atime[rid]) >= older_than:
                break
            name = ix.names[rid]
            assert name is not None
            names.append(name)
            where = int(ix.where[rid])
            st.counters[DISK].evictions += 1
            st.counters[DISK].victim(ix, rid)
            if where & (DEV | HOST):  # a memory copy stays; only the disk copy goes
                ix.where[rid] = where & ~DISK
            else:
                st.res.forget_row(rid)
        return names

    def make_disk_room(self, frame_len: int) -> None:
        """Evict from disk now so that a ``frame_len`` write fits the budget (the caller
        holds the disk lock). Goes down to the low watermark to amortise the scan."""
        st = self.st
        disk = st.disk()
        over = disk.used_bytes + frame_len - disk.budget_bytes
        if over <= 0:
            return
        band = int(disk.budget_bytes * (st.config.high_watermark - st.config.low_watermark))
        with st.lock:
            names = self.evict_disk(over + band)
        if names:
            self.spill(names)
            disk.delete_many(names)

    def spill(self, names: list[bytes]) -> None:
        """Copy the frames of rows leaving the disk to the next frame store down (the
        remote tier), as stored (no re-encode), before the disk deletes them. A failed
        write is that store's to count and show in health; the disk eviction goes on (the
        caller holds disk_lock)."""
        st = self.st
        if not st.below:
            return
        disk, remote = st.disk(), st.below[0]
        for name in names:
            try:
                frame = disk.read_frame(name)
                if frame is None:
                    continue
                info = frame_info(frame)
                remote.write_frame(name, frame, raw_len=info.raw_len, dtype=info.dtype,
                                   replace=True)
            except CorruptPage:
                continue  # damaged bytes are never spilled; the disk drops them anyway
            except TierError as exc:
                logger.debug("store: remote spill of %s… failed: %s", name.hex()[:16], exc)

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        st = self.st
        window: Window = collections.deque()
        dirty = self.dirty
        while True:
            if dirty is not None and not window and dirty.due():
                dirty.run()  # write-back's bounded dirty age (see .dirty)
            fut: Future[bytes] | None = None
            with st.lock:
                st.cond.wait_for(lambda: bool(window) or self._has_work()
                                 or (dirty is not None and dirty.due()),
                                 timeout=None if dirty is None else dirty.wait_s())
                if st.closed:
                    self._cancel_jobs(window)
                    st.busy = False
                    st.cond.notify_all()
                    return
                if not st.jobs and not window:
                    if dirty is not None and dirty.due():
                        continue  # the sweep runs at the top, with no lock held
                    self._plan()
                    if not st.jobs:
                        # Done at once (clean drops), or pressure without a plan (victims
                        # busy): tell flush, then wait for a change.
                        self._seen = st.changes
                        st.cond.notify_all()
                        continue
                self._fill_window(window)
                ready: list[tuple[Job, Future[bytes]]] = []
                if window:
                    job, fut = window.popleft()
                    # Demotions already encoded behind it share its transaction (one fsync).
                    while window and window[0][1].done() and len(ready) < GROUP_COMMIT - 1:
                        ready.append(window.popleft())
                else:
                    job = st.jobs.popleft()  # a copy or a purge, after every job before it
                st.busy = True
            try:
                if fut is not None:
                    self._finish_demotes([(job, fut), *ready])
                elif job.kind is JobKind.COPY_DOWN:
                    self._copy_down(job)
                else:
                    self.purge(job)
            except TierError as exc:
                logger.warning("store: mover job %s failed: %s", job.kind.value, exc)
                with st.lock:
                    st.note_disk_error(str(exc))
            except BaseException:
                logger.exception("store: mover crashed")  # never silent: health reports it
                with st.lock:
                    st.notes.append("mover crashed; see the log")
                    st.mover_dead = True
                    st.cond.notify_all()
                wait([f for _, f in window])  # their slots stay busy; close() unmaps them
                raise
            finally:
                with st.lock:
                    st.busy = bool(window)  # popped jobs in flight still count as busy
                    st.settled += 1
                    st.notify()

    def _fill_window(self, window: Window) -> None:
        """Start encoding the demotions at the head of the queue (caller holds the lock).
        A copy or purge at the head waits until the demotions before it are written."""
        st = self.st
        encoder = self.encoder  # made only with a disk tier
        depth = WINDOW_PER_WORKER * self.workers
        while encoder is not None and st.jobs \
                and st.jobs[0].kind is JobKind.DEMOTE and len(window) < depth:
            job = st.jobs.popleft()
            dtype = st.ix.dtypes[int(st.ix.dtype[job.rid])]
            pool = st.pools[job.bit]
            window.append((job, encoder.submit(st.copier.encode, st.disk(), pool, job.off,
                                               job.size, dtype)))

    def _cancel_jobs(self, window: Window) -> None:
        st = self.st
        wait([f for _, f in window])  # the encodes read busy slots: let them finish first
        for job, _ in window:
            self._end_move(job, written=False)
        window.clear()
        for job in st.jobs:
            if job.kind is not JobKind.PURGE:
                self._end_move(job, written=False)
        # Purges stay queued: close() runs them, so a deleted row never comes back.
        purges = [job for job in st.jobs if job.kind is JobKind.PURGE]
        st.jobs.clear()
        st.jobs.extend(purges)

    def _still_queued(self, job: Job) -> bool:
        ix, rid = self.st.ix, self.st.ix.ids.get(job.name)
        return (rid == job.rid and bool(int(ix.where[rid]) & job.bit)
                and self.st.res.mem_off(rid, job.bit) == job.off
                and bool(int(ix.flags[rid]) & MOVING))

    def _end_move(self, job: Job, *, written: bool) -> bool:
        """Settle a COPY_DOWN or DEMOTE under the lock; True when the row's copy moved."""
        st = self.st
        ix, res = st.ix, st.res
        st.queued[job.bit] -= job.size
        same = self._still_queued(job)
        res.release(job.bit, job.off)
        if job.kind is JobKind.COPY_DOWN:
            res.release(HOST, job.dst_off)
        rid = job.rid
        if same:
            ix.flags[rid] = int(ix.flags[rid]) & ~MOVING
        moved = same and written
        if job.kind is JobKind.COPY_DOWN:
            # A lock taken since it was queued may be a holder handed the device slot; a
            # pin taken meanwhile keeps the row where it was pinned.
            if (moved and not int(ix.where[rid]) & HOST and job.name not in st.locks
                    and job.name not in st.pins):
                res.free_slot(DEV, job.off)
                ix.set_off(rid, job.dst_off)
                ix.where[rid] = (int(ix.where[rid]) & ~DEV) | HOST
                st.counters[DEV].demoted(HOST, job.size)
            else:
                res.free_slot(HOST, job.dst_off)
                moved = False
        elif moved:
            ix.where[rid] = int(ix.where[rid]) | DISK
            if job.name not in st.locks and job.name not in st.pins:  # taken meanwhile: keep it
                res.drop_copy(rid, job.bit)
                st.counters[job.bit].demoted(DISK, job.size)
        return moved

    def _copy_down(self, job: Job) -> None:
        st = self.st
        assert st.host is not None and st.device is not None  # queued only with both
        try:
            st.copier.between(st.host, job.dst_off, st.device, job.off, job.size, to_host=True)
            view = st.host.view(job.dst_off, job.size)
            try:
                sum_ = checksum(view)  # the host copy's, recorded if the row has none yet
            finally:
                view.release()
        except BaseException:
            with st.lock:
                self._end_move(job, written=False)
            raise
        with st.lock:
            ix = st.ix
            want = ix.get_checksum(job.rid) if ix.ids.get(job.name) == job.rid else None
            ok = want is None or want == sum_
            if self._end_move(job, written=ok) and want is None:
                ix.set_checksum(job.rid, sum_)

    def _finish_demotes(self, batch: list[tuple[Job, Future[bytes]]]) -> None:
        """Write encoded demotions whose rows are still the ones queued, in one
        transaction (group commit), then drop their memory copies."""
        st = self.st
        disk = st.disk()
        frames: list[tuple[Job, bytes]] = []
        changed: list[bytes] = []
        failure: BaseException | None = None
        for job, encoded in batch:
            try:
                frames.append((job, encoded.result()))
            except BaseException as exc:
                with st.lock:
                    self._end_move(job, written=False)
                failure = failure or exc
        with self.disk_lock:
            writes: list[FrameWrite] = []
            todo: list[Job] = []
            with st.lock:
                ix = st.ix
                for job, frame in frames:
                    if not self._still_queued(job):
                        self._end_move(job, written=False)
                        continue
                    want = ix.get_checksum(job.rid)
                    if want is not None and parse_fast(frame)[3] != want:
                        # Bytes changed since commit: never launder them into a frame
                        # with a fresh checksum; the host copy is checked and dropped.
                        self._end_move(job, written=False)
                        changed.append(job.name)
                        continue
                    todo.append(job)
                    writes.append(FrameWrite(job.name, frame, job.size,
                                             ix.dtypes[int(ix.dtype[job.rid])],
                                             ix.parent_name(job.rid)))
            if writes:
                try:
                    self.make_disk_room(sum(len(w.frame) for w in writes))
                    disk.write_frames(writes, replace=True)  # one transaction on LMDB
                except BaseException:
                    with st.lock:
                        for job in todo:
                            self._end_move(job, written=False)
                    raise
                stale: list[bytes] = []
                with st.lock:
                    if st.disk_error is not None:
                        logger.warning("store: disk tier writes again")
                    st.disk_error = None
                    for job in todo:
                        moved = self._end_move(job, written=True)
                        rid = st.ix.ids.get(job.name)
                        if not moved and (rid is None or not int(st.ix.where[rid]) & DISK):
                            stale.append(job.name)  # overwritten or deleted while we wrote
                if stale:
                    disk.delete_many(stale)
        if changed:
            quarantine_host(st, changed)
        if failure is not None:
            raise failure

    def purge(self, job: Job) -> None:
        st = self.st
        if not st.has_disk:
            return
        disk = st.disk()
        with self.disk_lock:
            with st.lock:
                ids, where = st.ix.ids, st.ix.where
                names = [n for n in job.names
                         if (rid := ids.get(n)) is None or not int(where[rid]) & DISK]
            try:
                if names:
                    if job.evict:
                        self.spill(names)
                    disk.delete_many(names)
            finally:
                if job.evict:
                    with st.lock:
                        st.purge_pending = False

    # -- waiting and stopping ----------------------------------------------------------

    def flush(self, deadline: float) -> None:
        """Wait until the mover is idle: no queued job and no tier above its watermark
        with something it can move. ``Busy`` at the deadline."""
        st = self.st

        def idle() -> bool:
            return st.closed or not (st.jobs or st.busy
                                     or (st.disk_error is None and self.pressure()))

        with st.lock:
            st.notify()  # the mover looks again even if nothing changed since its last look
            if not st.cond.wait_for(idle, timeout=max(0.0, deadline - time.monotonic())):
                raise Busy(f"flush: the mover is still busy ({len(st.jobs)} jobs queued, "
                           f"{sum(st.queued.values())} bytes) at the deadline")

    def stop(self, timeout_s: float) -> bool:
        """Join the thread (after close set ``closed``); False if it is still running."""
        self.thread.join(timeout_s)
        return not self.thread.is_alive()
