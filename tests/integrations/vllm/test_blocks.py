"""Block adapters on tensors laid out by vLLM's own code for every KVCacheLayout order.

The caches are made with ``vllm.v1.kv_cache_interface.create_kv_cache_views`` (what the
model runner does), K and V read the way the backends read them (the CPU backend's
``view(B, H, 2N, D).chunk(2)``; GPU backends' ``split(D, dim=-1)``). Saved pages must hold
exactly the chosen blocks' K and V; loaded blocks must equal them, other blocks and the
source pages must be unchanged.
"""

from __future__ import annotations

import pytest

from tests.integrations.vllm.conftest import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvbank import PageLayout  # noqa: E402
from kvbank.integrations.vllm.blocks import (  # noqa: E402
    KNOWN_ORDERS,
    BlockAdapter,
    Interior,
    PagePool,
    gather_group,
    scatter_group,
)
from kvbank.integrations.vllm.layout import UnsupportedCache, VllmLayout  # noqa: E402
from kvbank.layout import BufferSpec, GroupKind, LayerGroup, Role  # noqa: E402

B, H, N, D = 6, 2, 32, 64
NAME = "model.layers.0.self_attn.attn"


def make_cache(order: str, seed: int = 0) -> torch.Tensor:
    """A float32 [B, H, N, 2D] cache view in ``order``, by vLLM's allocation code."""
    layout = KVCacheLayout[order]
    spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.float32)
    strides = compute_layout_strides(spec, B, 1, layout)
    size = B * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    t = KVCacheTensor(size=size, layers=[NAME], layer_stride=strides[0], block_stride=strides[1])
    view = create_kv_cache_views(raw, spec, B, layout, t)[0]
    g = torch.Generator().manual_seed(seed)
    view.copy_(torch.randn(view.shape, generator=g))
    return view


def reference_kv(cache: torch.Tensor, interior: Interior) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V as [B, N, H, D], read the way the backend reads them."""
    if interior is Interior.SPLIT_N:
        k, v = cache.contiguous().view(B, H, 2 * N, D).chunk(2, dim=2)
    else:
        k, v = cache[..., :D], cache[..., D:]
    return k.transpose(1, 2), v.transpose(1, 2)


def vl_for() -> VllmLayout:
    layout = PageLayout(model="test", tokens_per_page=N,
                        groups=(LayerGroup(GroupKind.ATTENTION, (0,)),),
                        buffers=(BufferSpec(0, Role.KEY, "float32", (H, D), head_axis=0),
                                 BufferSpec(0, Role.VALUE, "float32", (H, D), head_axis=0)))
    return VllmLayout(layout, ((NAME,),), {NAME: 0}, N)


CASES = [(o, Interior.SPLIT_C) for o in KNOWN_ORDERS] + [("LBHNC", Interior.SPLIT_N),
                                                          ("BLHNC", Interior.SPLIT_N)]


@pytest.mark.parametrize(("order", "interior"), CASES)
def test_blocks_save_and_load_move_exactly_the_chosen_blocks(order: str, interior: Interior) -> None:
    vl = vl_for()
    src = make_cache(order, seed=1)
    ad = BlockAdapter.of(NAME, src, order, interior, D, D)
    ids = [3, 1, 5]
    pages = gather_group(vl, {NAME: ad}, 0, ids)
    views = vl.layout.views(pages, 0)
    k_ref, v_ref = reference_kv(src, interior)
    assert torch.equal(views[(0, Role.KEY)], k_ref[ids])
    assert torch.equal(views[(0, Role.VALUE)], v_ref[ids])

    dst = make_cache(order, seed=2)
    before = dst.clone()
    kept = pages.clone()
    dst_ad = BlockAdapter.of(NAME, dst, order, interior, D, D)
    scatter_group(vl, {NAME: dst_ad}, 0, pages, [4, 0, 2])
    k_dst, v_dst = reference_kv(dst, interior)
    assert torch.equal(k_dst[[4, 0, 2]], k_ref[ids])
    assert torch.equal(v_dst[[4, 0, 2]], v_ref[ids])
    untouched = [1, 3, 5]
    assert torch.equal(dst[untouched], before[untouched])
    assert torch.equal(pages, kept)  # the source pages are unchanged


@pytest.mark.parametrize(("order", "interior"), [("LBHNC", Interior.SPLIT_N), ("BLHNC", Interior.SPLIT_C)])
def test_blocks_runs_of_ids_rows_and_a_reused_buffer(order: str, interior: Interior) -> None:
    """Consecutive block ids move as one slice copy, a reused pool buffer (dirty from its
    last use) holds exactly the gathered pages, and ``rows`` picks which page each block gets."""
    vl = vl_for()
    src = make_cache(order, seed=3)
    ad = BlockAdapter.of(NAME, src, order, interior, D, D)
    pool = PagePool()
    buf = pool.take(4, vl.layout.group_page_bytes[0])
    buf.fill_(0x7F)  # what an earlier use left behind
    ids = [1, 2, 3, 5]
    pages = gather_group(vl, {NAME: ad}, 0, ids, buf)
    assert pages.data_ptr() == buf.data_ptr() and pages.shape[0] == 4
    k_ref, v_ref = reference_kv(src, interior)
    views = vl.layout.views(pages, 0)
    assert torch.equal(views[(0, Role.KEY)], k_ref[ids])
    assert torch.equal(views[(0, Role.VALUE)], v_ref[ids])
    dst = make_cache(order, seed=4)
    before = dst.clone()
    dst_ad = BlockAdapter.of(NAME, dst, order, interior, D, D)
    scatter_group(vl, {NAME: dst_ad}, 0, pages, [0, 1, 4], rows=[1, 2, 0])  # pages of ids 2, 3, 1
    k_dst, _ = reference_kv(dst, interior)
    assert torch.equal(k_dst[[0, 1, 4]], k_ref[[2, 3, 1]])
    assert torch.equal(dst[[2, 3, 5]], before[[2, 3, 5]])
    pool.give(buf)
    assert pool.take(2, vl.layout.group_page_bytes[0]) is buf  # reused, not reallocated


def test_blocks_unknown_order_is_refused_naming_it() -> None:
    cache = make_cache("LBHNC")
    with pytest.raises(UnsupportedCache, match="'LNBHC'"):
        BlockAdapter.of(NAME, cache, "LNBHC", Interior.SPLIT_C, D, D)


def test_blocks_tensor_not_in_the_declared_order_is_refused() -> None:
    cache = make_cache("LBNHC")
    with pytest.raises(UnsupportedCache, match="not the declared layout LBHNC"):
        BlockAdapter.of(NAME, cache, "LBHNC", Interior.SPLIT_C, D, D)


def test_blocks_cpu_interior_needs_head_major_blocks() -> None:
    cache = make_cache("LBNHC")
    with pytest.raises(UnsupportedCache, match="CPU layout"):
        BlockAdapter.of(NAME, cache, "LBNHC", Interior.SPLIT_N, D, D)


def test_blocks_known_orders_are_vllms() -> None:
    assert {m.name: m.value for m in KVCacheLayout} == KNOWN_ORDERS
