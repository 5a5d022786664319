"""Resume bounds, case by case, per layout family (P = 4 tokens per page throughout)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.builders import full_attention, hybrid_mamba, mla, sliding_window
from kvbank.errors import InvalidInput
from kvbank.layout import BufferSpec, GroupKind, LayerGroup, PageLayout, QuantMode, Role
from kvbank.lender.resume import (
    Columns,
    Flags,
    Obstacle,
    required_pages,
    resume_and_boundaries,
    resume_bound,
    resume_boundaries,
)

P = 4
FA = full_attention("m@1", 2, 4, 8, tokens_per_page=P)
GQA_FP8 = full_attention("m@1", 2, 2, 16, tokens_per_page=P, quant=QuantMode.FP8)
SWA_SINK = sliding_window("m@1", 2, 4, 8, window=8, sink_tokens=4, tokens_per_page=P)
SWA = sliding_window("m@1", 2, 4, 8, window=8, tokens_per_page=P)
SWA_FULL = sliding_window("m@1", 3, 4, 8, window=8, full_layers=[2], tokens_per_page=P)
MAMBA = hybrid_mamba("m@1", [0], [1], 4, 8, conv_shape=(4, 3), ssm_shape=(2, 8), tokens_per_page=P)
MLA_IDX = mla("m@1", 2, 32, tokens_per_page=P, index_key_dim=16)
# Group 1 holds only an untransferred INDEX_KEY: a 0-byte page that must never block r.
INDEX_ONLY = PageLayout(
    model="m@1",
    tokens_per_page=P,
    groups=(LayerGroup(GroupKind.ATTENTION, (0,)), LayerGroup(GroupKind.ATTENTION, (1,))),
    buffers=(
        BufferSpec(0, Role.KEY, "bfloat16", (32,)),
        BufferSpec(1, Role.INDEX_KEY, "bfloat16", (16,), transferred=False),
    ),
)


def missing(*rows: tuple[int, int]) -> set[tuple[int, int]]:
    return set(rows)


def bound(layout: PageLayout, t: int, gone: set[tuple[int, int]], state_at: set[int] | None = None):
    """Everything present except ``gone``; STATE groups hold snapshots only at ``state_at``."""

    def present(g: int, j: int) -> bool:
        if layout.groups[g].kind is GroupKind.STATE and state_at is not None:
            return (j + 1) * P in state_at and (g, j) not in gone
        return (g, j) not in gone

    return resume_bound(layout, t, present)


R = range  # pages tables read better with ranges


CASES = [
    # id, layout, T, missing, snapshots at, r, reason, blocking group, pages per group
    ("fa-all", FA, 21, missing(), None, 20, None, None, (R(5),)),
    ("fa-last-token", FA, 20, missing(), None, 16, Obstacle.LAST_TOKEN, None, (R(4),)),
    ("fa-partial-page-not-keyed", FA, 23, missing(), None, 20, None, None, (R(5),)),
    ("fa-middle-page", FA, 21, missing((0, 2)), None, 8, Obstacle.MISSING_PAGE, 0, (R(2),)),
    ("fa-first-page", FA, 21, missing((0, 0)), None, 0, Obstacle.MISSING_PAGE, 0, ((),)),
    ("fa-short", FA, 3, missing(), None, 0, None, None, ((),)),
    ("fa-one-page", FA, 4, missing(), None, 0, Obstacle.LAST_TOKEN, None, ((),)),
    ("fa-empty", FA, 0, missing(), None, 0, None, None, ((),)),
    ("gqa-fp8-middle", GQA_FP8, 33, missing((0, 6)), None, 24, Obstacle.MISSING_PAGE, 0, (R(6),)),
    ("swa-sink-all", SWA_SINK, 33, missing(), None, 32, None, None, ((0, 6, 7),)),
    ("swa-sink-outside-window", SWA_SINK, 33, missing((0, 3)), None, 32, None, None, ((0, 6, 7),)),
    ("swa-window-evicted", SWA_SINK, 33, missing((0, 7)), None, 28, Obstacle.WINDOW_EVICTED, 0,
     ((0, 5, 6),)),
    ("swa-gap-skipped", SWA_SINK, 33, missing((0, 5), (0, 6)), None, 20, Obstacle.WINDOW_EVICTED,
     0, ((0, 3, 4),)),
    ("swa-sink-evicted", SWA_SINK, 33, missing((0, 0)), None, 0, Obstacle.SINK_EVICTED, 0, ((),)),
    ("swa-no-sink-page0-gone", SWA, 33, missing((0, 0)), None, 32, None, None, ((6, 7),)),
    ("swa-early", SWA_SINK, 9, missing(), None, 8, None, None, ((0, 1),)),
    ("hybrid-all", SWA_FULL, 33, missing(), None, 32, None, None, ((6, 7), R(8))),
    ("hybrid-full-missing", SWA_FULL, 33, missing((1, 5)), None, 20, Obstacle.MISSING_PAGE, 1,
     ((3, 4), R(5))),
    ("hybrid-window-evicted", SWA_FULL, 33, missing((0, 7)), None, 28, Obstacle.WINDOW_EVICTED, 0,
     ((5, 6), R(7))),
    ("hybrid-both", SWA_FULL, 33, missing((0, 4), (1, 6)), None, 16, Obstacle.WINDOW_EVICTED, 0,
     ((2, 3), R(4))),
    ("mamba-all", MAMBA, 33, missing(), {16, 32}, 32, None, None, (R(8), (7,))),
    ("mamba-no-snapshot", MAMBA, 33, missing(), {16, 28 + 8}, 16, Obstacle.NO_SNAPSHOT, 1,
     (R(4), (3,))),
    ("mamba-kv-gap", MAMBA, 33, missing((0, 5)), {16, 32}, 16, Obstacle.NO_SNAPSHOT, 1,
     (R(4), (3,))),
    ("mamba-none", MAMBA, 33, missing(), set(), 0, Obstacle.NO_SNAPSHOT, 1, ((), ())),
    ("mamba-kv-before-snapshot", MAMBA, 33, missing((0, 2)), {16, 32}, 0, Obstacle.NO_SNAPSHOT, 1,
     ((), ())),
    ("mla-index-key", MLA_IDX, 21, missing((0, 2)), None, 8, Obstacle.MISSING_PAGE, 0, (R(2),)),
    ("untransferred-group", INDEX_ONLY, 21, missing(*((1, j) for j in range(5))), None, 20, None,
     None, (R(5), ())),
]


@pytest.mark.parametrize(
    ("layout", "t", "gone", "snaps", "r", "reason", "blocking", "pages"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_resume_bound_table(layout, t, gone, snaps, r, reason, blocking, pages) -> None:
    b = bound(layout, t, gone, snaps)
    assert b.tokens == r
    assert b.recompute_from == r
    assert b.reason is reason
    assert b.blocking_group == blocking
    assert b.pages == tuple(tuple(p) for p in pages)
    assert b.keyed_pages == t // P


def test_resume_bound_never_asks_about_untransferred_groups_or_unkeyed_pages() -> None:
    asked: list[tuple[int, int]] = []

    def present(g: int, j: int) -> bool:
        asked.append((g, j))
        return True

    b = resume_bound(INDEX_ONLY, 23, present)
    assert b.tokens == 20
    assert {g for g, _ in asked} == {0}
    assert max(j for _, j in asked) == 23 // P - 1  # the partial last page is not keyed


def test_resume_bound_fills_row_names_for_exactly_the_needed_pages() -> None:
    names = [[bytes([g, j]) * 27 for j in range(8)] for g in range(2)]
    b = resume_bound(SWA_FULL, 33, lambda g, j: (g, j) != (0, 7), names)
    assert b.tokens == 28
    assert b.rows == ((names[0][5], names[0][6]), tuple(names[1][:7]))
    assert b.needed() == [names[0][5], names[0][6], *names[1][:7]]


def test_resume_bound_refuses_bad_input() -> None:
    with pytest.raises(InvalidInput, match="prompt_tokens"):
        resume_bound(FA, -1, lambda g, j: True)
    with pytest.raises(InvalidInput, match="names"):
        resume_bound(FA, 8, lambda g, j: True, [[b"x" * 54]])


def test_required_pages_window_and_sinks() -> None:
    assert required_pages(SWA_SINK, 0, 32) == (0, 6, 7)
    assert required_pages(SWA_SINK, 0, 4) == (0,)
    assert required_pages(SWA, 0, 8) == (0, 1)
    assert required_pages(MAMBA, 1, 12) == (2,)
    assert required_pages(INDEX_ONLY, 1, 12) == ()
    big_sink = sliding_window("m@1", 1, 1, 8, window=4, sink_tokens=9, tokens_per_page=P)
    assert required_pages(big_sink, 0, 8) == (0, 1)  # sink pages only below r
    assert required_pages(big_sink, 0, 20) == (0, 1, 2, 4)


LAYOUTS = [FA, SWA_SINK, SWA, SWA_FULL, MAMBA, MLA_IDX, INDEX_ONLY]


@settings(max_examples=150, deadline=None)
@given(
    li=st.integers(0, len(LAYOUTS) - 1),
    t=st.integers(0, 60),
    holes=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 15)), max_size=12),
)
def test_resume_bound_matches_the_definition(li: int, t: int, holes: set[tuple[int, int]]) -> None:
    """r is the largest boundary <= T-1 at which every group has its required rows, and the
    bound names exactly those rows (brute force over every candidate)."""
    layout = LAYOUTS[li]
    b = resume_bound(layout, t, lambda g, j: (g, j) not in holes)
    best = 0
    for c in range(P, t, P):
        if all(
            (g, j) not in holes
            for g in range(len(layout.groups))
            for j in required_pages(layout, g, c)
        ):
            best = c
    assert b.tokens == best
    assert b.pages == tuple(required_pages(layout, g, best) for g in range(len(layout.groups)))
    if best + P <= t - 1:  # a higher boundary existed and something blocked it
        assert b.reason not in (None, Obstacle.LAST_TOKEN)
    elif best + P <= (t // P) * P:  # the next page is keyed but holds the last token
        assert b.reason is Obstacle.LAST_TOKEN
    else:
        assert b.reason is None


@settings(max_examples=150, deadline=None)
@given(
    li=st.integers(0, len(LAYOUTS) - 1),
    t=st.integers(0, 60),
    holes=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 15)), max_size=12),
)
def test_resume_boundaries_are_every_usable_boundary(li: int, t: int, holes: set[tuple[int, int]]) -> None:
    """Every boundary at which each group has its required rows is listed, and no other;
    the bound at any of them needs exactly that boundary's rows; the largest is the
    default bound."""
    layout = LAYOUTS[li]
    have = lambda g, j: (g, j) not in holes  # noqa: E731
    usable = tuple(
        c for c in range(P, t, P)
        if all(have(g, j) for g in range(len(layout.groups)) for j in required_pages(layout, g, c))
    )
    assert resume_boundaries(layout, t, have) == usable
    for r in (0, *usable):
        b = resume_bound(layout, t, have, at=r)
        assert b.tokens == r
        assert b.pages == tuple(required_pages(layout, g, r) for g in range(len(layout.groups)))
        if r + P in usable:
            assert b.reason is None
    assert resume_bound(layout, t, have, at=usable[-1] if usable else 0) == resume_bound(layout, t, have)


def test_resume_bound_at_refuses_an_unusable_boundary() -> None:
    have = lambda g, j: j != 1  # noqa: E731  page 1 gone: only r = 4 works
    assert resume_boundaries(FA, 20, have) == (4,)
    for bad in (8, 6, -4, 20, True, "4"):
        with pytest.raises(InvalidInput, match="at:"):
            resume_bound(FA, 20, have, at=bad)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(
    li=st.integers(0, len(LAYOUTS) - 1),
    t=st.integers(0, 60),
    holes=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 15)), max_size=12),
)
def test_columns_answer_as_the_presence_callable_does(li: int, t: int, holes: set[tuple[int, int]]) -> None:
    """A match hands the bound its tiers as columns (read whole, not a call per page):
    every bound, boundary list and named row is the one the callable form gives."""
    layout = LAYOUTS[li]
    n = t // P
    cols = [tuple(None if (g, j) in holes else "here" for j in range(n)) for g in range(len(layout.groups))]
    names = [tuple(bytes([g, j]) for j in range(n)) for g in range(len(layout.groups))]
    have = lambda g, j: (g, j) not in holes  # noqa: E731
    assert resume_bound(layout, t, Columns(cols), names) == resume_bound(layout, t, have, names)
    assert resume_boundaries(layout, t, Columns(cols)) == resume_boundaries(layout, t, have)
    assert resume_and_boundaries(layout, t, Columns(cols), names) == (
        resume_bound(layout, t, have, names), resume_boundaries(layout, t, have))
    flags = Flags([[x is not None for x in c] for c in cols])  # a fetch's result: booleans
    assert resume_bound(layout, t, flags, names) == resume_bound(layout, t, have, names)
    assert resume_boundaries(layout, t, flags) == resume_boundaries(layout, t, have)


def test_columns_shorter_than_the_keyed_pages_are_refused() -> None:
    with pytest.raises(InvalidInput, match="2 pages known, 5 keyed"):
        resume_bound(FA, 21, Columns([("x", "x")]))
    with pytest.raises(InvalidInput, match="2 pages known, 5 keyed"):
        resume_bound(FA, 21, Flags([[True, True]]))
