"""Writes: publish a filled private slot (or a disk-only write) as a row's current copy.

A put copies the caller's bytes into a private slot (claimed and held under the store
lock, filled with no lock held) and publishes it under the lock; a commit publishes a
write lease's reserved slot the same way. Write-through, or a row with no memory room,
also writes the disk: the frame is encoded with no lock held, then written under the
mover's disk lock (lock order: disk lock → store lock → LMDB), and the row is checked
writable again under the store lock before and after, so a lock taken meanwhile wins.
On failure nothing changed, and the slot goes back (a commit's stays reserved).

Every publish records the row's checksum (:func:`kvbank.codec.checksum` of the bytes
published: the caller's for a put, the slot's for a commit, taken with no lock held) in
the index: committed rows are immutable, and a memory read is verified against it
(docs/reliability.md, "Checksums in memory").

A batch (:func:`put_many`) plans every row under one lock, fills and encodes them on the
copy lanes, and writes its disk frames in group commits of up to ``WRITE_CHUNK_BYTES``
of pages each (one transaction, one fsync), the workers encoding the next chunk while one
commits: when it returns every row it stored is published and, with a disk write,
durable; when it raises, a row of it is either fully stored or not at all (see
``docs/tiers.md``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvbank.codec import checksum
from kvbank.config import WritePolicy
from kvbank.errors import InvalidInput, RowLocked, TierError, TierFull, TierUnavailable
from kvbank.tiers.base import Buffer, FrameStore, FrameWrite, as_bytes_view, check_name
from kvbank.tiers.index import DEV, DISK, HOST
from kvbank.tiers.store.copier import Batch, Lanes
from kvbank.tiers.store.mover import Mover
from kvbank.tiers.store.placement import alloc_memory
from kvbank.tiers.store.state import MAX_PAGE, StoreState

logger = logging.getLogger("kvbank.tiers.store.store")

Reserve = tuple[str, int] | None  # a commit's (holder, size): where a failed slot goes back

# Raw bytes per LMDB transaction of a batch's disk writes: big enough that a commit's
# fixed costs (two fdatasyncs) stay small, small enough that a batch of 2 MiB pages has a
# next chunk to encode while one commits.
WRITE_CHUNK_BYTES = 32 << 20


def put(st: StoreState, mover: Mover, name: bytes, data: Buffer, dtype: str,
        parent: bytes | None, deadline: float) -> None:
    check_name(name)
    if parent is not None:
        check_name(parent)
    src = as_bytes_view(data)
    size = src.nbytes
    if size == 0 or size > MAX_PAGE:
        raise InvalidInput(f"data: page size must be in [1, {MAX_PAGE}], got {size}")
    with st.lock:
        st.check_open()
        code = st.dtype_code(dtype)
        st.check_writable(name, size, None)
        bit, off = alloc_memory(st, size, deadline)
        if off is not None:
            st.res.hold(bit, off)  # private until published; held keeps it off victim lists
    try:
        if off is not None:
            st.copier.fill(st.pools[bit], off, src)
        publish(st, mover, name, size, code, parent, bit, off, src, holder=None)
    finally:
        if off is not None:
            with st.lock:
                st.release(bit, off)


@dataclass(slots=True)
class _Row:
    """One row of a batch put, as planned under the store lock."""

    name: bytes
    src: memoryview
    parent: bytes | None
    bit: int = 0
    off: int | None = None
    stored: bool = False
    settled: bool = False  # stored, or its slot already given back
    checksum: int | None = None  # of src, taken on the copy lanes


def put_many(st: StoreState, mover: Mover, lanes: Lanes,
             items: Sequence[tuple[bytes, memoryview, bytes | None]], dtype: str,
             deadline: float) -> list[bool]:
    """Store ``(name, data, parent)`` rows as one batch; per row, True if stored, False if
    a lock holds its name (a lease fills it). Other refusals raise (nothing of the row
    stored)."""
    rows: list[_Row] = []
    for name, data, parent in items:
        check_name(name)
        if parent is not None:
            check_name(parent)
        src = as_bytes_view(data)
        if src.nbytes == 0 or src.nbytes > MAX_PAGE:
            raise InvalidInput(f"data: page size must be in [1, {MAX_PAGE}], got {src.nbytes}")
        rows.append(_Row(name, src, parent))
    planned: list[_Row] = []
    try:
        with st.lock:
            st.check_open()
            code = st.dtype_code(dtype)
            for r in rows:
                try:
                    st.check_writable(r.name, r.src.nbytes, None)
                except RowLocked:
                    continue
                r.bit, r.off = alloc_memory(st, r.src.nbytes, deadline)
                if r.off is not None:
                    st.res.hold(r.bit, r.off)
                planned.append(r)
        lanes.map(lambda r: _fill(st, r), planned)  # and each row's checksum
        through = st.config.write_policy is WritePolicy.WRITE_THROUGH and st.has_disk
        mem = [r for r in planned if r.off is not None and not through]
        with st.lock:
            for r in mem:
                _commit_one(st, r, code, on_disk=False)
        disk_rows = [r for r in planned if r.off is None or through]
        if disk_rows:
            _write_batch(st, mover, lanes, disk_rows, code)
    finally:
        with st.lock:
            for r in planned:
                if r.off is not None:
                    if not r.settled and not st.res.owned(r.bit, r.off):
                        st.res.fail_slot(r.bit, r.off, None, st.closed)
                    st.release(r.bit, r.off)
    return [r.stored for r in rows]


def _fill(st: StoreState, r: _Row) -> None:
    r.checksum = checksum(r.src)
    if r.off is not None:
        st.copier.fill(st.pools[r.bit], r.off, r.src)


def _commit_one(st: StoreState, r: _Row, code: int, *, on_disk: bool) -> None:
    """Publish one planned row (caller holds the store lock); a lock taken meanwhile
    leaves it unstored (``commit_locked`` gave its slot back)."""
    try:
        commit_locked(st, r.name, r.src.nbytes, code, r.parent, r.bit, r.off, None,
                      on_disk=on_disk, reserve=None, checksum=r.checksum)
    except BaseException as exc:
        r.settled = True  # commit_locked gave the slot back
        if isinstance(exc, RowLocked):
            return
        raise
    r.stored = r.settled = True


def _write_batch(st: StoreState, mover: Mover, lanes: Lanes, rows: list[_Row],
                 code: int) -> None:
    """Encode on the lanes and write the frames a chunk per transaction, publishing each
    chunk's rows once it is durable. While one chunk commits (its fsync is disk time, no
    CPU), the workers encode the next, so the disk and the cores work at once."""
    disk = st.disk()  # off is None only when there is a disk tier
    dtype = st.ix.dtypes[code]
    batch = {r.name for r in rows}
    chunks: list[list[_Row]] = [[]]
    size = 0
    for r in rows:
        if chunks[-1] and size + r.src.nbytes > WRITE_CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(r)
        size += r.src.nbytes

    def encode(r: _Row) -> bytes:
        return disk.frame(r.src, dtype)

    try:
        pending: Batch[_Row, bytes] | None = lanes.start(encode, chunks[0])
        for j, chunk in enumerate(chunks):
            assert pending is not None
            frames = pending.join()
            pending = lanes.start(encode, chunks[j + 1]) if j + 1 < len(chunks) else None
            try:
                _write_chunk(st, mover, chunk, frames, code, batch)
            except BaseException:
                if pending is not None:
                    pending.abandon()
                raise
    except BaseException as exc:
        with st.lock:
            if isinstance(exc, TierFull | TierUnavailable) and not st.closed:
                st.note_disk_error(str(exc))
        raise


def _write_chunk(st: StoreState, mover: Mover, rows: list[_Row], frames: list[bytes],
                 code: int, batch: set[bytes]) -> None:
    """Write one chunk's frames in one transaction and publish its rows."""
    disk = st.disk()
    dtype = st.ix.dtypes[code]
    with st.disk_lock:
        with st.lock:
            st.check_open()
            ids, locks = st.ix.ids, st.locks
            todo: list[_Row] = []
            writes: list[FrameWrite] = []
            for r, f in zip(rows, frames, strict=True):
                if locks.locked_by_other(r.name, None):
                    continue  # a lease took the name meanwhile: it fills these bytes
                st.check_writable(r.name, r.src.nbytes, None)
                todo.append(r)
                writes.append(FrameWrite(r.name, f, r.src.nbytes, dtype,
                                         r.parent if r.parent in ids or r.parent in batch
                                         else None))
        mover.make_disk_room(sum(len(w.frame) for w in writes))
        if writes:
            disk.write_frames(writes, replace=True)  # one transaction on LMDB
        orphans: list[bytes] = []
        try:
            with st.lock:
                if st.disk_error is not None:
                    logger.warning("store: disk tier writes again")
                st.disk_error = None
                for r in todo:
                    _commit_one(st, r, code, on_disk=True)
                    if not r.stored and _refused_frame(st, r):
                        orphans.append(r.name)
        except BaseException:
            # Refused after the write (closed meanwhile): a frame the index does not
            # hold must not outlive this call.
            with st.lock:
                for r in todo:
                    rid = st.ix.ids.get(r.name)
                    if not r.stored and (rid is None or not int(st.ix.where[rid]) & DISK):
                        orphans.append(r.name)
            raise
        finally:
            if orphans:
                with contextlib.suppress(TierError):  # closing: nothing more to do
                    disk.delete_many(orphans)


