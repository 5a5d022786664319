"""The node's hot routes (:mod:`kvbank.service.fast_routes`): the lean chain answers exactly as
the full FastAPI application does, keeps every gate and counter, and leaves what it does
not take to FastAPI."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from kvbank.keys import tokens_to_bytes
from kvbank.service.fast_routes import HotTable, NodeAPI
from kvbank.wire.framing import encode_match
from tests.service.admin_app import FA, TOKEN, auth, fill, served


async def _handler(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("never awaited: only matched")


def test_the_table_matches_templates_segment_by_segment() -> None:
    t = HotTable()
    for method, path in (("POST", "/v1/fetch"), ("POST", "/v1/fetch/{fetch_id}/ack"),
                         ("DELETE", "/v1/leases/{lease_id}")):
        t.add(method, path, _handler, None, path)
    found = t.find("POST", "/v1/fetch/abc/ack")
    assert found is not None and found[0].route == "/v1/fetch/{fetch_id}/ack" and found[1] == {"fetch_id": "abc"}
    assert t.find("POST", "/v1/fetch")[0].route == "/v1/fetch"  # type: ignore[index]
    assert t.find("DELETE", "/v1/leases/x")[1] == {"lease_id": "x"}  # type: ignore[index]
    for method, path in (("GET", "/v1/fetch"), ("POST", "/v1/fetch/"), ("POST", "/v1/fetch//ack"),
                         ("POST", "/v1/fetch/a/ack/b"), ("POST", "/v1/fetchx"), ("POST", "/v2/fetch"),
                         ("DELETE", "/v1/leases/x/y")):
        assert t.find(method, path) is None, (method, path)


# Requests a worker could send wrong, to each hot JSON route; the answer (status, error
# type and field) must not depend on which chain took it.
_BAD: list[tuple[str, bytes | None]] = [
    ("/v1/match", b"{not json"),
    ("/v1/match", b""),
    ("/v1/match", b"[]"),
    ("/v1/match", b'{"layout_id": 5}'),
    ("/v1/match", b'{"layout_id": "zz", "tokens": [1]}'),
    ("/v1/match", json.dumps({"layout_id": "ab" * 32, "tokens": [1, 2]}).encode()),
    ("/v1/match", json.dumps({"layout_id": FA.layout_id.hex(), "tokens": [1], "keys": ["00"]}).encode()),
    ("/v1/match", json.dumps({"layout_id": FA.layout_id.hex(), "tokens": ["x"]}).encode()),
    ("/v1/fetch", b'{"match": 3}'),
    ("/v1/fetch", b'{"match": {}}'),
    ("/v1/fetch", b'{"match": {}, "via": "carrier-pigeon"}'),
    ("/v1/fetch", b'{"match": {}, "max_rows": -1}'),
    ("/v1/fetch/nope/ack", b'{"rows": [0]}'),
    ("/v1/fetch/nope/ack", b'{"rows": "all"}'),
    ("/v1/leases/nope/commit", b'{"arrived": []}'),
    ("/v1/leases/nope/commit", b'{"arrived": 7}'),
    ("/v1/put", b"KVBX" + bytes(8)),
    ("/v1/put/lease", b""),
]


def _answers(client: TestClient) -> list[tuple[int, str, str]]:
    out = []
    for path, body in _BAD:
        r = client.post(path, content=body, headers={"Content-Type": "application/json"}
                        if not path.startswith("/v1/put") else {"Content-Type": "application/octet-stream"})
        doc = r.json()
        out.append((r.status_code, doc["type"], doc["field"]))
    return out


def test_bad_input_answers_the_same_on_both_chains(tmp_path: Path) -> None:
    with served(tmp_path / "a") as (client, node):
        fill(node.bank, 2, seed=1)
        app = client.app
        assert isinstance(app, NodeAPI)
        hot = _answers(client)
        table, app.hot = app.hot, HotTable()  # every request now takes the full application
        try:
            full = _answers(client)
        finally:
            app.hot = table
    assert hot == full
    for (path, _), (status, kind, field) in zip(_BAD, hot, strict=True):
        assert 400 <= status < 500 and kind and field, (path, status, kind, field)


def test_a_hot_route_fetches_and_counts_as_its_template(tmp_path: Path) -> None:
    with served(tmp_path / "a") as (client, node):
        fill(node.bank, 3, seed=2)
        tokens = [*range(20_000, 20_000 + 3 * FA.tokens_per_page), 1]
        m = client.post("/v1/match", json={"layout_id": FA.layout_id.hex(), "tokens": tokens}).json()
        assert m["resume"]["tokens"] == 3 * FA.tokens_per_page
        opened = client.post("/v1/fetch", json={"match": m, "via": "lease"}).json()
        lease = opened["lease"]
        assert [s[0] for s in lease["slots"]] == [0, 1, 2] and lease["ttl_s"] > 0
        assert [lease["id"]] == [x["id"] for x in client.get("/v1/leases").json()["leases"]]
        positions = [r[0] for r in opened["rows"]]
        done = client.post(f"/v1/fetch/{opened['fetch_id']}/ack",
                           json={"rows": positions, "lease_id": lease["id"]}).json()
        assert done["complete"] and client.get("/v1/leases").json()["leases"] == []
        text = client.get("/metrics").text
    for template in ("/v1/match", "/v1/fetch", "/v1/fetch/{fetch_id}/ack"):
        assert f'route="{template}"' in text, template


def test_what_the_lean_chain_does_not_take_goes_to_fastapi(tmp_path: Path) -> None:
    with served(tmp_path / "a") as (client, _):
        # a body declared as something other than JSON: FastAPI's own answer
        r = client.post("/v1/match", content=b"layout_id=1", headers={"Content-Type": "text/plain"})
        assert r.status_code == 400 and r.json()["type"] == "InvalidInput"
        # another method on a hot path
        r = client.get("/v1/match")
        assert r.status_code == 405 and r.json()["field"] == "method"


@pytest.mark.parametrize("path", ["/v1/put", "/v1/put/lease"])
def test_the_drain_gate_holds_on_the_lean_chain(tmp_path: Path, path: str) -> None:
    with served(tmp_path / "a") as (client, _):
        assert client.post("/admin/drain", headers=auth(TOKEN)).status_code == 200
        r = client.post(path, content=b"KVBX", headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 503 and r.json()["type"] == "Busy"


def test_a_binary_match_answers_what_the_json_match_answers(tmp_path: Path) -> None:
    """``POST /v1/match`` with a binary body (the client's form for tokens) asks exactly
    what the JSON body asks; a hostile one is a 400 naming the field, on the lean chain."""
    with served(tmp_path / "a") as (client, node):
        fill(node.bank, 4, seed=3)
        tokens = [*range(30_000, 30_000 + 3 * FA.tokens_per_page), 5, 9]
        scope = {"tenant": "", "cache_salt": "", "lora": ""}
        js = client.post("/v1/match", json={"layout_id": FA.layout_id.hex(), "scope": scope,
                                            "tokens_b64": base64.b64encode(tokens_to_bytes(tokens)).decode()})
        octets = {"Content-Type": "application/octet-stream"}
        bn = client.post("/v1/match", headers=octets,
                         content=encode_match(FA.layout_id, scope, None, tokens_to_bytes(tokens)))
        assert js.status_code == bn.status_code == 200 and js.json() == bn.json()
        assert bn.json()["resume"]["tokens"] == 3 * FA.tokens_per_page
        for body, field in ((b"KVBP" + bytes(12), "body.magic"),
                            (encode_match(FA.layout_id, scope, None, tokens_to_bytes(tokens))[:-2], "body"),
                            (encode_match(b"\1" * 32, scope, None, b""), "layout_id")):
            r = client.post("/v1/match", headers=octets, content=body)
            assert r.status_code in (400, 404) and field in r.json()["field"] + r.json()["message"], r.json()
        assert 'route="/v1/match"' in client.get("/metrics").text
