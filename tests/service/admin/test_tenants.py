"""Tenant tokens on a real served node: every data route needs a token (401 / 403), and
tenant B can never match, fetch, lease, locate, renew, commit, check, release or
acknowledge tenant A's rows or leases, through any route, nor see them listed."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from kvbank import LeaseMode, Scope, full_attention
from kvbank.client.client import Client
from kvbank.client.io import put_head
from kvbank.errors import Forbidden, InvalidInput, TierUnavailable, Unauthorized
from kvbank.keys import namespace
from kvbank.service.launch import NodeProcess
from kvbank.wire.framing import PutKind
from tests.service.conftest import NODE_ARGS

TA, TB = "token-a-0123456789abcdef", "token-b-0123456789abcdef"
ADMIN = "admin-0123456789abcdef"
FA = full_attention("tenants@1", num_layers=1, num_kv_heads=2, head_dim=64)
P, PAGE = FA.tokens_per_page, FA.group_page_bytes[0]
TOKENS = list(range(4 * P))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    env = {**os.environ, "KVBANK_TENANTS": f"a={TA},b={TB}", "KVBANK_ADMIN_TOKEN": ADMIN}
    proc = NodeProcess.start(["--data-dir", str(tmp_path_factory.mktemp("tenants")), *NODE_ARGS], env=env)
    try:
        yield proc
    finally:
        assert proc.stop() == 0, "".join(proc.lines)[-3000:]


def pages(n: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(7).integers(0, 256, (n, PAGE), dtype=np.uint8))


def _post(node: NodeProcess, path: str, body: Any, token: str | None) -> httpx.Response:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.post(node.url + path, json=body, headers=headers)


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/node"), ("GET", "/v1/stats"), ("GET", "/v1/leases"), ("POST", "/v1/match"),
    ("POST", "/v1/put"), ("POST", "/v1/fetch"), ("POST", "/v1/locate"), ("DELETE", "/v1/leases/x"),
    ("POST", "/v1/presence"), ("POST", "/v1/layouts/x/scopes"),
    ("POST", "/v1/engine/match"), ("POST", "/v1/engine/load"), ("POST", "/v1/engine/loaded"),
    ("POST", "/v1/engine/release"), ("POST", "/v1/engine/put"),
])
def test_every_data_route_needs_a_tenant_token(node: NodeProcess, method: str, path: str) -> None:
    assert httpx.request(method, node.url + path).status_code == 401
    wrong = httpx.request(method, node.url + path, headers={"Authorization": "Bearer " + "z" * 24})
    assert wrong.status_code == 403 and wrong.json()["type"] == "Forbidden"


def test_tenant_b_never_reaches_tenant_a(node: NodeProcess) -> None:
    with Client(node.url, token=TA) as a, Client(node.url, token=TB) as b, \
            Client(node.url, token=TA, same_host=False) as a_tcp:
        lid = a.register(FA)
        assert b.register(FA) == lid  # layouts are shared definitions, not rows
        names = a.put(lid, TOKENS[: 2 * P], group=0, pages=pages(2))  # shared memory
        names += a_tcp.put(lid, TOKENS, group=0, pages=pages(4)[2:], first_page=2)  # TCP
        ma = a.match(lid, [*TOKENS, 1])
        assert ma.scope.tenant == "a" and ma.resume.tokens == 4 * P  # forced to a's tenant
        got = a_tcp.fetch(ma, out={0: torch.empty((4, PAGE), dtype=torch.uint8)})
        assert got.complete
        # b's own match of the same tokens is b's scope: a miss, never a's hit
        mb = b.match(lid, [*TOKENS, 1])
        assert mb.scope.tenant == "b" and mb.resume.tokens == 0
        with pytest.raises(Forbidden):
            b.match(lid, [*TOKENS, 1], scope=Scope("a"))
        with pytest.raises(Forbidden):
            b.fetch(ma, out={0: torch.empty((4, PAGE), dtype=torch.uint8)})
        with pytest.raises(Forbidden):
            b.locate(names)
        # presence and register_scope hold b to b's scope as match does
        assert b.presence(lid, [*TOKENS, 1]).tokens == 0 and a.presence(lid, [*TOKENS, 1]).tokens == 4 * P
        with pytest.raises(Forbidden):
            b.presence(lid, [*TOKENS, 1], scope=Scope("a"))
        with pytest.raises(Forbidden):
            b.register_scope(lid, Scope("a"))
        assert a.register_scope(lid, Scope(cache_salt="s")) == namespace(lid, Scope("a", "s"))
        with pytest.raises(Forbidden):
            b.lend(names)
        with pytest.raises(Forbidden):
            b.lend_all()
        with pytest.raises(Forbidden):
            b.put(lid, TOKENS, group=0, pages=pages(4), scope=Scope("a"))
        lease = a.lend(names, mode=LeaseMode.READ)
        for call in (lambda: b.renew(lease.id), lambda: b.check_live(lease.id),
                     lambda: b.release(lease.id), lambda: b.commit(lease.id, [])):
            with pytest.raises(Forbidden):
                call()
        assert lease.id not in {x.id for x in b.leases()}
        assert lease.id in {x.id for x in a.leases()}
        assert None not in a.locate(names)
        # a fetch a opened cannot be acknowledged by b
        # (a same-host lease is refused on a tenant node: its segment has no name to map)
        refused = _post(node, "/v1/fetch", {"match": _wire(ma), "via": "lease"}, TA)
        assert refused.status_code == 503 and refused.json()["type"] == "TierUnavailable"
        opened = _post(node, "/v1/fetch", {"match": _wire(ma), "via": "data"}, TA).json()
        ack = _post(node, f"/v1/fetch/{opened['fetch_id']}/ack", {"rows": [0]}, TB)
        assert ack.status_code == 403 and ack.json()["field"] == "fetch_id"
        if opened["lease"]:
            httpx.delete(f"{node.url}/v1/leases/{opened['lease']['id']}", headers={"Authorization": f"Bearer {TA}"})
        assert a.release(lease.id)
        with Client(node.url) as anonymous, pytest.raises(Unauthorized):
            anonymous.stats()
        # the admin listing by scope: a's rows under a, none of them under b
        admin = {"Authorization": f"Bearer {ADMIN}"}
        rows_a = httpx.get(node.url + "/admin/rows", params={"tenant": "a"}, headers=admin).json()["rows"]
        rows_b = httpx.get(node.url + "/admin/rows", params={"tenant": "b"}, headers=admin).json()["rows"]
        assert {r["name"] for r in rows_a} == {n.hex() for n in names}
        assert not {r["name"] for r in rows_b} & {n.hex() for n in names}


def _wire(m: Any) -> Any:
    from kvbank import wire

    return wire.to_dict(m)


@pytest.mark.parametrize("same_host", [False, None], ids=["tcp", "local-channel"])
def test_cross_shard_fetch_under_tenant_tokens(node: NodeProcess, same_host: bool | None) -> None:
    """Rows a TP 4 worker of tenant A stored are found and resharded for A's TP 2 worker
    (bit-exact), through TCP and from the node's host (control calls on its local
    channel, bodies through the node's copies: a tenant node lends no shared memory);
    tenant B's identical prompt matches nothing and B cannot fetch A's match."""
    from tests.bank.test_cross_shard import _cut, _gqa, _pages

    seed = 11 if same_host is None else 12
    tp1 = _pages(_gqa(1), 0, 4, seed)
    toks = [(seed * 7919 + i) % 32_000 for i in range(4 * P)]
    with Client(node.url, token=TA, same_host=same_host) as a, \
            Client(node.url, token=TB, same_host=same_host) as b:
        for r, shard in enumerate(_cut(_gqa(1), 0, tp1, 4)):
            lid4 = a.register(_gqa(4, r))
            a.put(lid4, toks, group=0, pages=shard, shard=r)
        want = _cut(_gqa(1), 0, tp1, 2)
        for j in range(2):
            lid2 = a.register(_gqa(2, j))
            m = a.match(lid2, [*toks, 1], shard=j)
            assert m.resume.tokens == 4 * P and m.scope.tenant == "a"
            out = torch.zeros((4, _gqa(2).group_page_bytes[0]), dtype=torch.uint8)
            got = a.fetch(m, out={0: out})
            assert got.complete, got
            assert torch.equal(out, want[j])
            b.register(_gqa(2, j))
            assert b.match(lid2, [*toks, 1], shard=j).resume.tokens == 0
            with pytest.raises(Forbidden):
                b.fetch(m, out={0: torch.zeros_like(out)})


def test_a_put_by_engine_keys_under_a_token_names_its_tenant(node: NodeProcess) -> None:
    """16-byte engine keys are expanded under the scope: a put that left the tenant for the
    node to fill in would be keyed under "" and never match. Refused; named, it matches."""
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    with Client(node.url, token=TA) as a:
        lid = a.register(FA)
        with pytest.raises(InvalidInput, match=r"scope\.tenant"):
            a.put(lid, keys=keys, group=0, pages=pages(4))
        names = a.put(lid, keys=keys, group=0, pages=pages(4), scope=Scope("a"))
        m = a.match(lid, keys=keys)  # the node fills in tenant "a"
        assert list(m.names[0]) == names and m.resume.tokens == 3 * P


def _trickled_put(node: NodeProcess, token: str, seed: int, n_pages: int) -> socket.socket:
    """A put body whose head and first page arrive, and the rest never: its WRITE
    reservation is held until the body timeout."""
    toks = list(range(seed * 10**6, seed * 10**6 + n_pages * P))
    views = [memoryview(bytes(PAGE))] * n_pages
    head = put_head(PutKind.PAGES, FA.layout_id, toks, None, Scope(), 0, 0, None, None, views, PAGE,
                    tenant_token=True)
    host, port = node.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(f"POST /v1/put HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
              f"Content-Type: application/octet-stream\r\n"
              f"Content-Length: {len(head) + n_pages * PAGE}\r\n\r\n".encode() + head + bytes(PAGE))
    return s


def test_a_tenant_trickling_put_bodies_holds_at_most_half_the_host_tier(node: NodeProcess) -> None:
    """Regression (served-node review D9): trickled put bodies held their WRITE
    reservations until the body timeout, so one tenant could hold the whole host tier
    (another's puts went to disk, or were TierFull without one). A tenant's bodies in
    flight now hold at most half of it: its next put is 503 Busy, another tenant's goes."""
    big = (20 << 20) // PAGE  # 20 MiB of pages: two of them hold 40 of the 96 MiB
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with Client(node.url, token=TA, same_host=False) as a:
        a.register(FA)
    held = [_trickled_put(node, TA, 50 + i, big) for i in range(2)]
    try:
        deadline = time.monotonic() + 30
        while httpx.get(node.url + "/admin/stats", headers=admin).json()["bank"]["store"]["reserved_slots"] < 2 * big:
            assert time.monotonic() < deadline, "the trickled puts never reserved their slots"
            time.sleep(0.01)
        views = [memoryview(bytes(PAGE))] * big
        for token, seed, want in ((TA, 60, 503), (TB, 61, 200)):
            toks = list(range(seed * 10**6, seed * 10**6 + big * P))
            body = put_head(PutKind.PAGES, FA.layout_id, toks, None, Scope(), 0, 0, None, None, views,
                            PAGE, tenant_token=True) + bytes(big * PAGE)
            r = httpx.post(node.url + "/v1/put", content=body, timeout=60,
                           headers={"Authorization": f"Bearer {token}",
                                    "Content-Type": "application/octet-stream"})
            assert r.status_code == want, r.text[:300]
            if want == 503:
                assert r.json()["type"] == "Busy" and "share" in r.json()["message"]
    finally:
        for s in held:
            s.close()


def test_tenant_b_never_redeems_tenant_a_s_handle_or_rows(node: NodeProcess) -> None:
    """The engine calls: a's handle, a's match and a's scope are a's alone."""
    from kvbank.layout import Role

    pool = {(0, r): torch.randn(8, 2, P, 64).to(torch.bfloat16).transpose(1, 2) for r in (Role.KEY, Role.VALUE)}
    keys = [bytes([9, i]) * 8 for i in range(3)]
    with Client(node.url, token=TA) as a, Client(node.url, token=TB) as b:
        lid = a.register(FA)
        a.put_from(lid, pool=pool, block_ids={0: [0, 1, 2]}, keys=keys, scope=Scope("a"))
        (ha,) = a.match_many(lid, [keys], prompt_tokens=[3 * P + 1], hold=True, pin=True, scope=Scope("a"))
        assert ha.tokens == 3 * P and ha.handle is not None
        assert b.match_many(lid, [keys], prompt_tokens=[3 * P + 1])[0].tokens == 0  # b's own scope
        with pytest.raises(Forbidden):
            b.match_many(lid, [keys], scope=Scope("a"))
        with pytest.raises(Forbidden):
            b.fetch_into(ha.handle, pool=pool, block_ids={0: [3, 4, 5]})
        with pytest.raises(Forbidden):
            b.fetch_into(a.match(lid, keys=keys, prompt_tokens=3 * P + 1, scope=Scope("a")), pool=pool,
                         block_ids={0: [3, 4, 5]})
        with pytest.raises(Forbidden):
            b.release_match(ha.handle)
        # the local channel's LOAD and LOADED check as their HTTP routes do: b never redeems
        # a's handle nor acknowledges a lease not its own, and a's own lent load is refused
        # on a tenant node (its segment has no name to map)
        link_a, link_b = a._chan(), b._chan()
        assert link_a is not None and link_b is not None and link_a.loads
        for load in (link_b.load, lambda body: b._call("POST", "/v1/engine/load", body=body)):
            with pytest.raises(Forbidden):
                load({"handle": ha.handle, "via": "lease"})
        for load in (link_a.load, lambda body: a._call("POST", "/v1/engine/load", body=body)):
            with pytest.raises(TierUnavailable):
                load({"handle": ha.handle, "via": "lease"})
        for loaded in (link_b.loaded, lambda body: b._call("POST", "/v1/engine/loaded", body=body)):
            with pytest.raises(Forbidden):
                loaded({"lease_id": "no-such-lease", "arrived": []})
        # a load by keys matches in the caller's own scope: b's is empty, a's scope is
        # Forbidden to b; a's own prepared load on a tenant node is its match alone
        by_keys = {"layout_id": lid.hex(), "keys": [k.hex() for k in keys], "prompt_tokens": 3 * P + 1,
                   "via": "match"}
        got = b._call("POST", "/v1/engine/load", body=by_keys)
        assert got["match"]["resume"]["tokens"] == 0
        with pytest.raises(Forbidden):
            b._call("POST", "/v1/engine/load", body={**by_keys, "scope": {"tenant": "a"}})
        with pytest.raises(TierUnavailable):
            link_a.load({**by_keys, "via": "lease"})
        prepared = a.prepare_load(lid, keys=keys, prompt_tokens=3 * P + 1, scope=Scope("a"))
        assert prepared.doc is None and prepared.match.resume.tokens == 3 * P
        assert a.load_prepared(prepared, pool=pool, block_ids={0: [3, 4, 5]}).complete
        assert a.fetch_into(ha.handle, pool=pool, block_ids={0: [3, 4, 5]}).complete
        assert a.release_match(ha.handle)


def test_a_tenant_node_has_a_liveness_probe_that_needs_no_token_and_says_only_alive(
        node: NodeProcess) -> None:
    """With tenant tokens, /v1/health needs a tenant's token and /admin/health/live the
    admin's: an orchestrator's probe had nothing to call. ``GET /live`` needs none and
    answers nothing but ``alive``."""
    got = httpx.get(node.url + "/live")
    assert got.status_code == 200 and got.text == "alive\n"
    assert httpx.get(node.url + "/v1/health").status_code == 401
    assert httpx.get(node.url + "/admin/health/live").status_code == 401
