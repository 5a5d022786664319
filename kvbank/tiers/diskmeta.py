"""The disk tier's records: the ``meta`` value of a row, and the checks a row passes.

Primitives:

- :func:`pack_meta` / :func:`unpack_meta` / :func:`unpack_record` — a row's meta record:
  raw length, frame length, write clock, dtype, where the frame lies (segment and offset,
  :class:`Where`; absent for a row of the older layout, whose frame is the ``frames``
  value), parent row name, then an xxh3-64 of the row name and all of that.
  ``unpack_record`` checks the sum and bounds every field (``CorruptPage`` naming the
  fault). The two layouts tell apart by length alone: after the dtype come 0 or 54
  bytes (older) or 12 or 66 (a segment row).
- :func:`check_row` / :func:`check_header` — a frame agrees with its record (length,
  header raw length, dtype), reading only the header; what every read and the scan at
  open check.
- :func:`check_salvaged` — the record to keep for a row a salvage copies (its own, or one
  rebuilt from the frame's header); see :func:`kvbank.tiers.diskfile.salvage`.
- :data:`LMDB_ERRORS` — what a call into LMDB may raise (the tier maps them).
- :func:`delete_exact` — delete a key from an LMDB database even when its stored bytes
  are damaged (out of B-tree order, so a lookup misses it).

Pure functions over bytes (``delete_exact`` over an open write transaction); the
:class:`~kvbank.tiers.disk.DiskTier` owns the environment and the locks.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import lmdb
import xxhash

from kvbank.codec import DTYPE_CODES, HEADER_SIZE, MAX_PAGE_BYTES, decode_into, frame_info
from kvbank.errors import CorruptPage, InvalidInput
from kvbank.keys import ROW_NAME_BYTES
from kvbank.tiers.base import FrameRow

# The one table of what LMDB (and the file system under it) raises in the disk tier:
# every call into lmdb there catches exactly these and maps them through
# DiskTier._mapped (TierFull for a full map or file system, TierUnavailable otherwise),
# so only KvbankError leaves the tier's modules.
LMDB_ERRORS: tuple[type[Exception], ...] = (lmdb.Error, OSError)

_META = struct.Struct("<QQQB")  # raw_len, frame_len, seq, len(dtype); then dtype, parent
_SUM = struct.Struct("<Q")  # last: xxh3-64 of (row name + everything before it)
_MAX_RAW = MAX_PAGE_BYTES  # the one page limit (the codec's, and the store's uint32 sizes)
_MAX_SEQ = 2**62  # write clocks are counters; a larger one is damage
_WHERE = struct.Struct("<IQ")  # segment id, offset of the frame in it


@dataclass(frozen=True, slots=True)
class Where:
    """Where a segment row's frame lies: segment id and byte offset."""

    seg: int
    offset: int

DiskRow = FrameRow  # one committed row as its meta record says


def pack_meta(name: bytes, raw_len: int, frame_len: int, seq: int, dtype: str,
              parent: bytes | None, where: Where | None = None) -> bytes:
    d = dtype.encode()
    loc = b"" if where is None else _WHERE.pack(where.seg, where.offset)
    body = _META.pack(raw_len, frame_len, seq, len(d)) + d + loc + (parent or b"")
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(name + body))


def unpack_meta(name: bytes, value: bytes | memoryview) -> DiskRow:
    """Parse and check one meta record (either layout); see :func:`unpack_record`."""
    return unpack_record(name, value)[0]


