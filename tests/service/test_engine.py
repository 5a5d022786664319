"""The engine-facing calls (``match_many``, ``fetch_into``, ``put_from``,
``release_match``) on an embedded Bank and on a Client against a real ``kvbank serve``
(its shared-memory path, and off its host through staging), with the same assertions:
the pool is a *permuted* view (vLLM's CPU order, ``[B, H, N, D]`` read as ``[B, N, H, D]``),
moved blocks hold the stored pages, untouched blocks stay as they were, the source pool
is unchanged; pages the engine holds move no bytes; a handle loads on any shard, with that
shard's bytes; a pin holds rows until released; the breaker answers a dead node at once."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvbank import Bank, Client, full_attention, sliding_window
from kvbank.config import BankConfig
from kvbank.errors import FetchNotFound, InvalidInput, TierUnavailable
from kvbank.layout import PageLayout, Role
from kvbank.service.launch import NodeProcess
from kvbank.testing.servers import free_port

P, H, D, L = 4, 2, 8, 2
LAYOUT = full_attention("engine-calls@1", num_layers=L, num_kv_heads=H, head_dim=D, tokens_per_page=P,
                        dtype="float32")
PAGE = LAYOUT.group_page_bytes[0]
BLOCKS = 24
_seq = itertools.count(1)


def fresh_keys(n: int) -> list[bytes]:
    """An engine's key chain (16-byte keys, as vLLM's xxhash) no other test uses."""
    base = next(_seq)
    return [base.to_bytes(8, "big") + i.to_bytes(8, "big") for i in range(n)]


def cache(layers: list[int], seed: int, heads: int = H) -> dict[int, torch.Tensor]:
    """vLLM CPU-style per-layer caches ``[B, H, 2N, D]`` (K rows then V rows a head)."""
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randn(BLOCKS, heads, 2 * P, D, generator=g) for i in layers}


def pool_of(caches: dict[int, torch.Tensor]) -> dict[tuple[int, Role], torch.Tensor]:
    """Each layer's K and V as ``[B, N, H, D]`` views of its cache (strided, not contiguous)."""
    out = {}
    for i, t in caches.items():
        kv = t.view(t.shape[0], t.shape[1], 2, P, D)
        out[(i, Role.KEY)] = kv[:, :, 0].transpose(1, 2)
        out[(i, Role.VALUE)] = kv[:, :, 1].transpose(1, 2)
    return out


def counting(client: Client) -> list[str]:
    """The control calls' paths ``client`` makes from now on (less the one-time
    ``/v1/node`` a first use of the node's segment asks)."""
    calls: list[str] = []
    inner = client._call

    def call(method: str, path: str, **kw: Any) -> Any:
        if path != "/v1/node":
            calls.append(path)
        return inner(method, path, **kw)

    client._call = call  # type: ignore[method-assign]
    return calls


@pytest.fixture(scope="module")
def bank() -> Iterator[Bank]:
    with Bank.open(host_bytes="64M", device_bytes=0) as b:
        yield b


@pytest.fixture(params=["bank", "shm", "staged"])
def api(request: pytest.FixtureRequest, bank: Bank) -> Iterator[Any]:
    if request.param == "bank":
        yield bank
        return
    node: NodeProcess = request.getfixturevalue("node")
    with Client(node.url, same_host=request.param == "shm", data_plane=False) as c:
        yield c


def test_put_from_then_fetch_into_a_permuted_pool(api: Any) -> None:
    lid = api.register(LAYOUT)
    keys = fresh_keys(6)
    src = cache(list(range(L)), 1)
    before = {i: t.clone() for i, t in src.items()}
    names = api.put_from(lid, pool=pool_of(src), block_ids={0: [3, 5, 7, 9, 11, 13]}, keys=keys)
    assert len(names[0]) == 6 and all(isinstance(n, bytes) for n in names[0])
    assert all(torch.equal(src[i], before[i]) for i in src)  # the source is unchanged
    (b,) = api.match_many(lid, [keys], prompt_tokens=[6 * P + 1], hold=True)
    assert b.tokens == 6 * P and b.missing == ((),) and b.handle is not None
    dst = {i: torch.zeros(BLOCKS, H, 2 * P, D) for i in range(L)}
    got = api.fetch_into(b.handle, pool=pool_of(dst), block_ids={0: [20, 2, 4, 6, 8, 10]})
    assert got.complete and got.resume.tokens == 6 * P and got.nbytes == 6 * PAGE
    assert got.delivered == ((0, 1, 2, 3, 4, 5),)
    moved = dict(zip([3, 5, 7, 9, 11, 13], [20, 2, 4, 6, 8, 10], strict=True))
    for i in range(L):
        for s, d in moved.items():
            assert torch.equal(dst[i][d], src[i][s])
        untouched = [k for k in range(BLOCKS) if k not in moved.values()]
        assert not dst[i][untouched].any()  # blocks the load did not name stay as they were
    assert api.release_match(b.handle) is True
    assert api.release_match(b.handle) is False


