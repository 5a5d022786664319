"""Page gather/scatter between a worker's pool layout and canonical pages.

Checks in the style of vLLM's kv_offload kernel tests: moved pages match, untouched
blocks are unchanged, the source is unchanged; a Hypothesis round trip over random pool
shapes, split and fused.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.builders import full_attention, hybrid_mamba
from kvbank.errors import InvalidInput, PageSizeMismatch, TierUnavailable
from kvbank.kernels.pages import _gather, _resolve, _scatter, _spans, gather_pages, scatter_pages
from kvbank.layout import BufferSpec, GroupKind, LayerGroup, PageLayout, QuantMode, Role

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BLOCKS = 12


def _pool(layout: PageLayout, group: int, blocks: int = BLOCKS, seed: int = 0,
          device: str = "cpu") -> dict[tuple[int, Role], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kind = layout.groups[group].kind
    pool = {}
    for region in layout.regions[group]:
        b = region.buffer
        per = (layout.tokens_per_page, *b.shape) if kind is GroupKind.ATTENTION else b.shape
        raw = torch.randint(0, 256, (blocks, region.nbytes), dtype=torch.uint8, generator=gen)
        pool[(b.layer, b.role)] = raw.view(getattr(torch, b.dtype)).view(blocks, *per).to(device)
    return pool


def _expected_page(layout: PageLayout, group: int, pool: dict[tuple[int, Role], torch.Tensor],
                   block: int) -> torch.Tensor:
    page = torch.zeros(layout.group_page_bytes[group], dtype=torch.uint8)
    for region in layout.regions[group]:
        t = pool[(region.buffer.layer, region.buffer.role)][block]
        page[region.offset : region.offset + region.nbytes] = t.contiguous().view(torch.uint8).reshape(-1).cpu()
    return page


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes hold NaNs, which torch.equal calls unequal)."""
    return a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _clone(pool: dict[tuple[int, Role], torch.Tensor]) -> dict[tuple[int, Role], torch.Tensor]:
    return {k: v.clone() for k, v in pool.items()}


