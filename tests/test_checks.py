"""kvbank.checks: one-line argument checks that name the field, the limit and the value."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbank.checks import count, seconds
from kvbank.errors import ConfigError, InvalidInput, LayoutError


def test_count_returns_the_value_inside_its_range() -> None:
    assert count(0, "n") == 0
    assert count(5, "n", 1, 5) == 5


@pytest.mark.parametrize(
    ("value", "lo", "hi", "words"),
    [
        (-1, 0, None, "must be a non-negative integer, got -1"),
        (0, 1, None, "must be a positive integer, got 0"),
        (2, 3, None, "must be an integer >= 3, got 2"),
        (257, 1, 256, r"must be an integer in \[1, 256\], got 257"),
        (True, 0, None, "got True"),
        (1.0, 0, None, "got 1.0"),
        ("3", 0, None, "got '3'"),
        (None, 0, None, "got None"),
    ],
)
def test_count_refuses_with_field_limit_and_value(
    value: object, lo: int, hi: int | None, words: str
) -> None:
    with pytest.raises(InvalidInput, match=rf"^copies: (must be .*)?{words}$") as info:
        count(value, "copies", lo, hi)
    assert info.value.field == "copies"


def test_count_raises_the_callers_error_class() -> None:
    with pytest.raises(LayoutError, match=r"^shape: "):
        count(0, "shape", 1, error=LayoutError)
    with pytest.raises(ConfigError, match=r"^copy_threads: "):
        count(0, "copy_threads", 1, 256, error=ConfigError)


@given(st.integers(), st.integers(-5, 5), st.one_of(st.none(), st.integers(-5, 5)))
def test_count_accepts_exactly_the_ints_in_range(value: int, lo: int, hi: int | None) -> None:
    inside = lo <= value and (hi is None or value <= hi)
    if inside:
        assert count(value, "n", lo, hi) == value
    else:
        with pytest.raises(InvalidInput, match=r"^n: must be "):
            count(value, "n", lo, hi)


@given(st.one_of(st.booleans(), st.floats(), st.text(), st.none(), st.binary()))
def test_count_refuses_every_non_int(value: object) -> None:
    with pytest.raises(InvalidInput, match=r"^n: "):
        count(value, "n")


def test_seconds_returns_a_float() -> None:
    assert seconds(0, "t") == 0.0 and type(seconds(0, "t")) is float
    assert seconds(2.5, "t", positive=True) == 2.5


@pytest.mark.parametrize(
    ("value", "positive", "words"),
    [
        (-0.5, False, "must be a non-negative number of seconds, got -0.5"),
        (0, True, "must be a positive number of seconds, got 0"),
        (math.inf, False, "got inf"),
        (math.nan, True, "got nan"),
        (True, False, "got True"),
        ("1", False, "got '1'"),
        (10**400, False, "got 1000"),
    ],
)
def test_seconds_refuses_with_field_and_value(value: object, positive: bool, words: str) -> None:
    with pytest.raises(InvalidInput, match=rf"^ttl_s: (must be .*)?{words}") as info:
        seconds(value, "ttl_s", positive=positive)
    assert info.value.field == "ttl_s"


@given(st.one_of(st.integers(), st.floats()), st.booleans())
def test_seconds_accepts_exactly_finite_non_negative_numbers(value: float, positive: bool) -> None:
    try:
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    ok = math.isfinite(as_float) and as_float >= 0 and not (positive and as_float == 0)
    if ok:
        assert seconds(value, "t", positive=positive) == as_float
    else:
        with pytest.raises(InvalidInput, match=r"^t: must be a "):
            seconds(value, "t", positive=positive)


@given(st.one_of(st.booleans(), st.text(), st.none(), st.binary()))
def test_seconds_refuses_every_non_number(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^wait_timeout_s: "):
        seconds(value, "wait_timeout_s", error=ConfigError)