def test_fetch_into_skips_the_pages_the_engine_holds(api: Any) -> None:
    lid = api.register(LAYOUT)
    keys = fresh_keys(8)
    src = cache(list(range(L)), 2)
    api.put_from(lid, pool=pool_of(src), block_ids={0: list(range(8))}, keys=keys)
    (b,) = api.match_many(lid, [keys], prompt_tokens=[8 * P + 1], have_pages=[5], hold=True)
    assert b.tokens == 8 * P and b.handle is not None
    dst = {i: torch.full((BLOCKS, H, 2 * P, D), 7.0) for i in range(L)}
    got = api.fetch_into(b.handle, pool=pool_of(dst), block_ids={0: [None] * 5 + [15, 16, 17]})
    assert got.complete and got.nbytes == 3 * PAGE and got.delivered == ((5, 6, 7),)
    for i in range(L):
        assert torch.equal(dst[i][15:18], src[i][5:8])
        assert bool((dst[i][:15] == 7.0).all())  # the held pages' blocks were not written
    # an explicit start page on a plain match does the same
    m = api.match(LAYOUT.layout_id, keys=keys, prompt_tokens=8 * P + 1)
    got = api.fetch_into(m, pool=pool_of(dst), block_ids={0: [None] * 6 + [15, 16]}, start_page=6)
    assert got.complete and got.nbytes == 2 * PAGE
    api.release_match(b.handle)


def test_match_many_answers_bounds_boundaries_and_missing_pages(api: Any) -> None:
    lid = api.register(LAYOUT)
    keys = fresh_keys(6)
    api.put_from(lid, pool=pool_of(cache(list(range(L)), 3)), block_ids={0: [0, 1, 2, None, 4]},
                 keys=keys[:5])
    bounds = api.match_many(lid, [keys, keys[:2], fresh_keys(3)], prompt_tokens=[6 * P + 1, None, None],
                            have_pages=[0, 0, 0])
    full, short, miss = bounds
    assert (full.tokens, full.boundaries, full.missing) == (3 * P, (P, 2 * P, 3 * P), ((3, 5),))
    assert short.tokens == P  # two keyed pages, no more prompt: the last page is computed
    assert (miss.tokens, miss.missing) == (0, ((0, 1, 2),))
    assert all(b.handle is None for b in bounds)  # a pure query without hold
    # the engine holds page 3 itself: the bound goes past the page kvbank lacks
    (held,) = api.match_many(lid, [keys], prompt_tokens=[6 * P + 1], have_pages=[4])
    assert held.tokens == 5 * P and held.missing == ((5,),)


def test_handles_and_matches_load_the_callers_shard(api: Any) -> None:
    """A handle (or a Match) taken for shard 0 loads shard 1's own rows on rank 1, never
    shard 0's bytes (the TP hole: the rows are the same size)."""
    layouts = [full_attention("engine-tp@1", num_layers=L, num_kv_heads=2 * H, head_dim=D, tokens_per_page=P,
                              dtype="float32", shard_count=2, shard_index=s) for s in range(2)]
    lid = api.register(layouts[0])
    assert api.register(layouts[1]) == lid
    keys = fresh_keys(4)
    per_shard = [cache(list(range(L)), 10 + s) for s in range(2)]
    for s in range(2):
        api.put_from(lid, pool=pool_of(per_shard[s]), block_ids={0: [0, 1, 2, 3]}, keys=keys, shard=s)
    (b,) = api.match_many(lid, [keys], prompt_tokens=[4 * P + 1], shard=0, hold=True, pin=True)
    assert b.pinned
    m = api.match(lid, keys=keys, prompt_tokens=4 * P + 1, shard=0)
    for target in (b.handle, m):
        dst = {i: torch.zeros(BLOCKS, H, 2 * P, D) for i in range(L)}
        got = api.fetch_into(target, pool=pool_of(dst), block_ids={0: [4, 5, 6, 7]}, shard=1)
        assert got.complete and got.resume.tokens == 4 * P
        for i in range(L):
            assert torch.equal(dst[i][4:8], per_shard[1][i][0:4])
            assert not torch.equal(dst[i][4:8], per_shard[0][i][0:4])
    assert api.release_match(b.handle)


def test_a_pin_holds_the_rows_of_every_shard_until_released(api: Any) -> None:
    lid = api.register(LAYOUT)
    keys = fresh_keys(3)
    api.put_from(lid, pool=pool_of(cache(list(range(L)), 4)), block_ids={0: [0, 1, 2]}, keys=keys)
    before = {x.id for x in api.leases()}
    (b,) = api.match_many(lid, [keys], prompt_tokens=[3 * P + 1], hold=True, pin=True, ttl_s=60)
    pins = [x for x in api.leases() if x.id not in before]
    assert b.pinned and len(pins) == 1 and len(pins[0].rows) == 3
    assert api.release_match(b.handle) is True
    assert not [x for x in api.leases() if x.id not in before]
    with pytest.raises(FetchNotFound):
        api.fetch_into(b.handle, pool=pool_of(cache(list(range(L)), 0)), block_ids={0: [0, 1, 2]})


