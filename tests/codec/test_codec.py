"""The cold-page codec: round trips, method choice, header checks, fuzzing, golden frames."""

from __future__ import annotations

import base64
import json
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbank.codec import (
    DTYPE_CODES,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    FrameHeader,
    Method,
    decode,
    decode_into,
    encode,
    encode_into,
    entropy_bits,
    frame_info,
    max_frame_size,
)
from kvbank.codec.frame import header_check
from kvbank.errors import CorruptPage, InvalidInput
from kvbank.layout import DTYPE_ITEMSIZE
from tests.codec.golden import PATH as GOLDEN_PATH

DTYPES = sorted(DTYPE_ITEMSIZE)


def _bf16_normal(items: int, seed: int = 0) -> bytes:
    """Gaussian values truncated to bfloat16: exponent-skewed like real KV."""
    x = np.random.default_rng(seed).standard_normal(items).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype("<u2").tobytes()


def _roundtrip(data: bytes, dtype: str, level: int) -> bytes:
    frame = encode(data, dtype, level=level)
    assert len(frame) <= max_frame_size(len(data))
    out = bytearray(len(data) + 7)  # larger than needed: only the first raw_len change
    out[len(data) :] = b"\xee" * 7
    assert decode_into(frame, out) == len(data)
    assert bytes(out[len(data) :]) == b"\xee" * 7
    assert bytes(out[: len(data)]) == data
    assert decode(frame) == data
    return frame


# ---- round trips -------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    level=st.integers(0, 3),
    data=st.one_of(
        st.binary(max_size=3000),
        st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=3), st.integers(0, 2000)),
        st.builds(lambda n, s: _bf16_normal(n, s), st.integers(0, 1500), st.integers(0, 9)),
    ),
)
def test_encode_roundtrip_any_dtype_size_and_content(dtype: str, level: int, data: bytes) -> None:
    _roundtrip(data, dtype, level)


@pytest.mark.parametrize("size", [0, 1, 2, 3, 63, 64, 65, 1001, 4097])
@pytest.mark.parametrize("dtype", ["uint8", "bfloat16", "float16", "float32", "int32"])
def test_encode_roundtrip_edge_sizes(size: int, dtype: str) -> None:
    data = _bf16_normal((size + 1) // 2)[:size]
    for level in (0, 1, 2):
        _roundtrip(data, dtype, level)


def test_encode_roundtrip_16mib_page() -> None:
    data = _bf16_normal(8 << 20, seed=3)
    frame = _roundtrip(data, "bfloat16", 1)
    assert frame_info(frame).method is Method.PLANES
    assert len(data) / len(frame) > 1.4


@pytest.mark.parametrize("dtype", ["float32", "int32", "float16"])
def test_encode_roundtrip_wide_items(dtype: str) -> None:
    x = np.random.default_rng(1).standard_normal(50_000).astype(np.float32)
    data = {
        "float32": x.tobytes(),
        "int32": (x * 1000).astype("<i4").tobytes(),
        "float16": x.astype("<f2").tobytes(),
    }[dtype]
    for level in (1, 2, 5):
        frame = _roundtrip(data, dtype, level)
        assert len(frame) < len(data)


def test_encode_accepts_memoryview_numpy_and_bytearray() -> None:
    data = _bf16_normal(5000)
    arr = np.frombuffer(data, dtype=np.uint16)
    expected = encode(data, "bfloat16")
    assert encode(bytearray(data), "bfloat16") == expected
    assert encode(memoryview(data), "bfloat16") == expected
    assert encode(arr.data, "bfloat16") == expected  # a 'H'-format view


# ---- method choice -----------------------------------------------------------------------


def test_encode_picks_planes_for_bfloat16_and_beats_zstd_on_raw() -> None:
    import zstandard

    data = _bf16_normal(1 << 17)
    frame = encode(data, "bfloat16")
    assert frame_info(frame).method is Method.PLANES
    assert len(frame) < len(zstandard.ZstdCompressor(level=1).compress(data))


def test_encode_random_bytes_fall_back_to_raw() -> None:
    """Incompressible pages cost one header, never more."""
    data = np.random.default_rng(5).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    for dtype in ("uint8", "bfloat16", "float32"):
        frame = encode(data, dtype)
        info = frame_info(frame)
        assert info.method is Method.RAW
        assert len(frame) == HEADER_SIZE + len(data)


def test_encode_repeated_random_block_still_compresses() -> None:
    """Regression: a flat byte histogram (order-0 entropy ~8 bits) must not make the
    encoder skip zstd when the page repeats itself (LZ matches)."""
    block = np.random.default_rng(6).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    frame = _roundtrip(block * 8, "uint8", 1)
    assert frame_info(frame).method is Method.ZSTD
    assert len(frame) < 2 * len(block)


def test_encode_constant_page_compresses_to_almost_nothing() -> None:
    frame = _roundtrip(bytes(1 << 20), "bfloat16", 1)
    assert len(frame) < 200


@pytest.mark.parametrize(
    ("dtype", "size", "method"),
    [
        ("uint8", 4096, Method.ZSTD),
        ("float8_e4m3fn", 4096, Method.ZSTD),
        ("bfloat16", 4095, Method.ZSTD),  # odd length: no whole items to split
        ("int32", 4096, Method.PLANES_ZSTD),
        ("bfloat16", 10, Method.RAW),  # below MIN_CODED_LEN
    ],
)
def test_encode_method_follows_dtype_and_length(dtype: str, size: int, method: Method) -> None:
    data = (b"abcabcabd" * 1000)[:size]
    assert frame_info(encode(data, dtype)).method is method


def test_encode_level0_is_raw() -> None:
    assert frame_info(encode(bytes(5000), "bfloat16", level=0)).method is Method.RAW


def test_encode_level2_swaps_sign_into_mantissa_plane() -> None:
    data = _bf16_normal(1 << 15)
    frame = encode(data, "bfloat16", level=2)
    assert frame[HEADER_SIZE] == 1  # transform byte: sign swap
    assert len(frame) < len(encode(data, "bfloat16", level=1))


def test_encode_is_deterministic() -> None:
    data = _bf16_normal(20_000)
    assert encode(data, "bfloat16") == encode(bytes(data), "bfloat16")


def test_encode_into_matches_encode_and_reports_size() -> None:
    data = _bf16_normal(10_000)
    out = bytearray(max_frame_size(len(data)) + 5)
    size = encode_into(data, out, "bfloat16")
    assert bytes(out[:size]) == encode(data, "bfloat16")


# ---- input errors ------------------------------------------------------------------------


def test_encode_unknown_dtype_raises_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="dtype"):
        encode(b"abcd", "float64")


