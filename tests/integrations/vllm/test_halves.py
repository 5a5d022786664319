"""Each half of the connector alone, against a real node, without a model or an engine.

vLLM's config objects are stubbed where the connector reads only a few fields; the KV-cache
specs and configs are vLLM's own classes. The worker tests are the TP shard check on the
adapter level: two ranks of one TP=2 layout, each its own kvbank shard.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tests.integrations.vllm.conftest import Node, free_port, require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from kvbank import Client  # noqa: E402
from kvbank.integrations.vllm.blocks import BlockAdapter, Interior  # noqa: E402
from kvbank.integrations.vllm.config import ConnectorConfig  # noqa: E402
from kvbank.integrations.vllm.layout import UnsupportedCache, layout_for  # noqa: E402
from kvbank.integrations.vllm.metadata import (  # noqa: E402
    KvbankMetadata,
    KvbankWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvbank.integrations.vllm.scheduler import KvbankScheduler  # noqa: E402
from kvbank.integrations.vllm.worker import KvbankWorker  # noqa: E402
from kvbank.keys import engine_keys  # noqa: E402

P, D = 32, 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def vllm_config(tp: int = 1, eps: float = 1e-6, algo: str = "sha256") -> Any:
    hf = SimpleNamespace(to_dict=lambda: {"model_type": "llama", "rms_norm_eps": eps,
                                          "_name_or_path": "/somewhere"})
    mc = SimpleNamespace(model="tiny", revision=None, hf_config=hf, dtype=torch.float32,
                         quantization=None, get_total_num_kv_heads=lambda: 2)
    return SimpleNamespace(model_config=mc,
                           cache_config=SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo=algo),
                           load_config=SimpleNamespace(load_format="auto"),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1))


def kv_config(tp: int = 1, swa: bool = False, mamba: bool = False) -> Any:
    full = FullAttentionSpec(block_size=P, num_kv_heads=2 // tp, head_size=D, dtype=torch.float32)
    groups = [KVCacheGroupSpec(LAYERS[:1] if swa else LAYERS, full)]
    if swa:
        groups.append(KVCacheGroupSpec(LAYERS[1:], SlidingWindowSpec(
            block_size=P, num_kv_heads=2 // tp, head_size=D, dtype=torch.float32, sliding_window=64)))
    if mamba:
        groups.append(KVCacheGroupSpec(["model.layers.2.mixer"], MambaSpec(
            block_size=P, shapes=((4, 8),), dtypes=(torch.float32,))))
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def hashes(n: int, seed: str) -> list[bytes]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(n)]


def request(rid: str, tokens: int, seed: str, params: dict[str, Any] | None = None) -> Any:
    return SimpleNamespace(request_id=rid, num_tokens=tokens, num_prompt_tokens=tokens,
                           block_hashes=hashes(tokens // P, seed), kv_transfer_params=params)


def blocks(*groups: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: tuple(groups))


def sched_out(new: list[tuple[str, list[list[int]], int]], scheduled: dict[str, int],
              cached: list[tuple[str, list[list[int]] | None, int]] = ()) -> Any:  # type: ignore[assignment]
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=tuple(b), num_computed_tokens=c)
                            for r, b, c in new],
        num_scheduled_tokens=scheduled,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=set(),
            new_block_ids=[None if b is None else tuple(b) for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached]))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(tmp_path_factory.mktemp("node"), free_port())
    n.start()
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture
def make_sched(node: Node) -> Iterator[Any]:
    """KvbankScheduler factory; each is shut down (its client closed) after the test."""
    made: list[KvbankScheduler] = []

    def make(kv: Any = None, conf: ConnectorConfig | None = None) -> KvbankScheduler:
        made.append(KvbankScheduler(vllm_config(), kv or kv_config(), conf or cfg(node)))
        return made[-1]

    yield make
    for s in made:
        s.shutdown()


def cfg(node: Node) -> ConnectorConfig:
    return ConnectorConfig.from_extra({"url": node.url})


def store(node: Node, sched: KvbankScheduler, req: Any, pages: int) -> None:
    """Pages 0..pages-1 of every group of ``req``, as a worker would have put them."""
    lid = sched.vl.layout_id
    keys = engine_keys(req.block_hashes, lid, sched.scope)
    with Client(node.url) as c:
        c.register(sched.vl.layout)
        for g in range(len(sched.vl.layout.groups)):
            size = sched.vl.layout.group_page_bytes[g]
            c.put(lid, group=g, pages=torch.zeros((pages, size), dtype=torch.uint8),
                  keys=keys[:pages], scope=sched.scope, shard=0)


# ---- layout ---------------------------------------------------------------------------


def test_layout_follows_vllms_groups_and_fingerprints_the_config() -> None:
    vl = layout_for(vllm_config(), kv_config(swa=True))
    assert [g.layers for g in vl.layout.groups] == [(0,), (1,)]
    assert [g.window for g in vl.layout.groups] == [None, 63]  # vLLM's S counts the query
    assert vl.layout.tokens_per_page == P
    same = layout_for(vllm_config(), kv_config(swa=True))
    assert same.layout_id == vl.layout_id
    changed = layout_for(vllm_config(eps=1e-5), kv_config(swa=True))
    assert changed.layout_id != vl.layout_id


def test_layout_tp_ranks_are_shards_of_one_layout() -> None:
    r0 = layout_for(vllm_config(tp=2), kv_config(tp=2), shard_index=0)
    r1 = layout_for(vllm_config(tp=2), kv_config(tp=2), shard_index=1)
    assert (r0.layout.shard_count, r1.layout.shard_index) == (2, 1)
    assert r0.layout_id == r1.layout_id  # shard_index is not in the id; rows name the shard
    assert r0.layout.buffers[0].shape == (1, D)


def test_layout_refuses_mamba_groups_with_a_clear_message() -> None:
    with pytest.raises(UnsupportedCache, match=r"MambaSpec.*not supported"):
        layout_for(vllm_config(), kv_config(mamba=True))


# ---- scheduler half -------------------------------------------------------------------


def test_scheduler_offers_what_kvbank_holds_beyond_the_local_hit(node: Node, make_sched: Any) -> None:
    sched = make_sched()
    req = request("a", 100, "a")
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    store(node, sched, req, 3)
    assert sched.get_num_new_matched_tokens(req, 0) == (96, False)  # 3 pages; last token recomputed
    assert sched.get_num_new_matched_tokens(req, 32) == (64, False)  # side-effect free
    sched.update_state_after_alloc(req, blocks([7, 8, 9, 10]), 64)
    meta = sched.build_connector_meta(sched_out([("a", [[7, 8, 9, 10]], 96)], {"a": 4}))
    [load] = meta.loads
    assert (load.tokens, load.local_tokens, load.block_ids, load.is_async) == (96, 32, ((7, 8, 9, 10),), False)
    assert load.keys == tuple(engine_keys(req.block_hashes, sched.vl.layout_id, sched.scope))
    assert meta.saves == []  # the loaded pages are in kvbank already
    assert sched.build_connector_meta(sched_out([], {})).loads == []  # sent once


def test_scheduler_never_offers_a_failed_request_again(node: Node, make_sched: Any) -> None:
    sched = make_sched()
    req = request("f", 100, "f")
    store(node, sched, req, 3)
    assert sched.get_num_new_matched_tokens(req, 0) == (96, False)
    sched.update_connector_output(SimpleNamespace(failed_recving=set(),
                                                  kv_connector_worker_meta=KvbankWorkerMetadata({"f"})))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.request_finished(req)  # forgotten with the request


def test_scheduler_hybrid_models_load_async(node: Node, make_sched: Any) -> None:
    sched = make_sched(kv_config(swa=True))
    req = request("h", 200, "h")
    store(node, sched, req, 6)
    assert sched.get_num_new_matched_tokens(req, 0) == (192, True)


def test_scheduler_opt_out_neither_loads_nor_saves(node: Node, make_sched: Any) -> None:
    sched = make_sched()
    req = request("o", 100, "o", {"kvbank": False})
    store(node, sched, req, 3)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.build_connector_meta(sched_out([("o", [[1, 2, 3, 4]], 0)], {"o": 100})).saves == []


def test_scheduler_plans_saves_of_completed_prompt_pages_across_chunks(node: Node, make_sched: Any) -> None:
    sched = make_sched()
    req = request("c", 100, "c")
    sched.on_new_request(req)
    m1 = sched.build_connector_meta(sched_out([("c", [[1, 2]], 0)], {"c": 64}))
    assert [(s.first_page, s.block_ids, len(s.keys)) for s in m1.saves] == [(0, ((1, 2),), 2)]
    m2 = sched.build_connector_meta(sched_out([], {"c": 36}, [("c", [[3, 4]], 64)]))
    assert [(s.first_page, s.block_ids, len(s.keys)) for s in m2.saves] == [(2, ((3,),), 3)]
    m3 = sched.build_connector_meta(sched_out([], {"c": 1}, [("c", None, 100)]))
    assert m3.saves == []  # decode tokens are not stored


def test_scheduler_dead_node_is_a_miss_never_an_error(make_sched: Any) -> None:
    dead = ConnectorConfig.from_extra({"url": f"http://127.0.0.1:{free_port()}", "retry_s": 0})
    sched = make_sched(conf=dead)
    req = request("d", 100, "d")
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.guard.down  # the breaker skips kvbank for a while
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)


# ---- worker half: TP shards -----------------------------------------------------------


def rank_cache(seed: int) -> torch.Tensor:
    """A CPU-backend cache of one rank: [blocks, 1 head, P, 2D] (LBHNC)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((16, 1, P, 2 * D), generator=g)