def test_put_from_covers_several_groups_of_one_key_range(api: Any) -> None:
    """A sliding-window + full model: one put_from stores both groups; pages outside the
    window (None) are not stored, and the load needs only the window's."""
    layout: PageLayout = sliding_window("engine-swa@1", num_layers=2, num_kv_heads=H, head_dim=D, window=2 * P,
                                        full_layers=[1], tokens_per_page=P, dtype="float32")
    lid = api.register(layout)
    keys = fresh_keys(6)
    src = cache([0, 1], 5)
    names = api.put_from(lid, pool=pool_of(src), block_ids={0: [None, None, None, 3, 4, 5], 1: [0, 1, 2, 3, 4, 5]},
                         keys=keys)
    assert [len(names[0]), len(names[1])] == [3, 6]
    (b,) = api.match_many(lid, [keys], prompt_tokens=[6 * P + 1], hold=True)
    assert b.tokens == 6 * P and b.missing == ((0, 1, 2), ())
    dst = cache([0, 1], 6)
    got = api.fetch_into(b.handle, pool=pool_of(dst), block_ids={0: [None] * 4 + [14, 15], 1: list(range(10, 16))})
    assert got.complete and got.delivered == ((4, 5), (0, 1, 2, 3, 4, 5))
    assert torch.equal(dst[0][14:16], src[0][4:6]) and torch.equal(dst[1][10:16], src[1][0:6])
    api.release_match(b.handle)


def test_fetch_into_refuses_a_pool_that_cannot_take_the_load(api: Any) -> None:
    lid = api.register(LAYOUT)
    keys = fresh_keys(2)
    api.put_from(lid, pool=pool_of(cache(list(range(L)), 7)), block_ids={0: [0, 1]}, keys=keys)
    (b,) = api.match_many(lid, [keys], prompt_tokens=[2 * P + 1], hold=True)
    assert b.handle is not None
    before = {x.id for x in api.leases()}
    dst = {i: torch.zeros(BLOCKS, H, 2 * P, D) for i in range(L)}
    with pytest.raises(InvalidInput, match="block_ids"):
        api.fetch_into(b.handle, pool=pool_of(dst), block_ids={0: [3]})  # no block for page 1
    with pytest.raises(InvalidInput, match="twice"):
        api.fetch_into(b.handle, pool=pool_of(dst), block_ids={0: [3, 3]})
    with pytest.raises(InvalidInput, match="block_ids"):  # never "not needed", as None is
        api.fetch_into(b.handle, pool=pool_of(dst), block_ids={0: [3, -1]})
    with pytest.raises(InvalidInput, match=rf"block_ids.*\[0, {BLOCKS}\)"):
        api.fetch_into(b.handle, pool=pool_of(dst), block_ids={0: [3, BLOCKS]})
    with pytest.raises(InvalidInput, match="block_ids"):  # a bool is not a block id
        api.fetch_into(b.handle, pool=pool_of(dst), block_ids={0: [3, True]})
    half = pool_of(dst)
    del half[(1, Role.VALUE)]
    with pytest.raises(InvalidInput, match="layer 1 VALUE"):
        api.fetch_into(b.handle, pool=half, block_ids={0: [3, 4]})
    assert not dst[0].any() and not dst[1].any()  # nothing moved
    assert {x.id for x in api.leases()} == before  # and nothing is held
    api.release_match(b.handle)


def test_the_breaker_answers_a_dead_node_at_once_then_probes_again(node: NodeProcess) -> None:
    dead = Client(f"http://127.0.0.1:{free_port()}", retry_s=0)
    with dead:
        with pytest.raises(TierUnavailable):
            dead.match_many(b"\0" * 32, [[b"k"]])
        assert dead.breaker.open
        calls = counting(dead)
        for _ in range(100):  # a scheduler step each: none touches the network
            with pytest.raises(TierUnavailable, match="not asked again"):
                dead.match_many(b"\0" * 32, [[b"k"]])
        assert calls == []
    with Client(node.url) as live:
        lid = live.register(LAYOUT)
        live.breaker.trip("test")
        with pytest.raises(TierUnavailable, match="not asked again"):
            live.match_many(lid, [fresh_keys(1)])
        live.breaker.cool_s = 0.0
        live.breaker.trip("test")  # a cool-down of 0: the next call probes the node
        assert live.match_many(lid, [fresh_keys(1)])[0].tokens == 0
        assert not live.breaker.open