@pytest.mark.parametrize("level", [-1, 23, True, 1.0])
def test_encode_bad_level_raises_invalid_input(level: object) -> None:
    with pytest.raises(InvalidInput, match="level"):
        encode(b"abcd", "uint8", level=level)  # type: ignore[arg-type]


def test_encode_into_small_out_raises_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="max_frame_size"):
        encode_into(b"x" * 100, bytearray(100), "uint8")


def test_encode_non_buffer_raises_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="data"):
        encode("text", "uint8")  # type: ignore[arg-type]


def test_decode_into_small_out_raises_invalid_input() -> None:
    frame = encode(bytes(1000), "uint8")
    with pytest.raises(InvalidInput, match="out"):
        decode_into(frame, bytearray(999))


def test_decode_into_readonly_out_raises_invalid_input() -> None:
    frame = encode(bytes(1000), "uint8")
    with pytest.raises(InvalidInput, match="writable"):
        decode_into(frame, memoryview(bytes(1000)))


def test_codec_dtype_codes_cover_layout_dtypes() -> None:
    """Every dtype a layout can declare has a frame code; codes are distinct."""
    assert set(DTYPE_CODES) == set(DTYPE_ITEMSIZE)
    assert len(set(DTYPE_CODES.values())) == len(DTYPE_CODES)


# ---- header ------------------------------------------------------------------------------


def test_frame_info_reports_header_fields() -> None:
    data = _bf16_normal(3000)
    frame = encode(data, "bfloat16")
    info = frame_info(frame)
    assert info == FrameHeader(
        version=FORMAT_VERSION,
        method=Method.PLANES,
        dtype="bfloat16",
        itemsize=2,
        raw_len=len(data),
        payload_len=len(frame) - HEADER_SIZE,
        checksum=xxhash.xxh3_64_intdigest(data),
    )
    assert info.frame_len == len(frame)
    assert frame[:4] == MAGIC


def _reheader(frame: bytes, offset: int, fmt: str, value: int | bytes) -> bytes:
    """``frame`` with one header field replaced and the header check recomputed, so the
    test reaches the check for that field rather than the header check."""
    buf = bytearray(frame)
    struct.pack_into(fmt, buf, offset, value)
    struct.pack_into("<I", buf, 32, header_check(bytes(buf[:32])))
    return bytes(buf)


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "match"),
    [
        (0, "<4s", b"KVBX", "magic"),
        (4, "<B", 2, "version"),
        (5, "<B", 9, "method"),
        (6, "<B", 200, "dtype"),
        (7, "<B", 4, "itemsize"),
        (8, "<Q", 1 << 32, "raw length"),  # MAX_PAGE_BYTES is 2**32 - 1
        (16, "<Q", 5, "payload length"),
        (24, "<Q", 12345, "checksum"),
        (36, "<I", 1, "reserved"),
    ],
)
def test_decode_names_the_bad_field(offset: int, fmt: str, value: int | bytes, match: str) -> None:
    frame = encode(_bf16_normal(2000), "bfloat16")
    bad = _reheader(frame, offset, fmt, value)
    with pytest.raises(CorruptPage, match=match):
        decode_into(bad, bytearray(1 << 14))


def test_decode_header_bit_flip_fails_header_check() -> None:
    frame = bytearray(encode(_bf16_normal(2000), "bfloat16"))
    frame[9] ^= 0x01  # raw length
    with pytest.raises(CorruptPage, match="header check"):
        frame_info(frame)