def workers(node: Node) -> list[tuple[KvbankWorker, dict[str, torch.Tensor]]]:
    out = []
    for rank in (0, 1):
        w = KvbankWorker(vllm_config(tp=2), kv_config(tp=2), cfg(node), rank=rank,
                         interior=Interior.SPLIT_N)
        caches = {name: rank_cache(10 * rank + i) for i, name in enumerate(LAYERS)}
        w.register_kv_caches(caches)
        out.append((w, caches))
    return out


def kv_of(cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
    ad = BlockAdapter.of("x", cache, "LBHNC", Interior.SPLIT_N, D, D)
    return torch.cat([ad.key[ids], ad.value[ids]])


def test_worker_each_tp_rank_loads_its_own_shard(node: Node) -> None:
    """Both ranks store blocks 1..3 (each its own KV heads); a load into fresh caches on
    rank 1 gets rank 1's heads — never rank 0's, which the scheduler's shard-0 match names."""
    (w0, c0), (w1, c1) = workers(node)
    keys = tuple(engine_keys(hashes(3, "tp"), w0.vl.layout_id, w0.scope))
    save = KvbankMetadata(saves=[SaveSpec("r", keys, 0, ((1, 2, 3),))])
    for w in (w0, w1):
        w.wait_for_save(save)
        w.drain()
    assert not torch.equal(kv_of(c0[LAYERS[0]], [1, 2, 3]), kv_of(c1[LAYERS[0]], [1, 2, 3]))
    fresh = {name: torch.zeros_like(t) for name, t in c1.items()}
    w1.register_kv_caches(fresh)
    w1.start_load_kv(KvbankMetadata(loads=[LoadSpec("r", keys, 96, 0, ((4, 5, 6, 7),), False)]))
    assert w1.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(kv_of(fresh[name], [4, 5, 6]), kv_of(c1[name], [1, 2, 3]))
        assert not fresh[name][7].any()  # the block past r is not written
    for w in (w0, w1):
        w.shutdown()


def moved_out(node: Node) -> float:
    import httpx

    text = httpx.get(f"{node.url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvbank_moved_bytes_total{") and 'direction="out"' in line)


