"""Byte-plane split and merge (numpy): the transposition the cold-page codec codes pages in.

Plane ``j`` of a buffer of ``n`` items of ``itemsize`` bytes holds byte ``j`` (memory
order, so on the little-endian layout every kvbank page uses, plane ``itemsize - 1`` is
the most significant byte: sign and exponent of a float) of every item, in item order::

    items  b0 b1 | b0 b1 | b0 b1 ...          planes  b0 b0 b0 ... | b1 b1 b1 ...

Primitives: :func:`split_planes` / :func:`merge_planes` (and :func:`merge_unchecked`, the
codec's decode path), into caller-provided outputs (pooled memory: a fresh allocation
costs ten times the copy on this machine kind). Each plane may be a separate array, so a
codec can split one plane straight into its output frame and another into scratch, and
merge from a frame view plus scratch. No torch here: a reader that needs only frames
(a client, a remote tier) never imports it. Torch tensors on any device:
:mod:`kvbank.kernels.planes`.

Why integer shifts and not a transposing copy on the CPU: a ``[n, k] -> [k, n]`` strided
copy runs at 0.6 (torch) to 4 (numpy) GB/s on one core, while ``u16 >> 8`` into a
``uint8`` output and ``hi * 256 + lo`` into a ``uint16`` output are contiguous,
vectorised loops at 15-28 GB/s (measured, 2 MiB pages, see ``kvbank bench codec``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbank.errors import InvalidInput

U8Array = npt.NDArray[np.uint8]
BytesLike = bytes | bytearray | memoryview
Planes = Sequence[U8Array] | U8Array  # a uint8 [k, n] array, or k separate 1-D arrays

# itemsize -> the little-endian unsigned integer the shift kernels view items as
_UINT: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_SUPPORTED = (1, 2, 4)  # every item size in kvbank.dtypes.DTYPE_ITEMSIZE


def as_u8(data: BytesLike | npt.NDArray[np.generic], what: str = "data") -> U8Array:
    """A flat ``uint8`` view of a contiguous buffer (no copy)."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise InvalidInput(f"{what}: must be C-contiguous")
        return data.reshape(-1).view(np.uint8)
    try:
        view = memoryview(data)
    except TypeError:
        raise InvalidInput(
            f"{what}: expected a bytes-like object or numpy array, got {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidInput(f"{what}: must be a contiguous buffer")
    return np.frombuffer(view, dtype=np.uint8)


_ZERO = np.uint8(0)


_STREAMING = 16 << 20  # from here on a copy goes to libc memmove (non-temporal stores)


def _amd() -> bool:
    """Whether this machine's CPU is AMD's (``/proc/cpuinfo``; False where unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return "AuthenticAMD" in line
    except OSError:
        pass
    return False


_LOOP = _amd()  # pages copy through numpy's loop, not memmove (copy_bytes says why)


def copy_bytes(dst: U8Array, src: U8Array) -> None:
    """``dst[...] = src`` for two ``uint8`` arrays of one shape, GIL released.

    On AMD CPUs, pages (under 16 MiB) go through numpy's SIMD ``bitwise_or`` loop with a
    zero scalar, not ``np.copyto``: numpy's copy calls libc ``memmove``, which on AMD EPYC
    machines (glibc, ``rep movsb`` for MiB sizes) moves a 2 MiB page at 6-9 GB/s on one
    core where the loop streams it at 11-13 GB/s. On an Intel Xeon ``memmove`` is the
    faster one (one core, 32 MiB in pieces of 256 KiB to 2 MiB: 11.6-12.2 GB/s against
    10.0-10.9 through the loop), so there every copy goes to it. A longer copy (rows
    merged into one run) goes to ``memmove`` everywhere: past the cache glibc writes with
    non-temporal stores, which skip reading the destination first, and on a Xeon a
    128 MiB copy ran at 9.5 GB/s through it against 4.9 through the loop. Same result
    bit for bit either way, no temporary.
    """
    if _LOOP and dst.nbytes < _STREAMING:
        np.bitwise_or(src, _ZERO, out=dst)
    else:
        np.copyto(dst, src)


def check_itemsize(itemsize: int) -> None:
    if isinstance(itemsize, bool) or itemsize not in _SUPPORTED:
        raise InvalidInput(f"itemsize: must be one of {_SUPPORTED}, got {itemsize!r}")


def _plane_outputs(
    out: Planes | None, itemsize: int, n: int, what: str
) -> Planes:
    if out is None:
        return np.empty((itemsize, n), dtype=np.uint8)
    if len(out) != itemsize:
        raise InvalidInput(f"{what}: expected {itemsize} planes, got {len(out)}")
    for j, plane in enumerate(out):
        if not isinstance(plane, np.ndarray) or plane.dtype != np.uint8 or plane.shape != (n,):
            shape = getattr(plane, "shape", None)
            raise InvalidInput(f"{what}[{j}]: expected a uint8 array of shape ({n},), got {shape}")
    return out


def split_planes(
    data: BytesLike | npt.NDArray[np.generic],
    itemsize: int,
    out: Planes | None = None,
) -> Planes:
    """Split ``data`` (``n * itemsize`` bytes) into ``itemsize`` planes of ``n`` bytes.

    ``out`` is a ``uint8 [itemsize, n]`` array or a sequence of ``itemsize`` 1-D arrays
    of ``n`` bytes (they may live in different buffers); returned as given. Without
    ``out`` a new ``[itemsize, n]`` array is returned.
    """
    check_itemsize(itemsize)
    raw = as_u8(data)
    if raw.size % itemsize:
        raise InvalidInput(
            f"data: {raw.size} bytes is not a whole number of {itemsize}-byte items"
        )
    n = raw.size // itemsize
    planes = _plane_outputs(out, itemsize, n, "out")
    if itemsize == 1:
        np.copyto(planes[0], raw)
        return planes
    words = raw.view(_UINT[itemsize])
    # Truncating casts keep the low byte; shifting first selects byte j. Each is one
    # contiguous pass that writes its plane directly.
    np.copyto(planes[0], words, casting="unsafe")
    for j in range(1, itemsize):
        np.right_shift(words, 8 * j, out=planes[j], casting="unsafe")
    return planes


def merge_planes(
    planes: Planes,
    out: BytesLike | npt.NDArray[np.generic] | None = None,
    *,
    scratch: npt.NDArray[np.uint16] | None = None,
) -> U8Array:
    """Interleave ``itemsize = len(planes)`` planes of ``n`` bytes into ``n * itemsize``
    bytes. Inverse of :func:`split_planes`.

    ``out`` is a writable buffer of at least ``n * itemsize`` bytes (the first
    ``n * itemsize`` are written); the flat ``uint8`` view of what was written is
    returned. ``scratch`` (``uint16``, at least ``2 * n`` items) is used only for
    ``itemsize`` 4; without it a temporary is allocated.
    """
    itemsize = len(planes)
    check_itemsize(itemsize)
    first = planes[0]
    if not isinstance(first, np.ndarray) or first.ndim != 1:
        raise InvalidInput("planes[0]: expected a 1-D uint8 array")
    n = first.shape[0]
    _plane_outputs(planes, itemsize, n, "planes")
    if out is None:
        dst = np.empty(n * itemsize, dtype=np.uint8)
    else:
        dst = as_u8(out, "out")
        if not dst.flags.writeable:
            raise InvalidInput("out: must be writable")
        if dst.size < n * itemsize:
            raise InvalidInput(f"out: needs {n * itemsize} bytes, has {dst.size}")
        dst = dst[: n * itemsize]
    return merge_unchecked(planes, dst, scratch)


def merge_unchecked(
    planes: Planes, dst: U8Array, scratch: npt.NDArray[np.uint16] | None = None
) -> U8Array:
    """:func:`merge_planes` without argument checks, for callers that built ``planes``
    and ``dst`` themselves (the codec's per-page hot path): 1-D uint8 planes of equal
    length ``n``, ``dst`` exactly ``n * len(planes)`` writable bytes."""
    itemsize = len(planes)
    n = planes[0].shape[0]
    if itemsize == 1:
        np.copyto(dst, planes[0])
        return dst
    if itemsize == 2:
        _merge2(planes[0], planes[1], dst.view("<u2"))
        return dst
    # Four-byte items: merge byte pairs into uint16 halves, then the halves into words,
    # so every pass stays a contiguous vector loop (a strided store costs 4-10x).
    if scratch is None or scratch.size < 2 * n:
        scratch = np.empty(2 * n, dtype=np.uint16)
    lo16, hi16 = scratch[:n], scratch[n : 2 * n]
    _merge2(planes[0], planes[1], lo16)
    _merge2(planes[2], planes[3], hi16)
    words = dst.view("<u4")
    np.multiply(hi16, 1 << 16, out=words, dtype=np.uint32, casting="unsafe")
    np.add(words, lo16, out=words, casting="unsafe")
    return dst


def _merge2(lo: U8Array, hi: U8Array, out16: npt.NDArray[np.uint16]) -> None:
    # hi * 256 then + lo: two contiguous passes (shift-then-or measured slower).
    np.multiply(hi, 256, out=out16, dtype=np.uint16, casting="unsafe")
    np.add(out16, lo, out=out16, casting="unsafe")
