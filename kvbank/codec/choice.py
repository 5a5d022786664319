"""How a page is coded: the method for a dtype, level and size, and which byte planes
are worth entropy-coding, from a small sample's order-0 entropy.

- :func:`choose` — RAW, ZSTD, PLANES or PLANES_ZSTD for a page (RAW stays the fallback
  when coding does not shrink it).
- :func:`sample_entropies` / :func:`plane_policy` — per plane: code it? with the tuned
  zstd parameters?
- :func:`entropy_bits` — the order-0 entropy bound of a buffer's planes (the bench's).

Pure functions of numpy arrays; no state.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvbank.codec.frame import Method
from kvbank.codec.planes import BytesLike, as_u8, split_planes
from kvbank.dtypes import DTYPE_ITEMSIZE

U8Array = npt.NDArray[np.uint8]

MIN_CODED_LEN = 64  # below this zstd's frame overhead eats any gain; store RAW

# A plane is entropy-coded when a sample of it shows order-0 entropy below this
# (bits/byte). 7.75 = a saving of at least 3 %, worth zstd's ~1 ns/byte. A 2048-byte
# sample of uniform bytes reads ~7.91 (+-0.02), so random planes are never coded.
_CODE_BELOW_BITS = 7.75
_TUNED_BELOW_BITS = 4.5
_SAMPLE = 2048
SWAP_DTYPES = frozenset({"bfloat16", "float32"})  # the exponent straddles the top 2 bytes
FLOAT_DTYPES = frozenset({"bfloat16", "float16", "float32"})


def choose(dtype: str, raw_len: int, level: int) -> Method:
    """The method to try for a page; RAW remains the fallback when it does not shrink."""
    itemsize = DTYPE_ITEMSIZE[dtype]
    if level == 0 or raw_len < MIN_CODED_LEN:
        return Method.RAW
    if itemsize == 1 or raw_len % itemsize:
        return Method.ZSTD  # nothing to split: code the bytes
    if dtype in FLOAT_DTYPES:
        return Method.PLANES
    return Method.PLANES_ZSTD  # integers: zstd's matches find repeats across items


# c * log2(c) for every count a sample can hold: entropy from a histogram in one take.
_CLOG2C = np.zeros(_SAMPLE + 1)
_CLOG2C[1:] = np.arange(1, _SAMPLE + 1) * np.log2(np.arange(1, _SAMPLE + 1))


def sample_entropies(raw: U8Array, itemsize: int) -> list[float]:
    """Order-0 entropy (bits/byte) of an evenly spaced sample of each plane: the same
    ``_SAMPLE`` items for every plane, gathered once as whole items, counted in one
    ``bincount`` (plane ``j``'s bytes are keyed ``256 * j + byte``)."""
    n = raw.size // itemsize
    step = max(1, n // _SAMPLE)
    items = raw[: n * itemsize].view(_SAMPLE_UINT[itemsize])[::step][:_SAMPLE]
    words = items.astype(np.intp)
    size = words.size
    if itemsize == 1:
        keys = words
    else:
        keys = np.empty(itemsize * size, dtype=np.intp)
        for j in range(itemsize):
            part = keys[j * size : (j + 1) * size]
            np.right_shift(words, 8 * j, out=part)
            np.bitwise_and(part, 0xFF, out=part)
            if j:
                np.add(part, 256 * j, out=part)
    counts = np.bincount(keys, minlength=256 * itemsize).reshape(itemsize, 256)
    sums = _CLOG2C[counts].sum(axis=1)
    log2size = float(np.log2(size)) if size else 0.0
    return [log2size - float(total) / size if size else 0.0 for total in sums]


_SAMPLE_UINT: dict[int, np.dtype[Any]] = {1: np.dtype(np.uint8), 2: np.dtype("<u2"), 4: np.dtype("<u4")}


def plane_policy(bits: float, level: int) -> tuple[bool, bool]:
    """(code this plane?, with the tuned parameters?) from its sampled entropy.

    Tuned parameters only on low-entropy planes (an exponent byte, ~2.9 bits on bf16):
    there LZ matches are spurious and cost time. Planes that carry mantissa bits (fp16's
    top byte, fp8) hold real repeats that zstd's level-1 match finder pays for: 1 % smaller
    at 2 MiB, measured.
    """
    return bits < _CODE_BELOW_BITS, level <= 2 and bits < _TUNED_BELOW_BITS


def zstd_level(level: int) -> int:
    return 1 if level <= 2 else level


def entropy_bits(data: BytesLike | U8Array, itemsize: int) -> float:
    """Sum over byte planes of each plane's order-0 entropy, in bits per item.

    ``8 * itemsize / entropy_bits`` is the best ratio a coder that codes each plane byte
    by byte, without context, can reach (the bench's entropy bound).
    """
    bits = 0.0
    for plane in split_planes(as_u8(data), itemsize):
        if plane.size:
            counts = np.bincount(plane, minlength=256)
            p = counts[counts > 0] / plane.size
            bits += float(-(p * np.log2(p)).sum())
    return bits
