"""Encode and decode cold-page frames.

Primitives:

- :func:`encode` / :func:`encode_into` — raw page bytes -> one frame. The method is picked
  per page from the dtype, the level and the bytes (see :func:`kvbank.codec.choice.choose`); a frame is
  never larger than ``HEADER_SIZE + raw_len`` (RAW is the fallback).
- :func:`decode_into` / :func:`decode` — a frame -> the raw bytes, into the caller's
  buffer. Raises :class:`~kvbank.errors.CorruptPage` on any fault of the frame and
  :class:`~kvbank.errors.InvalidInput` when ``out`` is too small; nothing else. The
  xxh3-64 of the decoded bytes is checked last, so wrong bytes are never reported as
  decoded. On ``CorruptPage`` the contents of ``out`` are unspecified.
- :func:`frame_info` — the validated header alone.

Lifecycle: stateless for the caller. Each thread keeps zstd contexts and grow-only
scratch arrays (about two pages' worth) so the hot path allocates only the compressed
plane zstd returns. Frames are byte-identical across runs and hosts for one libzstd.

The PLANES method (kvbank's own): split the page into byte planes; entropy-code only the
planes whose sampled order-0 entropy says they compress (the exponent-carrying top
byte); store the rest verbatim, which costs one memcpy on encode and nothing on decode
(the merge reads them straight from the frame). At level 2 and up, ``bfloat16`` and
``float32`` also swap the sign bit with the exponent's lowest bit, so the coded plane
holds the whole exponent and the verbatim plane sign plus mantissa.
"""

from __future__ import annotations

import functools
import logging
import struct
import threading

import numpy as np
import numpy.typing as npt

from kvbank.codec import entropy
from kvbank.codec.choice import SWAP_DTYPES, choose, plane_policy, sample_entropies, zstd_level
from kvbank.codec.frame import (
    HEADER_SIZE,
    MAX_RAW_LEN,
    FrameHeader,
    Method,
    dtype_code,
    pack_header,
    parse_fast,
    parse_header,
)
from kvbank.codec.frame import checksum as page_checksum
from kvbank.codec.planes import as_u8, merge_planes, merge_unchecked, split_planes
from kvbank.dtypes import DTYPE_ITEMSIZE
from kvbank.errors import CorruptPage, InvalidInput

logger = logging.getLogger(__name__)

BytesLike = bytes | bytearray | memoryview
U8Array = npt.NDArray[np.uint8]

DEFAULT_LEVEL = 1

# PLANES payload: transform u8, plane count u8, reserved u16; per plane: coding u8,
# 3 reserved bytes, stored length u32 (see _planes_struct).
TRANSFORM_NONE = 0
TRANSFORM_SWAP_SIGN = 1  # bit 7 of the top byte <-> bit 7 of the byte below it
CODING_VERBATIM = 0
CODING_ZSTD = 1

_KEEP_SCRATCH = 64 << 20  # larger scratch is not kept between calls


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.arrays: dict[str, U8Array] = {}
        self.frame = bytearray()
        self.plane_key: tuple[int, int] = (0, 0)
        self.plane_list: list[U8Array] = []

    def get(self, name: str, nbytes: int) -> U8Array:
        arr = self.arrays.get(name)
        if arr is None or arr.size < nbytes:
            arr = np.empty(max(nbytes, 1), dtype=np.uint8)
            if nbytes <= _KEEP_SCRATCH:
                self.arrays[name] = arr
        return arr[:nbytes]

    def plane_views(self, k: int, n: int) -> list[U8Array]:
        """``k`` scratch planes of ``n`` bytes for the decoder, views cached per shape."""
        if self.plane_key == (k, n):
            return self.plane_list
        arr = np.empty((k, max(n, 1)), dtype=np.uint8)[:, :n]
        views = [arr[j] for j in range(k)]
        if k * n <= _KEEP_SCRATCH:
            self.plane_key, self.plane_list = (k, n), views
        return views


_scratch = _Scratch()


def max_frame_size(raw_len: int) -> int:
    """The largest frame :func:`encode` can produce for ``raw_len`` bytes."""
    return HEADER_SIZE + raw_len


def _check_level(level: int) -> None:
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= entropy.MAX_LEVEL:
        raise InvalidInput(f"level: must be an integer in 0..{entropy.MAX_LEVEL}, got {level!r}")


# ---- encode ------------------------------------------------------------------------------