def test_worker_load_past_vllms_own_hit_fetches_only_those_pages(node: Node) -> None:
    """vLLM holds pages 0-1 itself (local_tokens = 64): the load fetches pages 2-3 only
    (the node sends two pages' bytes), writes exactly their blocks, and leaves the blocks
    of vLLM's own pages alone."""
    (w0, c0), (w1, _) = workers(node)
    keys = tuple(engine_keys(hashes(4, "partial"), w0.vl.layout_id, w0.scope))
    w0.wait_for_save(KvbankMetadata(saves=[SaveSpec("p", keys, 0, ((1, 2, 3, 4),))]))
    w0.drain()
    fresh = {name: torch.zeros_like(t) for name, t in c0.items()}
    w0.register_kv_caches(fresh)
    before = moved_out(node)
    w0.start_load_kv(KvbankMetadata(loads=[LoadSpec("p", keys, 128, 64, ((5, 6, 7, 8, 9),), False)]))
    assert w0.get_block_ids_with_load_errors() == set()
    assert moved_out(node) - before == 2 * w0.vl.layout.group_page_bytes[0]
    for name in LAYERS:
        assert torch.equal(kv_of(fresh[name], [7, 8]), kv_of(c0[name], [3, 4]))
        assert not fresh[name][[5, 6, 9]].any()  # vLLM's own pages, and the block past r
    for w in (w0, w1):
        w.shutdown()