def _refused_frame(st: StoreState, r: _Row) -> bool:
    """After a row's publish was refused (locked or pinned meanwhile; store lock held),
    whether the frame its write left must go. A row the index keeps on disk had its frame
    replaced by that write: with its own bytes it stays; with other bytes the row's memory
    copy is its own again (written back later) and the frame goes, or, where the disk held
    its only copy, the frame is the row now and its checksum follows."""
    rid = st.ix.ids.get(r.name)
    where = 0 if rid is None else int(st.ix.where[rid])
    if rid is None or not where & DISK:
        return True  # no row keeps a frame of this name
    if st.ix.get_checksum(rid) == r.checksum:
        return False
    if where & (DEV | HOST):
        st.ix.where[rid] = where & ~DISK
        return True
    st.ix.set_checksum(rid, r.checksum)
    return False


@dataclass(slots=True)
class Claimed:
    """One row of a write lease's commit, its reserved slot claimed and held."""

    name: bytes
    bit: int
    off: int
    size: int
    code: int
    parent: bytes | None
    holder: str
    src: memoryview | None = None  # the slot's bytes, set once claimed
    checksum: int | None = None  # of the slot's bytes, taken before the claim


def commit_through(st: StoreState, mover: Mover, lanes: Lanes, rows: Sequence[Claimed],
                   published: list[bytes]) -> None:
    """Write-through commit of a write lease's claimed rows, all or nothing: their frames
    are encoded on the lanes with no lock held, written in ONE disk transaction (one
    fsync: a crash leaves every row on disk or none), then published under one hold of
    the store lock. A refusal before the write puts every slot back in its reservation;
    a row locked by another holder meanwhile is refused after the write (its frame is
    deleted) while the others are published."""
    disk = st.disk()  # write-through only runs with a disk tier
    try:
        frames = lanes.map(lambda r: disk.frame(r.src if r.src is not None else memoryview(b""),
                                                st.ix.dtypes[r.code]), rows)
        with st.disk_lock:
            with st.lock:
                st.check_open()
                ids = st.ix.ids
                batch = {r.name for r in rows}
                todo: list[FrameWrite] = []
                for r, f in zip(rows, frames, strict=True):
                    st.check_writable(r.name, r.size, r.holder)
                    parent = r.parent if r.parent in ids or r.parent in batch else None
                    todo.append(FrameWrite(r.name, f, r.size, st.ix.dtypes[r.code], parent))
            mover.make_disk_room(sum(len(f) for f in frames))
            disk.write_frames(todo, replace=True)  # one transaction on LMDB
            _publish_through(st, disk, rows, published)
    except BaseException as exc:
        with st.lock:
            if isinstance(exc, TierFull | TierUnavailable) and not st.closed:
                st.note_disk_error(str(exc))
            for r in rows:
                if r.name not in published and not st.res.owned(r.bit, r.off):
                    st.res.fail_slot(r.bit, r.off, (r.holder, r.size), st.closed)
        raise


