"""The codec frame header: constants, the method and dtype code tables, pack and parse.

A frame is ``HEADER_SIZE`` bytes of header followed by ``payload_len`` bytes of payload.
All integers are little-endian. See ``docs/codec.md`` for the byte-exact layout and each
method's payload; this module is the single place the header is read or written.

Parsing validates everything the header alone can tell (magic, version, header check,
reserved bits, method, dtype, item size, the lengths against the frame's size and
against each other) and raises :class:`~kvbank.errors.CorruptPage` naming the field.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import xxhash

from kvbank.dtypes import DTYPE_CODES, DTYPE_ITEMSIZE, DTYPE_NAMES, check_dtype
from kvbank.errors import CorruptPage

MAGIC = b"KVBC"
FORMAT_VERSION = 1
HEADER_SIZE = 40
# The largest page kvbank stores, and so the largest raw length a frame may claim: the
# store's index and the disk's meta records keep sizes as uint32. It also bounds what a
# crafted header can make a reader allocate. Pages are MiBs.
MAX_PAGE_BYTES = 2**32 - 1
MAX_RAW_LEN = MAX_PAGE_BYTES  # the frame's name for the same limit

# magic, version, method, dtype code, itemsize, raw_len, payload_len, checksum
_HEAD = struct.Struct("<4sBBBBQQQ")
_CHECKED = _HEAD.size  # 32: the bytes the header check covers
_TAIL = struct.Struct("<II")  # header check, reserved (zero)
_WHOLE = struct.Struct("<4sBBBBQQQII")  # all 40 bytes in one call (the decode fast path)


class Method(enum.IntEnum):
    """How the payload encodes the raw bytes (the header's method byte)."""

    RAW = 0  # payload is the raw bytes
    ZSTD = 1  # payload is one zstd frame of the raw bytes
    PLANES_ZSTD = 2  # payload is one zstd frame of the concatenated byte planes
    PLANES = 3  # per-plane sub-headers; each plane stored verbatim or as its own zstd frame


_METHODS: Mapping[int, Method] = {int(m): m for m in Method}

# The dtype codes are kvbank.dtypes' (one table with the item sizes); re-exported here.


def dtype_code(dtype: str) -> int:
    """The header code of a kvbank dtype name; unknown names raise InvalidInput."""
    return check_dtype(dtype).code


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The parsed, validated header of one frame."""

    version: int
    method: Method
    dtype: str
    itemsize: int
    raw_len: int
    payload_len: int
    checksum: int  # xxh3-64 (seed 0) of the raw bytes

    @property
    def frame_len(self) -> int:
        return HEADER_SIZE + self.payload_len


# (method, dtype code, itemsize) triples a valid header can hold, packed into one int:
# one set lookup on the decode fast path replaces three table checks.
_VALID_KINDS = frozenset(
    int(m) | code << 8 | DTYPE_ITEMSIZE[name] << 16
    for m in Method
    for name, code in DTYPE_CODES.items()
    if name in DTYPE_ITEMSIZE
)


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The checksum of a page's raw bytes: xxh3-64, seed 0. The one definition: a frame
    header carries it, and a memory tier's committed row is verified against it."""
    return xxhash.xxh3_64_intdigest(data)


def header_check(head: bytes | bytearray | memoryview) -> int:
    """The 32-bit check over the first 32 header bytes: low half of their xxh3-64."""
    return xxhash.xxh3_64_intdigest(head) & 0xFFFFFFFF


def pack_header(
    out: bytearray | memoryview,
    method: Method,
    dtype: str,
    raw_len: int,
    payload_len: int,
    checksum: int,
) -> None:
    """Write a header into ``out[:HEADER_SIZE]``."""
    code = dtype_code(dtype)
    _HEAD.pack_into(
        out, 0, MAGIC, FORMAT_VERSION, int(method), code, DTYPE_ITEMSIZE[dtype],
        raw_len, payload_len, checksum,
    )
    _TAIL.pack_into(out, _CHECKED, header_check(memoryview(out)[:_CHECKED]), 0)


def parse_header(frame: bytes | bytearray | memoryview, size: int | None = None) -> FrameHeader:
    """Parse and validate the header of ``frame`` (the whole frame, to check its length;
    or its first bytes and the whole frame's ``size``, for a reader that has only those)."""
    size = len(frame) if size is None else size
    if size < HEADER_SIZE or len(frame) < HEADER_SIZE:
        got = min(size, len(frame))
        raise CorruptPage(f"frame: {got} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, method, code, itemsize, raw_len, payload_len, checksum = _HEAD.unpack_from(
        frame, 0
    )
    if magic != MAGIC:
        raise CorruptPage(f"magic: expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise CorruptPage(f"version: this build reads format {FORMAT_VERSION}, got {version}")
    check, reserved = _TAIL.unpack_from(frame, _CHECKED)
    if check != header_check(memoryview(frame)[:_CHECKED]):
        raise CorruptPage(f"header check: stored {check:#010x} does not match the header bytes")
    if reserved != 0:
        raise CorruptPage(f"reserved: header bytes 36..39 must be zero, got {reserved:#x}")
    method_e = _METHODS.get(method)
    if method_e is None:
        raise CorruptPage(f"method: unknown method {method}")
    dtype = DTYPE_NAMES.get(code)
    if dtype is None:
        raise CorruptPage(f"dtype: unknown dtype code {code}")
    if itemsize != DTYPE_ITEMSIZE[dtype]:
        raise CorruptPage(
            f"itemsize: {dtype} has {DTYPE_ITEMSIZE[dtype]}-byte items, header says {itemsize}"
        )
    if raw_len > MAX_RAW_LEN:
        raise CorruptPage(f"raw length: {raw_len} exceeds the limit {MAX_RAW_LEN}")
    if payload_len != size - HEADER_SIZE:
        what = "truncated" if payload_len > size - HEADER_SIZE else "has trailing bytes"
        raise CorruptPage(
            f"payload length: header says {payload_len} bytes, frame holds "
            f"{size - HEADER_SIZE} ({what})"
        )
    if method_e is Method.RAW and payload_len != raw_len:
        raise CorruptPage(f"raw length: a RAW payload of {payload_len} bytes, header says {raw_len}")
    if method_e in (Method.PLANES, Method.PLANES_ZSTD) and raw_len % itemsize:
        raise CorruptPage(
            f"raw length: {raw_len} is not a whole number of {itemsize}-byte items "
            f"({method_e.name} needs whole items)"
        )
    return FrameHeader(version, method_e, dtype, itemsize, raw_len, payload_len, checksum)


def parse_fast(frame: bytes | memoryview) -> tuple[int, int, int, int]:
    """``(method, itemsize, raw_len, checksum)`` of a valid header, for the decode path.

    Accepts exactly the headers :func:`parse_header` accepts, with one struct call and no
    object creation. Any fault goes to :func:`parse_header`, which raises CorruptPage
    naming the field (checked in the documented order).
    """
    size = len(frame)
    if size >= HEADER_SIZE:
        magic, version, method, code, itemsize, raw_len, payload_len, checksum, check, res = (
            _WHOLE.unpack_from(frame, 0)
        )
        if (
            magic == MAGIC
            and version == FORMAT_VERSION
            and res == 0
            and payload_len == size - HEADER_SIZE
            and raw_len <= MAX_RAW_LEN
            and (method | code << 8 | itemsize << 16) in _VALID_KINDS
            and (payload_len == raw_len if method == 0 else method == 1 or raw_len % itemsize == 0)
            and check == xxhash.xxh3_64_intdigest(frame[:_CHECKED]) & 0xFFFFFFFF
        ):
            return method, itemsize, raw_len, checksum
    header = parse_header(frame)  # raises CorruptPage naming the field
    return int(header.method), header.itemsize, header.raw_len, header.checksum
