"""Byte-plane split/merge (numpy): against a transpose, plane order, scratch, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.codec import planes
from kvbank.codec.planes import copy_bytes, merge_planes, split_planes
from kvbank.errors import InvalidInput


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


@settings(max_examples=50, deadline=None)
@given(size=st.one_of(st.integers(0, 5000), st.integers((16 << 20) - 3, (16 << 20) + 5)),
       src_at=st.integers(0, 63), dst_at=st.integers(0, 63), seed=st.integers(0, 2**32 - 1),
       loop=st.booleans())
def test_copy_bytes_copies_exactly_and_leaves_the_rest(size: int, src_at: int, dst_at: int,
                                                       seed: int, loop: bool) -> None:
    """Any length at any alignment, through either routine (an AMD machine's loop, or
    memmove) and on both sides of the 16 MiB switch to memmove: the destination range
    holds the source's bytes, every byte around it is untouched and the source is
    unchanged."""
    planes._LOOP = loop  # hypothesis runs examples in this thread: restored below
    try:
        _copy_case(size, src_at, dst_at, seed)
    finally:
        planes._LOOP = planes._amd()


def _copy_case(size: int, src_at: int, dst_at: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, src_at + size, dtype=np.uint8)
    before = src.copy()
    dst = rng.integers(0, 256, dst_at + size + 64, dtype=np.uint8)
    around = dst.copy()
    copy_bytes(dst[dst_at : dst_at + size], src[src_at:])
    assert np.array_equal(dst[dst_at : dst_at + size], src[src_at:])
    assert np.array_equal(dst[:dst_at], around[:dst_at])
    assert np.array_equal(dst[dst_at + size :], around[dst_at + size :])
    assert np.array_equal(src, before)
