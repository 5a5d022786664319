"""The admin API on a real bank: every route refuses a missing token (401) and a wrong
one (403) and answers the right one; the generated token file; rows pages and their
cursors (forged or stale: 400); evict reports locked rows; pin over budget is 409 naming
the budget; drain refuses puts and turns the node unready; bad input is never 5xx."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from kvbank import LeaseMode, Scope, full_attention, wire
from kvbank.errors import InvalidInput
from kvbank.keys import namespace
from kvbank.service.admin.auth import TOKEN_FILE
from kvbank.service.admin.routes import admin_of
from kvbank.service.config import ServiceConfig
from kvbank.service.server import _ready
from tests.service.admin_app import FA, PAGE, TOKEN, auth, fill, served

ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/admin/health", None), ("GET", "/admin/health/live", None),
    ("GET", "/admin/health/ready", None), ("GET", "/admin/stats", None),
    ("GET", "/admin/tiers", None), ("GET", "/admin/layouts", None),
    ("DELETE", "/admin/layouts/" + "ab" * 32, None),
    ("GET", "/admin/leases", None), ("DELETE", "/admin/leases/no-such-lease", None),
    ("GET", "/admin/fetches", None), ("GET", "/admin/rows", None),
    ("POST", "/admin/evict", {"prefix": "ff"}), ("POST", "/admin/flush", {"timeout_s": 10}),
    ("POST", "/admin/drain", {"wait": False}), ("POST", "/admin/undrain", None),
    ("POST", "/admin/pin", {"names": ["00" * 54]}), ("POST", "/admin/unpin", {"names": ["00" * 54]}),
    ("POST", "/admin/check", None), ("POST", "/admin/compact", None), ("GET", "/admin/fleet", None),
    ("GET", "/admin/series", None), ("GET", "/admin/usage", None),
    ("GET", "/admin/quarantine", None), ("DELETE", "/admin/quarantine/" + "00" * 32, None),
]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory):
    with served(tmp_path_factory.mktemp("admin")) as pair:
        yield pair


def test_every_admin_route_is_listed_here(app) -> None:
    client, _ = app
    spec = client.get("/openapi.json").json()
    served_routes = {(m.upper(), p) for p, ops in spec["paths"].items() if p.startswith("/admin/")
                     for m in ops}
    listed = {(m, p.replace("no-such-lease", "{lease_id}").replace("00" * 32, "{layout_id}")
               .replace("ab" * 32, "{layout_id}"))
              for m, p, _ in ROUTES}
    assert served_routes == listed


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_admin_route_needs_the_token(app, method: str, path: str, body: Any) -> None:
    client, _ = app
    kw: dict[str, Any] = {} if body is None else {"json": body}
    none = client.request(method, path, **kw)
    assert none.status_code == 401 and none.json()["type"] == "Unauthorized", none.text
    wrong = client.request(method, path, headers=auth("x" * len(TOKEN)), **kw)
    assert wrong.status_code == 403 and wrong.json()["field"] == "authorization"
    basic = client.request(method, path, headers={"Authorization": f"Basic {TOKEN}"}, **kw)
    assert basic.status_code == 401
    right = client.request(method, path, headers=auth(), **kw)
    # this node runs without Redis: the fleet listing is a typed 400 naming the fleet
    # a layout never registered is UnknownLayout (404); a release of a missing lease too
    expected = 404 if "no-such" in path or "abab" in path else 400 if path == "/admin/fleet" else 200
    assert right.status_code == expected, right.text
    if expected == 400:
        assert right.json()["field"] == "fleet"
    client.post("/admin/undrain", headers=auth())


def test_generated_token_file_is_0600_and_the_ready_line_names_only_the_file(tmp_path: Path) -> None:
    with served(tmp_path, admin_token=None) as (client, node):
        state = admin_of(client.app).state
        path = tmp_path / TOKEN_FILE
        assert state.token_file == path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert path.read_text().strip() == state.token and len(state.token) >= 32
        assert client.get("/admin/health", headers=auth(state.token)).status_code == 200
        out = io.StringIO()
        _ready(node.config, out, state.token_file)
        assert str(path) in out.getvalue() and state.token not in out.getvalue()
    with served(tmp_path, admin_token=None) as (client, _):
        assert admin_of(client.app).state.token != state.token  # a fresh one each start
    with pytest.raises(Exception, match="admin_token"):
        ServiceConfig(admin_token="short")


def _rows(client, **params: Any):
    r = client.get("/admin/rows", params=params, headers=auth())
    assert r.status_code == 200, r.text
    return r.json()


def test_rows_pages_by_layout_scope_and_prefix(app) -> None:
    client, node = app
    a = fill(node.bank, 5, 1, Scope("ta"))
    b = fill(node.bank, 3, 2, Scope("tb"))
    lid = FA.layout_id.hex()
    seen, cursor = [], None
    while True:
        doc = _rows(client, layout_id=lid, limit=2, **({"cursor": cursor} if cursor else {}))
        seen += [r["name"] for r in doc["rows"]]
        cursor = doc["next_cursor"]
        if cursor is None:
            break
    assert seen == sorted(n.hex() for n in a + b)
    only_a = _rows(client, layout_id=lid, tenant="ta")["rows"]
    assert [r["name"] for r in only_a] == sorted(n.hex() for n in a)
    row = only_a[0]
    assert row["size"] == PAGE and row["tiers"] == ["HOST"] and row["pinned"] is False
    ns = namespace(FA.layout_id, Scope("tb")).hex()
    assert {r["name"] for r in _rows(client, prefix=ns)["rows"]} == {n.hex() for n in b}
    assert _rows(client, tenant="nobody")["rows"] == []


def test_rows_cursor_forged_other_query_or_stale_is_400(app) -> None:
    client, node = app
    fill(node.bank, 4, 3)
    doc = _rows(client, limit=1)
    cursor = doc["next_cursor"]
    assert cursor
    flipped = cursor[:-2] + ("A" if cursor[-2] != "A" else "B") + cursor[-1]
    for params in ({"limit": 1, "cursor": flipped}, {"limit": 1, "cursor": "bm90LWEtY3Vyc29y"},
                   {"limit": 1, "cursor": cursor, "tenant": "x"}):
        r = client.get("/admin/rows", params=params, headers=auth())
        assert r.status_code == 400 and r.json()["field"] == "cursor", r.text
    cursors = admin_of(client.app).state.cursors
    real_clock = cursors._clock
    cursors._clock = lambda: real_clock() + 3600.0  # the cursor is an hour old now
    try:
        r = client.get("/admin/rows", params={"limit": 1, "cursor": cursor}, headers=auth())
        assert r.status_code == 400 and "stale" in r.json()["message"]
    finally:
        cursors._clock = real_clock
    assert client.get("/admin/rows", params={"limit": 1, "cursor": cursor}, headers=auth()).status_code == 200


def test_evict_reports_locked_and_pinned_rows_and_leaves_them(app) -> None:
    client, node = app
    names = fill(node.bank, 4, 4, Scope("ev"))
    lease = node.bank.lend([names[0]], mode=LeaseMode.READ)
    try:
        r = client.post("/admin/pin", json={"names": [names[1].hex()]}, headers=auth())
        assert r.status_code == 200 and r.json()["pinned"] == 1
        r = client.post("/admin/evict", json={"layout_id": FA.layout_id.hex(), "scope": {"tenant": "ev"}},
                        headers=auth())
        doc = r.json()
        assert doc["locked"] == [names[0].hex()] and doc["pinned"] == [names[1].hex()]
        assert set(doc["evicted"]) == {n.hex() for n in names[2:]}
        assert node.bank.locate(names)[2:] == [None, None]
        leases = client.get("/admin/leases", headers=auth()).json()["leases"]
        assert lease.id in [x["id"] for x in leases]
        assert client.delete(f"/admin/leases/{lease.id}", headers=auth()).json() == {"released": True}
        r = client.post("/admin/evict", json={"names": [names[0].hex()]}, headers=auth())
        assert r.json()["evicted"] == [names[0].hex()]
    finally:
        node.bank.release(lease.id)
        client.post("/admin/unpin", json={"names": [names[1].hex()]}, headers=auth())


def test_pin_over_budget_is_409_naming_the_budget(app) -> None:
    client, node = app
    names = fill(node.bank, 6, 5)
    r = client.post("/admin/pin", json={"names": [n.hex() for n in names]}, headers=auth())
    assert r.status_code == 409, r.text
    assert r.json()["type"] == "PinBudgetExceeded" and "pin_bytes" in r.json()["message"]
    r = client.post("/admin/pin", json={"names": [n.hex() for n in names[:4]]}, headers=auth())
    assert r.json()["pinned_bytes"] == 4 * PAGE == r.json()["pin_budget_bytes"]
    client.post("/admin/unpin", json={"names": [n.hex() for n in names]}, headers=auth())


def test_drain_refuses_puts_turns_unready_and_undrain_restores(app) -> None:
    client, _ = app
    assert client.get("/admin/health/ready", headers=auth()).status_code == 200
    doc = client.post("/admin/drain", json={"timeout_s": 5}, headers=auth()).json()
    assert doc["draining"] and doc["done"]
    try:
        assert client.post("/v1/put", content=b"x").status_code == 503
        lend = client.post("/v1/leases", json={"names": ["00" * 54], "mode": "WRITE"})
        assert lend.status_code == 503 and lend.json()["type"] == "Busy"
        ready = client.get("/admin/health/ready", headers=auth())
        assert ready.status_code == 503 and "node: draining" in ready.json()["degraded"]
    finally:
        client.post("/admin/undrain", headers=auth())
    assert client.get("/admin/health", headers=auth()).json()["ready"] is True


def test_health_reasons_hook_and_check(app) -> None:
    client, _ = app
    state = admin_of(client.app).state
    state.add_health_reasons(lambda: ["fleet: redis unreachable"])
    try:
        doc = client.get("/admin/health", headers=auth()).json()
        assert "fleet: redis unreachable" in doc["degraded"] and doc["live"]
    finally:
        state._reasons.clear()
    assert client.post("/admin/check", headers=auth()).json() == {"ok": True, "problems": []}
    tiers = {t["kind"]: t for t in client.get("/admin/tiers", headers=auth()).json()["tiers"]}
    assert tiers["HOST"]["enabled"] and tiers["HOST"]["budget_bytes"] == 16 << 20
    assert tiers["DISK"]["high_watermark"] > tiers["DISK"]["low_watermark"]


@pytest.mark.parametrize(("method", "path", "body", "field"), [
    ("POST", "/admin/evict", {"names": ["zz"]}, "names[0]"),
    ("POST", "/admin/evict", {}, "names"),
    ("POST", "/admin/evict", {"names": ["00" * 54], "prefix": "00"}, "names"),
    ("POST", "/admin/evict", {"layout_id": "00"}, "layout_id"),
    ("POST", "/admin/pin", {"names": []}, "names"),
    ("POST", "/admin/pin", {"names": ["00" * 53]}, "names[0]"),
    ("POST", "/admin/pin", {"nams": ["00"]}, "names"),
    ("POST", "/admin/flush", {"timeout_s": -1}, "timeout_s"),
    ("GET", "/admin/rows?limit=0", None, "limit"),
    ("GET", "/admin/rows?limit=x", None, "limit"),
    ("GET", "/admin/rows?prefix=xyz", None, "prefix"),
    ("GET", "/admin/rows?layout_id=00", None, "layout_id"),
])
def test_bad_admin_input_is_4xx_naming_the_field(app, method: str, path: str, body: Any, field: str) -> None:
    client, _ = app
    r = client.request(method, path, headers=auth(), **({} if body is None else {"json": body}))
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["field"] == field, r.text


def test_tiers_report_raw_bytes_and_the_disk_codec_ratio_also_after_a_reopen(tmp_path: Path) -> None:
    """The disk tier's codec ratio is the rows' raw page bytes over the frame bytes on
    disk; memory tiers report raw bytes and no ratio; after a reopen the figures are
    rebuilt from the disk's meta records alone."""
    import torch

    def tiers(client: Any) -> dict[str, Any]:
        return {t["kind"]: t for t in client.get("/admin/tiers", headers=auth()).json()["tiers"]}

    n = 8
    with served(tmp_path) as (client, node):
        assert tiers(client)["DISK"]["codec_ratio"] is None  # nothing stored yet
        node.bank.register(FA)
        pages = torch.arange(n * PAGE, dtype=torch.int64).remainder(7).to(torch.uint8).reshape(n, PAGE)
        node.bank.put(FA.layout_id, list(range(n * 16)), group=0, pages=pages)
        assert client.post("/admin/flush", json={"timeout_s": 30}, headers=auth()).status_code == 200
        node.bank.close()  # written back to disk: every row now has a frame
    with served(tmp_path) as (client, node):
        t = tiers(client)
        disk = t["DISK"]
        assert disk["rows"] == n and disk["raw_bytes"] == n * PAGE
        assert 0 < disk["used_bytes"] < n * PAGE  # a repeating pattern compresses
        assert disk["codec_ratio"] == round(n * PAGE / disk["used_bytes"], 4) and disk["codec_ratio"] > 1
        assert t["HOST"]["codec_ratio"] is None and t["HOST"]["raw_bytes"] == 0
        got = torch.zeros((1, PAGE), dtype=torch.uint8)
        m = node.bank.match(FA.layout_id, list(range(16 + 1)))
        assert node.bank.fetch(m, out={0: got}).complete  # read back: promoted into host
        t = tiers(client)
        assert t["HOST"]["raw_bytes"] == PAGE and t["DISK"]["raw_bytes"] == n * PAGE


