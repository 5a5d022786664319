"""``fetch_prefix``: a prompt matched and fetched in one call, against ``match`` then
``fetch``, on each of the three paths of a real ``kvbank serve`` node (shared memory,
the data port, an HTTP stream), and the fetch body's refusals."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import pytest
import torch

from kvbank import Bank, Client, Fetched, Scope, full_attention
from kvbank.errors import InvalidInput
from kvbank.service.launch import NodeProcess

LAYOUT = full_attention("fetch-prefix@1", num_layers=2, num_kv_heads=2, head_dim=64)  # 16 KiB pages
PAGE = LAYOUT.group_page_bytes[0]
PATHS: dict[str, dict[str, Any]] = {"local": {"channel": "local"}, "shm": {"same_host": True, "channel": "http"},
                                    "data": {"same_host": False, "data_plane": True},
         "tcp": {"same_host": False, "data_plane": False}}


def rand(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8))


def counting(client: Client) -> list[str]:
    """The control calls ``client`` makes from now on, as ``METHOD path``."""
    calls: list[str] = []
    inner = client._call

    def call(method: str, path: str, **kw: Any) -> Any:
        calls.append(f"{method} {path}")
        return inner(method, path, **kw)

    client._call = call  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("path", sorted(PATHS))
def test_fetch_prefix_agrees_with_match_then_fetch(node: NodeProcess, path: str) -> None:
    data = rand(8, 1)
    prompt = [*range(5000, 5000 + 8 * 16), 1, 2, 3]
    with Client(node.url, **PATHS[path]) as c:
        lid = c.register(LAYOUT)
        c.put(lid, prompt[: 8 * 16], group=0, pages=data)
        m = c.match(lid, prompt)
        calls = counting(c)
        got = c.fetch_prefix(lid, prompt)
    assert isinstance(got, Fetched) and got.match == m and got.tokens == 8 * 16
    assert got.result is not None and got.result.complete and got.result.nbytes == 8 * PAGE
    assert torch.equal(got.pages[0], data)
    posts = [k for k in calls if k.startswith("POST")]
    if path == "local":  # over the local channel: no HTTP call at all
        assert posts == [], calls
    elif path == "tcp":  # a stream needs the match first: match, the stream (its own request), its ack
        assert posts[0] == "POST /v1/match" and len(posts) == 2 and posts[1].endswith("/ack"), calls
    else:  # matched and lent in one call, then the acknowledgement: no match call
        assert posts[0] == "POST /v1/fetch" and len(posts) == 2, calls


@pytest.mark.parametrize("path", ["local", "shm"])
def test_fetch_prefix_into_callers_buffers_and_of_a_cold_prompt(node: NodeProcess, path: str) -> None:
    data = rand(4, 2)
    prompt = [*range(7000, 7000 + 4 * 16), 9]
    with Client(node.url, **PATHS[path]) as c:
        lid = c.register(LAYOUT)
        c.put(lid, prompt[: 4 * 16], group=0, pages=data)
        mine = torch.zeros((4, PAGE), dtype=torch.uint8)
        got = c.fetch_prefix(lid, prompt, out={0: mine})
        assert got.pages[0] is mine and torch.equal(mine, data)
        before = c.stats().served_fetches
        calls = counting(c)
        cold = c.fetch_prefix(lid, prompt, scope=Scope(tenant="nobody-stored-this"))
        # nothing stored: one call, no fetch opened on the node, nothing to acknowledge
        assert cold.result is None and cold.tokens == 0 and dict(cold.pages) == {}
        assert calls == ([] if path == "local" else ["POST /v1/fetch"])
        assert c.stats().served_fetches == before
        with pytest.raises(InvalidInput, match=r"out\[0\]"):  # too small for the bound: nothing lent stays
            c.fetch_prefix(lid, prompt, out={0: torch.zeros((2, PAGE), dtype=torch.uint8)})
        assert c.stats().live_leases == 0


def test_bank_fetch_prefix_is_match_then_fetch() -> None:
    data = rand(3, 3)
    prompt = [*range(300, 300 + 3 * 16), 1]
    with Bank.open(host_bytes="8M", device_bytes=0) as bank:
        lid = bank.register(LAYOUT)
        bank.put(lid, prompt[: 3 * 16], group=0, pages=data)
        got = bank.fetch_prefix(lid, prompt)
        assert got.match == bank.match(lid, prompt) and got.tokens == 48
        assert torch.equal(got.pages[0], data)
        assert bank.fetch_prefix(lid, prompt[:10]).result is None  # shorter than a page


def _post(node: NodeProcess, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(node.url + "/v1/fetch", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_fetch_body_takes_a_match_or_a_prompt(node: NodeProcess) -> None:
    with Client(node.url) as c:
        lid = c.register(LAYOUT)
        m = c._match_doc(c.match(lid, list(range(40))))
    prompt = {"layout_id": lid.hex(), "tokens": list(range(40))}
    for body, why in (({"match": m, "prompt": prompt, "via": "lease"}, "not both or neither"),
                      ({"via": "lease"}, "not both or neither"),
                      ({"prompt": prompt, "via": "stream"}, "a streamed fetch needs the match first")):
        status, doc = _post(node, body)
        assert status == 400 and doc["type"] == "InvalidInput" and why in doc["message"], doc
    status, doc = _post(node, {"prompt": {**prompt, "layout_id": "00" * 32}, "via": "lease"})
    assert status == 404 and doc["type"] == "UnknownLayout", doc
    status, doc = _post(node, {"prompt": prompt, "via": "lease"})  # 40 tokens: two pages, none stored
    assert status == 200 and doc["fetch_id"] is None and doc["lease"] is None
    assert doc["match"]["resume"]["tokens"] == 0