def test_worker_rank_whose_shard_is_missing_fails_its_load(node: Node) -> None:
    """Only rank 0 stored: rank 1's load fails (its blocks reported, the request sent to
    the scheduler's failure memory) instead of loading rank 0's heads."""
    (w0, _), (w1, c1) = workers(node)
    keys = tuple(engine_keys(hashes(3, "half"), w0.vl.layout_id, w0.scope))
    w0.wait_for_save(KvbankMetadata(saves=[SaveSpec("q", keys, 0, ((1, 2, 3),))]))
    w0.drain()
    before = {n: t.clone() for n, t in c1.items()}
    w1.start_load_kv(KvbankMetadata(loads=[LoadSpec("q", keys, 96, 0, ((4, 5, 6, 7),), False)]))
    assert w1.get_block_ids_with_load_errors() == {4, 5, 6}
    meta = w1.build_worker_meta()
    assert meta is not None and meta.failed == {"q"}
    assert all(torch.equal(c1[n], before[n]) for n in LAYERS)
    for w in (w0, w1):
        w.shutdown()


def test_worker_async_load_reports_done_and_failed(node: Node) -> None:
    (w0, _), (w1, _) = workers(node)
    keys = tuple(engine_keys(hashes(2, "async"), w0.vl.layout_id, w0.scope))
    w0.wait_for_save(KvbankMetadata(saves=[SaveSpec("s", keys, 0, ((1, 2),))]))
    w0.drain()
    for w, ok in ((w0, True), (w1, False)):
        w.start_load_kv(KvbankMetadata(loads=[LoadSpec("s", keys, 64, 0, ((3, 4, 5),), True)]))
        w._loading["s"].result(10)
        done, failed = w.get_transfer_results()
        assert done == {"s"} and failed == (set() if ok else {"s"})
        w.shutdown()


