"""The reshard kernel: moved bytes match the reference, untouched bytes and sources are
unchanged, bad input moves nothing; the differential test TP 1 -> n -> m against TP 1 ->
m for every builder; a Hypothesis test over random layouts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvbank import layout as L
from kvbank.errors import InvalidInput, LayoutError, PageSizeMismatch
from kvbank.kernels.reshard import reshard_pages
from kvbank.reshard.plan import ReshardPlan, plan_reshard, shard_layout
from tests.reshard_reference import BUILDERS, COUNTS, split_reference, valid

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _random_pages(layout: L.PageLayout, group: int, count: int, seed: int,
                  device: str = "cpu") -> torch.Tensor:
    """TP 1 pages of random bytes with zero padding, as canonical pages are."""
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randint(0, 256, (count, layout.group_page_bytes[group]), dtype=torch.uint8,
                          generator=gen)
    covered = torch.zeros(layout.group_page_bytes[group], dtype=torch.bool)
    for r in layout.regions[group]:
        covered[r.offset : r.offset + r.nbytes] = True
    pages[:, ~covered] = 0
    return pages.to(device)


def _split(full: L.PageLayout, group: int, pages: torch.Tensor, n: int) -> list[torch.Tensor]:
    """TP 1 pages cut into the n ranks' pages by the kernel."""
    out = []
    for r in range(n):
        dst = shard_layout(full, n, r)
        shard = torch.full((pages.shape[0], dst.group_page_bytes[group]), 0xAB,
                           dtype=torch.uint8, device=pages.device)
        reshard_pages(plan_reshard(full, dst), group, {0: pages}, shard)
        out.append(shard)
    return out


def _reference(full: L.PageLayout, group: int, pages: torch.Tensor, dst: L.PageLayout) -> torch.Tensor:
    rows = [split_reference(full, p.cpu().numpy().astype(np.int64), group, dst) for p in pages]
    return torch.from_numpy(np.stack(rows).clip(0).astype(np.uint8))


def _differential(build_full: L.PageLayout, n: int, m: int, seed: int, device: str = "cpu") -> None:
    full = build_full
    src = shard_layout(full, n)
    for g in range(len(full.groups)):
        pages = _random_pages(full, g, 3, seed + g, device)
        before = pages.clone()
        shards = _split(full, g, pages, n)
        for r, shard in enumerate(shards):
            assert torch.equal(shard.cpu(), _reference(full, g, pages, shard_layout(full, n, r)))
        kept = [s.clone() for s in shards]
        for j in range(m):
            dst = shard_layout(full, m, j)
            out = torch.full((3, dst.group_page_bytes[g]), 0x5A, dtype=torch.uint8, device=device)
            reshard_pages(plan_reshard(src, dst), g, dict(enumerate(shards)), out)
            direct = _split(full, g, pages, m)[j]
            assert torch.equal(out, direct), (n, m, j, g)
            assert torch.equal(out.cpu(), _reference(full, g, pages, dst))
        assert all(torch.equal(a, b) for a, b in zip(shards, kept, strict=True))
        assert torch.equal(pages, before)


