"""kvbank.fastrows.build: the same objects as calling the class, at C speed."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbank import fastrows as columns
from kvbank.lender.ledger import PlannedRow
from kvbank.tiers.base import HostSlot
from kvbank.wire.framing import StreamRow


@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1 << 20), st.binary(min_size=54, max_size=54),
                          st.integers(0, 1 << 20)), max_size=40))
def test_build_equals_the_constructor(rows: list[tuple[int, int, bytes, int]]) -> None:
    cols = [list(c) for c in zip(*rows, strict=True)] if rows else [[], [], [], []]
    assert columns.build(PlannedRow, len(rows), cols) == [PlannedRow(*r) for r in rows]


def test_build_takes_repeat_for_a_constant_column() -> None:
    got = columns.build(HostSlot, 3, (repeat("seg"), [0, 10, 20], [5, 5, 5]))
    assert got == [HostSlot("seg", 0, 5), HostSlot("seg", 10, 5), HostSlot("seg", 20, 5)]
    assert all(type(s) is HostSlot for s in got)
    with pytest.raises(AttributeError):  # still frozen
        got[0].offset = 1  # type: ignore[misc]


def test_a_short_column_is_refused() -> None:
    with pytest.raises(ValueError, match="shorter"):
        columns.build(StreamRow, 3, ([0, 1, 2], [0, 0, 0], [0, 1], [8, 8, 8]))


def test_the_wrong_number_of_columns_is_refused() -> None:
    with pytest.raises(ValueError, match="4 fields, got 3"):
        columns.build(StreamRow, 1, ([0], [0], [0]))


def test_a_class_that_validates_is_refused() -> None:
    @dataclass(frozen=True, slots=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            if self.x < 0:
                raise ValueError("negative")

    with pytest.raises(TypeError, match="__post_init__"):
        columns.build(Checked, 1, ([-1],))