def test_scheduler_a_promised_load_reaches_the_worker_even_with_the_breaker_down(
        node: Node, make_sched: Any) -> None:
    """Once vLLM counts external tokens the worker must load them or report the load failed:
    a node failure between lookup and allocation (breaker down) still plans the load, and
    an allocation the lookup did not answer plans one that fails on the worker."""
    sched = make_sched()
    req = request("p", 100, "p")
    store(node, sched, req, 3)
    assert sched.get_num_new_matched_tokens(req, 0) == (96, False)
    sched.guard._down_until = float("inf")  # another request's lookup found the node dead
    sched.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 96)
    other = request("u", 100, "u")
    sched.update_state_after_alloc(other, blocks([5, 6, 7, 8]), 64)  # never looked up
    plans = {s.req_id: s for s in sched.build_connector_meta(sched_out([], {})).loads}
    assert len(plans["p"].keys) == 3 and plans["p"].tokens == 96
    assert plans["u"].keys == () and plans["u"].tokens == 64
    w = KvbankWorker(vllm_config(), kv_config(), cfg(node), rank=0, interior=Interior.SPLIT_N)
    w.register_kv_caches({name: torch.zeros((16, 2, P, 2 * D)) for name in LAYERS})
    w.start_load_kv(KvbankMetadata(loads=[plans["u"]]))
    assert w.get_block_ids_with_load_errors() == {5, 6}
    w.shutdown()


# ---- the connector class vLLM loads ---------------------------------------------------


def connector(node: Node, role: Any, policy: str = "fail", **extra: Any) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbank.integrations.vllm import KvbankConnector

    conf = vllm_config()
    conf.kv_transfer_config = SimpleNamespace(
        kv_connector_extra_config={"url": node.url, **extra}, kv_load_failure_policy=policy,
        is_kv_producer=True)
    return KvbankConnector(conf, getattr(KVConnectorRole, role), kv_config())


def test_connector_sets_recompute_policy_unless_told_to_keep(node: Node) -> None:
    c = connector(node, "SCHEDULER")
    assert c._kv_transfer_config.kv_load_failure_policy == "recompute"
    kept = connector(node, "SCHEDULER", keep_failure_policy=True)
    assert kept._kv_transfer_config.kv_load_failure_policy == "fail"
    for x in (c, kept):
        x.shutdown()


def test_connector_never_raises_into_vllm_and_planned_loads_still_go_out(node: Node) -> None:
    """A request or a scheduler output of a shape the connector does not expect is a miss
    (lookups) or a step without saves (metadata) — and a load already promised to vLLM is
    still sent to the worker."""
    c = connector(node, "SCHEDULER")
    assert c.get_num_new_matched_tokens(SimpleNamespace(request_id="x"), 0) == (0, False)
    req = request("l", 100, "l")
    store(node, c.sched, req, 3)
    assert c.get_num_new_matched_tokens(req, 0) == (96, False)
    c.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 96)
    meta = c.build_connector_meta(SimpleNamespace())  # no fields at all
    assert [s.req_id for s in meta.loads] == ["l"]
    c.update_connector_output(object())
    assert c.request_finished_all_groups(req, ([1, 2, 3, 4],)) == (False, None)
    c.shutdown()


# ---- the engine calls: batched lookups, handles, pins --------------------------------


def flush_releases(sched: KvbankScheduler) -> None:
    """Wait for the handle releases the scheduler queued (they run off its loop)."""
    if sched._releaser is not None:
        sched._releaser.submit(lambda: None).result(30)


def node_leases(node: Node, *loaded: KvbankWorker) -> int:
    """The node's live leases, after the one-way acknowledgements of the loads ``loaded``
    made on this thread are applied (another client's count does not wait for them)."""
    for w in loaded:
        link = w.clients.get()._chan()
        if link is not None:
            link.settle()
    with Client(node.url) as c:
        return len(c.leases())


def test_scheduler_looks_up_the_waiting_requests_in_one_call(node: Node, make_sched: Any) -> None:
    sched = make_sched()
    reqs = [request(f"b{i}", 100, f"b{i}") for i in range(5)]
    for i, r in enumerate(reqs):
        store(node, sched, r, i % 4)
        sched.on_new_request(r)
    answers = [sched.get_num_new_matched_tokens(r, 0) for r in reqs]
    assert answers == [(0, False), (32, False), (64, False), (96, False), (0, False)]
    assert sched.stats["match_calls"] == 1  # the first ask answered all five
    # a local hit covering a page kvbank lacks asks again, for that request alone
    assert sched.get_num_new_matched_tokens(reqs[0], 32) == (0, False)
    assert sched.stats["match_calls"] == 2
    for r in reqs:
        sched.request_finished(r)
    flush_releases(sched)


