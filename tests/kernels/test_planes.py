"""Byte-plane split/merge: numpy kernels, torch paths, CPU against the device-generic ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.errors import InvalidInput
from kvbank.kernels.planes import (
    _merge_tensor_ops,
    _split_tensor_ops,
    merge_planes,
    merge_planes_tensor,
    split_planes,
    split_planes_tensor,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _reference(raw: bytes, k: int) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, k).T


@settings(max_examples=100, deadline=None)
@given(k=st.sampled_from([1, 2, 4]), items=st.integers(0, 700), seed=st.integers(0, 2**32 - 1))
def test_split_planes_matches_transpose_and_merge_inverts(k: int, items: int, seed: int) -> None:
    raw = np.random.default_rng(seed).integers(0, 256, k * items, dtype=np.uint8).tobytes()
    planes = split_planes(raw, k)
    assert np.array_equal(np.asarray(planes), _reference(raw, k))
    out = np.full(k * items + 3, 0xAB, dtype=np.uint8)
    merged = merge_planes(planes, out)
    assert merged.tobytes() == raw
    assert (out[k * items :] == 0xAB).all()  # nothing past n * k is written


def test_split_planes_into_separate_buffers() -> None:
    """Planes may live in different buffers (frame slice + scratch), as the codec uses."""
    raw = np.arange(4000, dtype="<u4").tobytes()
    frame = bytearray(2 * 1000 + 10)
    lo = np.frombuffer(frame, dtype=np.uint8)[10 : 10 + 1000]
    rest = np.empty((3, 1000), dtype=np.uint8)
    targets = [lo, rest[0], rest[1], rest[2]][:4]
    split_planes(raw[:4000], 4, targets)
    ref = _reference(raw[:4000], 4)
    for got, want in zip(targets, ref, strict=True):
        assert np.array_equal(got, want)
    assert merge_planes(targets).tobytes() == raw[:4000]


def test_split_planes_plane_order_is_memory_byte_order() -> None:
    """Plane j is byte j of each item in memory: plane 1 of bf16 is sign and exponent."""
    raw = np.array([0x3F80, 0xBF80], dtype="<u2").tobytes()  # bf16 1.0, -1.0
    planes = split_planes(raw, 2)
    assert list(planes[0]) == [0x80, 0x80]
    assert list(planes[1]) == [0x3F, 0xBF]


def test_merge_planes_float32_uses_scratch() -> None:
    raw = np.random.default_rng(0).standard_normal(1000).astype("<f4").tobytes()
    planes = split_planes(raw, 4)
    scratch = np.empty(2000, dtype=np.uint16)
    assert merge_planes(planes, bytearray(4000), scratch=scratch).tobytes() == raw


@pytest.mark.parametrize("k", [0, 3, 8, True])
def test_split_planes_bad_itemsize_raises(k: int) -> None:
    with pytest.raises(InvalidInput, match="itemsize"):
        split_planes(b"abcdefgh", k)


def test_split_planes_partial_item_raises() -> None:
    with pytest.raises(InvalidInput, match="whole number"):
        split_planes(b"abc", 2)


def test_split_planes_wrong_out_shape_raises() -> None:
    with pytest.raises(InvalidInput, match="out"):
        split_planes(b"abcd", 2, np.empty((2, 3), dtype=np.uint8))
    with pytest.raises(InvalidInput, match="planes"):
        split_planes(b"abcd", 2, [np.empty(2, dtype=np.uint8)])


def test_merge_planes_out_too_small_or_readonly_raises() -> None:
    planes = split_planes(b"abcd", 2)
    with pytest.raises(InvalidInput, match="needs 4 bytes"):
        merge_planes(planes, bytearray(3))
    with pytest.raises(InvalidInput, match="writable"):
        merge_planes(planes, b"xxxx")


def test_merge_planes_unequal_planes_raise() -> None:
    with pytest.raises(InvalidInput, match="planes"):
        merge_planes([np.zeros(3, dtype=np.uint8), np.zeros(2, dtype=np.uint8)])


# ---- torch -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_split_planes_tensor_matches_numpy_and_generic_ops(dtype: torch.dtype) -> None:
    t = torch.randn(3, 257).to(dtype)
    k = t.element_size()
    planes = split_planes_tensor(t)
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    assert np.array_equal(planes.numpy(), _reference(raw, k))
    generic = torch.empty_like(planes)
    _split_tensor_ops(t.reshape(-1).view(torch.uint8), k, generic)
    assert torch.equal(generic, planes)

    out = torch.empty_like(t)
    merge_planes_tensor(planes, out)
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))
    generic_out = torch.empty(t.numel() * k, dtype=torch.uint8)
    _merge_tensor_ops(planes, generic_out)
    assert torch.equal(generic_out, t.reshape(-1).view(torch.uint8))


def test_split_planes_tensor_rejects_non_contiguous() -> None:
    t = torch.randn(8, 8).to(torch.bfloat16).t()
    with pytest.raises(InvalidInput, match="contiguous"):
        split_planes_tensor(t)


def test_merge_planes_tensor_wrong_out_size_raises() -> None:
    planes = split_planes_tensor(torch.randn(10).to(torch.bfloat16))
    with pytest.raises(InvalidInput, match="needs 20 bytes"):
        merge_planes_tensor(planes, torch.empty(9, dtype=torch.bfloat16))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_split_planes_tensor_cuda_matches_cpu(dtype: torch.dtype) -> None:
    t = torch.randn(1000, 33).to(dtype)
    cpu = split_planes_tensor(t)
    dev = split_planes_tensor(t.cuda())
    assert dev.device.type == "cuda"
    assert torch.equal(dev.cpu(), cpu)
    back = merge_planes_tensor(dev, torch.empty_like(t, device="cuda"))
    assert torch.equal(back.cpu(), t.view(torch.uint8).reshape(-1))
