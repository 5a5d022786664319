"""The disk tier's files before LMDB touches them: the data-dir lock, the size check, salvage.

Primitives:

- :class:`DirLock` — an exclusive ``flock`` on ``<data_dir>/kvbank.lock`` holding the
  owner's pid. Two banks on one data dir would each enforce the budget over their own
  rows only, so the second opener gets :class:`~kvbank.errors.TierUnavailable` naming the
  holder's pid. The kernel drops the lock when the holder dies (``kill -9`` included), so
  a stale lock file never blocks a restart.
- :func:`check_file` — reads LMDB's two meta pages with plain file reads (no mapping) and
  compares the newest valid one's last page number × page size with ``data.mdb``'s size.
  LMDB maps the file and reads pages past its end as SIGBUS, killing the process; a file
  shorter than its meta says, a 0-byte file, or one with no valid meta page is
  :class:`~kvbank.errors.TierUnavailable` naming the file and what was found, before any
  mapping exists.
- :func:`frame_spans` — where each row's frame lies in a closed data dir's files (its
  segment file, or its one copy in ``data.mdb`` for a row of the older layout): what the
  reliability bench and the tests damage to play bit rot.
- :func:`salvage` — the operator's way back from a damaged environment
  (``BankConfig.disk_salvage``): the old directory is renamed aside (kept, never wiped),
  every row that can still be read from it — a checksummed frame that decodes, with a
  meta record that agrees — is copied into a fresh environment, and a
  :class:`SalvageReport` says how many rows were copied and dropped and why.

Lifecycle: the disk tier takes the lock, checks the file, and (when salvage is asked for
and the check or the open failed) salvages, then opens LMDB; ``DirLock.release()`` at close.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from kvbank import progress
from kvbank.errors import CorruptPage, TierUnavailable
from kvbank.tiers.base import OS_ERRORS
from kvbank.tiers.datadir import FILE_MODE, open_private, private_dir
from kvbank.tiers.diskmeta import unpack_record
from kvbank.tiers.diskseg import SEGMENT_DIR, segment_file

logger = logging.getLogger(__name__)

LOCK_FILE = "kvbank.lock"
DATA_FILE = "data.mdb"
_MAGIC = 0xBEEFC0DE
# MDB_meta inside a meta page, after the 16-byte page header: magic, version, address,
# map size, two 48-byte MDB_db records (the first one's md_pad is the page size), last
# page number, transaction id.
_PAGE_HEADER = 16
_META = struct.Struct("<IIQQ48s48sQQ")
_MIN_PAGE = 512


@dataclass(frozen=True, slots=True)
class FileCheck:
    """What the meta pages of ``data.mdb`` say: page size, last page, needed bytes."""

    path: Path
    size: int
    page_size: int
    last_page: int

    @property
    def needed(self) -> int:
        return (self.last_page + 1) * self.page_size


@dataclass(frozen=True, slots=True)
class SalvageReport:
    """What a salvage found: the rows copied, those dropped, where the old files are."""

    reason: str
    copied: int
    dropped: int
    kept_at: Path
    first_error: str

    def summary(self) -> str:
        # Rows beneath a page that cannot be read are not even counted: "at least".
        return (f"disk: salvaged after {self.reason}: {self.copied} rows copied, at least "
                f"{self.dropped} dropped (first problem: {self.first_error or 'none'}); "
                f"the damaged files are kept at {self.kept_at}")


class DirLock:
    """An exclusive lock on a data dir (``<data_dir>/kvbank.lock``, outside the LMDB
    directory so that a salvage can rename that aside), held by one open disk tier."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_FILE
        try:
            self._fd: int | None = open_private(self.path, os.O_RDWR | os.O_CREAT)
        except OS_ERRORS as exc:
            raise TierUnavailable(f"disk tier: cannot create the lock {self.path}: {exc}") from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OS_ERRORS as exc:
            holder = _read_pid(self._fd)
            os.close(self._fd)
            self._fd = None
            raise TierUnavailable(
                f"data_dir: {directory} is in use by another bank (pid {holder}, "
                f"lock {self.path}); one data dir serves one bank", field="data_dir") from exc
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        except OS_ERRORS as exc:
            self.release()
            raise TierUnavailable(f"disk tier: cannot write the lock {self.path}: {exc}") from exc

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: removing it would race a new opener."""
        if self._fd is not None:
            with contextlib.suppress(*OS_ERRORS):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            with contextlib.suppress(*OS_ERRORS):  # closing drops the lock in any case
                os.close(self._fd)
            self._fd = None


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OS_ERRORS:
        return "unknown"
    return text if text.isdigit() else "unknown"


def check_file(directory: Path) -> FileCheck | None:
    """``None`` for a new environment (no ``data.mdb``); the meta pages' figures when the
    file holds every page they name; ``TierUnavailable`` naming the file otherwise."""
    path = directory / DATA_FILE
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(2 * 65536 + _PAGE_HEADER + _META.size)
    except FileNotFoundError:
        return None
    except OS_ERRORS as exc:
        raise TierUnavailable(f"disk tier: cannot read {path}: {exc}") from exc
    if size == 0:
        raise TierUnavailable(f"disk tier: {path} is empty (0 bytes): the rows it held are "
                              "lost; set disk_salvage to start afresh (the file is kept)")
    best: tuple[int, int, int] | None = None  # txnid, page size, last page
    first = _meta_at(head, 0)
    if first is not None:
        metas = [first]
        second = _meta_at(head, first[1])
        if second is not None and second[1] == first[1]:
            metas.append(second)
        best = max(metas)
    if best is None:
        raise TierUnavailable(f"disk tier: {path} ({size} bytes) has no valid LMDB meta "
                              "page; set disk_salvage to start afresh (the file is kept)")
    _, page_size, last_page = best
    found = FileCheck(path, size, page_size, last_page)
    if size < found.needed:
        raise TierUnavailable(
            f"disk tier: {path} is truncated: {size} bytes, but its meta page names page "
            f"{last_page} of {page_size} bytes ({found.needed} bytes); set disk_salvage to "
            "copy the rows that can be read into a fresh environment")
    return found


def _meta_at(head: bytes, offset: int) -> tuple[int, int, int] | None:
    """(txnid, page size, last page) of the meta page at ``offset``, or None if invalid."""
    at = offset + _PAGE_HEADER
    if len(head) < at + _META.size:
        return None
    magic, _version, _addr, _mapsize, free_db, _main_db, last_pg, txnid = \
        _META.unpack_from(head, at)
    (page_size,) = struct.unpack_from("<I", free_db, 0)
    if magic != _MAGIC or page_size < _MIN_PAGE or page_size & (page_size - 1):
        return None
    if offset not in (0, page_size):
        return None
    return txnid, page_size, last_pg


@dataclass(frozen=True, slots=True)
class Span:
    """A frame's bytes: the file, the offset of its first byte, its length."""

    path: Path
    offset: int
    length: int