def encode(data: BytesLike, dtype: str = "uint8", *, level: int = DEFAULT_LEVEL) -> bytes:
    """Encode ``data`` (raw page bytes of ``dtype`` items) into one frame.

    ``level``: 0 stores the bytes (RAW); 1 (default) is the fast, tuned entropy coder;
    2..22 spend more time (zstd's own level parameters, plus the sign/exponent swap for
    ``bfloat16`` and ``float32``). Unknown dtypes and levels raise InvalidInput.
    """
    raw = as_u8(data)
    frame = _scratch.frame
    need = max_frame_size(raw.size)
    if len(frame) < need:
        frame = bytearray(need)
        if need <= _KEEP_SCRATCH:
            _scratch.frame = frame
    size = encode_into(raw, frame, dtype, level=level)
    return bytes(memoryview(frame)[:size])


def encode_into(
    data: BytesLike | U8Array,
    out: bytearray | memoryview | U8Array,
    dtype: str = "uint8",
    *,
    level: int = DEFAULT_LEVEL,
) -> int:
    """Encode ``data`` into ``out`` (at least :func:`max_frame_size` bytes); returns the
    frame's length. Lets a tier encode straight into pooled memory."""
    dtype_code(dtype)
    _check_level(level)
    raw = as_u8(data)
    if raw.size > MAX_RAW_LEN:
        raise InvalidInput(f"data: {raw.size} bytes exceeds the frame limit {MAX_RAW_LEN}")
    dst = as_u8(out, "out")
    if not dst.flags.writeable:
        raise InvalidInput("out: must be writable")
    if dst.size < max_frame_size(raw.size):
        raise InvalidInput(
            f"out: needs max_frame_size({raw.size}) = {max_frame_size(raw.size)} bytes, "
            f"has {dst.size}"
        )
    checksum = page_checksum(raw.data)
    payload = dst[HEADER_SIZE:]
    method = choose(dtype, raw.size, level)
    size: int | None = None
    if method is Method.ZSTD:
        # Always try: a flat byte histogram can still hide LZ repeats (a copied block),
        # and zstd gives up on incompressible input quickly.
        _, tuned = plane_policy(sample_entropies(raw, 1)[0], level)
        size = _put_compressed(payload, raw, zstd_level(level), raw.size, tuned=tuned)
    elif method is Method.PLANES_ZSTD:
        planes = _scratch.get("planes", raw.size)
        split_planes(raw, DTYPE_ITEMSIZE[dtype], planes.reshape(DTYPE_ITEMSIZE[dtype], -1))
        size = _put_compressed(payload, planes, zstd_level(level), raw.size, tuned=False)
    elif method is Method.PLANES:
        size = _encode_planes(raw, payload, dtype, level)
    if size is None:  # RAW chosen, or the coded payload would not be smaller
        method = Method.RAW
        np.copyto(payload[: raw.size], raw)
        size = raw.size
    pack_header(dst.data, method, dtype, raw.size, size, checksum)
    return HEADER_SIZE + size


def _put_compressed(
    payload: U8Array, src: U8Array, level: int, limit: int, *, tuned: bool
) -> int | None:
    comp = entropy.compress(src, level, tuned=tuned)
    if len(comp) >= limit:
        return None
    payload[: len(comp)] = np.frombuffer(comp, dtype=np.uint8)
    return len(comp)


def _encode_planes(raw: U8Array, payload: U8Array, dtype: str, level: int) -> int | None:
    k = DTYPE_ITEMSIZE[dtype]
    n = raw.size // k
    transform = TRANSFORM_SWAP_SIGN if level >= 2 and dtype in SWAP_DTYPES else TRANSFORM_NONE
    policy = [plane_policy(bits, level) for bits in sample_entropies(raw, k)]
    coded = [code for code, _ in policy]
    if not any(coded):
        return None
    head = _planes_struct(k).size
    if head + n >= raw.size:  # too few items for the sub-headers to pay off
        return None
    # Planes before the first coded one go straight to their place in the payload (their
    # offsets are known); the others to scratch.
    scratch = _scratch.get("planes", raw.size).reshape(k, n)
    targets: list[U8Array] = []
    direct = 0
    for j in range(k):
        if not coded[j] and direct == j:
            start = head + j * n
            targets.append(payload[start : start + n])
            direct += 1
        else:
            targets.append(scratch[j])
    split_planes(raw, k, targets)
    if transform == TRANSFORM_SWAP_SIGN:
        _swap_sign_bits(targets[k - 2], targets[k - 1])
    cursor = head + direct * n
    entries: list[tuple[int, int]] = [(CODING_VERBATIM, n)] * direct
    for j in range(direct, k):
        plane = targets[j]
        code, tuned = policy[j]
        comp = entropy.compress(plane, zstd_level(level), tuned=tuned) if code else None
        if comp is not None and len(comp) < n:
            stored, coding = np.frombuffer(comp, dtype=np.uint8), CODING_ZSTD
        else:
            stored, coding = plane, CODING_VERBATIM
        if cursor + stored.size >= raw.size:
            return None  # not smaller than RAW
        payload[cursor : cursor + stored.size] = stored
        cursor += stored.size
        entries.append((coding, stored.size))
    if all(c == CODING_VERBATIM for c, _ in entries) and transform == TRANSFORM_NONE:
        return None  # nothing compressed: RAW is the same size minus sub-headers
    values: list[int | bytes] = [transform, k, 0]
    for coding, stored_len in entries:
        values += [coding, b"\0\0\0", stored_len]
    _planes_struct(k).pack_into(payload.data, 0, *values)
    return cursor


