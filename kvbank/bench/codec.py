"""``kvbank bench codec``: the cold-page codec on real KV, against the libraries it replaces.

Data: :func:`kvbank.bench.realkv.real_pages` — all-MiniLM-L6-v2 K/V on stdlib docstrings
in ``bfloat16``, ``float16`` and ``float8_e4m3fn``, cut into 256 KiB and 2 MiB canonical
pages. One core (``torch.set_num_threads(1)``, blosc2 with one thread). Every rate is the
median of several interleaved runs (:func:`kvbank.bench.common.paired_rates`) into
preallocated buffers; byte-plane split/merge and the xxh3 checksum are inside our
timings, the baselines carry no checksum.

Cases, per dtype and page size (``-bf16-2MiB`` …):

- ``ratio-*``, ``compress-*``, ``decompress-*`` — ``kvbank.codec`` at its default level
  against zstd level 1 on byte planes (split, compress; decompress, merge).
- the same with ``-vs-blosc2-zstd-shuffle`` and ``-vs-blosc2-lz4-bitshuffle`` (clevel 1).
- ``entropy-bound-*`` — value: our ratio; baseline: the ratio the order-0 entropy of each
  byte plane of each page allows; ``ratio`` is the fraction of the bound reached.
- ``*-level2`` (bf16) — level 2 (sign/exponent swap) against zstd-1 on byte planes.
- ``split-*`` / ``merge-*`` (bf16) — :mod:`kvbank.codec.planes` against torch's
  transposing copy, the obvious way to write it.

blosc2 is a bench/test dependency and is imported here only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import zstandard

from kvbank.bench.common import BenchRow, paired_rates, row
from kvbank.bench.realkv import real_pages
from kvbank.codec import decode_into, encode, encode_into, entropy_bits, max_frame_size
from kvbank.codec.planes import merge_planes, split_planes
from kvbank.dtypes import DTYPE_ITEMSIZE

logger = logging.getLogger(__name__)

SUITE = "codec"
_DTYPES = (("bfloat16", "bf16"), ("float16", "fp16"), ("float8_e4m3fn", "fp8"))
_PAGE_SIZES = ((256 << 10, "256KiB"), (2 << 20, "2MiB"))
U8Array = npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class _Plan:
    bytes_per_case: int  # raw bytes of real KV per (dtype, page size)
    repeat: int


_FULL = _Plan(bytes_per_case=32 << 20, repeat=7)
_QUICK = _Plan(bytes_per_case=4 << 20, repeat=3)


@dataclass(frozen=True, slots=True)
class _Coder:
    """A codec under test: encode all pages, decode all frames, both into preallocated
    buffers, plus the total encoded size."""

    name: str
    encode_all: Callable[[], object]
    decode_all: Callable[[], object]
    encoded_bytes: int


def _ours(pages: list[U8Array], dtype: str, level: int) -> _Coder:
    page = pages[0].size
    out = bytearray(max_frame_size(page))
    dec = bytearray(page)
    frames = [encode(p.data, dtype, level=level) for p in pages]

    def enc() -> None:
        for p in pages:
            encode_into(p, out, dtype, level=level)

    def dec_all() -> None:
        for f in frames:
            decode_into(f, dec)

    return _Coder(f"kvbank.codec level {level}", enc, dec_all, sum(map(len, frames)))


def _zstd_planes(pages: list[U8Array], itemsize: int) -> _Coder:
    page = pages[0].size
    cctx = zstandard.ZstdCompressor(level=1)
    dctx = zstandard.ZstdDecompressor()
    planes = np.empty((itemsize, page // itemsize), dtype=np.uint8)
    merged = np.empty(page, dtype=np.uint8)

    def enc_one(p: U8Array) -> bytes:
        split_planes(p, itemsize, planes)
        return cctx.compress(planes.data)

    frames = [enc_one(p) for p in pages]

    def enc() -> None:
        for p in pages:
            enc_one(p)

    def dec_all() -> None:
        for f in frames:
            with dctx.stream_reader(f) as reader:
                reader.readinto(planes.data)
            merge_planes(planes, merged)

    return _Coder("zstd-1 byte-planes", enc, dec_all, sum(map(len, frames)))


def _blosc2(pages: list[U8Array], itemsize: int, codec: str, shuffle: str) -> _Coder:
    import blosc2

    blosc_any: Any = blosc2
    cparams = {
        "codec": getattr(blosc_any.Codec, codec),
        "clevel": 1,
        "filters": [getattr(blosc_any.Filter, shuffle)],
        "typesize": itemsize,
        "nthreads": 1,
    }
    dparams = {"nthreads": 1}
    dst = bytearray(pages[0].size)
    frames = [blosc_any.compress2(p, cparams=cparams) for p in pages]

    def enc() -> None:
        for p in pages:
            blosc_any.compress2(p, cparams=cparams)

    def dec_all() -> None:
        for f in frames:
            blosc_any.decompress2(f, dst=dst, dparams=dparams)

    name = f"blosc2 {codec.lower()}+{shuffle.lower()} clevel 1"
    return _Coder(name, enc, dec_all, sum(map(len, frames)))


def _compare(
    case: str, ours: _Coder, base: _Coder, total: int, repeat: int
) -> Iterator[BenchRow]:
    yield row(SUITE, f"ratio-{case}", "x", total / ours.encoded_bytes, base.name,
              total / base.encoded_bytes)
    c_ours, c_base = paired_rates(total / 1e9, ours.encode_all, base.encode_all, repeat)
    yield row(SUITE, f"compress-{case}", "GB/s", c_ours, base.name, c_base)
    d_ours, d_base = paired_rates(total / 1e9, ours.decode_all, base.decode_all, repeat)
    yield row(SUITE, f"decompress-{case}", "GB/s", d_ours, base.name, d_base)


def _suffix(case: str, vs: str) -> str:
    return f"{case}-vs-{vs}" if vs else case


def run(quick: bool) -> Iterator[BenchRow]:
    """The codec suite: 32 MiB of real KV per (dtype, page size), medians of 7 runs;
    ``quick`` uses 4 MiB and 3 runs (the CI smoke test)."""
    plan = _QUICK if quick else _FULL
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dtype, short in _DTYPES:
            itemsize = DTYPE_ITEMSIZE[dtype]
            for page_bytes, page_name in _PAGE_SIZES:
                count = max(2, plan.bytes_per_case // page_bytes)
                tensor = real_pages(dtype, page_bytes, count)
                pages = [tensor[i].numpy() for i in range(count)]
                total = page_bytes * count
                case = f"{short}-{page_name}"
                ours = _ours(pages, dtype, 1)
                yield from _compare(case, ours, _zstd_planes(pages, itemsize), total, plan.repeat)
                for codec, shuffle, label in (
                    ("ZSTD", "SHUFFLE", "blosc2-zstd-shuffle"),
                    ("LZ4", "BITSHUFFLE", "blosc2-lz4-bitshuffle"),
                ):
                    base = _blosc2(pages, itemsize, codec, shuffle)
                    for r in _compare(case, ours, base, total, plan.repeat):
                        yield row(SUITE, _suffix(r.case, label), r.metric, r.value, r.baseline,
                                  r.baseline_value)
                bound_bytes = sum(entropy_bits(p, itemsize) * (p.size // itemsize) / 8 for p in pages)
                yield row(SUITE, f"entropy-bound-{case}", "x", total / ours.encoded_bytes,
                          "order-0 entropy of each byte plane, per page", total / bound_bytes)
                if dtype == "bfloat16":
                    level2 = _ours(pages, dtype, 2)
                    for r in _compare(case, level2, _zstd_planes(pages, itemsize), total,
                                      plan.repeat):
                        yield row(SUITE, f"{r.case}-level2", r.metric, r.value, r.baseline,
                                  r.baseline_value)
                    yield from _kernel_rows(pages, case, total, plan.repeat)
    finally:
        torch.set_num_threads(threads)


def _kernel_rows(pages: list[U8Array], case: str, total: int, repeat: int) -> Iterator[BenchRow]:
    n = pages[0].size // 2
    planes = np.empty((2, n), dtype=np.uint8)
    merged = np.empty(pages[0].size, dtype=np.uint8)
    t_pages = [torch.from_numpy(p) for p in pages]
    t_planes = torch.from_numpy(planes)
    t_merged = torch.from_numpy(merged)

    def split_ours() -> None:
        for p in pages:
            split_planes(p, 2, planes)

    def split_torch() -> None:
        for p in t_pages:
            t_planes.copy_(p.view(-1, 2).t())

    def merge_ours() -> None:
        for _ in pages:
            merge_planes(planes, merged)

    def merge_torch() -> None:
        for _ in pages:
            t_merged.view(-1, 2).copy_(t_planes.t())

    base = "torch transposing copy_"
    s_ours, s_base = paired_rates(total / 1e9, split_ours, split_torch, repeat)
    yield row(SUITE, f"split-{case}", "GB/s", s_ours, base, s_base)
    m_ours, m_base = paired_rates(total / 1e9, merge_ours, merge_torch, repeat)
    yield row(SUITE, f"merge-{case}", "GB/s", m_ours, base, m_base)
