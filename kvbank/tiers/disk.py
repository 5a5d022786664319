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
- :meth:`DiskTier.scan` lists every committed row from ``meta`` (no frame is touched), which
  is how the store rebuilds its index on restart: sizes exact, LRU order by write clock.

Settings from machine-limits.md section 4: ``writemap=False`` (4-5x faster on a fresh
file), ``readahead=True`` (cold reads of large values are 25x slower without it), one
transaction per value. The map size is a multiple of the budget so that LMDB's map never
fills before the budget does; the budget itself is exact and enforced here (``TierFull``),
and the store evicts before it is reached. ``MapFullError`` and a full file system
(``ENOSPC``) still map to ``TierFull``; any other LMDB error to ``TierUnavailable``.

Lifecycle: ``DiskTier(path, budget)`` opens (or creates) the environment and sums the
frame bytes from ``meta`` → reads from any thread, writes serialised by an internal lock →
``close()`` (idempotent).
"""

from __future__ import annotations

import errno
import logging
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb

from kvbank.codec import DTYPE_CODES, decode_into, encode
from kvbank.errors import (
    CorruptPage,
    InvalidInput,
    PageSizeMismatch,
    TierFull,
    TierUnavailable,
)
from kvbank.tiers.base import Buffer, Tier, TierKind, as_bytes_view, as_out_view, check_name

logger = logging.getLogger(__name__)

_META = struct.Struct("<QQQB")  # raw_len, frame_len, seq, len(dtype); then dtype, parent
MAP_FACTOR = 4  # map size = budget x 4 (+ 1 GiB): freed overflow pages fragment
MAP_SLACK = 1 << 30
DEFAULT_LEVEL = 1  # zstd-1 on byte planes: ratio ~1.44 at ~0.7 GB/s (machine-limits 3)


@dataclass(frozen=True, slots=True)
class DiskRow:
    """One committed row as ``meta`` records it."""

    name: bytes
    raw_len: int
    frame_len: int
    seq: int  # the store's logical clock at the write: the LRU order after a restart
    dtype: str
    parent: bytes | None


def _pack_meta(raw_len: int, frame_len: int, seq: int, dtype: str, parent: bytes | None) -> bytes:
    d = dtype.encode()
    return _META.pack(raw_len, frame_len, seq, len(d)) + d + (parent or b"")


def _unpack_meta(name: bytes, value: bytes | memoryview) -> DiskRow:
    raw = bytes(value)
    if len(raw) < _META.size:
        raise CorruptPage(f"meta of {name.hex()[:16]}…: {len(raw)} bytes, need {_META.size}")
    raw_len, frame_len, seq, dlen = _META.unpack_from(raw)
    rest = raw[_META.size :]
    if len(rest) not in (dlen, dlen + 54):
        raise CorruptPage(f"meta of {name.hex()[:16]}…: {len(rest)} trailing bytes")
    dtype = rest[:dlen].decode("ascii", "replace")
    parent = rest[dlen:] or None
    return DiskRow(name, raw_len, frame_len, seq, dtype, parent)


def check_dtype(dtype: str) -> None:
    """Refuse a dtype the codec cannot name (before anything is stored)."""
    if not isinstance(dtype, str) or dtype not in DTYPE_CODES:
        raise InvalidInput(f"dtype: unknown dtype {dtype!r}; known: {sorted(DTYPE_CODES)}")


class DiskTier(Tier):
    """Rows as codec frames in LMDB; durable commits; exact byte budget."""

    kind = TierKind.DISK

    def __init__(
        self,
        path: Path | str,
        budget: int,
        *,
        sync: bool = True,
        level: int = DEFAULT_LEVEL,
        map_size: int | None = None,
    ) -> None:
        self.path = Path(path) / "lmdb"
        self._budget = budget
        self._level = level
        self._lock = threading.Lock()  # one writer at a time; guards the counters
        self._closed = False
        self.corrupt_rows = 0
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._env = lmdb.open(
                str(self.path),
                map_size=map_size or budget * MAP_FACTOR + MAP_SLACK,
                subdir=True,
                max_dbs=2,
                sync=sync,
                metasync=sync,
                readahead=True,
                writemap=False,
                lock=True,
                max_readers=254,
            )
            self._frames = self._env.open_db(b"frames")
            self._meta = self._env.open_db(b"meta")
        except (lmdb.Error, OSError) as exc:
            raise TierUnavailable(f"disk tier: cannot open {self.path}: {exc}") from exc
        used, top = 0, 0
        bad: list[bytes] = []
        for row in self._scan_raw(bad):
            used += row.frame_len
            top = max(top, row.seq)
        self._used = used
        self.seq = top  # the highest write clock on disk
        if bad:  # meta that does not parse: the row cannot be trusted
            self.delete_many(bad)
            self.corrupt_rows += len(bad)
            logger.warning("disk tier: dropped %d rows with unreadable metadata", len(bad))
        logger.debug("disk tier %s: opened, %d bytes in rows", self.path, used)

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
        check_name(name)
        flen = len(frame)
        with self._lock:
            self._check_open()
            if seq is None:
                seq = self.seq + 1
            meta = _pack_meta(raw_len, flen, seq, dtype, parent)
            try:
                with self._env.begin(write=True) as txn:
                    old = txn.get(name, db=self._meta)
                    old_len = 0
                    if old is not None:
                        prev = _unpack_meta(name, old)
                        if prev.raw_len != raw_len and not replace:
                            raise PageSizeMismatch(f"data: {raw_len} bytes, but row "
                                                   f"{name.hex()[:16]}… holds {prev.raw_len}")
                        old_len = prev.frame_len
                    if self._used - old_len + flen > self._budget:
                        raise TierFull(f"disk tier: a {flen}-byte frame exceeds the budget "
                                       f"(used {self._used} of {self._budget})")
                    txn.put(name, frame, db=self._frames)
                    txn.put(name, meta, db=self._meta)
            except (lmdb.Error, OSError) as exc:
                raise self._mapped(f"writing {name.hex()[:16]}…", exc) from exc
            self._used += flen - old_len
            self.seq = max(self.seq, seq)

    def read_into(self, name: bytes, out: memoryview | bytearray) -> int | None:
        """Decode the row into ``out``; ``None`` if absent; ``CorruptPage`` if its frame
        fails a check (the caller drops it)."""
        self._check_open()
        try:
            with self._env.begin(db=self._frames, buffers=True) as txn:
                buf = txn.get(name)
                if buf is None:
                    return None
                # The buffer is LMDB's mapped page, valid only inside this transaction:
                # decode straight from it into the caller's memory, no copy in between.
                return decode_into(buf, out)
        except lmdb.Error as exc:
            raise TierUnavailable(f"disk tier: reading {name.hex()[:16]}…: {exc}") from exc

    def drop_corrupt(self, name: bytes) -> None:
        """Delete a row whose frame failed its checks, and count it."""
        self.delete_many([name])
        with self._lock:
            self.corrupt_rows += 1
        logger.warning("disk tier: row %s… failed its checks; deleted", name.hex()[:16])

    def _scan_raw(self, bad: list[bytes]) -> Iterator[DiskRow]:
        try:
            with self._env.begin(db=self._meta) as txn:
                for key, value in txn.cursor():
                    try:
                        yield _unpack_meta(bytes(key), value)
                    except CorruptPage:
                        bad.append(bytes(key))
        except lmdb.Error as exc:
            raise TierUnavailable(f"disk tier: scanning {self.path}: {exc}") from exc

    def scan(self) -> Iterator[DiskRow]:
        """Every committed row, from the metadata alone."""
        self._check_open()
        bad: list[bytes] = []
        rows = list(self._scan_raw(bad))
        if bad:
            self.delete_many(bad)
            with self._lock:
                self.corrupt_rows += len(bad)
        return iter(rows)

    def names(self) -> list[bytes]:
        self._check_open()
        with self._env.begin(db=self._meta) as txn:
            return [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]

    def check(self) -> None:
        """``frames`` and ``meta`` hold the same names and ``used_bytes`` is their sum."""
        with self._lock, self._env.begin(buffers=True) as txn:
            frames = {bytes(k): len(v) for k, v in txn.cursor(db=self._frames)}
            metas = {bytes(k): _unpack_meta(bytes(k), v) for k, v in txn.cursor(db=self._meta)}
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
        found: list[bool] = []
        with self._lock:
            self._check_open()
            freed = 0
            try:
                with self._env.begin(write=True) as txn:
                    for name in names:
                        old = txn.pop(check_name(name), db=self._meta)
                        frame_gone = txn.delete(name, db=self._frames)
                        found.append(old is not None or frame_gone)
                        if old is not None and len(old) >= _META.size:
                            freed += _META.unpack_from(old)[1]
            except (lmdb.Error, OSError) as exc:
                raise self._mapped("deleting rows", exc) from exc
            self._used -= freed
        return found

    def contains(self, names: Sequence[bytes]) -> list[bool]:
        self._check_open()
        try:
            with self._env.begin(db=self._meta, buffers=True) as txn:
                return [txn.get(check_name(n)) is not None for n in names]
        except lmdb.Error as exc:
            raise TierUnavailable(f"disk tier: lookup: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._env.close()
            logger.debug("disk tier %s: closed", self.path)
