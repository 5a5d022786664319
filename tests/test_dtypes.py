"""The dtype vocabulary: one table, one validator, read by the layout and the codec."""

from __future__ import annotations

import pytest

from kvbank import codec, dtypes, layout
from kvbank.errors import InvalidInput, LayoutError


def test_dtypes_one_table_behind_every_view() -> None:
    assert layout.DTYPE_ITEMSIZE is dtypes.DTYPE_ITEMSIZE
    assert codec.DTYPE_CODES is dtypes.DTYPE_CODES
    assert set(dtypes.DTYPE_CODES) == set(dtypes.DTYPE_ITEMSIZE) == set(dtypes.DTYPES)
    assert len(set(dtypes.DTYPE_CODES.values())) == len(dtypes.DTYPES)  # codes never shared
    assert {dtypes.DTYPE_NAMES[c]: c for c in dtypes.DTYPE_NAMES} == dict(dtypes.DTYPE_CODES)


def test_dtypes_codes_never_change() -> None:
    """A code names a dtype forever: frames on disk carry it."""
    assert dict(dtypes.DTYPE_CODES) == {
        "uint8": 0, "int8": 1, "float8_e4m3fn": 2, "float8_e5m2": 3, "float8_e8m0fnu": 4,
        "float4_e2m1fn_x2": 5, "float16": 6, "bfloat16": 7, "float32": 8, "int32": 9,
    }


def test_dtypes_one_validator_names_the_field() -> None:
    assert dtypes.check_dtype("bfloat16").itemsize == 2
    for bad in ("bf16", 7, None):
        with pytest.raises(InvalidInput) as info:
            dtypes.check_dtype(bad)
        assert info.value.field == "dtype"
    with pytest.raises(LayoutError) as info:
        layout.BufferSpec(0, layout.Role.KEY, "bf16", (4,))
    assert info.value.field == "buffer.dtype" and "layer 0" in str(info.value)
    with pytest.raises(InvalidInput, match="dtype"):
        codec.encode(b"\0" * 64, "bf16")
