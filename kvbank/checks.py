"""The argument-check vocabulary: one line per check, and the message names the field.

- :func:`count` — an integer in ``[lo, hi]`` (a count, an index, a size, a small id).
  ``bool`` is refused although it is an ``int``: ``True`` where a count belongs is a bug
  in the caller, not the value 1.
- :func:`seconds` — a finite, non-negative (or, with ``positive``, positive) duration.
  ``bool`` is refused, as are strings: ``"0.5"`` is a typo in code, not a value.

Each raises ``error`` (:class:`~kvbank.errors.InvalidInput` unless the caller names a
narrower or other class: :class:`~kvbank.errors.LayoutError`,
:class:`~kvbank.errors.ConfigError`) with a message ``"<field>: must be …, got <value>"``,
so :attr:`~kvbank.errors.KvbankError.field` names the field, and returns the value with
its type settled (``int``; ``float``). Nothing here imports more than the error tree.
"""

from __future__ import annotations

import contextlib
import math

from kvbank.errors import InvalidInput, KvbankError


def count(
    value: object,
    field: str,
    lo: int = 0,
    hi: int | None = None,
    *,
    error: type[KvbankError] = InvalidInput,
) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) with ``lo <= value <= hi``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
        hi is not None and value > hi
    ):
        raise error(f"{field}: must be {_range(lo, hi)}, got {value!r}", field=field)
    return value


def _range(lo: int, hi: int | None) -> str:
    if hi is not None:
        return f"an integer in [{lo}, {hi}]"
    if lo == 0:
        return "a non-negative integer"
    if lo == 1:
        return "a positive integer"
    return f"an integer >= {lo}"


def seconds(
    value: object,
    field: str,
    *,
    positive: bool = False,
    error: type[KvbankError] = InvalidInput,
) -> float:
    """``value`` as a float if it is a finite real number of seconds, at least 0 (above 0
    with ``positive``)."""
    got = math.nan
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        with contextlib.suppress(OverflowError):  # an int past float range: refused below
            got = float(value)
    if not math.isfinite(got) or got < 0 or (positive and got == 0):
        what = "positive" if positive else "non-negative"
        raise error(f"{field}: must be a {what} number of seconds, got {value!r}", field=field)
    return got
