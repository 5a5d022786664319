"""Resharding from layouts alone: compatibility, shard layouts and the plan, against brute
force (tests/reshard_reference.py)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from kvbank import builders as B
from kvbank import layout as L
from kvbank.errors import InvalidInput, LayoutError
from kvbank.reshard.plan import check_compatible, plan_reshard, refusal, shard_layout
from tests.reshard_reference import BUILDERS, COUNTS, split_reference, valid

PAIRS = [
    (name, n, m)
    for name in sorted(BUILDERS)
    for n, m in itertools.product(COUNTS, COUNTS)
    if valid(name, n) and valid(name, m)
]


# ---- shard layouts and logical ids ------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_shard_layout_equals_the_builder_at_every_count(name: str) -> None:
    """Resharding a declaration gives exactly what the builder declares at that count, so
    a layout id found by resharding is the id a worker at that size registers."""
    build = BUILDERS[name]
    full = build(1, 0)
    for n in COUNTS:
        if not valid(name, n):
            continue
        for r in range(n):
            want = build(n, r)
            got = shard_layout(full, n, r)
            assert got == want and got.layout_id == want.layout_id
            assert got.shard_index == r
            assert want.logical_id == full.layout_id == full.logical_id
            assert want.unsharded() == full
            assert shard_layout(want, 1) == full


def test_logical_id_is_shared_by_shard_counts_and_nothing_else() -> None:
    ids = {B.full_attention("m", 4, 8, 128, shard_count=n).logical_id for n in (1, 2, 4, 8, 16)}
    assert len(ids) == 1
    assert B.full_attention("m", 4, 8, 128, shard_count=2).layout_id not in ids
    others = [
        B.full_attention("m2", 4, 8, 128),
        B.full_attention("m", 4, 8, 64),
        B.full_attention("m", 4, 4, 128),
        B.full_attention("m", 4, 8, 128, quant=L.QuantMode.FP8),
        B.full_attention("m", 4, 8, 128, dtype="float16"),
    ]
    assert not ids & {o.logical_id for o in others}


def test_duplicated_heads_are_declared_and_keep_one_encoding() -> None:
    """8 KV heads at TP 16: one head a rank, two ranks a head; a head count the default
    already implies is dropped, so the same split never has two ids."""
    tp16 = B.full_attention("m", 2, 8, 128, shard_count=16, shard_index=5)
    assert {b.shape for b in tp16.buffers} == {(1, 128)}
    assert {b.heads for b in tp16.buffers} == {8}
    assert all(b.split is L.Split.HEAD for b in tp16.buffers)
    tp8 = B.full_attention("m", 2, 8, 128, shard_count=8)
    assert {b.heads for b in tp8.buffers} == {None}
    spelled = dataclasses.replace(
        tp8, buffers=tuple(dataclasses.replace(b, heads=8) for b in tp8.buffers)
    )
    assert spelled == tp8 and spelled.layout_id == tp8.layout_id


def test_shard_layout_refuses_heads_that_neither_divide_nor_duplicate() -> None:
    full = B.full_attention("m", 2, 6, 64)
    for n in (4, 8, 9):
        with pytest.raises(LayoutError, match=r"buffers\[0\] \(layer 0, KEY\)\.heads"):
            shard_layout(full, n)
    assert shard_layout(full, 3).buffers[0].shape == (2, 64)
    assert shard_layout(full, 12 // 2).buffers[0].shape == (1, 64)  # 6 heads over 6 ranks


def test_shard_layout_refuses_sections_that_do_not_divide() -> None:
    full = BUILDERS["hybrid-mamba"](1, 0)
    with pytest.raises(LayoutError, match=r"CONV_STATE\)\.sections"):
        shard_layout(full, 16)  # the 8-channel B and C sections do not split 16 ways
    with pytest.raises(LayoutError, match="shard_count"):
        shard_layout(full, 0)
    with pytest.raises(InvalidInput, match="layout"):
        shard_layout("not a layout", 2)  # type: ignore[arg-type]


# ---- compatibility --------------------------------------------------------------------------

_BASE = B.full_attention("m", 2, 8, 64, shard_count=4)


@pytest.mark.parametrize(
    ("other", "field"),
    [
        (B.full_attention("other", 2, 8, 64, shard_count=2), "model"),
        (B.full_attention("m", 2, 8, 64, tokens_per_page=32, shard_count=2), "tokens_per_page"),
        (B.full_attention("m", 2, 8, 128, shard_count=2), r"buffers\[0\]\.shape\[1\]"),
        (B.full_attention("m", 2, 4, 64, shard_count=2), r"buffers\[0\]\.shape\[0\]"),
        (B.full_attention("m", 2, 8, 64, dtype="float16", shard_count=2), r"buffers\[0\]\.dtype"),
        (B.full_attention("m", 3, 8, 64, shard_count=2), "buffers: 4 entries"),
        (B.full_attention("m", 2, 8, 64, quant=L.QuantMode.FP8, shard_count=2), "buffers"),
        (B.sliding_window("m", 2, 8, 64, window=64, shard_count=2), r"groups\[0\]\.window"),
    ],
)
def test_reshard_refusal_names_the_field(other: L.PageLayout, field: str) -> None:
    reason = refusal(_BASE, other)
    assert reason is not None
    assert reason == refusal(_BASE, other)
    with pytest.raises(LayoutError, match=field):
        check_compatible(_BASE, other)
    with pytest.raises(LayoutError, match=field):
        plan_reshard(_BASE, other)


def test_reshard_compatible_across_counts_and_indices() -> None:
    for n, m in itertools.product((1, 2, 4, 8, 16), repeat=2):
        a = B.full_attention("m", 2, 8, 64, shard_count=n, shard_index=n - 1)
        b = B.full_attention("m", 2, 8, 64, shard_count=m)
        assert refusal(a, b) is None
    with pytest.raises(InvalidInput, match="dst"):
        refusal(_BASE, object())  # type: ignore[arg-type]


# ---- the plan against brute force --------------------------------------------------------------


@pytest.mark.parametrize(("name", "n", "m"), PAIRS)
def test_plan_matches_brute_force(name: str, n: int, m: int) -> None:
    """Every destination byte of every region is written by exactly one copy, with the
    byte the reference split puts there; padding is left to zero; only the named source
    shards are read."""
    build = BUILDERS[name]
    full = build(1, 0)
    src = build(n, 0)
    for g in range(len(full.groups)):
        labels = np.arange(full.group_page_bytes[g], dtype=np.int64)
        shards = [split_reference(full, labels, g, build(n, r)) for r in range(n)]
        for j in range(m):
            dst = build(m, j)
            want = split_reference(full, labels, g, dst)
            gp = plan_reshard(src, dst).groups[g]
            got = np.full(gp.dst_page_bytes, -1, dtype=np.int64)
            writes = np.zeros(gp.dst_page_bytes, dtype=np.int64)
            for c in gp.copies:
                assert c.source in gp.sources
                for s0, d0, length in c.ranges():
                    assert s0 >= 0 and s0 + length <= gp.src_page_bytes
                    got[d0 : d0 + length] = shards[c.source][s0 : s0 + length]
                    writes[d0 : d0 + length] += 1
            assert np.array_equal(got, want)
            pad = np.zeros(gp.dst_page_bytes, dtype=bool)
            for a, b in gp.padding:
                pad[a:b] = True
            assert np.array_equal(writes, np.where(pad, 0, 1))
            assert np.array_equal(want == -1, pad)
            assert gp.sources == tuple(sorted({c.source for c in gp.copies}))


def test_plan_sources_for_the_common_cases() -> None:
    def gqa(n: int, r: int = 0) -> L.PageLayout:
        return B.full_attention("m", 32, 8, 128, shard_count=n, shard_index=r)

    for j in range(2):
        plan = plan_reshard(gqa(4), gqa(2, j))
        assert plan.sources == (2 * j, 2 * j + 1)
        assert len(plan.groups[0].copies) == 2  # one strided copy per source, all 64 buffers
    for j in range(4):
        plan = plan_reshard(gqa(2), gqa(4, j))
        assert plan.sources == (j // 2,) and len(plan.groups[0].copies) == 1
    # duplicated heads come from one holder, spread over the holders by destination rank
    assert plan_reshard(gqa(16), gqa(8, 3)).sources in ((6,), (7,))
    assert {plan_reshard(gqa(16), gqa(8, j)).sources[0] % 2 for j in range(8)} == {0, 1}
    # replicated: one source, the destination's rank modulo the source count
    mla = BUILDERS["mla"]
    assert [plan_reshard(mla(4, 0), mla(2, j)).sources for j in range(2)] == [(0,), (1,)]
    assert plan_reshard(mla(2, 0), mla(8, 5)).sources == (1,)


def test_plan_takes_replicated_bytes_from_a_source_already_needed() -> None:
    """The per-buffer-heads layout mixes by-head and replicated buffers: the replicated one
    adds no source row to fetch."""
    build = BUILDERS["per-buffer-heads"]
    for n, m in itertools.product(COUNTS, COUNTS):
        for j in range(m):
            dst = build(m, j)
            index_key = dst.region(0, 0, L.Role.INDEX_KEY)
            inside: set[int] = set()
            outside: set[int] = set()
            for c in plan_reshard(build(n, 0), dst).groups[0].copies:
                for _, d0, length in c.ranges():
                    hit = d0 < index_key.offset + index_key.nbytes and index_key.offset < d0 + length
                    (inside if hit else outside).add(c.source)
            assert inside and inside <= outside


# ---- the bench suite ----------------------------------------------------------------------------


def test_bench_reshard_quick_rows() -> None:
    """The suite prints the case names the issue fixes, with same-run baselines."""
    from kvbank.bench import SUITES
    from kvbank.bench.reshard import run

    assert SUITES["reshard"] == "kvbank.bench.reshard"
    rows = [r for r in run(quick=True) if not r.case.endswith("-cuda")]
    assert [r.case for r in rows] == ["reshard-4to2", "reshard-2to4", "match-1000-cross-tp"]
    for r in rows:
        assert r.suite == "reshard" and r.metric == ("ms" if r.case.startswith("match") else "GB/s")
        assert r.value > 0 and r.baseline_value > 0
        assert r.ratio == round(r.value / r.baseline_value, 4)


def test_plan_is_cached_per_source_count_and_destination_rank() -> None:
    src = B.full_attention("cache", 2, 8, 64, shard_count=4)
    dst = B.full_attention("cache", 2, 8, 64, shard_count=2, shard_index=1)
    plan = plan_reshard(src, dst)
    assert plan_reshard(src.with_shard(3), dst) is plan
    other = plan_reshard(src, dst.with_shard(0))
    assert other is not plan and other.sources == (0, 1) and plan.sources == (2, 3)