def _publish_through(st: StoreState, disk: FrameStore, rows: Sequence[Claimed],
                     published: list[bytes]) -> None:
    """Publish rows whose frames are durable (the caller holds the disk lock)."""
    refused: BaseException | None = None
    orphans: list[bytes] = []
    with st.lock:
        if st.disk_error is not None:
            logger.warning("store: disk tier writes again")
        st.disk_error = None
        for r in rows:
            try:
                commit_locked(st, r.name, r.size, r.code, r.parent, r.bit, r.off, r.holder,
                              on_disk=True, reserve=(r.holder, r.size), checksum=r.checksum)
            except BaseException as exc:  # commit_locked put the slot back
                refused = refused or exc
                rid = st.ix.ids.get(r.name)
                if rid is None or not int(st.ix.where[rid]) & DISK:
                    orphans.append(r.name)  # a frame the index does not hold must go
                continue
            published.append(r.name)
    if orphans:
        with contextlib.suppress(TierError):  # closing: nothing more to do
            disk.delete_many(orphans)
    if refused is not None:
        raise refused


def publish(st: StoreState, mover: Mover, name: bytes, size: int, code: int,
            parent: bytes | None, bit: int, off: int | None, src: memoryview, *,
            holder: str | None, reserve: Reserve = None, sum_: int | None = None) -> None:
    """Make a filled private slot (or a disk-only write, ``off is None``) the row, with
    ``sum_`` (default: the checksum of ``src``, when it holds the row's bytes: a device
    commit under write-back passes none) as its checksum."""
    if sum_ is None and src.nbytes == size:
        sum_ = checksum(src)
    to_disk = off is None or (
        st.config.write_policy is WritePolicy.WRITE_THROUGH and st.has_disk)
    if not to_disk:
        with st.lock:
            commit_locked(st, name, size, code, parent, bit, off, holder, on_disk=False,
                          reserve=reserve, checksum=sum_)
        return
    disk = st.disk()  # off is None only when there is a disk tier
    try:
        frame = disk.frame(src, st.ix.dtypes[code])
        with st.disk_lock:
            with st.lock:
                st.check_open()
                st.check_writable(name, size, holder)
                parent_name = parent if parent is not None and parent in st.ix.ids else None
            mover.make_disk_room(len(frame))
            disk.write_frame(name, frame, raw_len=size, dtype=st.ix.dtypes[code],
                             parent=parent_name, replace=True)
            with st.lock:
                if st.disk_error is not None:
                    logger.warning("store: disk tier writes again")
                st.disk_error = None
                refused: BaseException | None = None
                try:
                    commit_locked(st, name, size, code, parent, bit, off, holder,
                                  on_disk=True, reserve=reserve, checksum=sum_)
                except BaseException as exc:
                    # Refused after the write (locked or closed meanwhile): a frame the
                    # index does not hold must not outlive this call.
                    refused = exc
                    rid = st.ix.ids.get(name)
                    orphan = rid is None or not int(st.ix.where[rid]) & DISK
            if refused is not None:
                if orphan:
                    with contextlib.suppress(TierError):  # closing: nothing more to do
                        disk.delete_many([name])
                raise refused
    except BaseException as exc:
        with st.lock:
            if isinstance(exc, TierFull | TierUnavailable) and not st.closed:
                st.note_disk_error(str(exc))
            if off is not None and not st.res.owned(bit, off):
                st.res.fail_slot(bit, off, reserve, st.closed)
        raise