def test_a_handle_and_its_pin_expire_at_their_ttl() -> None:
    now = [1000.0]
    config = BankConfig().replace(host_bytes="16M", device_bytes=0)
    with Bank(config, clock=lambda: now[0], reaper=False) as b:
        lid = b.register(LAYOUT)
        keys = fresh_keys(2)
        b.put_from(lid, pool=pool_of(cache(list(range(L)), 8)), block_ids={0: [0, 1]}, keys=keys)
        (h,) = b.match_many(lid, [keys], prompt_tokens=[2 * P + 1], hold=True, pin=True, ttl_s=5)
        assert h.pinned and h.handle is not None and len(b.leases()) == 1
        now[0] += 6
        assert b.leases() == ()  # the pin ended at its ttl
        with pytest.raises(FetchNotFound):
            b.fetch_into(h.handle, pool=pool_of(cache(list(range(L)), 0)), block_ids={0: [0, 1]})
        assert b.release_match(h.handle) is False
        b.check_invariants()


def test_match_many_is_one_call_for_many_prompts(node: NodeProcess) -> None:
    with Client(node.url) as c:
        lid = c.register(LAYOUT)
        calls = counting(c)
        bounds = c.match_many(lid, [fresh_keys(4) for _ in range(32)])
        assert len(bounds) == 32 and calls == ["/v1/engine/match"]


def test_on_the_nodes_host_a_load_and_a_put_are_two_control_calls_each(node: NodeProcess) -> None:
    """fetch_into: the plan and its lease, then the release with what arrived; put_from of
    two groups: the plan and one WRITE lease, then the commit (the copies go through the
    node's segment, not the socket). Over HTTP: the local channel would carry the commit."""
    layout = sliding_window("engine-calls-swa@1", num_layers=2, num_kv_heads=H, head_dim=D, window=2 * P,
                            full_layers=[1], tokens_per_page=P, dtype="float32")
    with Client(node.url, same_host=True, channel="http") as c:
        lid = c.register(layout)
        keys = fresh_keys(4)
        calls = counting(c)
        c.put_from(lid, pool=pool_of(cache([0, 1], 9)), block_ids={0: [None, 1, 2, 3], 1: [0, 1, 2, 3]}, keys=keys)
        assert calls[0] == "/v1/engine/put" and calls[1].endswith("/commit") and len(calls) == 2, calls
        (b,) = c.match_many(lid, [keys], prompt_tokens=[4 * P + 1], hold=True)
        assert b.handle is not None
        del calls[:]
        got = c.fetch_into(b.handle, pool=pool_of(cache([0, 1], 0)), block_ids={0: [0, 1, 2, 3], 1: [4, 5, 6, 7]})
        assert got.complete and calls == ["/v1/engine/load", "/v1/engine/loaded"], calls


def test_on_the_nodes_host_a_load_goes_over_the_local_channel(node: NodeProcess) -> None:
    """With a local channel, fetch_into's plan and release are its LOAD and LOADED: no
    HTTP call, and the same result and bytes as the HTTP routes answer; a node whose
    HELLO does not offer them is asked over HTTP."""
    with Client(node.url, channel="local") as c, Client(node.url, same_host=True, channel="http") as h:
        lid = c.register(LAYOUT)
        keys = fresh_keys(5)
        src = cache(list(range(L)), 15)
        c.put_from(lid, pool=pool_of(src), block_ids={0: [2, 4, 6, 8, 10]}, keys=keys)
        link = c._chan()
        assert link is not None and link.loads
        (b,) = c.match_many(lid, [keys], prompt_tokens=[5 * P + 1], have_pages=[1], hold=True)
        assert b.handle is not None
        h.layout(lid)  # known to both clients before the calls are counted
        got = {}
        dst = {}
        for name, client in (("local", c), ("http", h)):
            dst[name] = {i: torch.zeros(BLOCKS, H, 2 * P, D) for i in range(L)}
            calls = counting(client)
            got[name] = client.fetch_into(b.handle, pool=pool_of(dst[name]), block_ids={0: [None, 1, 3, None, 7]})
            assert calls == ([] if name == "local" else ["/v1/engine/load", "/v1/engine/loaded"]), (name, calls)
        for r in got.values():
            assert not r.complete and r.delivered == ((1, 2, 4),) and r.missing == ((3,),)
            assert r.nbytes == 3 * PAGE and r.resume.tokens == 3 * P
        assert got["local"].resume == got["http"].resume
        for i in range(L):
            assert torch.equal(dst["local"][i], dst["http"][i])
            assert torch.equal(dst["local"][i][1], src[i][4]) and torch.equal(dst["local"][i][3], src[i][6])
            assert torch.equal(dst["local"][i][7], src[i][10])
        assert not {lease.id for lease in c.leases()} & {r.fetch_id for r in got.values()}  # released
        link.loads = False  # as after the HELLO of a node without LOAD: over HTTP
        calls = counting(c)
        again = c.fetch_into(b.handle, pool=pool_of(dst["local"]), block_ids={0: [None, 1, 3, None, 7]})
        assert calls == ["/v1/engine/load", "/v1/engine/loaded"] and again.delivered == ((1, 2, 4),)
        c.release_match(b.handle)