def test_scheduler_handle_loads_each_tp_rank_its_own_shard_then_is_released(node: Node) -> None:
    """The scheduler's lookup (shard 0) goes to the workers as a handle; rank 1 loads by it
    its own heads (the node translates), the pin holds every rank's rows until the load is
    over, and the next step releases it."""
    (w0, c0), (w1, c1) = workers(node)
    req = request("t", 100, "tp-handle")
    keys = tuple(engine_keys(req.block_hashes, w0.vl.layout_id, w0.scope))
    save = KvbankMetadata(saves=[SaveSpec("t", keys, 0, ((1, 2, 3),))])
    for w in (w0, w1):
        w.wait_for_save(save)
        w.drain()
    sched = KvbankScheduler(vllm_config(tp=2), kv_config(tp=2), cfg(node))
    try:
        before = node_leases(node)
        sched.on_new_request(req)
        assert sched.get_num_new_matched_tokens(req, 0) == (96, False)
        assert node_leases(node) == before + 1  # the pin: both ranks' rows
        sched.update_state_after_alloc(req, blocks([4, 5, 6, 7]), 96)
        meta = sched.build_connector_meta(sched_out([("t", [[4, 5, 6, 7]], 0)], {"t": 100}))
        [load] = meta.loads
        assert load.handle is not None
        fresh = {name: torch.zeros_like(t) for name, t in c1.items()}
        w1.register_kv_caches(fresh)
        w1.start_load_kv(KvbankMetadata(loads=[load]))
        assert w1.get_block_ids_with_load_errors() == set()
        for name in LAYERS:
            assert torch.equal(kv_of(fresh[name], [4, 5, 6]), kv_of(c1[name], [1, 2, 3]))
            assert not torch.equal(kv_of(fresh[name], [4, 5, 6]), kv_of(c0[name], [1, 2, 3]))
        sched.build_connector_meta(sched_out([], {}))  # the next step: the sync load is over
        flush_releases(sched)
        assert node_leases(node, w1) == before
    finally:
        sched.shutdown()
        for w in (w0, w1):
            w.shutdown()


def test_scheduler_releases_the_handle_of_a_preempted_request(node: Node, make_sched: Any) -> None:
    sched = make_sched()
    req = request("pre", 100, "pre")
    store(node, sched, req, 3)
    before = node_leases(node)
    assert sched.get_num_new_matched_tokens(req, 0) == (96, False)
    assert node_leases(node) == before + 1
    out = sched_out([], {})
    out.preempted_req_ids = {"pre"}
    sched.build_connector_meta(out)
    flush_releases(sched)
    assert node_leases(node) == before


def test_worker_a_handle_gone_falls_back_to_the_keys(node: Node) -> None:
    """A load whose handle the node no longer keeps (a restart, its hold_s) matches by the
    page keys instead: the same rows, loaded."""
    (w0, c0), _ = workers(node)
    keys = tuple(engine_keys(hashes(3, "gone"), w0.vl.layout_id, w0.scope))
    w0.wait_for_save(KvbankMetadata(saves=[SaveSpec("g", keys, 0, ((1, 2, 3),))]))
    w0.drain()
    fresh = {name: torch.zeros_like(t) for name, t in c0.items()}
    w0.register_kv_caches(fresh)
    w0.start_load_kv(KvbankMetadata(loads=[LoadSpec("g", keys, 96, 0, ((4, 5, 6, 7),), False, "0" * 32)]))
    assert w0.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(kv_of(fresh[name], [4, 5, 6]), kv_of(c0[name], [1, 2, 3]))
    w0.shutdown()
