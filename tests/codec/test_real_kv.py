"""The codec on real KV (all-MiniLM-L6-v2 on stdlib docstrings), and the capture itself."""

from __future__ import annotations

import math

import pytest
import torch

from kvbank.bench.codec import run
from kvbank.bench.realkv import real_kv, real_pages
from kvbank.codec import Method, decode, encode, entropy_bits, frame_info
from kvbank.errors import InvalidInput

pytestmark = pytest.mark.slow
TOKENS = 96


def test_real_kv_shapes_dtypes_and_values() -> None:
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16),
                               ("float8_e4m3fn", torch.float8_e4m3fn)):
        kv = real_kv(dtype, TOKENS)
        assert kv.shape == (6, 2, TOKENS, 12, 32)
        assert kv.dtype == torch_dtype
        values = kv.float()
        assert torch.isfinite(values).all()
        assert 0.1 < values.abs().mean() < 5  # real projections, not zeros or garbage
    # the same tokens in two precisions are the same values, rounded
    diff = real_kv("bfloat16", TOKENS).float() - real_kv("float16", TOKENS).float()
    assert diff.abs().max() < 0.1


def test_real_kv_is_deterministic_and_prefix_stable() -> None:
    """Asking for more tokens extends the sample; the first tokens do not change."""
    short = real_kv("bfloat16", 40)
    assert torch.equal(real_kv("bfloat16", TOKENS)[:, :, :40].view(torch.int16),
                       short.view(torch.int16))


def test_real_kv_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidInput, match="dtype"):
        real_kv("float64", 10)
    with pytest.raises(InvalidInput, match="tokens"):
        real_kv("bfloat16", 0)
    with pytest.raises(InvalidInput, match="page_bytes"):
        real_pages("bfloat16", 0, 1)


def test_real_pages_are_canonical_pages_of_real_kv() -> None:
    pages = real_pages("bfloat16", 4096, 3)
    assert pages.shape == (3, 4096) and pages.dtype == torch.uint8
    kv = real_kv("bfloat16", 16)
    # canonical page 0 starts with layer 0's K for tokens 0..15
    first_k = kv[0, 0, :16].contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(pages.reshape(-1)[: first_k.numel()], first_k[: 3 * 4096])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn"])
def test_encode_real_kv_pages_roundtrip_and_compress(dtype: str) -> None:
    pages = real_pages(dtype, 64 << 10, 4)
    itemsize = 1 if dtype.startswith("float8") else 2
    for page in pages:
        raw = page.numpy().tobytes()
        frame = encode(raw, dtype)
        assert decode(frame) == raw
        ratio = len(raw) / len(frame)
        bound = 8 * itemsize / entropy_bits(raw, itemsize)
        assert ratio > 0.95 * bound  # close to the order-0 bound of the byte planes
        if dtype == "bfloat16":
            assert frame_info(frame).method is Method.PLANES
            assert ratio > 1.4


def test_bench_codec_quick_rows() -> None:
    """The CI smoke run yields every case with finite, positive figures."""
    rows = list(run(quick=True))
    cases = {r.case for r in rows}
    for d in ("bf16", "fp16", "fp8"):
        for size in ("256KiB", "2MiB"):
            for kind in ("ratio", "compress", "decompress"):
                assert f"{kind}-{d}-{size}" in cases
                assert f"{kind}-{d}-{size}-vs-blosc2-zstd-shuffle" in cases
                assert f"{kind}-{d}-{size}-vs-blosc2-lz4-bitshuffle" in cases
            assert f"entropy-bound-{d}-{size}" in cases
    for r in rows:
        assert r.suite == "codec"
        assert math.isfinite(r.value) and r.value > 0
        assert math.isfinite(r.baseline_value) and r.baseline_value > 0
        assert r.baseline
    bound = {r.case: r for r in rows}["entropy-bound-bf16-2MiB"]
    assert bound.ratio > 0.9
