"""The cold-page codec: self-describing, checksummed frames for pages leaving host memory.

Pages that go to the disk tier, the remote tier or the wire are encoded as one frame
each: a 40-byte header (magic, format version, method, dtype, raw length, payload
length, xxh3-64 of the raw bytes, a header check) and a payload. ``docs/codec.md``
specifies the format byte by byte.

Primitives (the public API other modules code against):

- ``encode(data, dtype="uint8", *, level=1) -> bytes`` and ``encode_into(data, out,
  dtype, *, level=1) -> int`` (into pooled memory of ``max_frame_size(len(data))``).
- ``decode_into(frame, out) -> int`` (into the caller's buffer; the data path) and
  ``decode(frame) -> bytes``. Only ``CorruptPage`` (the frame is bad) or
  ``InvalidInput`` (``out`` too small) come out; wrong bytes never do.
- ``frame_info(frame, size=None) -> FrameHeader``: the validated header alone (``size``:
  of a frame of which only the header bytes are at hand).
- ``check_raw(head, frame_len, payload) -> int``: a RAW frame whose payload was read
  straight into the caller's buffer, checked (header and checksum).
- ``HEADER_SIZE``, ``MAGIC``, ``FORMAT_VERSION``, ``Method``.
- ``DEFAULT_LEVEL`` (the zstd level every encoder uses unless told otherwise),
  ``MAX_PAGE_BYTES`` (the one page-size limit, also ``MAX_RAW_LEN``), ``DTYPE_CODES``
  (a view of :mod:`kvbank.dtypes`, the one dtype table).

No torch: the byte-plane kernels are numpy (:mod:`kvbank.codec.planes`), so a reader that
needs only frames imports none of torch, the tiers or the bank.

Lifecycle: stateless calls; per-thread zstd contexts and scratch are reused.
"""

from __future__ import annotations

from kvbank.codec.choice import entropy_bits
from kvbank.codec.core import (
    DEFAULT_LEVEL,
    check_raw,
    decode,
    decode_into,
    encode,
    encode_into,
    frame_info,
    max_frame_size,
)
from kvbank.codec.frame import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_PAGE_BYTES,
    MAX_RAW_LEN,
    FrameHeader,
    Method,
    checksum,
)
from kvbank.dtypes import DTYPE_CODES

__all__ = [
    "DEFAULT_LEVEL",
    "DTYPE_CODES",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_PAGE_BYTES",
    "MAX_RAW_LEN",
    "FrameHeader",
    "Method",
    "check_raw",
    "checksum",
    "decode",
    "decode_into",
    "encode",
    "encode_into",
    "entropy_bits",
    "frame_info",
    "max_frame_size",
]
