"""One worker scenario run against the embedded Bank and against a served node through
kvbank.Client on both paths: same calls, same results, same exceptions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvbank import Bank, Client, LeaseMode, MemoryKind, Scope, full_attention, hybrid_mamba
from kvbank.errors import (
    Busy,
    InvalidInput,
    InvalidTokens,
    LeaseNotFound,
    PageSizeMismatch,
    UnknownLayout,
)
from kvbank.keys import namespace, page_keys
from kvbank.lender.base import CommitResult, Delivery, Lease
from kvbank.lender.resume import Obstacle
from kvbank.results import BankStats, FetchResult, Match, Presence
from kvbank.service.launch import NodeProcess
from kvbank.tiers.base import TierKind

FA = full_attention("svc@1", num_layers=2, num_kv_heads=4, head_dim=64)  # 16 tokens a page
PAGE = FA.group_page_bytes[0]
MAMBA = hybrid_mamba("svc-mamba@1", [0, 2], [1], 2, 32, conv_shape=(64, 3), ssm_shape=(4, 16))


def rand(n: int, size: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8))


@pytest.fixture(params=["bank", "client-shm", "client-tcp"])
def api(request: pytest.FixtureRequest, node: NodeProcess, tmp_path: Any) -> Iterator[Any]:
    if request.param == "bank":
        with Bank.open(host_bytes="64M", data_dir=tmp_path, device_bytes=0) as bank:
            yield bank
        return
    with Client(node.url, same_host=request.param == "client-shm") as client:
        assert client.same_host is (request.param == "client-shm")
        yield client


def test_scenario_same_results_on_bank_and_client(api: Any, request: pytest.FixtureRequest) -> None:
    salt = request.node.callspec.id  # rows of one run never satisfy another's
    scope = Scope(tenant="t", cache_salt=salt)
    lid = api.register(FA)
    assert lid == FA.layout_id and api.register(FA) == lid
    prompt = list(range(5000, 5100))
    pages = rand(6, PAGE, seed=len(salt))
    names = api.put(lid, prompt, group=0, pages=pages, scope=scope)
    assert len(names) == 6 and all(len(n) == 54 for n in names)
    assert api.put(lid, prompt, group=0, pages=pages[:2], scope=scope) == names[:2]  # already stored

    m = api.match(lid, [*prompt[:90], 7, 7, 7], scope=scope)
    assert isinstance(m, Match) and m.resume.tokens == 80 and m.resume.row_count == 5
    by_keys = api.match(lid, keys=page_keys([*prompt[:90], 7, 7, 7], FA.tokens_per_page, scope), scope=scope,
                        prompt_tokens=93)
    assert by_keys.resume.tokens == 80 and by_keys.resume.rows == m.resume.rows
    assert api.match(lid, prompt, scope=Scope(tenant="other")).resume.tokens == 0
    # Nothing at all under a scope, or under a layout of another model fingerprint, is
    # told apart from a prompt whose first page is missing under a scope that has rows.
    cold = api.match(lid, prompt, scope=Scope(tenant="other", cache_salt=salt)).resume
    assert (cold.tokens, cold.reason) == (0, Obstacle.NOTHING_STORED) and cold.blocking_group is None
    short = api.match(lid, prompt[:16], scope=Scope(tenant="other", cache_salt=salt)).resume
    assert short.reason is Obstacle.LAST_TOKEN  # too short to resume from: not a miss
    refp = api.register(full_attention("svc@2", num_layers=2, num_kv_heads=4, head_dim=64))
    assert api.match(refp, prompt, scope=scope).resume.reason is Obstacle.NOTHING_STORED
    miss = api.match(lid, list(range(9000, 9040)), scope=scope).resume
    assert (miss.tokens, miss.reason, miss.blocking_group) == (0, Obstacle.MISSING_PAGE, 0)

    buf = torch.zeros((5, PAGE), dtype=torch.uint8)
    part = api.fetch(m, out={0: buf}, max_rows=2)
    assert isinstance(part, FetchResult) and not part.complete and part.delivered == ((0, 1),)
    assert part.resume.tokens == 32 and part.nbytes == 2 * PAGE
    open_now = api.stats()  # the half-done fetch is open in the ledger that serves it
    if isinstance(api, Bank):
        assert open_now.open_fetches >= 1 and open_now.served_fetches == 0
    else:
        assert open_now.served_fetches >= 1
    rest = api.fetch(m, out={0: buf}, fetch_id=part.fetch_id)
    assert rest.complete and rest.fetch_id == part.fetch_id and rest.nbytes == 3 * PAGE
    assert rest.resume.tokens == 80 and torch.equal(buf, pages[:5])

    lease = api.lend(m, mode=LeaseMode.READ, kind=MemoryKind.HOST, ttl_s=30)
    assert isinstance(lease, Lease) and [r.delivery for r in lease.rows] == [Delivery.READY] * 5
    assert api.renew(lease.id, 20).id == lease.id
    assert api.release(lease.id) is True and api.release(lease.id) is False
    with pytest.raises(LeaseNotFound):
        api.renew(lease.id)

    more = prompt + list(range(7000, 7032))
    wl = api.lend(api.row_names(lid, more, group=0, scope=scope)[6:], mode=LeaseMode.WRITE)
    assert [r.delivery for r in wl.rows] == [Delivery.RESERVED] * 2
    done = api.commit(wl.id, [wl.rows[0].name])
    assert isinstance(done, CommitResult) and done.committed == (wl.rows[0].name,)
    assert done.discarded == (wl.rows[1].name,)

    mid = api.register(MAMBA)
    toks = list(range(64))
    api.put(mid, toks, group=0, pages=rand(4, MAMBA.group_page_bytes[0], 1), scope=scope)
    state = rand(1, MAMBA.group_page_bytes[1], 2)[0]
    api.put_state(mid, toks[:32], group=1, state=state, scope=scope)
    hm = api.match(mid, toks, scope=scope)
    assert hm.resume.tokens == 32 and hm.resume.reason is not None and hm.resume.reason.name == "NO_SNAPSHOT"
    sbuf = [bytearray(MAMBA.group_page_bytes[g]) for g in range(2)]
    got = api.fetch(hm, out={0: [bytearray(MAMBA.group_page_bytes[0]) for _ in range(2)], 1: [sbuf[1]]})
    assert got.complete and bytes(sbuf[1]) == state.numpy().tobytes()

    st = api.stats()
    assert isinstance(st, BankStats) and st.layouts >= 2
    assert api.locate([*names[:2], b"\x00" * 54])[:2] == [TierKind.HOST, TierKind.HOST]
    assert api.locate([b"\x00" * 54]) == [None]
    assert api.health().ok
    assert all(isinstance(x, Lease) for x in api.leases())
    api.flush()


def test_scenario_the_rest_of_the_worker_contract_on_bank_and_client(
        api: Any, request: pytest.FixtureRequest) -> None:
    """The WorkerAPI calls the scenario above leaves out answer alike on the bank and on a
    node (both paths): row_names, register_scope, resume_at, presence, put_states, the
    ``timeout=`` deadlines and flush's ``timeout_s``."""
    scope = Scope(tenant="t", cache_salt=f"{request.node.callspec.id}-contract")
    lid = api.register(FA)
    prompt = list(range(6000, 6100))  # 6 full pages
    names = api.row_names(lid, prompt, group=0, scope=scope)
    assert len(names) == 6 and names == api.row_names(
        lid, keys=page_keys(prompt, FA.tokens_per_page, scope), group=0, scope=scope)
    assert api.register_scope(lid, scope) == namespace(lid, scope) == names[0][:16]
    with pytest.raises(UnknownLayout):
        api.register_scope(b"\x02" * 32, scope)

    pages = rand(6, PAGE, seed=3)
    with pytest.raises(Busy, match="timeout"):
        api.put(lid, prompt, group=0, pages=pages, scope=scope, timeout=0)
    with pytest.raises(InvalidInput, match="timeout"):
        api.put(lid, prompt, group=0, pages=pages, scope=scope, timeout=-1)
    assert api.put(lid, prompt, group=0, pages=pages, scope=scope, timeout=30) == names
    m = api.match(lid, prompt, scope=scope)
    assert m.resume.tokens == 96 and m.boundaries == (16, 32, 48, 64, 80, 96)
    low = api.resume_at(m, 32)
    assert low.resume.tokens == 32 and low.needed == names[:2]
    with pytest.raises(InvalidInput, match="at"):
        api.resume_at(m, 33)
    out = api.out_buffers(low)
    if isinstance(api, Bank):  # a deadline already passed: kvbank.api, difference 3
        assert not api.fetch(low, out=out, timeout=0).complete
    else:
        with pytest.raises(Busy, match="timeout"):
            api.fetch(low, out=out, timeout=0)
    got = api.fetch(low, out=out, timeout=30)
    assert got.complete and got.resume.tokens == 32 and torch.equal(out[0], pages[:2])
    with pytest.raises(Busy, match="timeout"):
        api.lend(low, timeout=0)
    lease = api.lend(low, timeout=30)
    assert api.release(lease.id) is True

    seen = api.presence(lid, prompt, scope=scope)
    assert isinstance(seen, Presence) and seen.shards == (0,) and seen.tokens == 96
    assert seen.held(0, 0, 5) and api.presence(lid, prompt, scope=scope, shards=[0]).shard_tokens == (96,)
    with pytest.raises(InvalidInput, match="shards"):
        api.presence(lid, prompt, scope=scope, shards=[1])

    mid = api.register(MAMBA)
    p = MAMBA.tokens_per_page
    toks = list(range(4 * p))
    states = rand(2, MAMBA.group_page_bytes[1], seed=4)
    snaps = api.row_names(mid, toks, group=1, scope=scope)
    with pytest.raises(InvalidInput, match=r"at\[1\]"):  # checked before any is stored
        api.put_states(mid, toks, group=1, states=states, at=[p, 5 * p], scope=scope)
    assert api.locate([snaps[0]]) == [None]
    assert api.put_states(mid, toks, group=1, states=states, at=[2 * p, 4 * p], scope=scope) == \
        [snaps[1], snaps[3]]
    assert api.locate([snaps[1], snaps[3]]) == [TierKind.HOST, TierKind.HOST]
    api.flush(timeout_s=30)