def test_decode_truncated_and_extended_frames_raise() -> None:
    frame = encode(_bf16_normal(2000), "bfloat16")
    with pytest.raises(CorruptPage, match="truncated"):
        decode(frame[:-1])
    with pytest.raises(CorruptPage, match="trailing"):
        decode(frame + b"\0")
    with pytest.raises(CorruptPage, match="shorter than"):
        decode(frame[:10])


def test_decode_payload_bit_flip_never_returns_wrong_bytes() -> None:
    """Regression: a flipped bit in a verbatim plane (no zstd to notice) must still be
    caught, by the checksum."""
    data = _bf16_normal(4000)
    frame = bytearray(encode(data, "bfloat16"))
    assert frame_info(frame).method is Method.PLANES
    frame[HEADER_SIZE + 20 + 5] ^= 0x10  # inside plane 0, stored verbatim
    with pytest.raises(CorruptPage, match="checksum"):
        decode(frame)


# ---- fuzz --------------------------------------------------------------------------------

_FUZZ_INPUTS = [
    ("bfloat16", 1, _bf16_normal(700)),
    ("bfloat16", 2, _bf16_normal(700, seed=1)),
    ("float32", 2, np.random.default_rng(2).standard_normal(300).astype("<f4").tobytes()),
    ("int32", 1, np.arange(400, dtype="<i4").tobytes()),
    ("uint8", 1, b"fuzz me " * 150),
    ("bfloat16", 0, _bf16_normal(100)),
]
_FUZZ_FRAMES = [(encode(raw, dtype, level=level), raw) for dtype, level, raw in _FUZZ_INPUTS]


@st.composite
def _mutated(draw: st.DrawFn) -> tuple[bytes, bytes]:
    frame, raw = draw(st.sampled_from(_FUZZ_FRAMES))
    buf = bytearray(frame)
    kind = draw(st.sampled_from(["flip", "overwrite", "truncate", "extend", "splice", "refix"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(buf) - 1))
            buf[i] ^= 1 << draw(st.integers(0, 7))
    elif kind == "overwrite":
        i = draw(st.integers(0, len(buf) - 1))
        chunk = draw(st.binary(min_size=1, max_size=16))
        buf[i : i + len(chunk)] = chunk
    elif kind == "truncate":
        del buf[draw(st.integers(0, len(buf) - 1)) :]
    elif kind == "extend":
        buf += draw(st.binary(min_size=1, max_size=16))
    elif kind == "splice":
        i = draw(st.integers(0, len(buf)))
        buf[i:i] = draw(st.binary(min_size=1, max_size=8))
    else:
        # Mutate the payload and fix up the header (lengths, header check) as a careless
        # writer would: only the payload's own checks and the checksum remain.
        i = draw(st.integers(HEADER_SIZE, len(buf) - 1)) if len(buf) > HEADER_SIZE else 0
        if i:
            buf[i] ^= draw(st.integers(1, 255))
        struct.pack_into("<Q", buf, 16, len(buf) - HEADER_SIZE)
        struct.pack_into("<I", buf, 32, header_check(bytes(buf[:32])))
    return bytes(buf), raw


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_mutated())
def test_decode_into_fuzz_only_corrupt_page_or_exact_bytes(case: tuple[bytes, bytes]) -> None:
    """Mutated, truncated, extended frames: decode_into raises CorruptPage or (when the
    mutation happened to be a no-op) returns exactly the original bytes."""
    frame, raw = case
    out = bytearray(len(raw))
    try:
        n = decode_into(frame, out)
    except CorruptPage:
        return
    assert n == len(raw)
    assert bytes(out) == raw


@settings(max_examples=200, deadline=None)
@given(frame=st.binary(max_size=200))
def test_decode_random_bytes_raise_corrupt_page(frame: bytes) -> None:
    with pytest.raises(CorruptPage):
        decode_into(MAGIC + frame, bytearray(1 << 12))


# ---- golden frames -----------------------------------------------------------------------

_GOLDEN = json.loads(GOLDEN_PATH.read_text())


@pytest.mark.parametrize("entry", _GOLDEN, ids=[e["name"] for e in _GOLDEN])
def test_golden_frame_decodes_and_reencodes_identically(entry: dict[str, object]) -> None:
    """A format change must be deliberate: golden frames decode to their input, and the
    encoder still produces them byte for byte (a libzstd release that changes zstd's
    output also trips this; regenerate with ``python -m tests.codec.golden``)."""
    raw = base64.b64decode(str(entry["input"]))
    frame = base64.b64decode(str(entry["frame"]))
    assert decode(frame) == raw
    assert frame_info(frame).method.name == entry["method"]
    level = entry["level"]
    assert isinstance(level, int)
    assert encode(raw, str(entry["dtype"]), level=level) == frame


def test_golden_covers_every_method() -> None:
    assert {e["method"] for e in _GOLDEN} == {m.name for m in Method}


# ---- entropy bound -----------------------------------------------------------------------


def test_entropy_bits_of_uniform_and_constant_planes() -> None:
    rng = np.random.default_rng(0)
    assert entropy_bits(bytes(4096), 2) == 0.0
    uniform = rng.integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    assert 15.9 < entropy_bits(uniform, 2) <= 16.0