def test_layout_with_a_lone_surrogate_is_refused_and_layouts_stay_listable(app) -> None:
    """B1: a model name with a lone surrogate was registered (200), persisted, and from
    then on every ``GET /admin/layouts`` answered 500, across restarts. It is a 400 now,
    and the listing answers."""
    client, _ = app
    import json

    doc = wire.to_dict(FA)
    doc["model"] = "x\ud800y"
    body = json.dumps({"layout": doc}).encode()  # valid JSON: the surrogate is escaped
    got = client.post("/v1/layouts", content=body, headers={"Content-Type": "application/json"})
    assert got.status_code == 400 and "UTF-8" in got.json()["message"], got.text
    listed = client.get("/admin/layouts", headers=auth())
    assert listed.status_code == 200 and all("\ud800" not in x["model"] for x in listed.json()["layouts"])


def test_unregister_a_layout_only_once_its_rows_are_gone(app) -> None:
    """W14: a layout can be unregistered (every shard), not while it holds rows."""
    client, node = app
    other = full_attention("admin-unregister@1", num_layers=1, num_kv_heads=2, head_dim=64)
    lid = node.bank.register(other)
    node.bank.put(lid, list(range(16)), group=0, pages=torch.zeros((1, PAGE), dtype=torch.uint8))
    held = client.delete(f"/admin/layouts/{lid.hex()}", headers=auth())
    assert held.status_code == 400 and "evict them first" in held.json()["message"], held.text
    assert client.post("/admin/evict", headers=auth(), json={"layout_id": lid.hex()}).status_code == 200
    gone = client.delete(f"/admin/layouts/{lid.hex()}", headers=auth())
    assert gone.status_code == 200 and gone.json() == {"unregistered": 1}
    ids = [x["layout_id"] for x in client.get("/admin/layouts", headers=auth()).json()["layouts"]]
    assert lid.hex() not in ids and FA.layout_id.hex() in ids
    assert client.delete(f"/admin/layouts/{lid.hex()}", headers=auth()).status_code == 404
    assert node.bank.register(other) == lid  # and it can be registered again


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/match", {"layout_id": FA.layout_id.hex(), "tokens": [True, False]}, "tokens.0"),
    ("/v1/match", {"layout_id": FA.layout_id.hex(), "tokens": [1, 2], "scope": {"evil": 1}}, "scope.evil"),
    ("/v1/match", {"layout_id": FA.layout_id.hex(), "tokens": [1, 2], "shard": "0"}, "shard"),
    ("/v1/match", {"layout_id": FA.layout_id.hex(), "tokens": [1, 2], "evil": 1}, "evil"),
    ("/v1/leases", {"names": [], "ttl_s": "30"}, "ttl_s"),
    ("/v1/fetch/x/ack", {"rows": [True]}, "rows.0"),
    ("/v1/layouts", {"layout": {}, "evil": 1}, "evil"),
    ("/admin/drain", {"wait": "yes"}, "wait"),
    ("/admin/evict", {"scope": {"tenant": 1}}, "scope.tenant"),
])
def test_json_bodies_are_as_strict_as_the_binary_header(app, path: str, body: Any, field: str) -> None:
    """W13: wire.md's rules ("``true`` is not an integer", "a missing or unknown key is
    refused") held on the binary put header but not on the JSON routes, which coerced
    ``[true, false]`` to tokens, ``"0"`` to a shard, ``"30"`` to a TTL and ``"yes"`` to
    a drain (which then drained the node)."""
    client, node = app
    node.bank.register(FA)
    got = client.post(path, json=body, headers=auth())
    assert got.status_code in (400, 422), got.text
    assert field in got.json()["field"] + got.json()["message"], got.text
    assert client.get("/admin/health", headers=auth()).json()["draining"] is False


@pytest.mark.parametrize("fetch_id", ["фетч", "a\r\nx-evil: 1", "a b", "", "x" * 129, "a/b"])
def test_a_fetch_id_that_cannot_travel_is_400_and_opens_nothing(app, fetch_id: str) -> None:
    """W11: a non-Latin-1 fetch_id answered 500 (the stream's header could not be built)
    and left an open remote fetch behind each time; CR LF dropped the connection without
    an answer. Refused now, before anything is opened, on every path."""
    client, node = app
    fill(node.bank, 2, 3)
    m = node.bank.match(FA.layout_id, list(range(30_000, 30_040)))
    assert m.resume.tokens == 32
    before = len(node.ledger)
    for via in ("stream", "lease"):
        got = client.post("/v1/fetch", json={"match": wire.to_dict(m), "via": via, "fetch_id": fetch_id})
        assert got.status_code == 400 and got.json()["field"] == "fetch_id", got.text
    assert len(node.ledger) == before
    with pytest.raises(InvalidInput, match="fetch_id"):
        node.bank.fetch(m, out=node.bank.out_buffers(m), fetch_id=fetch_id)