def test_scenario_same_exceptions_on_bank_and_client(api: Any) -> None:
    lid = api.register(FA)
    with pytest.raises(UnknownLayout):
        api.match(b"\x01" * 32, [1, 2, 3])
    with pytest.raises(PageSizeMismatch, match="pages"):
        api.put(lid, list(range(32)), group=0, pages=rand(2, PAGE - 1, 0))
    with pytest.raises(InvalidTokens):
        api.match(lid, [1, -5, 3])
    with pytest.raises(InvalidInput, match="group"):
        api.put(lid, list(range(32)), group=3, pages=rand(2, PAGE, 0))
    with pytest.raises(InvalidInput, match="pages"):
        api.put(lid, list(range(32)), group=0, pages=rand(3, PAGE, 0))  # 3 pages for 2 keys
    with pytest.raises(LeaseNotFound):
        api.release("00" * 16)
    with pytest.raises(InvalidInput, match="fetch_id"):
        m = api.match(lid, list(range(64)))
        api.fetch(m, out={0: torch.zeros((0, PAGE), dtype=torch.uint8)}, fetch_id="")


def test_a_fetch_never_loads_another_shards_rows(api: Any) -> None:
    """Issue 25: a Match names one shard's rows. Rank 1 handed the scheduler's shard-0
    match must be refused (InvalidInput naming ``shard``), never given rank 0's heads."""
    tp = full_attention("svc-tp@shardfetch", num_layers=2, num_kv_heads=4, head_dim=64, shard_count=2)
    lid = api.register(tp)
    assert api.register(tp.with_shard(1)) == lid
    size = tp.group_page_bytes[0]
    prompt = list(range(1000, 1064))  # 4 pages, bound 48
    zero, one = rand(4, size, 71), rand(4, size, 72)  # distinct bytes per shard
    api.put(lid, prompt, group=0, pages=zero, shard=0)
    api.put(lid, prompt, group=0, pages=one, shard=1)
    m0 = api.match(lid, prompt, shard=0)
    assert m0.shard == 0 and m0.resume.tokens == 48
    with pytest.raises(InvalidInput, match=r"shard.*shard 0.*shard 1"):
        api.fetch(m0, out=api.out_buffers(m0), shard=1)
    with pytest.raises(InvalidInput, match="shard"):
        api.lend(m0, shard=1)
    with pytest.raises(InvalidInput, match="shard"):
        api.lend(m0.needed, shard=1)
    # the right way: rank 1 matches under its own shard and gets its own bytes
    m1 = api.match(lid, prompt, shard=1)
    assert m1.shard == 1
    out = api.out_buffers(m1)
    assert api.fetch(m1, out=out, shard=1).resume.tokens == 48
    assert torch.equal(out[0], one[:3]) and not torch.equal(out[0], zero[:3])
    out = api.out_buffers(m0)
    assert api.fetch(m0, out=out, shard=0).resume.tokens == 48 and torch.equal(out[0], zero[:3])
    lease = api.lend(m1, shard=1)
    api.release(lease.id)


