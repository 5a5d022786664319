"""The backend's hit queries as prepared loads (``Client.prepare_load``): on the node's host
``batch_exists`` takes the lease its load will use, so ``batch_get_v1`` is only the copies.
SGLang never says when it abandons a prefetch, so those leases must stay bounded."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvbank.client.engine import PreparedLoad
from kvbank.results import Match
from tests.integrations.sglang.conftest import require_sglang

require_sglang()

# SGLang's own modules, imported in this process here, warn about torch APIs they use
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore::UserWarning")

PAGE_TOKENS = 16


def _prepared(i: int) -> PreparedLoad:
    return PreparedLoad(Match.__new__(Match), None, 0.0, {"lease": {"id": f"lease-{i}"}})


def test_at_most_held_prepared_loads_keep_their_leases_the_oldest_handed_back() -> None:
    from kvbank.integrations.sglang.storage import _Recent

    recent = _Recent(keep=64, held=3)
    out: list[PreparedLoad] = []
    loads = [_prepared(i) for i in range(5)]
    for i, p in enumerate(loads):
        out += recent.add(b"L" * 32, [bytes([i]) * 32, b"k" * 32], p)
    assert out == loads[:2]  # the two oldest, for their leases to be given back
    got, stale = recent.take(b"L" * 32, [bytes([4]) * 32])  # a prefix of the query's keys
    assert got is loads[4] and stale is None
    got, stale = recent.take(b"L" * 32, [bytes([3]) * 32, b"x" * 32])  # not the query's keys
    assert got is None and stale is loads[3]
    assert recent.add(b"L" * 32, [], loads[2]) == [loads[2]]  # nothing to keep it for


def test_hit_queries_never_loaded_hold_at_most_eight_leases_and_a_load_uses_its_own(node: Any) -> None:
    """Twelve hit queries of twelve stored spans with no load after them (prefetches SGLang
    abandoned) leave at most eight leases on the node; the load of the last one reads its
    pages byte for byte through the lease its query took, and gives it back."""
    from kvbank import Client
    from kvbank.integrations.sglang import KvbankHiCacheStorage
    from kvbank.integrations.sglang.harness import mha_pools, page_hashes, storage_config

    _, _, host = mha_pools(tokens=12 * 2 * PAGE_TOKENS, page_size=PAGE_TOKENS, host_ratio=2.0)
    ours = KvbankHiCacheStorage(storage_config("prepared-model", {"kvbank_url": node.url}), {})
    try:
        ours.register_mem_pool_host(host)
        spans = [page_hashes(list(range(100 * i, 100 * i + 2 * PAGE_TOKENS)), PAGE_TOKENS) for i in range(12)]
        slots = []
        for i, keys in enumerate(spans):
            idx = host.alloc(2 * PAGE_TOKENS)
            g = torch.Generator().manual_seed(i)
            for k in range(0, idx.numel(), PAGE_TOKENS):
                page = host.get_data_page(int(idx[k]), flat=True)
                host.set_from_flat_data_page(int(idx[k]), torch.randn(page.numel(), generator=g).to(page.dtype))
            assert all(ours.batch_set_v1(keys, idx))
            slots.append(idx)
        with Client(node.url, channel="http") as admin:
            before = {x.id for x in admin.leases()}
            for keys in spans:
                assert ours.batch_exists(keys) == 2
            link = ours.clients.get()._chan()  # hit queries and the load: this thread's channel
            assert link is not None
            link.settle()
            held = {x.id for x in admin.leases()} - before
            assert 0 < len(held) <= 8, held
            want = [host.get_data_page(int(slots[-1][k]), flat=True).clone() for k in (0, PAGE_TOKENS)]
            target = host.alloc(2 * PAGE_TOKENS)
            assert ours.batch_get_v1(spans[-1], target) == [True, True]
            for k, page in zip((0, PAGE_TOKENS), want, strict=True):
                assert torch.equal(host.get_data_page(int(target[k]), flat=True), page)
            link.settle()
            assert len({x.id for x in admin.leases()} - before) == len(held) - 1
    finally:
        ours.close()