@pytest.mark.parametrize("channel", ["local", "http"])
def test_a_stale_load_acknowledgement_is_refused_alike(node: NodeProcess, channel: str) -> None:
    """LOADED of a lease that is no open load (acknowledged already, or never lent) is
    InvalidInput on the channel as on HTTP; a load's lease dropped with its connection."""
    with Client(node.url, same_host=True, channel=channel) as c:
        lid = c.register(LAYOUT)
        keys = fresh_keys(2)
        c.put_from(lid, pool=pool_of(cache(list(range(L)), 16)), block_ids={0: [0, 1]}, keys=keys)
        m = c.match(lid, keys=keys, prompt_tokens=2 * P + 1)
        link = c._chan()

        def load(body: dict[str, Any]) -> dict[str, Any]:
            if link is not None:
                return link.load(body)
            doc: dict[str, Any] = c._call("POST", "/v1/engine/load", body=body)
            return doc

        def loaded(body: dict[str, Any]) -> dict[str, Any]:
            if link is not None:
                return link.loaded(body)
            doc: dict[str, Any] = c._call("POST", "/v1/engine/loaded", body=body)
            return doc

        assert (link is not None) == (channel == "local")
        doc = load({"match": c._match_doc(m), "via": "lease"})
        lease_id = doc["lease"]["id"]
        done = loaded({"lease_id": lease_id, "arrived": [[0, 0], [0, 1]]})
        assert done["nbytes"] == 2 * PAGE
        for stale in (lease_id, "no-such-lease"):
            with pytest.raises(InvalidInput, match="not an open load"):
                loaded({"lease_id": stale, "arrived": []})
        with pytest.raises(InvalidInput):
            load({"via": "lease"})  # neither a handle nor a match
    if channel == "local":  # a load never acknowledged: its lease ends with its connection
        with Client(node.url, channel="http") as h:
            with Client(node.url, channel="local") as c:
                link = c._chan()
                assert link is not None
                lease_id = link.load({"match": c._match_doc(m), "via": "lease"})["lease"]["id"]
                assert lease_id in {x.id for x in h.leases()}
            for _ in range(200):  # its connection's close releases it
                if lease_id not in {x.id for x in h.leases()}:
                    break
                time.sleep(0.05)
            assert lease_id not in {x.id for x in h.leases()}


def test_a_page_without_a_block_is_not_moved_and_counts_missing(api: Any) -> None:
    """None for a page the load would move: the engine does not need it (a block vLLM left
    null); nothing is written for it, it is missing, and the bound stops before it."""
    lid = api.register(LAYOUT)
    keys = fresh_keys(4)
    src = cache(list(range(L)), 12)
    api.put_from(lid, pool=pool_of(src), block_ids={0: [0, 1, 2, 3]}, keys=keys)
    (b,) = api.match_many(lid, [keys], prompt_tokens=[4 * P + 1], hold=True)
    dst = {i: torch.zeros(BLOCKS, H, 2 * P, D) for i in range(L)}
    got = api.fetch_into(b.handle, pool=pool_of(dst), block_ids={0: [10, 11, None, 13]})
    assert not got.complete and got.delivered == ((0, 1, 3),) and got.missing == ((2,),)
    assert got.resume.tokens == 2 * P and got.nbytes == 3 * PAGE
    assert not dst[0][12].any() and torch.equal(dst[0][13], src[0][3])
    api.release_match(b.handle)


def test_presence_answers_for_every_shard_by_engine_keys(api: Any) -> None:
    """What a scheduler asks before it offers a hit to every rank: each shard's bound, in
    one call, by the engine's own keys (Client too)."""
    layouts = [full_attention("engine-presence@1", num_layers=L, num_kv_heads=2 * H, head_dim=D,
                              tokens_per_page=P, dtype="float32", shard_count=2, shard_index=s) for s in range(2)]
    lid = api.register(layouts[0])
    api.register(layouts[1])
    keys = fresh_keys(4)
    api.put_from(lid, pool=pool_of(cache(list(range(L)), 13)), block_ids={0: [0, 1, 2, 3]}, keys=keys, shard=0)
    api.put_from(lid, pool=pool_of(cache(list(range(L)), 14)), block_ids={0: [0, 1]}, keys=keys[:2], shard=1)
    seen = api.presence(lid, keys=keys, prompt_tokens=4 * P + 1)
    assert seen.shards == (0, 1) and seen.shard_tokens == (4 * P, 2 * P) and seen.tokens == 2 * P
    assert seen.held(1, 0, 1) and not seen.held(1, 0, 2)


