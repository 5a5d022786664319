"""A toy frame store: a directory of files, one file per row, in one module.

It shows that a new tier is one file: :class:`DirFrameStore` subclasses
:class:`~kvbank.tiers.base.FrameStoreBase`, writes the single-row calls and leaves
``write_frames`` to the base's loop; importing this module registers it for ``dir://``
remote URLs (:func:`kvbank.tiers.schemes.register_remote`), so a ``TieredStore`` with
``remote_url="dir:///some/path"`` spills into it without a change to the store. It passes
:class:`~kvbank.testing.frames.FrameStoreTests`.

Primitives:

- A row is ``<root>/<row name in hex>.row``: a record (magic, raw length, frame length,
  write clock, dtype length), the dtype, the parent row name (if any), the codec frame,
  then an xxh3-64 of everything before it.
- A write creates ``<root>/.tmp-<random>`` with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (never
  an existing file, never through a planted link), writes and fsyncs it, then renames it
  over the row's file: a reader sees the old row or the new one, whole.
- A read opens the file with ``O_NOFOLLOW`` and checks the sum, the record's bounds and
  the frame header against the record: ``CorruptPage`` otherwise, never wrong bytes.

Lifecycle: ``DirFrameStore(root, budget)`` removes leftover temporary files, checks every
row (a damaged one is deleted and counted in ``corrupt_rows``) and sums the frame bytes
→ any thread (writes and the counters under one lock) → ``close()`` (idempotent; every
call after it raises ``TierUnavailable``).
"""

from __future__ import annotations

import logging
import os
import secrets
import struct
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import xxhash

from kvbank.codec import (
    DEFAULT_LEVEL,
    DTYPE_CODES,
    HEADER_SIZE,
    MAX_PAGE_BYTES,
    decode_into,
    encode,
    frame_info,
)
from kvbank.errors import (
    CorruptPage,
    InvalidInput,
    PageSizeMismatch,
    TierFull,
    TierUnavailable,
)
from kvbank.keys import ROW_NAME_BYTES
from kvbank.tiers.base import Buffer, FrameRow, FrameStore, FrameStoreBase, check_name
from kvbank.tiers.schemes import register_remote

__all__ = ["SCHEME", "DirFrameStore", "open_dir_url"]

logger = logging.getLogger(__name__)

SCHEME = "dir"
_MAGIC = b"KVDR"
_RECORD = struct.Struct("<4sQQQB")  # magic, raw_len, frame_len, seq, len(dtype)
_SUM = struct.Struct("<Q")  # xxh3-64 of everything before it
_SUFFIX = ".row"
_TMP = ".tmp-"
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _pack(name: bytes, frame: bytes, raw_len: int, seq: int, dtype: str,
          parent: bytes | None) -> bytes:
    d = dtype.encode()
    body = _RECORD.pack(_MAGIC, raw_len, len(frame), seq, len(d)) + d + (parent or b"") + frame
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(name + body))


def _unpack(name: bytes, data: bytes) -> tuple[FrameRow, bytes]:
    """The row's record and frame; ``CorruptPage`` naming the fault when a check fails."""
    what = f"dir store: row {name.hex()[:16]}…"
    if len(data) < _RECORD.size + _SUM.size:
        raise CorruptPage(f"{what}: {len(data)} bytes, need {_RECORD.size + _SUM.size}")
    body = data[: -_SUM.size]
    (want,) = _SUM.unpack_from(data, len(body))
    got = xxhash.xxh3_64_intdigest(name + body)
    if got != want:
        raise CorruptPage(f"{what}: checksum: xxh3-64 is {got:#018x}, file says {want:#018x}")
    magic, raw_len, frame_len, seq, dlen = _RECORD.unpack_from(body)
    rest = body[_RECORD.size:]
    plen = len(rest) - dlen - frame_len
    if magic != _MAGIC or plen not in (0, ROW_NAME_BYTES):
        raise CorruptPage(f"{what}: magic {magic!r}, {len(rest)} bytes after the record for "
                          f"a {dlen}-byte dtype and a {frame_len}-byte frame")
    dtype = rest[:dlen].decode("ascii", "replace")
    if dtype not in DTYPE_CODES or not 1 <= raw_len <= MAX_PAGE_BYTES \
            or not HEADER_SIZE <= frame_len <= HEADER_SIZE + raw_len:
        raise CorruptPage(f"{what}: dtype {dtype!r}, raw {raw_len}, frame {frame_len} "
                          "outside what this store writes")
    frame = rest[dlen + plen:]
    header = frame_info(frame)
    if header.raw_len != raw_len or header.dtype != dtype:
        raise CorruptPage(f"{what}: frame header holds {header.raw_len} bytes of "
                          f"{header.dtype}, the record says {raw_len} of {dtype}")
    parent = rest[dlen:dlen + plen] or None
    return FrameRow(name, raw_len, frame_len, seq, dtype, parent), frame