def frame_spans(data_dir: Path) -> dict[bytes, Span]:
    """Where each row's frame in the files of a closed data dir (rows whose frame cannot be
    placed — an older-layout value with no unique copy in ``data.mdb`` — left out)."""
    env_dir = data_dir / "lmdb"
    env = lmdb.open(str(env_dir), readonly=True, lock=False, max_dbs=2, subdir=True)
    spans: dict[bytes, Span] = {}
    legacy: list[tuple[bytes, bytes]] = []
    try:
        meta = env.open_db(b"meta", create=False)
        frames = env.open_db(b"frames", create=False)
        with env.begin() as txn:
            for key, value in txn.cursor(db=meta):
                name = bytes(key)
                row, where = unpack_record(name, value)
                if where is not None:
                    seg = data_dir / SEGMENT_DIR / segment_file(where.seg)
                    spans[name] = Span(seg, where.offset, row.frame_len)
            legacy = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=frames)]
    finally:
        env.close()
    if legacy:
        data = (env_dir / "data.mdb").read_bytes()
        for name, value in legacy:
            at = data.find(value)
            if at >= 0 and data.find(value, at + 1) < 0:
                spans[name] = Span(env_dir / "data.mdb", at, len(value))
    return spans


# -- salvage -----------------------------------------------------------------------------

