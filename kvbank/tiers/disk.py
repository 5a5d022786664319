r"""The disk tier: frame bodies in append-only segment files, indexed by one LMDB environment.

Primitives:

- The index: two named databases in ``<data_dir>/lmdb``. ``meta`` maps a row name to its
  record (raw length, frame length, a logical write clock, dtype, where the frame lies —
  segment and offset — and the parent row name, sealed by an xxh3-64; see
  :mod:`kvbank.tiers.diskmeta`). ``frames`` holds frame bodies as values only for rows of
  the older layout (a data dir written before segments), which are read from there and
  served like any other row; a new write of such a row goes to a segment.
- The bodies: :class:`~kvbank.tiers.diskseg.Segments`, append-only files under
  ``<data_dir>/segments``. A write (:meth:`DiskTier.write_frames`, the store's group
  commit) appends the batch's frames with large sequential writes, ``fdatasync``\s them
  once (``sync=True``), and only then commits the index transaction that names them
  (write-ahead order: a crash leaves at most bytes nothing names, never an index entry
  whose bytes are missing or torn). The budget counts live frame bytes.
- Space comes back by whole segments: a sealed segment whose rows are all deleted,
  evicted or rewritten is unlinked after the index commit; one that is mostly dead is
  compacted in the background (:meth:`DiskTier.compact`: its live frames are appended to
  the active segment, the index repointed, the segment unlinked), at most
  ``compact_bytes`` written per wake-up. ``compact(legacy=True)`` also moves every
  older-layout row into segments (``kvbank admin compact``). The compaction itself is
  :mod:`kvbank.tiers.diskcompact`; the older layout's lookups :mod:`kvbank.tiers.disklegacy`.
- :meth:`DiskTier.frame` encodes a page (callers do it outside their locks; it is the
  expensive part); :meth:`DiskTier.read_into` reads a frame with ``preadv``: a RAW frame's
  payload straight into the caller's buffer (checked there), a coded one into per-thread
  scratch and decoded from it into the caller's buffer; large reads get a readahead hint.
- A frame that fails its checks (checksum, header, a frame that runs past its segment's
  end, a missing segment) raises :class:`~kvbank.errors.CorruptPage` from ``read_into``;
  :meth:`DiskTier.get_into` (the Tier method) and the store then delete the row, count
  it in :attr:`DiskTier.corrupt_rows` and report a miss. Wrong bytes are never returned.
- Each ``meta`` record is checked like a frame: on every read (and the frame header's
  raw length must equal the record's), and at open, where every record is also bounded
  and compared with its frame's header (read from its segment: 40 bytes a row). A row
  that fails is deleted and counted in ``corrupt_rows``; the open never fails for it.
  That check, the salvage and rebuild of a damaged index, and :meth:`DiskTier.check`
  are :mod:`kvbank.tiers.diskcheck`.
- :meth:`DiskTier.scan` lists the committed rows that passed those checks at open, which
  is how the store rebuilds its index on restart: sizes exact, LRU order by write clock.

Settings: ``writemap=False``, ``readahead=True``, one index transaction per value or per
group commit. The map size is a multiple of the budget (older-layout values still live in
it); the budget itself is exact and enforced here (``TierFull``), and the store evicts
before it is reached. ``MapFullError`` and a full file system (``ENOSPC`` from a segment
append, which is cut off again) map to ``TierFull``; any other LMDB or file error to
``TierUnavailable``. ``segments=False`` writes the older layout (frames as LMDB values):
kept so that tests can build a data dir as the previous release wrote it.

Lifecycle: ``DiskTier(path, budget)`` takes the data dir's lock, opens the segments and
the environment, checks every row's record against its frame (dropping and counting
those that fail), unlinks segments no row is in, starts the compactor → reads from any
thread, writes serialised by an internal lock → ``close()`` (idempotent; stops the
compactor).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import lmdb

from kvbank.codec import DEFAULT_LEVEL, HEADER_SIZE, check_raw, decode_into, encode
from kvbank.errors import CorruptPage, InvalidInput, TierFull, TierUnavailable
from kvbank.keys import ROW_NAME_BYTES
from kvbank.tiers import diskcheck
from kvbank.tiers.base import (
    OS_ERRORS,
    Buffer,
    FrameStoreBase,
    FrameWrite,
    Tier,
    TierKind,
    as_bytes_view,
    as_out_view,
    check_name,
)
from kvbank.tiers.datadir import FILE_MODE, private_dir, tighten
from kvbank.tiers.diskcompact import DEFAULT_COMPACT_BYTES, CompactReport, compact, run_compactor
from kvbank.tiers.diskfile import DirLock, SalvageReport, check_file
from kvbank.tiers.disklegacy import locate, replaced
from kvbank.tiers.disklog import LOG_DB, mark, replay, sync_index
from kvbank.tiers.diskmeta import (
    LMDB_ERRORS,
    DiskRow,
    Where,
    check_dtype,
    check_header,
    check_row,
    pack_meta,
    unpack_record,
)
from kvbank.tiers.diskseg import SEGMENT_BYTES, Segment, Segments, entry_head
from kvbank.tiers.lockorder import Rank, make_lock

__all__ = ["DEFAULT_LEVEL", "LMDB_ERRORS", "CompactReport", "DiskRow", "DiskTier", "FrameWrite",
           "check_dtype"]

logger = logging.getLogger(__name__)

MAP_FACTOR = 4  # map size = budget x 4 (+ 1 GiB): freed overflow pages fragment
MAP_SLACK = 1 << 30
FULL_FREE_BYTES = 1 << 20  # less free than this after a short write: the disk is full
_KEEP_SCRATCH = 64 << 20  # a per-thread read buffer larger than this is not kept

def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB"


def _free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class _Scratch(threading.local):
    """Per-thread room for a coded frame read from a segment before it is decoded."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def view(self, n: int) -> memoryview:
        if len(self.buf) < n:
            if n > _KEEP_SCRATCH:
                return memoryview(bytearray(n))
            self.buf = bytearray(n)
        return memoryview(self.buf)[:n]


