"""The disk tier: one LMDB environment per node, rows stored as self-checking codec frames.

Primitives:

- Two named databases in ``<data_dir>/lmdb``: ``frames`` (row name → codec frame, see
  :mod:`kvbank.codec`) and ``meta`` (row name → raw length, frame length, a logical
  write clock, dtype, parent row name). Both are written in **one transaction**, so a
  crash leaves a row either whole in both or absent from both; with ``sync=True`` a
  commit is on disk before :meth:`DiskTier.write_frame` returns.
- :meth:`DiskTier.frame` encodes a page (callers do it outside their locks; it is the
  expensive part), :meth:`DiskTier.write_frame` commits it, :meth:`DiskTier.read_into`
  decodes straight from LMDB's mapped page (``buffers=True``) into the caller's buffer.
- A frame that fails its checks raises :class:`~kvbank.errors.CorruptPage` from
  ``read_into``; :meth:`DiskTier.get_into` (the Tier method) and the store then delete the
  row, count it in :attr:`DiskTier.corrupt_rows` and report a miss. Wrong bytes are never
  returned.
- Each ``meta`` record (packed and checked in :mod:`kvbank.tiers.diskmeta`) carries an
  xxh3-64 of the row name and the record, and is checked like a frame: on every read
  (and the frame header's raw length must equal the record's),
  and at open, where every record is also bounded (sizes, dtype) and compared with its
  frame's length and header. A row that fails is deleted and counted in ``corrupt_rows``;
  the open never fails for it, and a read answers a miss.
- :meth:`DiskTier.scan` lists the committed rows that passed those checks at open, which
  is how the store rebuilds its index on restart: sizes exact, LRU order by write clock.

Settings: ``writemap=False``, ``readahead=True`` (cold reads of large values are 25x
slower without it), one transaction per value or per group commit. ``writemap=True`` was
measured through ``Bank.put`` with group commits: it saves LMDB's per-value allocation and
copy, yet the durable put was no faster and the disk fetch a little slower, and it would
make a write on a full file system a SIGBUS (LMDB grows the file to the map size as a
sparse file) instead of ``TierFull``. The map size is a multiple of the budget so that LMDB's map never
fills before the budget does; the budget itself is exact and enforced here (``TierFull``),
and the store evicts before it is reached. ``MapFullError`` and a full file system
(``ENOSPC``) still map to ``TierFull``; any other LMDB error to ``TierUnavailable``.

Lifecycle: ``DiskTier(path, budget)`` opens (or creates) the environment, checks every
row's meta record against its frame (dropping and counting those that fail) and sums the
frame bytes → reads from any thread, writes serialised by an internal lock →
``close()`` (idempotent).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import lmdb

from kvbank.codec import DEFAULT_LEVEL, decode_into, encode
from kvbank.errors import (
    CorruptPage,
    InvalidInput,
    PageSizeMismatch,
    TierFull,
    TierUnavailable,
)
from kvbank.keys import ROW_NAME_BYTES
from kvbank.tiers.base import (
    Buffer,
    FrameStoreBase,
    FrameWrite,
    Tier,
    TierKind,
    as_bytes_view,
    as_out_view,
    check_name,
)
from kvbank.tiers.diskfile import DirLock, SalvageReport, check_file
from kvbank.tiers.diskfile import salvage as run_salvage
from kvbank.tiers.diskmeta import (
    DiskRow,
    check_dtype,
    check_row,
    check_salvaged,
    delete_exact,
    pack_meta,
    unpack_meta,
)
from kvbank.tiers.lockorder import Rank, make_lock

__all__ = ["DEFAULT_LEVEL", "LMDB_ERRORS", "DiskRow", "DiskTier", "FrameWrite", "check_dtype"]

logger = logging.getLogger(__name__)

MAP_FACTOR = 4  # map size = budget x 4 (+ 1 GiB): freed overflow pages fragment
MAP_SLACK = 1 << 30
FULL_FREE_BYTES = 1 << 20  # less free than this after a short write: the disk is full

# The one table of what LMDB (and the file system under it) raises here: every call into
# lmdb catches exactly these and maps them through DiskTier._mapped (TierFull for a full
# map or file system, TierUnavailable otherwise), so only KvbankError leaves this module.
LMDB_ERRORS: tuple[type[Exception], ...] = (lmdb.Error, OSError)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB"


def _free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class DiskTier(Tier, FrameStoreBase):
    """Rows as codec frames in LMDB; durable commits; exact byte budget. A
    :class:`~kvbank.tiers.base.FrameStore` (for the store) and a :class:`~kvbank.tiers.base.Tier`
    (for the conformance suite)."""

    kind = TierKind.DISK

    def __init__(
        self,
        path: Path | str,
        budget: int,
        *,
        sync: bool = True,
        level: int = DEFAULT_LEVEL,
        map_size: int | None = None,
        salvage: bool = False,
    ) -> None:
        self.path = Path(path) / "lmdb"
        self._budget = budget
        self._level = level
        self._lock = make_lock(Rank.DISK_TIER, "DiskTier._lock")  # one writer; the counters
        self._closed = False
        self.corrupt_rows = 0
        self.salvaged: SalvageReport | None = None  # what a salvage at open found
        size = map_size or budget * MAP_FACTOR + MAP_SLACK
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierUnavailable(f"disk tier: cannot create {self.path}: {exc}") from exc
        self._dirlock = DirLock(Path(path))
        try:
            try:
                # Before LMDB maps the file: a truncated one would be SIGBUS on first touch.
                check_file(self.path)
                self._open_env(size, sync)
                rows, bad, self._used = self._scan_checked()
            except TierUnavailable as exc:
                if not salvage:
                    raise
                if hasattr(self, "_env"):
                    self._env.close()
                self.salvaged = run_salvage(self.path, str(exc), check_salvaged, map_size=size)
                self._open_env(size, sync)
                rows, bad, self._used = self._scan_checked()
        except BaseException:
            if hasattr(self, "_env"):
                self._env.close()
            self._dirlock.release()
            raise
        self.seq = max((r.seq for r in rows), default=0)  # the highest write clock on disk
        self._opened: list[DiskRow] | None = rows  # what scan() answers until a write
        if bad:  # the row cannot be trusted: drop it, never fail the open for it
            self._drop_bad(bad)
        logger.debug("disk tier %s: opened, %d bytes in rows", self.path, self._used)
        room = _free_bytes(self.path) + self._used
        if budget > room:  # the file system fills before the budget: say so at open
            logger.warning("disk tier %s: disk_bytes %s is more than the file system can hold "
                           "(%s free + %s in rows): the file system fills before the budget does",
                           self.path, _gib(budget), _gib(room - self._used), _gib(self._used))

    def _open_env(self, map_size: int, sync: bool) -> None:
        try:
            self._env = lmdb.open(str(self.path), map_size=map_size, subdir=True, max_dbs=2,
                                  sync=sync, metasync=sync, readahead=True, writemap=False,
                                  lock=True, max_readers=254)
            self._frames = self._env.open_db(b"frames")
            self._meta = self._env.open_db(b"meta")
        except (lmdb.Error, OSError, OverflowError) as exc:
            # Most often the map (budget x MAP_FACTOR + slack) is more address space than
            # the process may have: say which setting sized it.
            raise TierUnavailable(f"disk tier: cannot open {self.path} with a {_gib(map_size)} map "
                                  f"(disk_bytes {_gib(self._budget)} x {MAP_FACTOR} + slack): {exc}; "
                                  "a smaller disk_bytes maps less", field="disk_bytes") from exc

    # -- capabilities ------------------------------------------------------------------

    @property
    def persistent(self) -> bool:
        return True

    @property
    def in_place(self) -> bool:
        return False

    @property
    def compressed(self) -> bool:
        return True

    @property
    def used_bytes(self) -> int:
        """Frame bytes of the committed rows."""
        return self._used

    @property
    def budget_bytes(self) -> int:
        return self._budget

    # -- errors ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"disk tier: {self.path} is closed")

    def _mapped(self, what: str, exc: BaseException) -> Exception:
        if isinstance(exc, lmdb.MapFullError):
            return TierFull(f"disk tier: {what}: the LMDB map is full: {exc}")
        full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or (
            "no space left" in str(exc).lower())
        if not full and isinstance(exc, lmdb.Error) and "input/output error" in str(exc).lower():
            # LMDB reports a short write as EIO, and a write that fills the file system
            # is a short one: the free space tells a full disk from a failing one.
            full = _free_bytes(self.path) < FULL_FREE_BYTES
        if full:
            return TierFull(f"disk tier: {what}: the file system is full: {exc}")
        return TierUnavailable(f"disk tier: {what}: {exc}")

    # -- the store's primitives --------------------------------------------------------

    def frame(self, data: Buffer, dtype: str) -> bytes:
        """Encode page bytes into one frame (thread-safe, no lock taken)."""
        return encode(data, dtype, level=self._level)

    def write_frame(
        self,
        name: bytes,
        frame: bytes,
        *,
        raw_len: int,
        dtype: str,
        parent: bytes | None = None,
        seq: int | None = None,
        replace: bool = False,
    ) -> None:
        """Commit a frame and its metadata in one (durable) transaction.

        ``replace=True`` overwrites a row of another size under the same name: the store
        uses it because its index, not the disk, says which copy is current (a frame it
        evicted may still wait for its purge)."""
        self.write_frames([FrameWrite(name, frame, raw_len, dtype, parent)], seq=seq,
                          replace=replace)

    def write_frames(self, rows: Sequence[FrameWrite], *, seq: int | None = None,
                     replace: bool = False) -> None:
        """Commit several frames in ONE transaction (group commit: one fsync for the
        batch). All of them are durable when this returns, or none was written."""
        for r in rows:
            check_name(r.name)
        with self._lock:
            self._check_open()
            first = self.seq + 1 if seq is None else seq
            bad_old: list[CorruptPage] = []
            grow = 0
            try:
                with self._env.begin(write=True, buffers=True) as txn:
                    for i, r in enumerate(rows):
                        meta = pack_meta(r.name, r.raw_len, len(r.frame), first + i, r.dtype,
                                          r.parent)
                        old = txn.get(r.name, db=self._meta)
                        if old is not None:
                            try:
                                prev = unpack_meta(r.name, old)
                            except CorruptPage as exc:
                                bad_old.append(exc)  # replaced below, counted once committed
                            else:
                                if prev.raw_len != r.raw_len and not replace:
                                    raise PageSizeMismatch(
                                        f"data: {r.raw_len} bytes, but row {r.name.hex()[:16]}… "
                                        f"holds {prev.raw_len}")
                        old_frame = txn.get(r.name, db=self._frames)
                        change = len(r.frame) - (0 if old_frame is None else len(old_frame))
                        if self._used + grow + change > self._budget:
                            raise TierFull(f"disk tier: a {len(r.frame)}-byte frame exceeds the "
                                           f"budget (used {self._used + grow} of {self._budget})")
                        txn.put(r.name, r.frame, db=self._frames)
                        txn.put(r.name, meta, db=self._meta)
                        grow += change
            except LMDB_ERRORS as exc:
                what = rows[0].name.hex()[:16] + "…" + (f" and {len(rows) - 1} more" if len(rows) > 1 else "")
                raise self._mapped(f"writing {what}", exc) from exc
            self._used += grow
            self.seq = max(self.seq, first + len(rows) - 1)
            self._opened = None
            self.corrupt_rows += len(bad_old)
        for bad in bad_old:
            logger.warning("disk tier: replaced a row whose metadata failed its checks: %s", bad)

    def read_into(self, name: bytes, out: memoryview | bytearray, *,
                  expect: int | None = None) -> int | None:
        """Decode the row into ``out``; ``None`` if absent (or, with ``expect``, if the
        row holds another number of bytes: it is not the row the caller looked up);
        ``CorruptPage`` if its frame or meta record fails a check or they disagree (the
        caller drops it)."""
        self._check_open()
        try:
            with self._env.begin(buffers=True) as txn:
                buf = txn.get(name, db=self._frames)
                rec = txn.get(name, db=self._meta)
                if buf is None and rec is None:
                    return None
                if rec is None:
                    raise CorruptPage(f"row {name.hex()[:16]}…: frame has no meta record")
                row = unpack_meta(name, rec)
                check_row(row, buf)  # the header's raw length is the record's
                assert buf is not None  # _check_row raised otherwise
                if expect is not None and row.raw_len != expect:
                    return None
                # The buffer is LMDB's mapped page, valid only inside this transaction:
                # decode straight from it into the caller's memory, no copy in between.
                return decode_into(buf, out)
        except LMDB_ERRORS as exc:
            raise TierUnavailable(f"disk tier: reading {name.hex()[:16]}…: {exc}") from exc

    def read_frame(self, name: bytes) -> bytes | None:
        """The row's frame as stored (not decoded), after its meta record and the frame
        header are checked; ``None`` if absent; ``CorruptPage`` if they disagree."""
        self._check_open()
        try:
            with self._env.begin(buffers=True) as txn:
                buf = txn.get(name, db=self._frames)
                rec = txn.get(name, db=self._meta)
                if buf is None and rec is None:
                    return None
                if rec is None:
                    raise CorruptPage(f"row {name.hex()[:16]}…: frame has no meta record")
                check_row(unpack_meta(name, rec), buf)
                assert buf is not None  # _check_row raised otherwise
                return bytes(buf)
        except LMDB_ERRORS as exc:
            raise TierUnavailable(f"disk tier: reading {name.hex()[:16]}…: {exc}") from exc

    def drop_corrupt(self, name: bytes) -> None:
        """Delete a row whose frame failed its checks, and count it."""
        self.delete_many([name])
        with self._lock:
            self.corrupt_rows += 1
        logger.warning("disk tier: row %s… failed its checks; deleted", name.hex()[:16])

    def _scan_checked(self) -> tuple[list[DiskRow], list[bytes], int]:
        """Every row whose meta record passes its checks and agrees with its frame
        (length, header raw length and dtype; only header bytes are read); the names
        that fail (a frame with no record included); the bytes of every frame."""
        rows: list[DiskRow] = []
        bad: list[bytes] = []
        used = 0
        first: str | None = None
        try:
            with self._env.begin(buffers=True) as txn:
                with_frame = 0
                for key, value in txn.cursor(db=self._meta):
                    name, rec = bytes(key), bytes(value)
                    frame = txn.get(name, db=self._frames)
                    used += 0 if frame is None else len(frame)
                    with_frame += frame is not None
                    try:
                        if len(name) != ROW_NAME_BYTES:
                            raise CorruptPage(f"meta key of {len(name)} bytes is no row name")
                        row = unpack_meta(name, rec)
                        check_row(row, frame)
                    except CorruptPage as exc:
                        bad.append(name)
                        first = first or str(exc)
                        continue
                    rows.append(row)
                n_frames = txn.stat(self._frames)["entries"]
                if n_frames > with_frame:  # frames with no meta record (or a damaged key)
                    known = {r.name for r in rows}.union(bad)
                    for key, value in txn.cursor(db=self._frames):
                        if bytes(key) not in known:
                            bad.append(bytes(key))
                            used += len(value)
        except LMDB_ERRORS as exc:
            raise TierUnavailable(f"disk tier: scanning {self.path}: {exc}") from exc
        if first is not None:
            logger.warning("disk tier: %d rows failed their metadata checks (first: %s)",
                           len(bad), first)
        return rows, bad, used

    def _drop_bad(self, names: list[bytes]) -> None:
        """Delete rows that failed their checks at a scan, and count them. A key whose
        stored bytes are damaged sits out of B-tree order, where a lookup by key never
        finds it: such an entry is found by walking the database and deleted through the
        cursor, and ``used_bytes`` drops by the frame bytes really freed."""
        with self._lock:
            self._check_open()
            freed = 0
            try:
                with self._env.begin(write=True, buffers=True) as txn:
                    for name in names:
                        for db in (self._frames, self._meta):
                            n = delete_exact(txn, db, name)
                            freed += n if db is self._frames else 0
            except LMDB_ERRORS as exc:
                raise self._mapped("deleting damaged rows", exc) from exc
            self._used -= freed
            self._opened = None
            self.corrupt_rows += len(names)
        logger.warning("disk tier: dropped %d rows whose metadata failed its checks", len(names))

    def scan(self, prefix: bytes = b"") -> Iterator[DiskRow]:
        """Every committed row whose name starts with ``prefix`` and that passed its
        checks (the meta record, and its agreement with the frame's length and header);
        a row that fails is deleted and counted."""
        self._check_open()
        if not isinstance(prefix, bytes) or len(prefix) > ROW_NAME_BYTES:
            raise InvalidInput(f"prefix: expected at most {ROW_NAME_BYTES} bytes, got {prefix!r}")
        with self._lock:
            rows, self._opened = self._opened, None
        if rows is None:
            rows, bad, _ = self._scan_checked()
            if bad:
                self._drop_bad(bad)
        return iter([r for r in rows if r.name.startswith(prefix)] if prefix else rows)

    def names(self) -> list[bytes]:
        self._check_open()
        try:
            with self._env.begin(db=self._meta) as txn:
                return [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]
        except LMDB_ERRORS as exc:
            raise TierUnavailable(f"disk tier: listing names: {exc}") from exc

    def check(self) -> None:
        """``frames`` and ``meta`` hold the same names and ``used_bytes`` is their sum."""
        self._check_open()
        try:
            with self._lock, self._env.begin(buffers=True) as txn:
                frames = {bytes(k): len(v) for k, v in txn.cursor(db=self._frames)}
                try:
                    metas = {bytes(k): unpack_meta(bytes(k), v)
                             for k, v in txn.cursor(db=self._meta)}
                except CorruptPage as exc:
                    raise AssertionError(f"disk tier: {exc}") from exc
        except LMDB_ERRORS as exc:
            raise TierUnavailable(f"disk tier: checking {self.path}: {exc}") from exc
        if frames.keys() != metas.keys():
            diff = frames.keys() ^ metas.keys()
            raise AssertionError(f"disk tier: {len(diff)} names in only one of frames/meta")
        for name, row in metas.items():
            if frames[name] != row.frame_len:
                raise AssertionError(f"disk tier: {name.hex()[:16]}… frame is {frames[name]} "
                                     f"bytes, meta says {row.frame_len}")
        total = sum(frames.values())
        if total != self._used:
            raise AssertionError(f"disk tier: used_bytes {self._used} != frames {total}")
        if total > self._budget:
            raise AssertionError(f"disk tier: {total} bytes over the budget {self._budget}")

    # -- the Tier methods --------------------------------------------------------------

    def get_into(self, name: bytes, out: memoryview | bytearray) -> int | None:
        check_name(name)
        dst = as_out_view(out)
        try:
            return self.read_into(name, dst)
        except CorruptPage:
            self.drop_corrupt(name)
            return None

    def put(self, name: bytes, data: Buffer, *, dtype: str = "uint8") -> None:
        check_name(name)
        src = as_bytes_view(data)
        if src.nbytes == 0:
            raise InvalidInput("data: a page cannot be empty")
        check_dtype(dtype)
        self.write_frame(name, self.frame(src, dtype), raw_len=src.nbytes, dtype=dtype)

    def put_many(self, items: Iterable[tuple[bytes, Buffer]], *, dtype: str = "uint8") -> None:
        for name, data in items:
            self.put(name, data, dtype=dtype)

    def delete(self, name: bytes) -> bool:
        return self.delete_many([check_name(name)])[0]

    def delete_many(self, names: Sequence[bytes]) -> list[bool]:
        """Delete rows in one transaction; which of them were there."""
        names = [check_name(n) for n in names]
        with self._lock:
            self._check_open()
            return self._delete_locked(names)

    def _delete_locked(self, names: Sequence[bytes]) -> list[bool]:
        """Delete in one transaction (caller holds ``_lock``); ``used_bytes`` drops by the
        frames' real lengths, never by what a (possibly damaged) meta record says."""
        found: list[bool] = []
        freed = 0
        try:
            with self._env.begin(write=True, buffers=True) as txn:
                for name in names:
                    frame = txn.get(name, db=self._frames)
                    if frame is not None:
                        freed += len(frame)
                        txn.delete(name, db=self._frames)
                    meta_gone = txn.delete(name, db=self._meta)
                    found.append(meta_gone or frame is not None)
        except LMDB_ERRORS as exc:
            raise self._mapped("deleting rows", exc) from exc
        self._used -= freed
        self._opened = None
        return found

    def contains(self, names: Sequence[bytes]) -> list[bool]:
        self._check_open()
        try:
            with self._env.begin(db=self._meta, buffers=True) as txn:
                return [txn.get(check_name(n)) is not None for n in names]
        except LMDB_ERRORS as exc:
            raise TierUnavailable(f"disk tier: lookup: {exc}") from exc

    def contains_many(self, names: Sequence[bytes]) -> list[bool]:
        """:meth:`contains` (one read transaction): the FrameStore's name for it."""
        return self.contains(names)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._env.close()
            self._dirlock.release()
            logger.debug("disk tier %s: closed", self.path)