def unpack_record(name: bytes, value: bytes | memoryview) -> tuple[DiskRow, Where | None]:
    """Parse and check one meta record: the row, and where its frame lies (``None``: in
    the ``frames`` database, the older layout); ``CorruptPage`` naming the fault if it is
    damaged (checksum, lengths, or a field outside what the tier can have written)."""
    raw = bytes(value)
    what = f"meta of {name.hex()[:16]}…"
    if len(raw) < _META.size + _SUM.size:
        raise CorruptPage(f"{what}: {len(raw)} bytes, need {_META.size + _SUM.size}")
    body = raw[: -_SUM.size]
    (want,) = _SUM.unpack_from(raw, len(body))
    got = xxhash.xxh3_64_intdigest(name + body)
    if got != want:
        raise CorruptPage(f"{what}: checksum: xxh3-64 is {got:#018x}, record says {want:#018x}")
    raw_len, frame_len, seq, dlen = _META.unpack_from(body)
    rest = body[_META.size :]
    extra = len(rest) - dlen
    if extra not in (0, ROW_NAME_BYTES, _WHERE.size, _WHERE.size + ROW_NAME_BYTES):
        raise CorruptPage(f"{what}: {len(rest)} trailing bytes for a {dlen}-byte dtype")
    dtype = rest[:dlen].decode("ascii", "replace")
    where: Where | None = None
    if extra in (_WHERE.size, _WHERE.size + ROW_NAME_BYTES):
        where = Where(*_WHERE.unpack_from(rest, dlen))
        rest = rest[:dlen] + rest[dlen + _WHERE.size :]
    if dtype not in DTYPE_CODES:
        raise CorruptPage(f"{what}: dtype {dtype!r} is not a codec dtype")
    if not 1 <= raw_len <= _MAX_RAW:
        raise CorruptPage(f"{what}: raw length {raw_len} outside [1, {_MAX_RAW}]")
    if not HEADER_SIZE <= frame_len <= HEADER_SIZE + raw_len:
        raise CorruptPage(f"{what}: frame length {frame_len} outside "
                          f"[{HEADER_SIZE}, {HEADER_SIZE + raw_len}] for {raw_len} raw bytes")
    if seq > _MAX_SEQ:
        raise CorruptPage(f"{what}: write clock {seq} exceeds {_MAX_SEQ}")
    parent = rest[dlen:] or None
    return DiskRow(name, raw_len, frame_len, seq, dtype, parent), where


def check_row(row: DiskRow, frame: memoryview | bytes | bytearray | None) -> None:
    """The frame agrees with its meta record: present, the recorded length, a valid
    header naming the same raw length and dtype. Reads only the header bytes."""
    if frame is None:
        raise CorruptPage(f"row {row.name.hex()[:16]}…: meta has no frame")
    check_header(row, len(frame), frame)


def check_header(row: DiskRow, frame_len: int, head: memoryview | bytes | bytearray) -> None:
    """:func:`check_row` from the frame's length and its first bytes (at least the
    header: what a segment read fetches first)."""
    what = f"row {row.name.hex()[:16]}…"
    if frame_len != row.frame_len:
        raise CorruptPage(f"{what}: frame is {frame_len} bytes, meta says {row.frame_len}")
    header = frame_info(head, frame_len)
    if header.raw_len != row.raw_len or header.dtype != row.dtype:
        raise CorruptPage(f"{what}: frame header holds {header.raw_len} bytes of "
                          f"{header.dtype}, meta says {row.raw_len} of {row.dtype}")


def check_salvaged(name: bytes, frame: bytes | None, meta: bytes | None) -> bytes:
    """The meta record to keep for a row worth salvaging: a row name and a frame that
    decodes (its checksum included); its own record if that passes and agrees, else one
    rebuilt from the frame's header (no parent, the oldest write clock). ``CorruptPage``
    when the frame cannot be trusted."""
    if len(name) != ROW_NAME_BYTES:
        raise CorruptPage(f"key of {len(name)} bytes is no row name")
    if frame is None:
        raise CorruptPage(f"row {name.hex()[:16]}…: meta has no frame")
    header = frame_info(frame)
    try:
        decode_into(frame, bytearray(header.raw_len))
    except CorruptPage:
        raise
    except ValueError as exc:  # a payload at odds with its header (numpy's split says so)
        raise CorruptPage(f"row {name.hex()[:16]}…: {exc}") from exc
    if meta is not None:
        try:
            check_row(unpack_meta(name, meta), frame)
            return meta
        except CorruptPage:
            pass
    return pack_meta(name, header.raw_len, len(frame), 0, header.dtype, None)


def delete_exact(txn: lmdb.Transaction, db: lmdb._Database, key: bytes) -> int:
    """Delete ``key`` from ``db``; the bytes its value held (0 if absent). By lookup
    first; when that misses, by a walk (a damaged key is out of order)."""
    value = txn.get(key, db=db)
    if value is not None:
        n = len(value)
        txn.delete(key, db=db)
        return n
    cur = txn.cursor(db=db)
    for k, v in cur:
        if bytes(k) == key:
            n = len(v)
            cur.delete()
            return n
    return 0


def check_dtype(dtype: str) -> None:
    """Refuse a dtype the codec cannot name (before anything is stored)."""
    if not isinstance(dtype, str) or dtype not in DTYPE_CODES:
        raise InvalidInput(f"dtype: unknown dtype {dtype!r}; known: {sorted(DTYPE_CODES)}")