def commit_locked(st: StoreState, name: bytes, size: int, code: int, parent: bytes | None,
                  bit: int, off: int | None, holder: str | None, *, on_disk: bool,
                  reserve: Reserve, checksum: int | None = None) -> None:
    ix, res = st.ix, st.res
    try:
        st.check_open()
        st.check_writable(name, size, holder)  # again: a lock may have come meanwhile
    except BaseException:
        if off is not None:
            res.fail_slot(bit, off, reserve, st.closed)
        raise
    rid = ix.ids.get(name)
    if rid is None:
        pid = ix.ids.get(parent, -1) if parent is not None and parent != name else -1
        rid = res.add_row(name, size, code, pid)
    else:
        where = int(ix.where[rid])
        for b in (DEV, HOST):
            if where & b:
                res.drop_copy(rid, b)
        if where & DISK and not on_disk:
            st.queue_purge([name])  # the disk copy is stale now
        ix.where[rid] = 0
        ix.flags[rid] = 0  # a demotion in flight sees the new offset and backs off
        ix.dtype[rid] = code
        ix.touch(rid)
    where = DISK if on_disk else 0
    if off is not None:
        ix.set_off(rid, off)
        where |= bit
    ix.where[rid] = where
    ix.set_checksum(rid, checksum)
    st.counters[bit if off is not None else DISK].admitted_bytes += size
    st.puts += 1
    st.notify()