LAYOUTS = {
    "gqa-bf16": (full_attention("m", 3, 2, 16, tokens_per_page=4), 0),
    "fp8-with-scales": (full_attention("m", 2, 2, 32, tokens_per_page=4, quant=QuantMode.FP8), 0),
    # 3-byte token rows: regions need padding and cannot use wide word views
    "odd-int8": (PageLayout("m", 4, (LayerGroup(GroupKind.ATTENTION, (0, 1)),),
                            (BufferSpec(0, Role.KEY, "int8", (3,)),
                             BufferSpec(1, Role.KEY, "int8", (5,)))), 0),
    "mamba-state": (hybrid_mamba("m", [0], [1, 2], 2, 8, conv_shape=(4, 3),
                                 ssm_shape=(2, 5, 3), tokens_per_page=4), 1),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("staging", [False, True])
def test_gather_pages_matches_pool_blocks_and_zero_pads(name: str, staging: bool) -> None:
    layout, group = LAYOUTS[name]
    pool = _pool(layout, group)
    before = _clone(pool)
    ids = [7, 2, 2, 11, 0]
    out = torch.full((len(ids), layout.group_page_bytes[group]), 0xEE, dtype=torch.uint8)
    _gather(pool, ids, layout, group, out, staging=staging)
    for i, block in enumerate(ids):
        assert torch.equal(out[i], _expected_page(layout, group, pool, block))
    for key in pool:  # the source is unchanged
        assert _eq(pool[key], before[key])


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("staging", [False, True])
def test_scatter_pages_moves_pages_and_leaves_other_blocks(name: str, staging: bool) -> None:
    layout, group = LAYOUTS[name]
    src_pool = _pool(layout, group, seed=1)
    pages = torch.empty((3, layout.group_page_bytes[group]), dtype=torch.uint8)
    gather_pages(src_pool, [4, 5, 6], layout, group, pages)
    pages_before = pages.clone()

    dst_pool = _pool(layout, group, seed=2)
    dst_before = _clone(dst_pool)
    targets = [9, 0, 3]
    _scatter(pages, dst_pool, torch.tensor(targets), layout, group, staging=staging)
    for key, t in dst_pool.items():
        for src_block, dst_block in zip([4, 5, 6], targets, strict=True):
            assert _eq(t[dst_block], src_pool[key][src_block])
        untouched = [b for b in range(BLOCKS) if b not in targets]
        assert _eq(t[untouched], dst_before[key][untouched])
    assert torch.equal(pages, pages_before)  # the source is unchanged


def test_scatter_pages_ignores_padding_bytes() -> None:
    layout, group = LAYOUTS["odd-int8"]
    pool = _pool(layout, group)
    pages = torch.empty((1, layout.group_page_bytes[group]), dtype=torch.uint8)
    gather_pages(pool, [1], layout, group, pages)
    noisy = pages.clone()
    first = layout.regions[group][0]
    noisy[0, first.offset + first.nbytes :layout.regions[group][1].offset] = 0x55
    fresh = _pool(layout, group, seed=9)
    scatter_pages(noisy, fresh, [1], layout, group)
    for key in pool:
        assert _eq(fresh[key][1], pool[key][1])


def test_gather_pages_strided_pool_blocks() -> None:
    """A vLLM-style combined [blocks, 2, tokens, heads, dim] cache: K and V are views with
    a block stride twice their block size; each block is still contiguous."""
    layout = full_attention("m", 1, 2, 8, tokens_per_page=4)
    kv = torch.randn(BLOCKS, 2, 4, 2, 8).to(torch.bfloat16)
    pool = {(0, Role.KEY): kv[:, 0], (0, Role.VALUE): kv[:, 1]}
    out = torch.empty((2, layout.group_page_bytes[0]), dtype=torch.uint8)
    gather_pages(pool, [3, 8], layout, 0, out)
    for i, block in enumerate([3, 8]):
        assert torch.equal(out[i], _expected_page(layout, 0, pool, block))
    target = torch.zeros_like(kv)
    scatter_pages(out, {(0, Role.KEY): target[:, 0], (0, Role.VALUE): target[:, 1]},
                  [1, 2], layout, 0)
    assert _eq(target[1], kv[3]) and _eq(target[2], kv[8])
    assert not target[[0, *range(3, BLOCKS)]].view(torch.uint8).any()


def test_neighbour_regions_fuse_only_when_the_pool_holds_them_side_by_side() -> None:
    """K and V of a combined cache move as one span; the same views swapped (V first in
    memory) or a pool of separate tensors stay separate spans, and every shape moves the
    right bytes to the right blocks."""
    layout = full_attention("m", 2, 2, 8, tokens_per_page=4)
    kv = [torch.randn(BLOCKS, 2, 4, 2, 8).to(torch.bfloat16) for _ in range(2)]
    fused = {(layer, role): kv[layer][:, i] for layer in range(2)
             for i, role in enumerate((Role.KEY, Role.VALUE))}
    swapped = {(layer, role): kv[layer][:, 1 - i] for layer in range(2)
               for i, role in enumerate((Role.KEY, Role.VALUE))}
    split = _pool(layout, 0)
    pages = torch.empty((1, layout.group_page_bytes[0]), dtype=torch.uint8)
    for pool, spans in ((fused, 2), (swapped, 4), (split, 4)):
        resolved, _ = _resolve(pool, layout, 0, 1, pages, "pages")
        assert len(_spans(resolved)) == spans
        ids = [5, 0, 11]
        out = torch.empty((3, layout.group_page_bytes[0]), dtype=torch.uint8)
        gather_pages(pool, ids, layout, 0, out)
        for i, block in enumerate(ids):
            assert torch.equal(out[i], _expected_page(layout, 0, pool, block))
        target = {k: torch.zeros_like(v) for k, v in pool.items()}
        scatter_pages(out, target, [1, 2, 3], layout, 0)
        for key, t in target.items():
            for src_block, dst_block in zip(ids, [1, 2, 3], strict=True):
                assert _eq(t[dst_block], pool[key][src_block])
            assert not t[[0, *range(4, BLOCKS)]].contiguous().view(torch.uint8).any()


@pytest.mark.parametrize("name", ["gqa-bf16", "odd-int8"])
def test_cpu_moves_split_over_threads_match_one_thread(name: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A gather or scatter split by rows over several threads moves exactly what one
    thread does: every page right, untouched blocks unchanged."""
    from kvbank.kernels import pages as kernel

    layout, group = LAYOUTS[name]
    blocks = 64
    pool = _pool(layout, group, blocks=blocks, seed=3)
    ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(4))[:41]
    monkeypatch.setattr(kernel, "PARALLEL_BYTES", 1)  # split even these small moves
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        out = torch.empty((41, layout.group_page_bytes[group]), dtype=torch.uint8)
        gather_pages(pool, ids, layout, group, out)
        for i, block in enumerate(ids.tolist()):
            assert torch.equal(out[i], _expected_page(layout, group, pool, block))
        target = _pool(layout, group, blocks=blocks, seed=5)
        before = _clone(target)
        dest = torch.randperm(blocks, generator=torch.Generator().manual_seed(6))[:41]
        scatter_pages(out, target, dest, layout, group)
    finally:
        torch.set_num_threads(threads)
    moved = set(dest.tolist())
    for key, t in target.items():
        for src_block, dst_block in zip(ids.tolist(), dest.tolist(), strict=True):
            assert _eq(t[dst_block], pool[key][src_block])
        untouched = [b for b in range(blocks) if b not in moved]
        assert _eq(t[untouched], before[key][untouched])


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 3), heads=st.integers(1, 3), dim=st.sampled_from([1, 3, 8]),
       tokens=st.integers(1, 4), blocks=st.integers(1, 24), fused=st.booleans(),
       dtype=st.sampled_from(["bfloat16", "float32", "int8"]), data=st.data())
def test_round_trip_is_bit_exact_for_split_and_fused_pools(
    layers: int, heads: int, dim: int, tokens: int, blocks: int, fused: bool, dtype: str,
    data: st.DataObject,
) -> None:
    """For any pool shape, a gather writes each block's bytes at its region's offset, and a
    scatter of those pages into another pool makes the target blocks bit-equal to the
    source blocks while every other block keeps its bytes."""
    layout = full_attention("m", layers, heads, dim, tokens_per_page=tokens, dtype=dtype)
    count = data.draw(st.integers(0, blocks))
    ids = data.draw(st.permutations(range(blocks)))[:count]
    targets = data.draw(st.permutations(range(blocks)))[:count]
    gen = torch.Generator().manual_seed(blocks * 31 + count)
    tdtype = getattr(torch, dtype)

    def make() -> dict[tuple[int, Role], torch.Tensor]:
        if not fused:
            return _pool(layout, 0, blocks=blocks, seed=int(torch.randint(0, 1 << 30, (1,), generator=gen)))
        pool = {}
        for layer in range(layers):  # FlashInfer's [blocks, 2, P, heads, dim]: K, V side by side
            raw = torch.randint(0, 256, (blocks, 2 * tokens * heads * dim * tdtype.itemsize),
                                dtype=torch.uint8, generator=gen)
            kv = raw.view(tdtype).view(blocks, 2, tokens, heads, dim)
            pool[(layer, Role.KEY)], pool[(layer, Role.VALUE)] = kv[:, 0], kv[:, 1]
        return pool

    src, dst = make(), make()
    src_before, dst_before = _clone(src), _clone(dst)
    pages = torch.full((count, layout.group_page_bytes[0]), 0xEE, dtype=torch.uint8)
    gather_pages(src, ids, layout, 0, pages)
    for i, block in enumerate(ids):
        assert torch.equal(pages[i], _expected_page(layout, 0, src, block))
    scatter_pages(pages, dst, targets, layout, 0)
    for key, t in dst.items():
        assert _eq(src[key], src_before[key])
        for src_block, dst_block in zip(ids, targets, strict=True):
            assert _eq(t[dst_block], src[key][src_block])
        untouched = [b for b in range(blocks) if b not in set(targets)]
        assert not untouched or _eq(t[untouched], dst_before[key][untouched])


def test_gather_pages_empty_ids_is_a_no_op() -> None:
    layout, group = LAYOUTS["gqa-bf16"]
    gather_pages(_pool(layout, group), [], layout, group,
                 torch.empty((0, layout.group_page_bytes[group]), dtype=torch.uint8))


# ---- validation --------------------------------------------------------------------------


def _setup() -> tuple[PageLayout, dict[tuple[int, Role], torch.Tensor], torch.Tensor]:
    layout, _ = LAYOUTS["gqa-bf16"]
    return layout, _pool(layout, 0), torch.empty((2, layout.group_page_bytes[0]), dtype=torch.uint8)


def test_gather_pages_missing_buffer_raises() -> None:
    layout, pool, out = _setup()
    del pool[(1, Role.VALUE)]
    with pytest.raises(InvalidInput, match=r"layer 1, VALUE"):
        gather_pages(pool, [0, 1], layout, 0, out)


def test_gather_pages_wrong_dtype_raises() -> None:
    layout, pool, out = _setup()
    pool[(0, Role.KEY)] = pool[(0, Role.KEY)].to(torch.float16)
    with pytest.raises(InvalidInput, match="dtype"):
        gather_pages(pool, [0, 1], layout, 0, out)


def test_gather_pages_wrong_shape_raises() -> None:
    layout, pool, out = _setup()
    pool[(0, Role.KEY)] = pool[(0, Role.KEY)][:, :3]
    with pytest.raises(InvalidInput, match="shape"):
        gather_pages(pool, [0, 1], layout, 0, out)


def test_gather_pages_wrong_page_size_raises_page_size_mismatch() -> None:
    layout, pool, _ = _setup()
    with pytest.raises(PageSizeMismatch, match="pages of"):
        gather_pages(pool, [0], layout, 0, torch.empty((1, 64), dtype=torch.uint8))


def test_gather_pages_wrong_out_rows_or_dtype_raise() -> None:
    layout, pool, out = _setup()
    with pytest.raises(InvalidInput, match="2 pages for 3 block ids"):
        gather_pages(pool, [0, 1, 2], layout, 0, out)
    with pytest.raises(InvalidInput, match="uint8"):
        gather_pages(pool, [0, 1], layout, 0, out.view(torch.int16))


@pytest.mark.parametrize("bad", [[0, BLOCKS], [-1, 0]])
def test_gather_pages_block_id_out_of_range_raises(bad: list[int]) -> None:
    layout, pool, out = _setup()
    with pytest.raises(InvalidInput, match="outside the pool"):
        gather_pages(pool, bad, layout, 0, out)


def test_gather_pages_bad_group_and_ids_raise() -> None:
    layout, pool, out = _setup()
    with pytest.raises(InvalidInput, match="group"):
        gather_pages(pool, [0, 1], layout, 1, out)
    with pytest.raises(InvalidInput, match="integers"):
        gather_pages(pool, [0, 1.5], layout, 0, out)  # type: ignore[list-item]
    with pytest.raises(InvalidInput, match="integer tensor"):
        gather_pages(pool, torch.tensor([0.0, 1.0]), layout, 0, out)


def test_scatter_pages_duplicate_ids_raise_and_change_nothing() -> None:
    layout, pool, out = _setup()
    before = _clone(pool)
    with pytest.raises(InvalidInput, match="duplicate"):
        scatter_pages(out, pool, [3, 3], layout, 0)
    for key in pool:
        assert _eq(pool[key], before[key])


@pytest.mark.parametrize("row_stride", [0, 768])
def test_gather_pages_out_rows_that_overlap_raise_before_any_write(row_stride: int) -> None:
    """An ``out`` whose rows share bytes (an expanded row, a stride under the page size) is
    refused before anything is written: torch raised a bare RuntimeError for the first
    and wrote one page over another for the second."""
    layout, pool, _ = _setup()
    page_bytes = layout.group_page_bytes[0]
    assert row_stride < page_bytes
    base = torch.full((3 * page_bytes,), 0xEE, dtype=torch.uint8)
    out = base.as_strided((3, page_bytes), (row_stride, 1))
    with pytest.raises(InvalidInput, match=r"out: rows overlap"):
        gather_pages(pool, [0, 1, 2], layout, 0, out)
    assert bool((base == 0xEE).all())


def test_pages_sharing_memory_with_the_pool_raise_and_change_nothing() -> None:
    """Pages that alias a pool tensor are refused before anything moves: a gather into
    them overwrote pool blocks as it read them."""
    layout, pool, _ = _setup()
    page_bytes = layout.group_page_bytes[0]
    before = _clone(pool)
    key = pool[(0, Role.KEY)]
    alias = key.view(torch.uint8).view(-1)[: 2 * page_bytes].view(2, page_bytes)
    with pytest.raises(InvalidInput, match=r"out: shares memory with pool\[\(0, KEY\)\]"):
        gather_pages(pool, [5, 6], layout, 0, alias)
    with pytest.raises(InvalidInput, match=r"pages: shares memory with pool\[\(0, KEY\)\]"):
        scatter_pages(alias, pool, [5, 6], layout, 0)
    for k in pool:
        assert _eq(pool[k], before[k])


def test_block_ids_beyond_int64_or_complex_raise_invalid_input() -> None:
    """torch raised a bare ValueError ("Overflow when unpacking long") for the first and
    took the real part of the second."""
    layout, pool, out = _setup()
    with pytest.raises(InvalidInput, match="outside int64"):
        gather_pages(pool, [0, 1 << 64], layout, 0, out)
    with pytest.raises(InvalidInput, match="outside int64"):
        scatter_pages(out, pool, [-(1 << 63) - 1, 0], layout, 0)
    with pytest.raises(InvalidInput, match="integer tensor"):
        gather_pages(pool, torch.tensor([0j, 1j]), layout, 0, out)


def test_a_torch_failure_during_a_move_leaves_as_a_typed_error() -> None:
    """A pool on the meta device passes every check (dtypes, shapes) but holds no bytes:
    torch's NotImplementedError leaves as TierUnavailable with it as the cause, as do the
    block ids of a meta tensor, and ``out`` keeps its bytes."""
    layout, pool, out = _setup()
    meta = {k: torch.empty_like(v, device="meta") for k, v in pool.items()}
    out.fill_(0xEE)
    with pytest.raises(TierUnavailable, match="gather_pages: 2 pages from meta into cpu") as info:
        gather_pages(meta, [0, 1], layout, 0, out)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert bool((out == 0xEE).all())
    with pytest.raises(TierUnavailable, match="block_ids") as info:
        gather_pages(pool, torch.empty(2, dtype=torch.long, device="meta"), layout, 0, out)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_gather_pages_non_contiguous_block_raises() -> None:
    layout, pool, out = _setup()
    key = (0, Role.KEY)
    t = pool[key]
    pool[key] = t.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, heads strided
    with pytest.raises(InvalidInput, match="contiguous"):
        gather_pages(pool, [0, 1], layout, 0, out)


@pytest.mark.cuda
@cuda
def test_gather_scatter_cuda_pool_with_host_pages() -> None:
    layout, group = LAYOUTS["gqa-bf16"]
    pool = _pool(layout, group, device="cuda")
    cpu_pool = {k: v.cpu() for k, v in pool.items()}
    out = torch.empty((3, layout.group_page_bytes[group]), dtype=torch.uint8)
    gather_pages(pool, [5, 1, 9], layout, group, out)
    for i, block in enumerate([5, 1, 9]):
        assert torch.equal(out[i], _expected_page(layout, group, cpu_pool, block))
    target = {k: torch.zeros_like(v) for k, v in pool.items()}
    scatter_pages(out, target, [0, 2, 4], layout, group)
    for key in pool:
        assert _eq(target[key][[0, 2, 4]].cpu(), cpu_pool[key][[5, 1, 9]])
        assert not target[key][[1, 3, *range(5, BLOCKS)]].view(torch.uint8).any()


def test_cpu_lanes_leave_torch_thread_counts_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lanes make their own torch ops serial, but the caller's intra-op thread count and
    the count a thread started afterwards begins with stay what they were; the moved
    pages are right when the lanes are built again (as after a fork)."""
    import threading

    from kvbank.kernels import pages as kernel

    layout, group = LAYOUTS["gqa-bf16"]
    pool = _pool(layout, group, blocks=32, seed=7)
    ids = torch.randperm(32, generator=torch.Generator().manual_seed(8))[:20]
    monkeypatch.setattr(kernel, "PARALLEL_BYTES", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        monkeypatch.setattr(kernel, "_lanes_pid", -1)  # as in a forked child: start new lanes
        out = torch.empty((20, layout.group_page_bytes[group]), dtype=torch.uint8)
        gather_pages(pool, ids, layout, group, out)
        assert kernel._lanes_pid == os.getpid() and kernel._lanes_size == 3
        lanes = kernel._lanes
        assert lanes is not None
        assert [lanes.submit(torch.get_num_threads).result() for _ in range(3)] == [1, 1, 1]
        assert torch.get_num_threads() == 3
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [3]
    finally:
        torch.set_num_threads(threads)
    for i, block in enumerate(ids.tolist()):
        assert torch.equal(out[i], _expected_page(layout, group, pool, block))