def _swap_sign_bits(low: U8Array, top: U8Array) -> None:
    """Exchange bit 7 of ``top`` and ``low`` item by item (its own inverse)."""
    diff = _scratch.get("diff", top.size)
    np.bitwise_xor(top, low, out=diff)
    np.bitwise_and(diff, 0x80, out=diff)
    np.bitwise_xor(top, diff, out=top)
    np.bitwise_xor(low, diff, out=low)


# ---- decode ------------------------------------------------------------------------------


def frame_info(frame: BytesLike, size: int | None = None) -> FrameHeader:
    """Parse and validate a frame's header (not its payload); raises CorruptPage. With
    ``size``, ``frame`` may be only the header bytes of a frame of ``size`` bytes."""
    return parse_header(_frame_view(frame), size)


def check_raw(head: BytesLike, frame_len: int, payload: BytesLike) -> int:
    """Check a RAW frame read in two parts: its header (``head``, of a frame of
    ``frame_len`` bytes) and its payload, already where the caller wants it (a reader
    that reads the payload straight into its destination, no copy in between). Returns
    the raw length; ``CorruptPage`` if the header is bad, names another method, or the
    payload's xxh3-64 is not the header's."""
    header = parse_header(_frame_view(head), frame_len)
    if header.method is not Method.RAW:
        raise CorruptPage(f"method: expected a RAW frame, header says {header.method.name}")
    data = as_u8(payload, "payload")
    if data.size < header.raw_len:
        raise InvalidInput(f"payload: the frame holds {header.raw_len} bytes, got {data.size}")
    got = page_checksum(data[: header.raw_len].data)
    if got != header.checksum:
        raise CorruptPage(
            f"checksum: xxh3-64 of the payload is {got:#018x}, header says {header.checksum:#018x}"
        )
    return header.raw_len


def _frame_view(frame: BytesLike) -> memoryview:
    try:
        view = memoryview(frame)
    except TypeError:
        raise InvalidInput(
            f"frame: expected a bytes-like object, got {type(frame).__name__}"
        ) from None
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise InvalidInput("frame: must be a contiguous buffer")
        view = view.cast("B")
    return view


def decode(frame: BytesLike) -> bytes:
    """Decode a frame into new bytes (convenience; the data path uses decode_into)."""
    header = frame_info(frame)
    out = bytearray(header.raw_len)
    decode_into(frame, out)
    return bytes(out)


def decode_into(frame: BytesLike, out: memoryview | bytearray) -> int:
    """Decode ``frame`` into ``out[:raw_len]``; returns ``raw_len``.

    Raises CorruptPage on any fault of the frame (naming magic, version, method, a length
    or the checksum) and InvalidInput when ``out`` is too small or not writable.
    """
    # Per-page overhead matters at 256 KiB (a page decodes in ~65 us): one struct call for
    # the header, no header object, one view per plane, cached scratch views.
    view = memoryview(frame) if type(frame) is bytes else _frame_view(frame)
    method, k, raw_len, checksum = parse_fast(view)
    dst = _out_array(out, raw_len)
    if method == _PLANES:
        _decode_planes(view, k, raw_len, dst)
    elif method == _ZSTD:
        entropy.decompress_into(view[HEADER_SIZE:], dst, "payload")
    elif method == _RAW:
        dst[:] = np.frombuffer(view, np.uint8, raw_len, HEADER_SIZE)
    else:  # PLANES_ZSTD
        planes = _scratch.get("planes", raw_len)
        entropy.decompress_into(view[HEADER_SIZE:], planes, "payload")
        merge_planes(planes.reshape(k, -1), dst)
    got = page_checksum(dst.data)
    if got != checksum:
        raise CorruptPage(
            f"checksum: xxh3-64 of the decoded bytes is {got:#018x}, header says {checksum:#018x}"
        )
    return raw_len