# (name, frame, meta) -> (the meta record to keep, the frame to keep in ``frames`` or
# None for a row whose frame lies in a segment, which a salvage leaves where it is).
CheckRow = Callable[[bytes, "bytes | None", "bytes | None"], "tuple[bytes, bytes | None]"]
Found = tuple[bytes, "bytes | None", "bytes | None", str]  # name, frame, meta, why not
_BATCH = 256  # rows per salvage transaction
# A salvage reads old files and writes a new environment: the OS table and LMDB's.
_SALVAGE_ERRORS: tuple[type[Exception], ...] = (*OS_ERRORS, lmdb.Error)


def salvage(directory: Path, reason: str, check_row: CheckRow, *, map_size: int,
            walk_meta: bool = True) -> SalvageReport:
    """Rename ``directory`` aside, recreate it empty, and copy into a fresh environment
    there every row of the old one that ``check_row(name, frame, meta)`` accepts (it
    returns the meta record to write, or raises :class:`CorruptPage` to drop the row). The
    old files are kept; the caller holds
    the data dir's lock. ``walk_meta=False`` reads only the ``frames`` database (each
    frame checks itself; its record is rebuilt from its header): the disk tier asks for
    that when segment files hold the rows' entries, because LMDB aborts the process on
    some damaged B-tree pages, and the records are then rebuilt from the segments."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    kept = directory.with_name(f"{directory.name}.damaged-{stamp}-{os.getpid()}")
    try:
        directory.rename(kept)
        private_dir(directory)
        src = _readable_copy(kept)
        env = lmdb.open(str(directory), map_size=map_size, subdir=True, max_dbs=2, mode=FILE_MODE)
    except _SALVAGE_ERRORS as exc:
        raise TierUnavailable(f"disk tier: salvage of {directory}: {exc}") from exc
    copied = dropped = 0
    first = ""
    entries = [0]
    shown = progress.bar(None, f"salvaging {directory}", unit="row")
    try:
        frames_db, meta_db = env.open_db(b"frames"), env.open_db(b"meta")
        batch: list[tuple[bytes, bytes | None, bytes]] = []
        for name, frame, meta, error in _rows(src, entries, walk_meta):
            if shown.total is None and entries[0]:
                shown.total = entries[0]  # the old frame count, read as the walk starts
            shown.update(1)
            if not error:
                try:
                    meta, keep = check_row(name, frame, meta)
                    batch.append((name, keep, meta))
                    copied += 1
                    if len(batch) >= _BATCH:
                        _put(env, frames_db, meta_db, batch)
                    continue
                except CorruptPage as exc:
                    error = str(exc)
            dropped += 1 if name else 0
            first = first or error
        _put(env, frames_db, meta_db, batch)
        env.sync(True)
    except _SALVAGE_ERRORS as exc:  # the old files are read as the walk goes
        raise TierUnavailable(f"disk tier: salvage into {directory}: {exc}") from exc
    finally:
        shown.close()
        env.close()
        if src != kept:
            shutil.rmtree(src, ignore_errors=True)
    # Rows beneath a damaged page are never seen: the old frame count says how many.
    dropped = max(dropped, entries[0] - copied)
    report = SalvageReport(reason, copied, dropped, kept, first)
    logger.warning("%s", report.summary())
    return report


def _put(env: lmdb.Environment, frames_db: Any, meta_db: Any,
         batch: list[tuple[bytes, bytes | None, bytes]]) -> None:
    with env.begin(write=True) as txn:
        for name, frame, meta in batch:
            if frame is not None:
                txn.put(name, frame, db=frames_db)
            txn.put(name, meta, db=meta_db)
    batch.clear()


def _readable_copy(kept: Path) -> Path:
    """A directory LMDB can map without SIGBUS: ``kept`` itself, or (for a truncated
    file) a copy padded with zero pages, which LMDB reports as damaged instead."""
    try:
        check_file(kept)
        return kept
    except TierUnavailable:
        pass
    padded = kept.with_name(kept.name + ".padded")
    padded.mkdir()
    data = kept / DATA_FILE
    size = data.stat().st_size if data.exists() else 0
    if size:
        shutil.copyfile(data, padded / DATA_FILE)
        with open(data, "rb") as f:
            head = f.read(2 * 65536 + _PAGE_HEADER + _META.size)
        first = _meta_at(head, 0)
        if first is not None:
            second = _meta_at(head, first[1])
            _, page_size, last_page = max([first] + ([second] if second else []))
            if (last_page + 1) * page_size > size:
                os.truncate(padded / DATA_FILE, (last_page + 1) * page_size)
    return padded


def _rows(src: Path, entries: list[int], walk_meta: bool) -> Iterator[Found]:
    """Each row reachable through ``src``'s ``meta`` database; a damaged B-tree page
    ends a walk, which resumes past it at coarser and coarser successors of the last key
    read. ``entries[0]`` is set to the old frame count."""
    data = src / DATA_FILE
    if not data.exists() or _meta_at(data.read_bytes()[: 2 * 65536 + 200], 0) is None:
        return
    try:
        env = lmdb.open(str(src), readonly=True, lock=False, max_dbs=2, subdir=True,
                        map_size=max(data.stat().st_size, 1 << 20))
    except lmdb.Error as exc:
        yield b"", None, None, f"cannot open the old environment: {exc}"
        return
    try:
        try:
            frames_db = env.open_db(b"frames", create=False)
            meta_db = env.open_db(b"meta", create=False)
            with env.begin() as txn:
                entries[0] = int(txn.stat(frames_db)["entries"])
        except lmdb.Error as exc:
            yield b"", None, None, f"cannot open its databases: {exc}"
            return
        seen: set[bytes] = set()
        # Meta first (its records carry parents and write clocks), then frames whose
        # meta record is gone: a frame checks itself, so it alone can be trusted.
        walks = ((meta_db, frames_db, False), (frames_db, meta_db, True)) if walk_meta else (
            (frames_db, None, True),)
        for walked, other, frames_first in walks:
            for found in _walk_all(env, walked, other, frames_first):
                if found[0] not in seen:
                    seen.add(found[0])
                    yield found
    finally:
        env.close()


def _walk_all(env: lmdb.Environment, walked: Any, other: Any,
              frames_first: bool) -> Iterator[Found]:
    """Every entry of ``walked`` that can be reached, with ``other``'s value for its key."""
    start: bytes | None = None
    probes: list[bytes] | None = None
    while True:
        got, last, error = _walk(env, walked, other, start, frames_first)
        yield from got
        if last is not None:
            probes = None  # progress: probe afresh past the new last key
        if error is None:
            return
        yield b"", None, None, error
        if probes is None:
            probes = _successors(last if last is not None else start or b"")
        if not probes:
            return
        start = probes.pop()


def _walk(env: lmdb.Environment, walked: Any, other: Any, start: bytes | None,
          frames_first: bool) -> tuple[list[Found], bytes | None, str | None]:
    """Entries from ``start`` (inclusive) on: those read, the last key, the error (None at
    the end of the database)."""
    out: list[Found] = []
    last: bytes | None = None
    try:
        with env.begin() as txn:
            cur = txn.cursor(db=walked)
            ok = cur.set_range(start) if start is not None else cur.first()
            while ok:
                key = bytes(cur.key())
                value = bytes(cur.value())
                last = key
                try:
                    got = None if other is None else txn.get(key, db=other)
                    twin = None if got is None else bytes(got)
                except lmdb.Error:
                    twin = None  # the row may still be whole from the other side
                out.append((key, value, twin, "") if frames_first else (key, twin, value, ""))
                ok = cur.next()
    except lmdb.Error as exc:
        return out, last, f"{type(exc).__name__}: {exc}"
    return out, last, None


def _successors(key: bytes) -> list[bytes]:
    """Keys just past each prefix of ``key``, coarsest first (the finest is popped first)."""
    return [key[:i] + bytes([key[i] + 1]) for i in range(len(key)) if key[i] < 0xFF]