@pytest.mark.parametrize("channel", ["local", "http"])
def test_a_row_changed_in_the_segment_is_a_miss_for_a_load_and_only_it_is_read_again(
        node: NodeProcess, channel: str) -> None:
    """A same-uid process overwrites a committed row in the node's segment. fetch_into
    reads in place, hashes each row after its scatter against the lease's sums, and
    leaves the changed row out (missing, never counted as loaded); its acknowledgement
    names that row alone as changed, the node reads it again and drops its host copy. An
    acknowledgement without ``changed`` (an older client) is checked by the node itself."""
    with Client(node.url, same_host=True, channel=channel) as c:
        lid = c.register(LAYOUT)
        src = cache(list(range(L)), 21)

        def stored(n: int, first_block: int) -> Any:
            keys = fresh_keys(n)
            c.put_from(lid, pool=pool_of(src), block_ids={0: list(range(first_block, first_block + n))}, keys=keys)
            return c.match(lid, keys=keys, prompt_tokens=n * P + 1)

        def overwrite(m: Any, page: int) -> None:
            """Write over ``page``'s row where the node lends it from (a lease's slot)."""
            link = c._chan()
            body = {"match": c._match_doc(m), "via": "lease"}
            doc = link.load(body) if link is not None else c._call("POST", "/v1/engine/load", body=body)
            lease = doc["lease"]
            (_, seg, off, _), = [s for s in lease["slots"] if doc["rows"][s[0]][1] == page]
            c._shm.borrower(writable=True).segment(lease["segments"][seg])[off : off + 64] = b"\xee" * 64
            done = link.loaded({"lease_id": lease["id"], "arrived": []}) if link is not None else \
                c._call("POST", "/v1/engine/loaded", body={"lease_id": lease["id"], "arrived": []})
            assert done["nbytes"] == 0

        acks: list[dict[str, Any]] = []
        link = c._chan()
        assert (link is not None) == (channel == "local")
        if link is not None:
            inner_loaded = link.loaded_oneway

            def loaded(body: dict[str, Any]) -> None:
                acks.append(body)
                inner_loaded(body)

            link.loaded_oneway = loaded  # type: ignore[method-assign]
        else:
            inner = c._call

            def call(method: str, path: str, **kw: Any) -> Any:
                if path == "/v1/engine/loaded":
                    acks.append(kw["body"])
                return inner(method, path, **kw)

            c._call = call  # type: ignore[method-assign]

        m = stored(4, 0)
        overwrite(m, 2)
        before = sum("host copy dropped" in line for line in node.lines)
        dst = {i: torch.zeros(BLOCKS, H, 2 * P, D) for i in range(L)}
        got = c.fetch_into(m, pool=pool_of(dst), block_ids={0: [10, 11, 12, 13]})
        assert got.delivered == ((0, 1, 3),) and got.missing == ((2,),) and got.nbytes == 3 * PAGE
        assert acks[-1]["changed"] == [[0, 2]] and sorted(acks[-1]["arrived"]) == [[0, 0], [0, 1], [0, 3]]
        for i in range(L):
            for page in (0, 1, 3):
                assert torch.equal(dst[i][10 + page], src[i][page])
        for _ in range(50):  # the log line comes from the node's process
            if sum("host copy dropped" in line for line in node.lines) > before:
                break
            time.sleep(0.1)
        assert sum("host copy dropped" in line for line in node.lines) == before + 1, "".join(node.lines)[-2000:]

        # an acknowledgement that names no changed rows: the node reads every arrived row
        m2 = stored(3, 4)
        overwrite(m2, 1)
        body = {"match": c._match_doc(m2), "via": "lease"}
        doc = link.load(body) if link is not None else c._call("POST", "/v1/engine/load", body=body)
        assert doc["lease"]["sums"] and all(s is not None for s in doc["lease"]["sums"])
        ack = {"lease_id": doc["lease"]["id"], "arrived": [[0, 0], [0, 1], [0, 2]]}
        done = link.loaded(ack) if link is not None else c._call("POST", "/v1/engine/loaded", body=ack)
        assert done["nbytes"] == 2 * PAGE and done["missing"] == [[1]]


