"""zstd as the codec's entropy coder: parameters, thread-local contexts, decode-into.

Why these parameters. KV planes hold almost no LZ matches; all the gain is the skewed
histogram of the exponent byte, i.e. zstd's Huffman-coded literals. zstd's level 1 spends
most of its time in a match finder that finds nothing. Measured on real bf16 KV (one
core, exponent plane of 2 MiB pages): level 1 gives 2.91 bits/byte at 0.44 GB/s compress,
1.6 GB/s decompress. ``strategy=fast, hash_log=6, min_match=7`` gives 2.79 bits/byte at
1.1 GB/s and 3.1 GB/s: a 64-entry hash table lives in L1, and the 7-byte minimum keeps
the rare spurious short matches (each one a costly sequence) from splitting the literal
runs. ``target_length`` must stay 0: on the fast strategy any other value switches
Huffman coding of literals off (zstd's negative levels), which compresses nothing here.
``window_log=17`` keeps zstd's 128 KiB blocks; each block gets its own Huffman table,
which tracks the per-layer statistics inside a page. Level 2 and up use zstd's own
parameters for that level.

Primitives: :func:`compress` (bytes out; python-zstandard offers no compress-into) and
:func:`decompress_into` (straight into the caller's array; every zstd or length fault is
a :class:`~kvbank.errors.CorruptPage`). Contexts are per thread: a zstd context is not
thread-safe, and building one per page costs more than compressing a small page.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt
import zstandard

from kvbank.errors import CodecError, CorruptPage

MAX_LEVEL = 22

# The one table of what zstandard raises: every call into it catches exactly these. A
# decode maps them to CorruptPage (the frame is at fault), an encode to CodecError (the
# library is), so only KvbankError leaves the codec.
ZSTD_ERRORS: tuple[type[Exception], ...] = (zstandard.ZstdError,)
_FRAME_FLAGS = {"write_checksum": False, "write_content_size": True, "write_dict_id": False}
FAST_PARAMS = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST,
    window_log=17,
    hash_log=6,
    chain_log=6,
    search_log=1,
    min_match=7,
    target_length=0,
    **_FRAME_FLAGS,
)


class _Contexts(threading.local):
    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}  # 0 = tuned
        self.decompressor = zstandard.ZstdDecompressor()


_local = _Contexts()


def compressor(level: int, *, tuned: bool) -> zstandard.ZstdCompressor:
    """This thread's compressor: FAST_PARAMS when ``tuned``, else zstd's own ``level``
    (whose parameters zstd adapts to each input's size, as ``zstd -1`` does)."""
    key = 0 if tuned else level
    c = _local.compressors.get(key)
    if c is None:
        if tuned:
            c = zstandard.ZstdCompressor(compression_params=FAST_PARAMS)
        else:
            c = zstandard.ZstdCompressor(level=level, write_checksum=False,
                                         write_content_size=True, write_dict_id=False)
        _local.compressors[key] = c
    return c


def compress(
    data: npt.NDArray[np.uint8] | bytes | memoryview, level: int, *, tuned: bool
) -> bytes:
    """One zstd frame (content size recorded, no zstd checksum: the kvbank frame has one)."""
    try:
        return compressor(level, tuned=tuned).compress(data.data if isinstance(data, np.ndarray) else data)
    except ZSTD_ERRORS as exc:
        raise CodecError(f"codec: zstd could not compress {len(data)} bytes at level "
                         f"{level}: {exc}") from exc


def decompress_into(payload: memoryview, out: npt.NDArray[np.uint8], what: str) -> None:
    """Decode the single zstd frame ``payload`` into all of ``out`` (exactly ``out.size``
    bytes). ``what`` names the payload part in error messages."""
    expected = out.size
    try:
        size = zstandard.frame_content_size(payload)
    except ZSTD_ERRORS as exc:
        raise CorruptPage(f"{what}: not a zstd frame ({exc})") from exc
    if size != expected:
        raise CorruptPage(f"{what}: zstd content size {size}, expected {expected}")
    try:
        # The whole frame is in memory and out has room for all of it, so zstd takes its
        # single-pass path and writes straight into out: one readinto, normally.
        reader = _local.decompressor.stream_reader(payload, read_across_frames=False, closefd=False)
        view = out.data
        got = reader.readinto(view)
        while got < expected:
            n = reader.readinto(view[got:])
            if not n:
                break
            got += n
        extra = reader.read(1)  # the frame must end exactly here
    except ZSTD_ERRORS as exc:
        raise CorruptPage(f"{what}: zstd data is corrupt ({exc})") from exc
    if got != expected or extra:
        raise CorruptPage(f"{what}: zstd frame decoded to {got}+ bytes, expected {expected}")
