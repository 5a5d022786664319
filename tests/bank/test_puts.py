"""kvbank.bank.puts: a put's rules, checked and planned once for every receiver."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbank import layout as L
from kvbank.bank import puts
from kvbank.errors import InvalidInput, PageSizeMismatch
from kvbank.layout import GroupKind
from tests.golden_specs import golden_layouts

P = 16  # tokens per page in the chains below
CHAIN = [bytes([i]) * 4 for i in range(6)]  # stands for six row names, one per full page


def test_put_group_takes_a_group_of_its_kind() -> None:
    lay = golden_layouts()["hybrid-mamba"]  # group 0 ATTENTION, group 1 STATE
    assert puts.put_group(lay, 0, GroupKind.ATTENTION) == 0
    assert puts.put_group(lay, 1, GroupKind.STATE, route="put_state") == 1


@pytest.mark.parametrize(
    ("group", "kind", "words"),
    [
        (2, GroupKind.ATTENTION, r"must be an integer in \[0, 1\], got 2"),
        (True, GroupKind.ATTENTION, "got True"),
        (-1, GroupKind.ATTENTION, "got -1"),
        (1, GroupKind.ATTENTION, r"group 1 is a STATE group; put takes ATTENTION groups \(use put_state\)"),
        (0, GroupKind.STATE, "group 0 is a ATTENTION group; put takes STATE groups"),
    ],
)
def test_put_group_refuses_naming_the_field(group: object, kind: GroupKind, words: str) -> None:
    lay = golden_layouts()["hybrid-mamba"]
    other = "put_state" if kind is GroupKind.ATTENTION else None
    with pytest.raises(InvalidInput, match=rf"^header\.group: .*{words}") as info:
        puts.put_group(lay, group, kind, field="header.group", other=other)
    assert info.value.field == "header.group"


def test_put_group_refuses_a_group_that_transfers_no_bytes() -> None:
    lay = L.PageLayout(
        "m", 16,
        (L.LayerGroup(L.GroupKind.ATTENTION, (0,)), L.LayerGroup(L.GroupKind.ATTENTION, (1,))),
        (L.BufferSpec(0, L.Role.KEY, "bfloat16", (2, 8)),
         L.BufferSpec(1, L.Role.INDEX_KEY, "bfloat16", (2, 8), transferred=False)),
    )
    assert lay.group_page_bytes[1] == 0
    with pytest.raises(InvalidInput, match=r"^group: group 1 transfers no bytes"):
        puts.put_group(lay, 1, GroupKind.ATTENTION)


def test_check_page_bytes_is_a_page_size_mismatch() -> None:
    lay = golden_layouts()["hybrid-mamba"]
    puts.check_page_bytes(lay, 0, lay.group_page_bytes[0], "header.page_bytes")
    with pytest.raises(PageSizeMismatch, match=r"^header\.page_bytes: 3, the layout's page is"):
        puts.check_page_bytes(lay, 0, 3, "header.page_bytes")


@given(st.integers(0, 8), st.integers(0, 8))
def test_page_rows_are_the_chain_slice_when_it_lies_within(first: int, count: int) -> None:
    if first + count <= len(CHAIN):
        assert puts.page_rows(CHAIN, first, count) == CHAIN[first : first + count]
    else:
        with pytest.raises(InvalidInput, match=r"^pages: .*exceed the 6 full pages"):
            puts.page_rows(CHAIN, first, count)


@pytest.mark.parametrize("first", [-1, True, 1.0, None])
def test_page_rows_refuse_a_first_page_that_is_no_count(first: object) -> None:
    with pytest.raises(InvalidInput, match=r"^header\.first_page: must be a non-negative integer"):
        puts.page_rows(CHAIN, first, 1, first_field="header.first_page")


@given(st.one_of(st.none(), st.integers(-40, 140)))
def test_state_row_is_keyed_by_the_page_ending_at_the_boundary(at: int | None) -> None:
    boundary = len(CHAIN) * P if at is None else at
    if 0 < boundary <= len(CHAIN) * P and boundary % P == 0:
        assert puts.state_row(CHAIN, at, P) == CHAIN[boundary // P - 1]
    else:
        with pytest.raises(InvalidInput, match=r"^at: "):
            puts.state_row(CHAIN, at, P)


def test_state_row_refuses_an_empty_chain_and_a_bool() -> None:
    with pytest.raises(InvalidInput, match=r"^header\.at: must be a positive multiple of tokens_per_page 16, got 0"):
        puts.state_row([], None, P, field="header.at")
    with pytest.raises(InvalidInput, match="got True"):
        puts.state_row(CHAIN, True, P)


def test_state_rows_check_every_boundary_before_naming_any() -> None:
    assert puts.state_rows(CHAIN, [16, 96], 2, P) == [CHAIN[0], CHAIN[5]]
    with pytest.raises(InvalidInput, match=r"^at\[1\]: "):
        puts.state_rows(CHAIN, [16, 17], 2, P)
    with pytest.raises(InvalidInput, match=r"^at: expected one boundary per snapshot \(3\)"):
        puts.state_rows(CHAIN, [16, 32], 3, P)