def test_a_one_way_load_release_builds_the_result_the_node_answers(node: NodeProcess) -> None:
    """On a channel whose node takes LOADED one-way, fetch_into of a Match sends its
    release without waiting and builds the FetchResult itself: equal (less its id) to what
    the node answers the same load with over HTTP, for a whole load, one with a page the
    engine does not need, and one cut at ``start_page``; a handle's load (whose match the
    client does not hold) waits for the node's answer. Every lease is released."""
    with Client(node.url, channel="local") as c, Client(node.url, same_host=True, channel="http") as h:
        lid = c.register(LAYOUT)
        keys = fresh_keys(4)
        src = cache(list(range(L)), 23)
        c.put_from(lid, pool=pool_of(src), block_ids={0: [0, 1, 2, 3]}, keys=keys)
        m = c.match(lid, keys=keys, prompt_tokens=4 * P + 1)
        h.layout(lid)
        link = c._chan()
        assert link is not None and link.oneway_loaded
        sent: list[str] = []
        inner = link.loaded_oneway

        def oneway(body: dict[str, Any]) -> None:
            sent.append(body["lease_id"])
            inner(body)

        link.loaded_oneway = oneway  # type: ignore[method-assign]
        for ids, start in (([4, 5, 6, 7], None), ([4, None, 6, 7], None), ([4, 5, 6, 7], 2)):
            dst = {name: {i: torch.zeros(BLOCKS, H, 2 * P, D) for i in range(L)} for name in ("local", "http")}
            one = c.fetch_into(m, pool=pool_of(dst["local"]), block_ids={0: ids}, start_page=start)
            assert sent and sent[-1] == one.fetch_id
            two = h.fetch_into(m, pool=pool_of(dst["http"]), block_ids={0: ids}, start_page=start)
            assert dataclasses.replace(one, fetch_id="") == dataclasses.replace(two, fetch_id=""), (ids, start)
            for i in range(L):
                assert torch.equal(dst["local"][i], dst["http"][i])
        n = len(sent)
        (b,) = c.match_many(lid, [keys], prompt_tokens=[4 * P + 1], hold=True)
        assert b.handle is not None
        c.fetch_into(b.handle, pool=pool_of(cache(list(range(L)), 0)), block_ids={0: [4, 5, 6, 7]})
        assert len(sent) == n  # a handle's release waits for the node's answer
        c.release_match(b.handle)
        link.settle()
        assert not {x.id for x in h.leases()} & set(sent)  # every one-way release applied


def test_a_prepared_load_lends_with_its_hit_query_and_loads_without_a_control_call(node: NodeProcess) -> None:
    """prepare_load on the node's host is one LOAD_KEYS call: the match and a READ lease in
    the same answer. load_prepared then copies straight into the pool and releases
    one-way (no answered call), with the bytes and result of fetch_into of the same match;
    a shorter list of blocks loads only those pages (the rest missing, the lease released
    whole); release_prepared gives back a lease never loaded; a prepared load used twice
    is loaded the second time as fetch_into loads it, as is one from a node that takes no
    load by keys (its match alone)."""
    with Client(node.url, channel="local") as c, Client(node.url, same_host=True, channel="http") as h:
        lid = c.register(LAYOUT)
        keys = fresh_keys(4)
        src = cache(list(range(L)), 29)
        c.put_from(lid, pool=pool_of(src), block_ids={0: [0, 1, 2, 3]}, keys=keys)
        h.layout(lid)
        link = c._chan()
        assert link is not None and link.oneway_loaded
        answered: list[str] = []
        keys32 = [k * 2 for k in fresh_keys(4)]  # 32-byte keys (SGLang's): the binary LOAD_KEYS
        c.put_from(lid, pool=pool_of(src), block_ids={0: [0, 1, 2, 3]}, keys=keys32)
        for name in ("load_keys", "load", "loaded", "call"):
            inner = getattr(link, name)

            def counted(*a: Any, _inner: Any = inner, _name: str = name, **kw: Any) -> Any:
                answered.append(_name)
                return _inner(*a, **kw)

            setattr(link, name, counted)
        p16 = c.prepare_load(lid, keys=keys, prompt_tokens=4 * P + 1)  # 16-byte keys: LOAD's JSON
        assert answered == ["load", "call"] and p16.doc is not None and p16.match.resume.tokens == 4 * P
        c.release_prepared(p16)
        del answered[:]
        p = c.prepare_load(lid, keys=keys32, prompt_tokens=4 * P + 1)
        assert answered == ["load_keys", "call"] and p.doc is not None and p.match.resume.tokens == 4 * P
        lease_id = p.doc["lease"]["id"]
        assert lease_id in {x.id for x in h.leases()}
        del answered[:]
        dst = {i: torch.zeros(BLOCKS, H, 2 * P, D) for i in range(L)}
        got = c.load_prepared(p, pool=pool_of(dst), block_ids={0: [4, 5, 6, 7]})
        assert answered == [], answered
        ref = {i: torch.zeros(BLOCKS, H, 2 * P, D) for i in range(L)}
        want = h.fetch_into(p.match, pool=pool_of(ref), block_ids={0: [4, 5, 6, 7]})
        assert dataclasses.replace(got, fetch_id="") == dataclasses.replace(want, fetch_id="") and got.complete
        for i in range(L):
            assert torch.equal(dst[i], ref[i]) and torch.equal(dst[i][4:8], src[i][0:4])
        link.settle()
        assert lease_id not in {x.id for x in h.leases()}

        short = c.prepare_load(lid, keys=keys, prompt_tokens=4 * P + 1)
        assert short.doc is not None
        short_lease = short.doc["lease"]["id"]
        part = c.load_prepared(short, pool=pool_of(dst), block_ids={0: [8, 9]})
        assert part.delivered == ((0, 1),) and part.missing == ((2, 3),) and part.nbytes == 2 * PAGE
        for i in range(L):
            assert torch.equal(dst[i][8:10], src[i][0:2])
        again = c.load_prepared(short, pool=pool_of(dst), block_ids={0: [10, 11, 12, 13]})  # used: loaded anew
        assert again.complete and all(torch.equal(dst[i][10:14], src[i][0:4]) for i in range(L))

        unused = c.prepare_load(lid, keys=keys, prompt_tokens=4 * P + 1)
        assert unused.doc is not None
        held = unused.doc["lease"]["id"]
        c.release_prepared(unused)
        c.release_prepared(unused)  # nothing left to give back
        link.settle()
        assert not {x.id for x in h.leases()} & {held, short_lease}

        link.load_keys_op = False  # as after the HELLO of a node that takes no load by keys
        older = c.prepare_load(lid, keys=keys32, prompt_tokens=4 * P + 1)
        assert older.doc is None and older.match.resume.tokens == 4 * P  # its match alone
        dst = {i: torch.zeros(BLOCKS, H, 2 * P, D) for i in range(L)}
        assert c.load_prepared(older, pool=pool_of(dst), block_ids={0: [4, 5, 6, 7]}).complete
        assert all(torch.equal(dst[i][4:8], src[i][0:4]) for i in range(L))