# ---- the differential test over every builder ----------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_reshard_differential_every_builder(name: str) -> None:
    """TP 1 -> n by the kernel, then n -> m, equals TP 1 -> m directly (and the numpy
    reference), for n, m in {1, 2, 4, 8}; counts the heads cannot take are refused."""
    build = BUILDERS[name]
    full = build(1, 0)
    for i, (n, m) in enumerate(itertools.product(COUNTS, COUNTS)):
        if valid(name, n) and valid(name, m):
            _differential(full, n, m, seed=i)
        else:
            with pytest.raises(LayoutError, match="heads"):
                shard_layout(full, n if not valid(name, n) else m)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_reshard_differential_random_layouts(data: st.DataObject) -> None:
    """Random layouts of one shape: by-head buffers (any axis, head counts that divide,
    duplicate or neither), sectioned and replicated buffers, attention and state groups."""
    n_layers = data.draw(st.integers(1, 4))
    n_state = data.draw(st.integers(0, n_layers - 1))
    groups = [L.LayerGroup(L.GroupKind.ATTENTION, tuple(range(n_state, n_layers)))]
    if n_state:
        groups.append(L.LayerGroup(L.GroupKind.STATE, tuple(range(n_state))))
    dtypes = st.sampled_from(["bfloat16", "float32", "uint8", "float8_e4m3fn"])
    buffers = []
    for layer in range(n_layers):
        roles = [L.Role.SSM_STATE, L.Role.CONV_STATE] if layer < n_state else \
            [L.Role.KEY, L.Role.VALUE, L.Role.INDEX_KEY]
        for role in data.draw(st.lists(st.sampled_from(roles), min_size=1, unique=True)):
            shape = list(data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
            kind = data.draw(st.sampled_from(["replicated", "head", "sectioned"]))
            axis = data.draw(st.integers(0, len(shape) - 1))
            sections: tuple[int, ...] = ()
            if kind == "head":
                shape[axis] = data.draw(st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
            elif kind == "sectioned":
                sections = tuple(data.draw(st.lists(st.sampled_from([8, 16]), min_size=1,
                                                    max_size=3)))
                shape[axis] = sum(sections)
            buffers.append(L.BufferSpec(
                layer, role, data.draw(dtypes), tuple(shape),
                head_axis=None if kind == "replicated" else axis, sections=sections,
                transferred=data.draw(st.booleans()) if role is L.Role.INDEX_KEY else True,
            ))
    full = L.PageLayout("random", data.draw(st.integers(1, 5)), tuple(groups), tuple(buffers))
    n, m = data.draw(st.sampled_from(COUNTS)), data.draw(st.sampled_from(COUNTS))
    try:
        shard_layout(full, n)
        shard_layout(full, m)
    except LayoutError as exc:
        assert "heads" in str(exc)  # sections of 8 and 16 always split 8 ways
        heads = [b.shape[b.head_axis] for b in buffers
                 if b.split is L.Split.HEAD and b.head_axis is not None]
        assert any(h % c and c % h for h in heads for c in (n, m))
        assume(False)
    _differential(full, n, m, seed=data.draw(st.integers(0, 1000)))


# ---- the kernel's contract ----------------------------------------------------------------------


def test_reshard_pages_leaves_untouched_bytes_and_sources_unchanged() -> None:
    """Destination pages in a larger slab: only the addressed rows change, fully; every
    byte equals the reference; the source pages are only read."""
    full = BUILDERS["gqa-fp8"](1, 0)
    pages = _random_pages(full, 0, 5, seed=1)
    shards = _split(full, 0, pages, 4)
    kept = [s.clone() for s in shards]
    dst = shard_layout(full, 2, 1)
    slab = torch.full((9, dst.group_page_bytes[0]), 0x77, dtype=torch.uint8)
    reshard_pages(plan_reshard(shard_layout(full, 4), dst), 0,
                  dict(enumerate(shards)), slab[2:7])
    assert torch.equal(slab[2:7], _reference(full, 0, pages, dst))
    assert bool((slab[:2] == 0x77).all()) and bool((slab[7:] == 0x77).all())
    assert all(torch.equal(a, b) for a, b in zip(shards, kept, strict=True))


def test_reshard_pages_strided_rows_and_padding_zeroed() -> None:
    """Source rows that are every other row of a buffer work; destination padding is zero
    even where it held junk."""
    full = BUILDERS["per-buffer-heads"](1, 0)
    pages = _random_pages(full, 0, 4, seed=2)
    src = shard_layout(full, 2)
    shards = [torch.repeat_interleave(s, 2, dim=0)[::2] for s in _split(full, 0, pages, 2)]
    assert shards[0].stride(0) == 2 * shards[0].shape[1]
    dst = shard_layout(full, 4, 3)
    out = torch.full((4, dst.group_page_bytes[0]), 0xFF, dtype=torch.uint8)
    plan = plan_reshard(src, dst)
    assert plan.groups[0].padding
    reshard_pages(plan, 0, dict(enumerate(shards)), out)
    assert torch.equal(out, _reference(full, 0, pages, dst))


def _gqa_case() -> tuple[ReshardPlan, dict[int, torch.Tensor], torch.Tensor]:
    full = BUILDERS["gqa"](1, 0)
    pages = _random_pages(full, 0, 2, seed=3)
    dst = shard_layout(full, 2, 0)
    shards = dict(enumerate(_split(full, 0, pages, 4)))
    out = torch.full((2, dst.group_page_bytes[0]), 0x11, dtype=torch.uint8)
    return plan_reshard(shard_layout(full, 4), dst), shards, out


@pytest.mark.parametrize(
    ("change", "error", "field"),
    [
        (lambda p, s, o: (p, {0: s[0]}, o), InvalidInput, r"sources\[1\]"),
        (lambda p, s, o: (p, {**s, 1: s[1][:1]}, o), InvalidInput, r"sources\[1\]: 1 pages"),
        (lambda p, s, o: (p, {**s, 0: s[0][:, :-64]}, o), PageSizeMismatch, r"sources\[0\]"),
        (lambda p, s, o: (p, {**s, 0: s[0].view(torch.int8)}, o), InvalidInput, r"sources\[0\]"),
        (lambda p, s, o: (p, {**s, 0: s[0].t().contiguous().t()}, o), InvalidInput, "contiguous"),
        (lambda p, s, o: (p, s, o[:, :-64]), PageSizeMismatch, "out"),
        (lambda p, s, o: (p, s, o.float()), InvalidInput, "out"),
        (lambda p, s, o: (p, {**s, 0: o[:, : s[0].shape[1]]}, o), InvalidInput, "overlaps out"),
        (lambda p, s, o: (p, s, o.as_strided(o.shape, (64, 1))), InvalidInput, "rows overlap"),
        (lambda p, s, o: ("plan", s, o), InvalidInput, "plan"),
        (lambda p, s, o: (p, [s[0], s[1]], o), InvalidInput, "sources"),
    ],
)
def test_reshard_pages_bad_input_moves_nothing(change: object, error: type[Exception],
                                               field: str) -> None:
    plan, shards, out = _gqa_case()
    kept = {k: v.clone() for k, v in shards.items()}
    p, s, o = change(plan, shards, out)  # type: ignore[operator]
    before = o.clone()
    with pytest.raises(error, match=field):
        reshard_pages(p, 0, s, o)
    assert torch.equal(o, before)
    assert all(torch.equal(shards[k], kept[k]) for k in shards)


def test_reshard_pages_group_out_of_range() -> None:
    plan, shards, out = _gqa_case()
    for group in (1, -1, True):
        with pytest.raises(InvalidInput, match="group"):
            reshard_pages(plan, group, shards, out)


def test_reshard_pages_no_pages_is_a_no_op() -> None:
    plan, shards, out = _gqa_case()
    reshard_pages(plan, 0, {k: v[:0] for k, v in shards.items()}, out[:0])


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("name", ["gqa", "gqa-duplicated", "hybrid-mamba", "per-buffer-heads"])
def test_reshard_pages_cuda_matches_cpu(name: str) -> None:
    full = BUILDERS[name](1, 0)
    for n, m in [(4, 2), (2, 4), (8, 1), (1, 8)]:
        _differential(full, n, m, seed=n * 10 + m, device="cuda")


@pytest.mark.cuda
@cuda
def test_reshard_pages_cuda_refuses_mixed_devices() -> None:
    plan, shards, out = _gqa_case()
    with pytest.raises(InvalidInput, match="out is on"):
        reshard_pages(plan, 0, {k: v.cuda() for k, v in shards.items()}, out)