class DirFrameStore(FrameStoreBase):
    """Rows as files under ``root``; see the module docstring."""

    def __init__(self, root: Path | str, budget: int, *, sync: bool = True,
                 level: int = DEFAULT_LEVEL) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise InvalidInput(f"budget: expected an integer >= 1, got {budget!r}")
        self.root = Path(root)
        self._budget = budget
        self._sync = sync
        self._level = level
        self._lock = threading.Lock()  # one writer; the counters and the row table
        self._closed = False
        self.corrupt_rows = 0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for p in self.root.glob(_TMP + "*"):  # a write a crash cut short
                p.unlink(missing_ok=True)
        except OSError as exc:
            raise TierUnavailable(f"dir store: cannot open {self.root}: {exc}") from exc
        self._rows: dict[bytes, FrameRow] = {}
        for name in self._listed():
            try:
                self._rows[name] = self._load(name)[0]
            except CorruptPage as exc:
                logger.warning("%s; deleted", exc)
                self._unlink(name)
                self.corrupt_rows += 1
        self.seq = max((r.seq for r in self._rows.values()), default=0)
        self._used = sum(r.frame_len for r in self._rows.values())

    # -- files -------------------------------------------------------------------------

    def _path(self, name: bytes) -> Path:
        return self.root / (name.hex() + _SUFFIX)

    def _listed(self) -> list[bytes]:
        names: list[bytes] = []
        try:
            for p in self.root.iterdir():
                stem = p.name[: -len(_SUFFIX)]
                if p.name.endswith(_SUFFIX) and len(stem) == 2 * ROW_NAME_BYTES:
                    try:
                        names.append(bytes.fromhex(stem))
                    except ValueError:
                        continue
        except OSError as exc:
            raise TierUnavailable(f"dir store: listing {self.root}: {exc}") from exc
        return names

    def _load(self, name: bytes) -> tuple[FrameRow, bytes]:
        """The row's record and frame from its file; ``FileNotFoundError`` if absent."""
        with os.fdopen(os.open(self._path(name), _OPEN_READ), "rb") as f:
            data = f.read()
        return _unpack(name, data)

    def _read(self, name: bytes) -> tuple[FrameRow, bytes] | None:
        check_name(name)
        self._check_open()
        try:
            return self._load(name)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TierUnavailable(f"dir store: reading {name.hex()[:16]}…: {exc}") from exc

    def _unlink(self, name: bytes) -> bool:
        try:
            self._path(name).unlink()
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise TierUnavailable(f"dir store: deleting {name.hex()[:16]}…: {exc}") from exc

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"dir store: {self.root} is closed")

    # -- the FrameStore members --------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def budget_bytes(self) -> int:
        return self._budget

    def frame(self, data: Buffer, dtype: str) -> bytes:
        """Encode page bytes into one frame (no lock taken)."""
        return encode(data, dtype, level=self._level)

    def write_frame(self, name: bytes, frame: bytes, *, raw_len: int, dtype: str,
                    parent: bytes | None = None, seq: int | None = None,
                    replace: bool = False) -> None:
        """Write the row's file whole (temporary file, fsync, rename over the old one)."""
        check_name(name)
        with self._lock:
            self._check_open()
            old = self._rows.get(name)
            if old is not None and old.raw_len != raw_len and not replace:
                raise PageSizeMismatch(f"data: {raw_len} bytes, but row {name.hex()[:16]}… "
                                       f"holds {old.raw_len}")
            used = self._used - (0 if old is None else old.frame_len)
            if used + len(frame) > self._budget:
                raise TierFull(f"dir store: a {len(frame)}-byte frame exceeds the budget "
                               f"(used {used} of {self._budget})")
            seq = self.seq + 1 if seq is None else seq
            tmp = self.root / (_TMP + secrets.token_hex(8))
            try:
                fd = os.open(tmp, _OPEN_NEW, 0o600)
                try:
                    os.write(fd, _pack(name, frame, raw_len, seq, dtype, parent))
                    if self._sync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self._path(name))
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                raise TierUnavailable(f"dir store: writing {name.hex()[:16]}…: {exc}") from exc
            self._rows[name] = FrameRow(name, raw_len, len(frame), seq, dtype, parent)
            self._used = used + len(frame)
            self.seq = max(self.seq, seq)

    def read_frame(self, name: bytes) -> bytes | None:
        """The frame as stored, after the file's checks; ``None`` if absent."""
        got = self._read(name)
        return None if got is None else got[1]

    def read_into(self, name: bytes, out: memoryview | bytearray, *,
                  expect: int | None = None) -> int | None:
        """Decode the row into ``out``; ``None`` if absent or not ``expect`` bytes."""
        got = self._read(name)
        if got is None:
            return None
        row, frame = got
        if expect is not None and row.raw_len != expect:
            return None
        return decode_into(frame, out)

    def contains_many(self, names: Sequence[bytes]) -> list[bool]:
        """Whether each row's file is listed here (no file is read)."""
        names = [check_name(n) for n in names]
        self._check_open()
        return [n in self._rows for n in names]

    def delete_many(self, names: Sequence[bytes]) -> list[bool]:
        names = [check_name(n) for n in names]
        with self._lock:
            self._check_open()
            found: list[bool] = []
            for name in names:
                gone = self._unlink(name)
                row = self._rows.pop(name, None)
                self._used -= 0 if row is None else row.frame_len
                found.append(row is not None or gone)
            return found

    def drop_corrupt(self, name: bytes) -> None:
        self.delete_many([name])
        with self._lock:
            self.corrupt_rows += 1
        logger.warning("dir store: row %s… failed its checks; deleted", name.hex()[:16])

    def scan(self, prefix: bytes = b"") -> Iterator[FrameRow]:
        """The rows whose name starts with ``prefix``, oldest write first."""
        self._check_open()
        if not isinstance(prefix, bytes) or len(prefix) > ROW_NAME_BYTES:
            raise InvalidInput(f"prefix: expected at most {ROW_NAME_BYTES} bytes, got {prefix!r}")
        with self._lock:
            rows = sorted(self._rows.values(), key=lambda r: r.seq)
        return iter([r for r in rows if r.name.startswith(prefix)])

    def names(self) -> list[bytes]:
        return [r.name for r in self.scan()]

    def check(self) -> None:
        """The files are the rows listed, each passes its checks, and ``used_bytes`` is
        their frames' sum within the budget."""
        self._check_open()
        with self._lock:
            on_disk = set(self._listed())
            if on_disk != self._rows.keys():
                raise AssertionError(f"dir store: {len(on_disk ^ self._rows.keys())} rows "
                                     "in only one of the directory and the table")
            for name, row in self._rows.items():
                try:
                    got, _ = self._load(name)
                except (CorruptPage, OSError) as exc:
                    raise AssertionError(f"dir store: {exc}") from exc
                if got != row:
                    raise AssertionError(f"dir store: row {name.hex()[:16]}… file says {got}, "
                                         f"the table {row}")
            total = sum(r.frame_len for r in self._rows.values())
            if total != self._used:
                raise AssertionError(f"dir store: used_bytes {self._used} != frames {total}")
            if total > self._budget:
                raise AssertionError(f"dir store: {total} bytes over the budget {self._budget}")

    def close(self) -> None:
        with self._lock:
            self._closed = True


def open_dir_url(url: str, budget: int) -> FrameStore:
    """A :class:`DirFrameStore` for ``dir://<path>`` (an absolute path: ``dir:///x``)."""
    path = url[len(SCHEME) + 3:]
    if not path.startswith("/"):
        raise InvalidInput(f"remote_url: expected dir:///an/absolute/path, got {url!r}")
    return DirFrameStore(path, budget)


register_remote(SCHEME, open_dir_url)
