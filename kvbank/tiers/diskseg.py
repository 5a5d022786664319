"""The disk tier's frame bodies: append-only segment files beside the LMDB index.

Primitives:

- :class:`Segments` — the files ``<data_dir>/segments/<id>.seg`` (id: 8 hex digits,
  increasing). Entries are only ever appended: :meth:`Segments.append` writes a group
  commit's entries with large ``pwritev`` calls at the end of the active segment and (for a
  durable tier) one ``fdatasync``, and answers where each frame landed. An entry is
  :func:`entry_head` (magic, the row name and its meta record) then the frame, so that the
  segments alone can rebuild the index when LMDB's file is damaged
  (:meth:`Segments.entries`; later entries win). The index (LMDB)
  is committed only after that, so a crash leaves at most bytes no index entry names —
  never an entry whose bytes are missing or torn. A failed append (``ENOSPC`` included) is
  cut off again with ``ftruncate`` so a full file system gets its space back.
- :meth:`Segments.read_into` — ``preadv`` of a frame's bytes straight into the caller's
  buffer, with a ``POSIX_FADV_WILLNEED`` readahead hint for a large frame first.
- Live bytes per segment (:meth:`Segments.add_live` / :meth:`Segments.drop_live`): a
  sealed segment whose live bytes reach zero is unlinked at once; one that is mostly dead
  is a candidate for compaction (:meth:`Segments.sparse`), which copies its live frames
  into the active segment and then retires it.
- Readers pin a segment (:meth:`Segments.pin`) while they read: a retired segment's file
  is unlinked at once, but its descriptor is closed only when the last reader lets go, so
  a reader never reads another file through a reused descriptor number.

Files are created ``0600`` with ``O_EXCL | O_NOFOLLOW`` (the directory ``0700``); a name
that already exists, or is a link, is an error, never followed or reused. Every open of
the tier starts a fresh active segment: the older ones are sealed, and their unindexed
tails (a crash between append and index commit) are dead bytes that compaction reclaims.

Lifecycle: ``Segments(directory)`` opens every existing segment read-only → ``append`` /
``read_into`` / ``retire`` from the disk tier (appends serialised by the tier's lock,
reads from any thread) → ``close()``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvbank.tiers.base import OS_ERRORS

logger = logging.getLogger(__name__)

SEGMENT_DIR = "segments"
SEGMENT_BYTES = 256 << 20  # roll over to a new segment past this size (a batch stays whole)
SPARSE_LIVE = 0.5  # a sealed segment with less live than this share is worth compacting
WILLNEED_BYTES = 256 << 10  # frames at least this large get a readahead hint before a read
_IOV_MAX = 512  # buffers per pwritev call (Linux allows 1024)
ENTRY_MAGIC = b"KVS1"
_ENTRY = struct.Struct("<4sH")  # magic, meta record length; then the row name, the record
NAME_BYTES = 54  # kvbank.keys.ROW_NAME_BYTES (tiers may not import keys' anatomy here)
_NAME = re.compile(r"^([0-9a-f]{8})\.seg$")
_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_OPEN = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def segment_file(seg: int) -> str:
    return f"{seg:08x}.seg"


def entry_head(name: bytes, record: bytes) -> bytes:
    """What precedes a frame in its segment: magic, record length, row name, record."""
    return _ENTRY.pack(ENTRY_MAGIC, len(record)) + name + record


@dataclass(slots=True)
class Segment:
    """One open segment file: its descriptor, bytes appended, live frame bytes, readers."""

    id: int
    path: Path
    fd: int
    size: int
    live: int = 0
    readers: int = 0
    retired: bool = False


class Segments:
    """The segment files of one data dir (see the module docstring)."""

    def __init__(self, directory: Path, *, sync: bool = True,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        self.path = directory / SEGMENT_DIR
        self._sync = sync
        self._roll = segment_bytes
        self._lock = threading.Lock()  # a leaf: the table, the counts (never held over I/O)
        self._segs: dict[int, Segment] = {}
        self._active: Segment | None = None
        self._dir_fd: int | None = None
        self._last: tuple[Segment, int] | None = None  # the last append: (segment, start)
        try:
            made = not self.path.exists()
            self.path.mkdir(mode=0o700, exist_ok=True)
            if made and sync:  # the directory's own name, durable before a file in it is
                parent = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
                try:
                    os.fsync(parent)
                finally:
                    os.close(parent)
            if self.path.is_symlink():
                raise OSError(f"{self.path} is a symbolic link")
            self._dir_fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            for entry in sorted(os.listdir(self.path)):
                m = _NAME.match(entry)
                if m is None:
                    continue
                seg = int(m.group(1), 16)
                fd = os.open(self.path / entry, _OPEN)
                self._segs[seg] = Segment(seg, self.path / entry, fd, os.fstat(fd).st_size)
        except OS_ERRORS:
            self.close()
            raise
        self._next = max(self._segs, default=0) + 1

    # -- what is there -----------------------------------------------------------------

    def size_of(self, seg: int) -> int | None:
        """Bytes in segment ``seg`` (``None``: no such segment)."""
        s = self._segs.get(seg)
        return None if s is None else s.size

    def ids(self) -> list[int]:
        return sorted(self._segs)

    def file_bytes(self) -> int:
        """Bytes of every segment file, dead ones included (the footprint on disk)."""
        return sum(s.size for s in self._segs.values())

    def live_of(self, seg: int) -> int:
        s = self._segs.get(seg)
        return 0 if s is None else s.live

    @property
    def active(self) -> int | None:
        return None if self._active is None else self._active.id

    # -- live accounting ---------------------------------------------------------------

    def add_live(self, seg: int, n: int) -> None:
        with self._lock:
            self._segs[seg].live += n

    def drop_live(self, seg: int, n: int) -> bool:
        """Forget ``n`` live bytes of ``seg``; True when the segment should now go (sealed
        and empty: the caller retires it once its index commit is done)."""
        with self._lock:
            s = self._segs.get(seg)
            if s is None:
                return False
            s.live = max(0, s.live - n)
            return s.live == 0 and s is not self._active

    def empty_sealed(self) -> list[int]:
        """Sealed segments no live frame is in (crash tails, fully deleted ones)."""
        return [s.id for s in self._segs.values() if s.live == 0 and s is not self._active]

    def sparse(self) -> list[int]:
        """Sealed segments whose live share is under :data:`SPARSE_LIVE`, emptiest first."""
        got = [s for s in self._segs.values()
               if s is not self._active and s.size and s.live < SPARSE_LIVE * s.size]
        return [s.id for s in sorted(got, key=lambda s: s.live / s.size)]

    # -- writes ------------------------------------------------------------------------

    def append(self, entries: Sequence[tuple[bytes, bytes | memoryview]]) -> list[tuple[int, int]]:
        """Write ``entries`` (head, frame) at the end of the active segment (a new one if
        it is full), durable when this returns if the tier is; (segment, offset of the
        frame) of each. On an error the bytes written are cut off again and the error
        raised (``OSError``)."""
        total = sum(len(h) + len(f) for h, f in entries)
        s = self._active
        if s is None or (s.size and s.size + total > self._roll):
            s = self._new_segment()
        start = s.size
        where: list[tuple[int, int]] = []
        at = start
        bufs: list[bytes | memoryview] = []
        for head, frame in entries:
            where.append((s.id, at + len(head)))
            at += len(head) + len(frame)
            bufs += (head, frame)
        try:
            self._write_all(s.fd, bufs, start)
            if self._sync:
                os.fdatasync(s.fd)
        except OS_ERRORS:
            with contextlib.suppress(*OS_ERRORS):
                os.ftruncate(s.fd, start)
            raise
        with self._lock:
            s.size = at
        self._last = (s, start)
        return where

    def undo_append(self) -> None:
        """Cut the last append off again (its index commit failed: nothing names those
        bytes, and on a full file system the space is wanted back). Best effort: a
        failure leaves them as dead bytes, which compaction reclaims."""
        last, self._last = self._last, None
        if last is None:
            return
        s, start = last
        if s is not self._active or s.retired:
            return
        try:
            os.ftruncate(s.fd, start)
        except OS_ERRORS:
            return
        with self._lock:
            s.size = start

    @staticmethod
    def _write_all(fd: int, frames: Sequence[bytes | memoryview], offset: int) -> None:
        bufs = [memoryview(f).cast("B") for f in frames if len(f)]
        i = 0
        while i < len(bufs):
            chunk = bufs[i : i + _IOV_MAX]
            n = os.pwritev(fd, chunk, offset)
            offset += n
            for b in chunk:  # a short write: go on from the first byte not written
                if n >= len(b):
                    n -= len(b)
                    i += 1
                else:
                    bufs[i] = b[n:]
                    break

    def _new_segment(self) -> Segment:
        seg = self._next
        path = self.path / segment_file(seg)
        fd = os.open(path, _CREATE, 0o600)
        if self._sync and self._dir_fd is not None:
            os.fsync(self._dir_fd)  # the new name is durable before an index entry names it
        s = Segment(seg, path, fd, 0)
        with self._lock:
            self._segs[seg] = s
            self._active = s
            self._next = seg + 1
        logger.debug("disk segments: started %s", path.name)
        return s

    def retire(self, seg: int) -> None:
        """Unlink a segment no index entry names any more; its descriptor closes when the
        last reader lets go."""
        with self._lock:
            s = self._segs.pop(seg, None)
            if s is None:
                return
            if s is self._active:
                self._active = None
            s.retired = True
            close = s.readers == 0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(s.path)
        if close:
            with contextlib.suppress(*OS_ERRORS):
                os.close(s.fd)
        logger.debug("disk segments: retired %s", s.path.name)

    # -- reads -------------------------------------------------------------------------

    def pin(self, seg: int) -> Segment | None:
        """The segment, held open for a read (``None``: it was retired); :meth:`unpin`."""
        with self._lock:
            s = self._segs.get(seg)
            if s is not None:
                s.readers += 1
            return s

    def unpin(self, s: Segment) -> None:
        with self._lock:
            s.readers -= 1
            close = s.retired and s.readers == 0
        if close:
            with contextlib.suppress(*OS_ERRORS):
                os.close(s.fd)

    def read_into(self, s: Segment, offset: int, bufs: Sequence[memoryview]) -> int:
        """``preadv`` from a pinned segment into ``bufs`` (in order); the bytes read. A
        large read is announced first (``POSIX_FADV_WILLNEED``): the kernel then reads it
        in one request instead of its default readahead window at a time."""
        want = sum(len(b) for b in bufs)
        if want >= WILLNEED_BYTES and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(s.fd, offset, want, os.POSIX_FADV_WILLNEED)
        got = 0
        views = list(bufs)
        while views:
            n = os.preadv(s.fd, views, offset + got)
            if n == 0:
                break  # past the end: the caller's length check reports it
            got += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
        return got

    def entries(self, seg: int, frame_len: Callable[[bytes, bytes], int | None], *,
                start: int = 0) -> Iterator[tuple[bytes, bytes, int, int]]:
        """(row name, meta record, frame offset, frame length) of each entry of a segment
        from offset ``start`` (where an entry begins) on, in order, up to the first that
        is not whole (a torn tail, or a record that ``frame_len(name, record)`` refuses
        with ``None``)."""
        s = self.pin(seg)
        if s is None:
            return
        try:
            at = start
            while at + _ENTRY.size + NAME_BYTES <= s.size:
                head = os.pread(s.fd, _ENTRY.size + NAME_BYTES, at)
                magic, n = _ENTRY.unpack_from(head)
                start = at + _ENTRY.size + NAME_BYTES + n
                if magic != ENTRY_MAGIC or start > s.size:
                    return
                name = head[_ENTRY.size :]
                record = os.pread(s.fd, n, at + _ENTRY.size + NAME_BYTES)
                length = frame_len(name, record)
                if length is None or start + length > s.size:
                    return
                yield name, record, start, length
                at = start + length
        finally:
            self.unpin(s)

    def close(self) -> None:
        with self._lock:
            segs, self._segs, self._active = list(self._segs.values()), {}, None
        for s in segs:
            with contextlib.suppress(*OS_ERRORS):
                os.close(s.fd)
        if self._dir_fd is not None:
            with contextlib.suppress(*OS_ERRORS):
                os.close(self._dir_fd)
            self._dir_fd = None