def test_put_takes_the_engine_keys_match_takes(api: Any) -> None:
    """Issue 25: vLLM's 16-byte xxhash block hashes, put then matched by the same keys."""
    lid = api.register(FA)
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    pages = rand(4, PAGE, 73)
    names = api.put(lid, keys=keys, group=0, pages=pages)
    assert names == api.row_names(lid, keys=keys, group=0)
    m = api.match(lid, keys=keys)
    assert list(m.names[0]) == names and m.resume.tokens == 48  # the last page is computed
    out = api.out_buffers(m)
    assert api.fetch(m, out=out).resume.tokens == 48 and torch.equal(out[0], pages[:3])
    more = [bytes([i]) * 16 for i in (9, 10)]
    assert api.put(lid, keys=keys + more, group=0, pages=rand(2, PAGE, 74), first_page=4) \
        == api.row_names(lid, keys=keys + more, group=0)[4:]
    assert api.match(lid, keys=keys + more).resume.tokens == 80
    # STATE snapshots by the same 16-byte keys: put_state and put_states name the rows
    # row_names gives (the one expansion rule)
    mid = api.register(MAMBA)
    mkeys = [bytes([i]) * 16 for i in range(21, 25)]
    snaps = api.row_names(mid, keys=mkeys, group=1)
    states = rand(2, MAMBA.group_page_bytes[1], 75)
    assert api.put_state(mid, keys=mkeys, group=1, state=states[0], at=32) == snaps[1]
    assert api.put_states(mid, keys=mkeys, group=1, states=states, at=[48, 64]) == snaps[2:]
    assert api.locate(snaps) == [None, TierKind.HOST, TierKind.HOST, TierKind.HOST]