_scratch = _Scratch()


class DiskTier(Tier, FrameStoreBase):
    """Rows as codec frames in segment files, indexed in LMDB; durable commits; exact
    byte budget. A :class:`~kvbank.tiers.base.FrameStore` (for the store) and a
    :class:`~kvbank.tiers.base.Tier` (for the conformance suite)."""

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
        segments: bool = True,
        compact_bytes: int = DEFAULT_COMPACT_BYTES,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        self.path = Path(path) / "lmdb"
        self._budget = budget
        self._level = level
        self._lock = make_lock(Rank.DISK_TIER, "DiskTier._lock")  # one writer; the counters
        self._closed = False
        self._to_segments = segments  # False: write the older layout (frames in LMDB)
        self._lazy_meta = segments and sync  # the index's meta page synced by the next commit
        self._compact_bytes = compact_bytes
        self.corrupt_rows = 0
        self.salvaged: SalvageReport | None = None  # what a salvage at open found
        self.created = False  # there was no data.mdb at open: a new environment
        size = map_size or budget * MAP_FACTOR + MAP_SLACK
        try:
            private_dir(self.path)
        except OSError as exc:
            raise TierUnavailable(f"disk tier: cannot create {self.path}: {exc}") from exc
        self._dirlock = DirLock(Path(path))
        self._live: dict[int, int] = {}
        try:
            try:
                self._segs = Segments(Path(path), sync=sync, segment_bytes=segment_bytes)
            except OS_ERRORS as exc:
                raise TierUnavailable(f"disk tier: cannot open the segments of {path}: "
                                      f"{exc}") from exc
            try:
                # Before LMDB maps the file: a truncated one would be SIGBUS on first touch.
                self.created = check_file(self.path) is None
                self._open_env(size, sync)
                if segments:
                    replay(self)  # writes whose index commit a machine crash undid
                rows, bad, self._used = diskcheck.scan_checked(self)
            except TierUnavailable as exc:
                if not salvage:
                    raise diskcheck.salvage_hint(exc) from exc.__cause__
                diskcheck.salvage_index(self, str(exc), map_size=size, sync=sync)
                if segments:
                    replay(self)
                rows, bad, self._used = diskcheck.scan_checked(self)
        except BaseException:
            if hasattr(self, "_env"):
                self._env.close()
            if hasattr(self, "_segs"):
                self._segs.close()
            self._dirlock.release()
            raise
        self.seq = max((r.seq for r in rows), default=0)  # the highest write clock on disk
        self._opened: list[DiskRow] | None = rows  # what scan() answers until a write
        if bad:  # the row cannot be trusted: drop it, never fail the open for it
            diskcheck.drop_bad(self, bad)
        # Sealed segments no row is in: crash tails, or deleted before a crash let the
        # unlink happen. Nothing names them; their space goes back now.
        self._retire(self._segs.empty_sealed())
        self._wake = threading.Event()
        self._compactor: threading.Thread | None = None
        if compact_bytes > 0:
            self._compactor = threading.Thread(target=run_compactor, args=(self,), daemon=True,
                                               name=f"kvbank-disk-compact-{self.path}")
            self._compactor.start()
            if self._segs.sparse():
                self._wake.set()
        logger.debug("disk tier %s: opened, %d bytes in rows", self.path, self._used)
        room = _free_bytes(self.path) + self._used
        if budget > room:  # the file system fills before the budget: say so at open
            logger.warning("disk tier %s: disk_bytes %s is more than the file system can hold "
                           "(%s free + %s in rows): the file system fills before the budget does",
                           self.path, _gib(budget), _gib(room - self._used), _gib(self._used))

    def _open_env(self, map_size: int, sync: bool) -> None:
        try:
            # metasync off with segments: the segments are the index's write-ahead log
            # (kvbank.tiers.disklog), so a commit needs LMDB's data sync, not its meta sync.
            self._env = lmdb.open(str(self.path), map_size=map_size, subdir=True, max_dbs=3,
                                  sync=sync, metasync=sync and not self._lazy_meta,
                                  readahead=True, writemap=False, lock=True, max_readers=254,
                                  mode=FILE_MODE)
            # files an older version (or another umask) made readable by others
            tighten([self.path / "data.mdb", self.path / "lock.mdb"])
            self._frames = self._env.open_db(b"frames")
            self._meta = self._env.open_db(b"meta")
            self._log = self._env.open_db(LOG_DB)
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

    @property
    def file_bytes(self) -> int:
        """Bytes of the segment files, dead bytes not yet compacted away included."""
        return self._segs.file_bytes()

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
        """Commit a frame and its metadata (durably, on a durable tier).

        ``replace=True`` overwrites a row of another size under the same name: the store
        uses it because its index, not the disk, says which copy is current (a frame it
        evicted may still wait for its purge)."""
        self.write_frames([FrameWrite(name, frame, raw_len, dtype, parent)], seq=seq,
                          replace=replace)

    def write_frames(self, rows: Sequence[FrameWrite], *, seq: int | None = None,
                     replace: bool = False) -> None:
        """Commit several frames at once (group commit: the frames appended to a segment
        with one ``fdatasync``, then one index transaction). All of them are durable when
        this returns, or none is indexed."""
        for r in rows:
            check_name(r.name)
        if not rows:
            return
        with self._lock:
            self._check_open()
            first = self.seq + 1 if seq is None else seq
            bad_old = 0
            grow = 0
            dropped: list[tuple[int, int]] = []  # (segment, frame bytes) the batch replaces
            added: list[tuple[int, int]] = []
            appended = False
            try:
                with self._env.begin(write=True, buffers=True) as txn:
                    for r in rows:
                        old_len, old_where, bad = replaced(txn, self._meta, self._frames, r.name,
                                                           r.raw_len, replace)
                        bad_old += bad
                        change = len(r.frame) - old_len
                        if self._used + grow + change > self._budget:
                            raise TierFull(f"disk tier: a {len(r.frame)}-byte frame exceeds the "
                                           f"budget (used {self._used + grow} of {self._budget})")
                        grow += change
                        if old_where is not None:
                            dropped.append((old_where.seg, old_len))
                    # Write-ahead: the frames are on disk (fdatasync) before the index
                    # transaction that names them commits; a crash in between leaves
                    # bytes nothing names, never an entry whose bytes are missing.
                    where: list[Where | None] = [None] * len(rows)
                    if self._to_segments:
                        entries = [(entry_head(r.name, pack_meta(r.name, r.raw_len, len(r.frame),
                                                                 first + i, r.dtype, r.parent)),
                                    r.frame) for i, r in enumerate(rows)]
                        at = self._segs.append(entries)
                        where = [Where(s, o) for s, o in at]
                        appended = True
                        mark(txn, self._log, at[-1][0], at[-1][1] + len(rows[-1].frame))
                    for i, (r, w) in enumerate(zip(rows, where, strict=True)):
                        meta = pack_meta(r.name, r.raw_len, len(r.frame), first + i, r.dtype,
                                         r.parent, w)
                        if w is None:
                            txn.put(r.name, r.frame, db=self._frames)
                        else:
                            txn.delete(r.name, db=self._frames)  # an older-layout copy
                            added.append((w.seg, len(r.frame)))
                        txn.put(r.name, meta, db=self._meta)
            except BaseException as exc:
                if appended:  # appended, but the index never named it
                    self._segs.undo_append()
                if isinstance(exc, LMDB_ERRORS):
                    what = rows[0].name.hex()[:16] + "…" + (
                        f" and {len(rows) - 1} more" if len(rows) > 1 else "")
                    raise self._mapped(f"writing {what}", exc) from exc
                raise
            self._used += grow
            for seg, n in added:
                self._segs.add_live(seg, n)
            self._let_go(dropped)
            self._retire(self._segs.empty_sealed())  # sealed by this append's rollover, empty
            self.seq = max(self.seq, first + len(rows) - 1)
            self._opened = None
            if bad_old:
                self.corrupt_rows += bad_old
                diskcheck.recount_locked(self)
        if bad_old:
            logger.warning("disk tier: replaced %d rows whose metadata failed its checks", bad_old)

    def _let_go(self, dropped: Sequence[tuple[int, int]]) -> int:
        """Forget live bytes of segments (after the index commit that stopped naming
        them): unlink a sealed segment left empty, wake the compactor for a sparse one.
        The segments unlinked."""
        sparse = False
        empty: list[int] = []
        for seg, n in dropped:
            if self._segs.drop_live(seg, n):
                empty.append(seg)
            else:
                sparse = sparse or seg in self._segs.sparse()
        if sparse and self._compactor is not None:
            self._wake.set()
        return self._retire(empty)

    def _retire(self, segs: Sequence[int]) -> int:
        """Unlink segments no index entry names, once the commits that stopped naming
        them are durable (with the lazy meta sync a machine crash may undo the last one,
        which must then find its rows' bytes); how many. A failed sync keeps them (dead
        bytes a later retire or open reclaims)."""
        if not segs:
            return 0
        if self._lazy_meta:
            try:
                sync_index(self)
            except LMDB_ERRORS as exc:
                logger.warning("disk tier %s: syncing the index before unlinking %d segments "
                               "failed (kept): %s", self.path, len(segs), exc)
                return 0
        for seg in segs:
            self._segs.retire(seg)
        return len(segs)

    def read_into(self, name: bytes, out: memoryview | bytearray, *,
                  expect: int | None = None) -> int | None:
        """Decode the row into ``out``; ``None`` if absent (or, with ``expect``, if the
        row holds another number of bytes: it is not the row the caller looked up);
        ``CorruptPage`` if its frame or meta record fails a check or they disagree (the
        caller drops it)."""
        self._check_open()
        for attempt in range(2):
            try:
                with self._env.begin(buffers=True) as txn:
                    found = locate(txn, self._meta, self._frames, name)
                    if found is None:
                        return None
                    row, where, legacy = found
                    if expect is not None and row.raw_len != expect:
                        return None
                    if where is None:
                        assert legacy is not None  # locate raised otherwise
                        # LMDB's mapped page, valid only inside this transaction: decode
                        # straight from it into the caller's memory, no copy in between.
                        return decode_into(legacy, out)
            except LMDB_ERRORS as exc:
                raise TierUnavailable(f"disk tier: reading {name.hex()[:16]}…: {exc}") from exc
            seg = self._segs.pin(where.seg)
            if seg is None:
                if attempt == 0:
                    continue  # compaction moved the row after we looked: look again
                raise CorruptPage(f"row {name.hex()[:16]}…: segment {where.seg} is gone")
            try:
                return self._read_segment(seg, where, row, out)
            finally:
                self._segs.unpin(seg)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _read_segment(self, seg: Segment, where: Where, row: DiskRow,
                      out: memoryview | bytearray) -> int:
        what = f"row {row.name.hex()[:16]}…"
        if where.offset + row.frame_len > seg.size:
            raise CorruptPage(f"{what}: its frame ends at {where.offset + row.frame_len}, "
                              f"segment {where.seg} holds {seg.size} bytes (torn or truncated)")
        dst = as_out_view(out)
        if len(dst) < row.raw_len:
            raise InvalidInput(f"out: the frame holds {row.raw_len} bytes, out has {len(dst)}")
        try:
            if row.frame_len == HEADER_SIZE + row.raw_len:
                # A RAW frame (a coded one is always smaller): header aside, payload
                # straight into the caller's buffer, checked there.
                head = bytearray(HEADER_SIZE)
                got = self._segs.read_into(seg, where.offset,
                                           [memoryview(head), dst[: row.raw_len]])
                if got != row.frame_len:
                    raise CorruptPage(f"{what}: read {got} of {row.frame_len} frame bytes")
                check_header(row, row.frame_len, head)
                return check_raw(head, row.frame_len, dst[: row.raw_len])
            buf = _scratch.view(row.frame_len)
            got = self._segs.read_into(seg, where.offset, [buf])
            if got != row.frame_len:
                raise CorruptPage(f"{what}: read {got} of {row.frame_len} frame bytes")
            check_header(row, row.frame_len, buf)
            return decode_into(buf, dst)
        except OS_ERRORS as exc:
            raise TierUnavailable(f"disk tier: reading {what} from segment {where.seg}: "
                                  f"{exc}") from exc

    def read_frame(self, name: bytes) -> bytes | None:
        """The row's frame as stored (not decoded), after its meta record and the frame
        header are checked; ``None`` if absent; ``CorruptPage`` if they disagree."""
        self._check_open()
        for attempt in range(2):
            try:
                with self._env.begin(buffers=True) as txn:
                    found = locate(txn, self._meta, self._frames, name)
                    if found is None:
                        return None
                    row, where, legacy = found
                    if where is None:
                        assert legacy is not None  # locate raised otherwise
                        return bytes(legacy)
            except LMDB_ERRORS as exc:
                raise TierUnavailable(f"disk tier: reading {name.hex()[:16]}…: {exc}") from exc
            frame = self._segment_frame(where, row)
            if frame is not None:
                return frame
            if attempt:
                raise CorruptPage(f"row {name.hex()[:16]}…: segment {where.seg} is gone")
        raise AssertionError("unreachable")

    def _segment_frame(self, where: Where, row: DiskRow) -> bytes | None:
        """A segment row's frame bytes, header checked; ``None`` if its segment is gone."""
        seg = self._segs.pin(where.seg)
        if seg is None:
            return None
        try:
            if where.offset + row.frame_len > seg.size:
                raise CorruptPage(f"row {row.name.hex()[:16]}…: its frame runs past the end "
                                  f"of segment {where.seg}")
            buf = bytearray(row.frame_len)
            try:
                got = self._segs.read_into(seg, where.offset, [memoryview(buf)])
            except OS_ERRORS as exc:
                raise TierUnavailable(f"disk tier: reading segment {where.seg}: {exc}") from exc
            if got != row.frame_len:
                raise CorruptPage(f"row {row.name.hex()[:16]}…: read {got} of "
                                  f"{row.frame_len} frame bytes")
            check_row(row, buf)
            return bytes(buf)
        finally:
            self._segs.unpin(seg)

    def drop_corrupt(self, name: bytes) -> None:
        """Delete a row whose frame failed its checks, and count it."""
        self.delete_many([name])
        with self._lock:
            self.corrupt_rows += 1
        logger.warning("disk tier: row %s… failed its checks; deleted", name.hex()[:16])

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
            rows, bad, _ = diskcheck.scan_checked(self)
            if bad:
                diskcheck.drop_bad(self, bad)
        return iter([r for r in rows if r.name.startswith(prefix)] if prefix else rows)

    def names(self) -> list[bytes]:
        self._check_open()
        try:
            with self._env.begin(db=self._meta) as txn:
                return [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]
        except LMDB_ERRORS as exc:
            raise TierUnavailable(f"disk tier: listing names: {exc}") from exc

    def check(self) -> None:
        """The tier's invariants hold (see :func:`kvbank.tiers.diskcheck.check`):
        records, ``frames`` values and segments agree, and ``used_bytes`` and each
        segment's live bytes are the sums of the rows'; ``AssertionError`` if not."""
        diskcheck.check(self)

    # -- compaction --------------------------------------------------------------------

    def compact(self, *, legacy: bool = True, budget: int | None = None) -> CompactReport:
        """Rewrite live rows into the active segment (see
        :func:`kvbank.tiers.diskcompact.compact`): every older-layout row (with
        ``legacy``), then the rows of sparse sealed segments, which are then unlinked;
        at most ``budget`` bytes written (``None``: no limit)."""
        return compact(self, legacy=legacy, budget=budget)

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
        """Delete in one transaction (caller holds ``_lock``). ``used_bytes`` drops by the
        rows' frame bytes; a record that fails its checks cannot say how many, so the
        bytes are recounted after such a delete. A segment left empty is unlinked."""
        found: list[bool] = []
        freed = 0
        dropped: list[tuple[int, int]] = []
        recount = False
        try:
            with self._env.begin(write=True, buffers=True) as txn:
                for name in names:
                    frame = txn.get(name, db=self._frames)
                    if frame is not None:
                        freed += len(frame)
                        txn.delete(name, db=self._frames)
                    rec = txn.get(name, db=self._meta)
                    if rec is not None:
                        try:
                            row, where = unpack_record(name, rec)
                        except CorruptPage:
                            recount = True
                        else:
                            if where is not None:
                                freed += row.frame_len
                                dropped.append((where.seg, row.frame_len))
                    meta_gone = txn.delete(name, db=self._meta)
                    found.append(meta_gone or frame is not None)
        except LMDB_ERRORS as exc:
            raise self._mapped("deleting rows", exc) from exc
        self._used -= freed
        self._let_go(dropped)
        self._opened = None
        if recount:
            diskcheck.recount_locked(self)
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
        if self._compactor is not None:
            self._wake.set()
            self._compactor.join()
        with self._lock:
            if self._lazy_meta:  # a clean close leaves the last commit durable too
                try:
                    sync_index(self)
                except LMDB_ERRORS as exc:
                    logger.warning("disk tier %s: syncing the index at close failed: %s",
                                   self.path, exc)
            self._env.close()
            self._segs.close()
            self._dirlock.release()
            logger.debug("disk tier %s: closed", self.path)
