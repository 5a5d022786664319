"""MLA through the kvbank backend, against a real ``kvbank serve``: SGLang's real
``MLATokenToKVPoolHost`` (one latent ``(1, kv_cache_dim)`` a token and layer) is one shard
the same on every TP rank, written once by SGLang's storage writer (TP rank 0) and loaded
by every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integrations.sglang.conftest import require_sglang

require_sglang()

# SGLang's own modules, imported in this process here, warn about torch APIs they use
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore::UserWarning")

PAGE_TOKENS = 16
PAGES = 3
MODEL = "mla-model"


def _backend(node: Any, rank: int, *, mla: bool = True) -> Any:
    """The backend SGLang's TP rank ``rank`` of 2 makes (``is_storage_writer``: rank 0 for MLA)."""
    from kvbank.integrations.sglang import KvbankHiCacheStorage
    from kvbank.integrations.sglang.harness import storage_config

    return KvbankHiCacheStorage(storage_config(MODEL, {"kvbank_url": node.url}, tp_rank=rank, tp_size=2,
                                               mla=mla), {})


def _keys(seed: int) -> list[str]:
    from kvbank.integrations.sglang.harness import page_hashes

    return page_hashes(list(range(1000 * seed, 1000 * seed + PAGES * PAGE_TOKENS)), PAGE_TOKENS)


def _fill(host: Any, seed: int) -> torch.Tensor:
    """``PAGES`` pages of random latents in fresh host slots; those slots."""
    idx = host.alloc(PAGES * PAGE_TOKENS)
    g = torch.Generator().manual_seed(seed)
    for k in range(0, idx.numel(), PAGE_TOKENS):
        n = host.get_data_page(int(idx[k]), flat=True).numel()
        host.set_from_flat_data_page(int(idx[k]), torch.randn(n, generator=g).to(host.dtype))
    return idx


def _pages(host: Any, idx: torch.Tensor) -> list[torch.Tensor]:
    """The pages at host slots ``idx``, each ``[tokens, layers, 1, dim]`` whatever the host
    pool's layout (copies)."""
    out = []
    for k in range(0, idx.numel(), PAGE_TOKENS):
        page = host.get_data_page(int(idx[k]), flat=False)
        if host.layout == "layer_first":  # [L, p, 1, C]
            page = page.transpose(0, 1)
        elif host.layout == "page_first_direct":  # [1, L, p, 1, C]
            page = page[0].transpose(0, 1)
        out.append(page.clone())
    return out


@pytest.mark.parametrize(("writer_layout", "reader_layout"),
                         [("page_first", "page_first"), ("layer_first", "layer_first"),
                          ("page_first", "page_first_direct")])
def test_mla_pages_stored_by_the_writer_rank_load_byte_for_byte_on_every_rank(
        node: Any, writer_layout: str, reader_layout: str) -> None:
    """The latent pages TP rank 0 (SGLang's storage writer) stores are found and loaded,
    byte for byte, into other host slots by rank 0 and by rank 1, whose host pool may be
    laid out differently (through ``batch_get_v1`` and through the legacy flat pages of
    ``batch_get``): one shard for every rank."""
    from kvbank.integrations.sglang.harness import mla_pools

    _, _, host0 = mla_pools(page_size=PAGE_TOKENS, layout=writer_layout)
    _, _, host1 = mla_pools(page_size=PAGE_TOKENS, layout=reader_layout)
    rank0, rank1 = _backend(node, 0), _backend(node, 1)
    try:
        rank0.register_mem_pool_host(host0)
        rank1.register_mem_pool_host(host1)
        assert (rank0.writer, rank1.writer) == (True, False)
        assert rank0._pool("kv").layout_id == rank1._pool("kv").layout_id
        keys = _keys(1)
        stored = _fill(host0, seed=1)
        want = _pages(host0, stored)
        assert rank0.batch_set_v1(keys, stored) == [True] * PAGES
        for ours, host in ((rank0, host0), (rank1, host1)):
            assert ours.batch_exists(keys) == PAGES
            target = host.alloc(PAGES * PAGE_TOKENS)
            assert ours.batch_get_v1(keys, target) == [True] * PAGES
            got = _pages(host, target)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            # the legacy calls' flat pages, put in host slots as SGLang's page_get puts them
            flat = ours.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
            assert all(page is not None for page in flat)
            target = host.alloc(PAGES * PAGE_TOKENS)
            for k, page in zip(range(0, target.numel(), PAGE_TOKENS), flat, strict=True):
                host.set_from_flat_data_page(int(target[k]), page)
            assert all(torch.equal(a, b) for a, b in zip(_pages(host, target), want, strict=True))
    finally:
        rank0.close()
        rank1.close()


