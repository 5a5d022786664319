"""The one dtype vocabulary: every dtype a page buffer may hold, its item size, its code.

Primitives:

- :data:`DTYPES` — name (torch spelling) -> :class:`DType`: bytes per item and the code
  the codec frame header stores. Codes are fixed numbers, never reused: a code names a
  dtype forever, whatever order this table lists them in. FP4 is stored packed, two
  values a byte.
- :data:`DTYPE_ITEMSIZE`, :data:`DTYPE_CODES`, :data:`DTYPE_NAMES` — views of the table
  (name -> item size, name -> code, code -> name).
- :func:`check_dtype` — the one validator: the :class:`DType` of a name, or
  :class:`~kvbank.errors.InvalidInput` (or the subclass asked for) naming the field.

No torch, no numpy: the layout, the codec and the tiers all read this table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvbank.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    itemsize: int  # bytes per item
    code: int  # the frame header's dtype byte


DTYPES: Mapping[str, DType] = MappingProxyType({d.name: d for d in (
    DType("uint8", 1, 0),
    DType("int8", 1, 1),
    DType("float8_e4m3fn", 1, 2),
    DType("float8_e5m2", 1, 3),
    DType("float8_e8m0fnu", 1, 4),
    DType("float4_e2m1fn_x2", 1, 5),
    DType("float16", 2, 6),
    DType("bfloat16", 2, 7),
    DType("float32", 4, 8),
    DType("int32", 4, 9),
)})

DTYPE_ITEMSIZE: Mapping[str, int] = MappingProxyType({n: d.itemsize for n, d in DTYPES.items()})
DTYPE_CODES: Mapping[str, int] = MappingProxyType({n: d.code for n, d in DTYPES.items()})
DTYPE_NAMES: Mapping[int, str] = MappingProxyType({d.code: n for n, d in DTYPES.items()})


def check_dtype(dtype: object, field: str = "dtype", error: type[InvalidInput] = InvalidInput,
                context: str = "") -> DType:
    """The table entry of ``dtype``; ``error`` naming ``field`` for anything else."""
    found = DTYPES.get(dtype) if isinstance(dtype, str) else None
    if found is None:
        raise error(f"{field}: unknown dtype {dtype!r}{context}; known: {sorted(DTYPES)}", field=field)
    return found
