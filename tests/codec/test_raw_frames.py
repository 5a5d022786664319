"""RAW (uncompressed) frames checked directly, not only through randomized round trips.

Planted bugs these catch (issue 9): a RAW frame whose raw length disagrees with its
payload length used to let numpy's ``ValueError`` out of ``decode_into``; dropping the
checksum comparison for RAW frames passed every test that only compressed frames.
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvbank.codec import HEADER_SIZE, decode_into, encode, frame_info
from kvbank.codec.frame import Method, pack_header
from kvbank.errors import CorruptPage

RAW_LEN = 4096


def _raw_frame() -> bytearray:
    data = np.random.default_rng(7).integers(0, 256, RAW_LEN, dtype=np.uint8).tobytes()
    frame = bytearray(encode(data, "uint8", level=0))
    assert frame_info(frame).method is Method.RAW
    return frame


@pytest.mark.parametrize("raw_len", [RAW_LEN - 1, RAW_LEN + 1, 1])
def test_a_raw_frame_whose_raw_length_disagrees_with_its_payload_is_corrupt(raw_len: int) -> None:
    frame = _raw_frame()
    # A header that is valid in itself (its own check resealed), lying about the length.
    pack_header(frame, Method.RAW, "uint8", raw_len, RAW_LEN, xxhash.xxh3_64_intdigest(
        bytes(frame[HEADER_SIZE:])))
    with pytest.raises(CorruptPage, match="raw length"):
        decode_into(bytes(frame), bytearray(RAW_LEN + 1))
    with pytest.raises(CorruptPage, match="raw length"):
        frame_info(frame)


@pytest.mark.parametrize("at", [0, RAW_LEN // 2, RAW_LEN - 1])
def test_a_raw_frame_with_one_payload_byte_flipped_fails_its_checksum(at: int) -> None:
    frame = _raw_frame()
    frame[HEADER_SIZE + at] ^= 0x01
    out = bytearray(RAW_LEN)
    with pytest.raises(CorruptPage, match="checksum"):
        decode_into(bytes(frame), out)


def test_an_intact_raw_frame_decodes_to_its_bytes() -> None:
    frame = _raw_frame()
    out = bytearray(RAW_LEN)
    assert decode_into(bytes(frame), out) == RAW_LEN
    assert bytes(out) == bytes(frame[HEADER_SIZE:])
