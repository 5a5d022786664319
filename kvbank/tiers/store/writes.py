"""Writes: publish a filled private slot (or a disk-only write) as a row's current copy.

A put copies the caller's bytes into a private slot (claimed and held under the store
lock, filled with no lock held) and publishes it under the lock; a commit publishes a
write lease's reserved slot the same way. Write-through, or a row with no memory room,
also writes the disk: the frame is encoded with no lock held, then written under the
mover's disk lock (lock order: disk lock → store lock → LMDB), and the row is checked
writable again under the store lock before and after, so a lock taken meanwhile wins.
On failure nothing changed, and the slot goes back (a commit's stays reserved).
"""

from __future__ import annotations

import contextlib
import logging

from kvbank.config import WritePolicy
from kvbank.errors import InvalidInput, TierError, TierFull, TierUnavailable
from kvbank.tiers.base import Buffer, as_bytes_view, check_name
from kvbank.tiers.index import DEV, DISK, HOST
from kvbank.tiers.store.mover import Mover
from kvbank.tiers.store.placement import alloc_memory
from kvbank.tiers.store.state import MAX_PAGE, StoreState

logger = logging.getLogger("kvbank.tiers.store")

Reserve = tuple[str, int] | None  # a commit's (holder, size): where a failed slot goes back


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


def publish(st: StoreState, mover: Mover, name: bytes, size: int, code: int,
            parent: bytes | None, bit: int, off: int | None, src: memoryview, *,
            holder: str | None, reserve: Reserve = None) -> None:
    """Make a filled private slot (or a disk-only write, ``off is None``) the row."""
    to_disk = off is None or (
        st.config.write_policy is WritePolicy.WRITE_THROUGH and st.disk is not None)
    if not to_disk:
        with st.lock:
            commit_locked(st, name, size, code, parent, bit, off, holder, on_disk=False,
                          reserve=reserve)
        return
    disk = st.disk
    assert disk is not None  # off is None only when there is a disk tier
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
                                  on_disk=True, reserve=reserve)
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
                  reserve: Reserve) -> None:
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
    st.puts += 1
    st.notify()