def test_a_worker_a_failure_put_off_shared_memory_asks_again_later(node: NodeProcess,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A same-host load whose segment will not map is loaded through staging, whole, and
    the client goes over the network from then on, until ``LOCAL_RETRY_S`` later it asks
    again whether the node's memory maps here: a passing fault (or a node restart) never
    keeps a worker off shared memory for good."""
    from kvbank.client import client as client_module

    with Client(node.url) as c:
        lid = c.register(LAYOUT)
        keys = fresh_keys(2)
        src = cache(list(range(L)), 21)
        c.put_from(lid, pool=pool_of(src), block_ids={0: [0, 1]}, keys=keys)
        assert c.same_host
        mapped = c._shm.borrower

        def will_not_map(*args: Any, **kwargs: Any) -> Any:
            raise TierUnavailable("test: the segment will not map")

        for retry_s, back in ((0.0, True), (3600.0, False)):
            monkeypatch.setattr(client_module, "LOCAL_RETRY_S", retry_s)
            monkeypatch.setattr(c._shm, "borrower", will_not_map)
            (b,) = c.match_many(lid, [keys], prompt_tokens=[2 * P + 1], hold=True)
            assert b.handle is not None
            dst = cache(list(range(L)), 22)
            got = c.fetch_into(b.handle, pool=pool_of(dst), block_ids={0: [5, 6]})
            assert got.complete and all(torch.equal(dst[i][5:7], src[i][0:2]) for i in range(L))
            c.release_match(b.handle)
            monkeypatch.setattr(c._shm, "borrower", mapped)
            assert c.same_host is back  # asked again at once / not for an hour


def test_an_engine_put_on_the_channel_sends_its_slots_checksums_and_a_wrong_one_is_a_miss(
        node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """put_from on the node's host hashes each slot right after the gather filled it, and
    COMMIT carries the sums: the node keeps them as the rows' (a READ lease answers exactly
    them, the hashes of the pages in canonical order), so a sum that does not match its
    row's bytes — sent here on purpose — makes that row a miss, never other bytes."""
    import kvbank.client.poolio as poolio  # put_from's copies and their checksums
    from kvbank.codec.frame import checksum
    from kvbank.kernels.strided import gather_strided

    with Client(node.url, same_host=True) as c:
        lid = c.register(LAYOUT)
        link = c._chan()
        assert link is not None and link.commit_sums
        src = cache(list(range(L)), 21)
        keys = fresh_keys(4)
        names = c.put_from(lid, pool=pool_of(src), block_ids={0: [2, 4, 6, 8]}, keys=keys)[0]
        canon = torch.zeros((4, PAGE), dtype=torch.uint8)
        gather_strided(LAYOUT, 0, pool_of(src), [2, 4, 6, 8], canon)
        lease = c.lend(names, ttl_s=60)
        assert lease.checksums() == {n: checksum(canon[k].numpy().tobytes()) for k, n in enumerate(names)}
        c.release(lease.id)

        monkeypatch.setattr(poolio, "checksum", lambda b: checksum(b) ^ 1)
        keys = fresh_keys(4)
        c.put_from(lid, pool=pool_of(src), block_ids={0: [2, 4, 6, 8]}, keys=keys)  # wrong sums
        monkeypatch.undo()
        (b,) = c.match_many(lid, [keys], prompt_tokens=[4 * P + 1], hold=True)
        assert b.tokens == 4 * P and b.handle is not None  # stored: its rows match
        dst = {i: torch.zeros(BLOCKS, H, 2 * P, D) for i in range(L)}
        got = c.fetch_into(b.handle, pool=pool_of(dst), block_ids={0: [1, 3, 5, 7]})
        assert got.delivered == ((),) and not got.complete  # every row a miss: none loaded
        c.release_match(b.handle)