_RAW, _ZSTD, _PLANES = int(Method.RAW), int(Method.ZSTD), int(Method.PLANES)


def _out_array(out: memoryview | bytearray, raw_len: int) -> U8Array:
    """The first ``raw_len`` bytes of the caller's ``out`` as a writable uint8 array."""
    if type(out) is bytearray:  # the common case: writable, contiguous, bytes
        if len(out) < raw_len:
            raise InvalidInput(f"out: the frame holds {raw_len} bytes, out has {len(out)}")
        return np.frombuffer(out, np.uint8, raw_len)
    dst = as_u8(out, "out")
    if not dst.flags.writeable:
        raise InvalidInput("out: must be writable")
    if dst.size < raw_len:
        raise InvalidInput(f"out: the frame holds {raw_len} bytes, out has {dst.size}")
    return dst[:raw_len]


@functools.cache
def _planes_struct(k: int) -> struct.Struct:
    """The whole PLANES sub-header for ``k`` planes, parsed in one call."""
    return struct.Struct("<BBH" + "B3sI" * k)


_PAD = b"\0\0\0"


def _decode_planes(view: memoryview, k: int, raw_len: int, dst: U8Array) -> None:
    size = len(view) - HEADER_SIZE
    layout = _planes_struct(k)
    head = layout.size
    if size < head:
        raise CorruptPage(f"planes header: {k} plane entries need {head} bytes, payload has {size}")
    fields = layout.unpack_from(view, HEADER_SIZE)
    transform, count, reserved = fields[0], fields[1], fields[2]
    if transform not in (TRANSFORM_NONE, TRANSFORM_SWAP_SIGN):
        raise CorruptPage(f"planes transform: unknown transform {transform}")
    if count != k:
        raise CorruptPage(f"plane count: {count} planes for {k}-byte items")
    if transform == TRANSFORM_SWAP_SIGN and k < 2:
        raise CorruptPage("planes transform: the sign swap needs at least 2 planes")
    if reserved:
        raise CorruptPage(f"planes header: reserved bytes must be zero, got {reserved:#x}")
    n = raw_len // k
    scratch = _scratch.plane_views(k, n)
    planes: list[U8Array] = []
    in_scratch: list[bool] = []
    cursor = head
    for j in range(k):
        coding, pad, stored = fields[3 + 3 * j : 6 + 3 * j]
        if pad != _PAD:
            raise CorruptPage(f"plane {j}: reserved entry bytes must be zero")
        end = cursor + stored
        if end > size:
            raise CorruptPage(f"plane {j}: stored length {stored} runs past the payload ({size})")
        if coding == CODING_ZSTD:
            # zstd writes straight into scratch the merge reads (no intermediate copy).
            entropy.decompress_into(
                view[HEADER_SIZE + cursor : HEADER_SIZE + end], scratch[j], f"plane {j}"
            )
            planes.append(scratch[j])
            in_scratch.append(True)
        elif coding == CODING_VERBATIM:
            if stored != n:
                raise CorruptPage(f"plane {j}: verbatim length {stored}, expected {n}")
            # Read straight from the frame: a verbatim plane costs no copy on decode.
            planes.append(np.frombuffer(view, np.uint8, n, HEADER_SIZE + cursor))
            in_scratch.append(False)
        else:
            raise CorruptPage(f"plane {j}: unknown coding {coding}")
        cursor = end
    if cursor != size:
        raise CorruptPage(f"plane lengths: sub-headers and planes add up to {cursor}, payload is {size}")
    if transform == TRANSFORM_SWAP_SIGN:
        for j in (k - 2, k - 1):
            if not in_scratch[j]:  # frame views are read-only
                np.copyto(scratch[j], planes[j])
                planes[j] = scratch[j]
        _swap_sign_bits(planes[k - 2], planes[k - 1])
    merge16 = _scratch.get("merge", 4 * n).view(np.uint16) if k == 4 else None
    merge_unchecked(planes, dst, merge16)