def test_mla_non_writer_rank_stores_nothing(node: Any) -> None:
    """Rank 1's ``batch_set_v1`` answers True (as SGLang expects of a non-writer) and stores
    nothing: its own keys are found on no rank, and its different bytes under the writer's
    keys leave the writer's bytes in place."""
    from kvbank.integrations.sglang.harness import mla_pools

    _, _, host0 = mla_pools(page_size=PAGE_TOKENS)
    _, _, host1 = mla_pools(page_size=PAGE_TOKENS)
    rank0, rank1 = _backend(node, 0), _backend(node, 1)
    try:
        rank0.register_mem_pool_host(host0)
        rank1.register_mem_pool_host(host1)
        alone = _keys(2)
        assert rank1.batch_set_v1(alone, _fill(host1, seed=2)) == [True] * PAGES
        assert (rank0.batch_exists(alone), rank1.batch_exists(alone)) == (0, 0)
        keys = _keys(3)
        stored = _fill(host0, seed=3)
        want = _pages(host0, stored)
        assert rank0.batch_set_v1(keys, stored) == [True] * PAGES
        other = _fill(host1, seed=4)
        assert not any(torch.equal(a, b) for a, b in zip(_pages(host1, other), want, strict=True))
        assert rank1.batch_set_v1(keys, other) == [True] * PAGES
        for ours, host in ((rank0, host0), (rank1, host1)):
            target = host.alloc(PAGES * PAGE_TOKENS)
            assert ours.batch_get_v1(keys, target) == [True] * PAGES
            assert all(torch.equal(a, b) for a, b in zip(_pages(host, target), want, strict=True))
    finally:
        rank0.close()
        rank1.close()


def test_mha_backend_of_the_same_model_does_not_see_mla_rows(node: Any) -> None:
    """An MHA engine of the same model name (and TP rank) finds none of the MLA writer's
    pages and loads none: the two pools are different layouts."""
    from kvbank.integrations.sglang.harness import mha_pools, mla_pools

    _, _, host0 = mla_pools(page_size=PAGE_TOKENS)
    _, _, mha_host = mha_pools(page_size=PAGE_TOKENS)
    rank0, mha = _backend(node, 0), _backend(node, 0, mla=False)
    try:
        rank0.register_mem_pool_host(host0)
        mha.register_mem_pool_host(mha_host)
        keys = _keys(5)
        assert rank0.batch_set_v1(keys, _fill(host0, seed=5)) == [True] * PAGES
        assert rank0.batch_exists(keys) == PAGES
        assert mha.batch_exists(keys) == 0
        assert mha.batch_get_v1(keys, mha_host.alloc(PAGES * PAGE_TOKENS)) == [False] * PAGES
    finally:
        rank0.close()
        mha.close()


def test_mla_controller_backs_up_and_prefetches_latent_pages_byte_for_byte(node: Any) -> None:
    """SGLang's real ``HiCacheController`` over MLA pools, the kvbank backend attached
    through its ``dynamic`` factory: the controller's storage config says MLA (from its
    device pool) and this rank is the writer, its backup stores a prompt's latent pages
    and its prefetch loads them into fresh host slots byte for byte."""
    from kvbank.integrations.sglang.harness import Controller, mla_pools

    _, alloc, host = mla_pools(page_size=PAGE_TOKENS)
    extra = {"backend_name": "kvbank", "module_path": "kvbank.integrations.sglang",
             "class_name": "KvbankHiCacheStorage", "interface_v1": 1, "kvbank_url": node.url}
    c = Controller(alloc, host, extra=extra, model_name=MODEL, page_size=PAGE_TOKENS)
    try:
        cfg = c.cc.storage_config
        assert type(c.backend).__name__ == "KvbankHiCacheStorage"
        assert (cfg.is_mla_model, cfg.is_storage_writer) == (True, True)
        tokens = list(range(7, 7 + 5 * PAGE_TOKENS))
        assert c.store(tokens) == 5 * PAGE_TOKENS
        want = c.pages(c.stored)
        hit, loaded, idx = c.load([*tokens, 1])
        assert (hit, loaded) == (5 * PAGE_TOKENS, 5 * PAGE_TOKENS)
        assert idx is not None
        assert all(torch.equal(a, b) for a, b in zip(c.pages(idx), want, strict=True))
    finally:
        c.close()
