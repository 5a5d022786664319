"""The status page's routes, its samples and usage table, the offline ``/docs``, and the
Grafana dashboard against the metrics a node exports (in process: a real bank and app;
the page in a browser is tests/service/test_status_page_browser.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from kvbank import Scope
from kvbank.service.admin.routes import admin_of
from kvbank.service.admin.timeseries import Series, Traffic, quantile, usage
from tests.service.admin_app import FA, PAGE, P, auth, fill, served

ROOT = Path(__file__).parents[3]
GRAFANA = ROOT / "docs" / "grafana-kvbank.json"
QUIET = 3600.0  # the sampling thread takes its first sample, then the test samples by hand


def _match(client, tokens: list[int], tenant: str = "") -> dict:
    r = client.post("/v1/match", json={"layout_id": FA.layout_id.hex(), "tokens": tokens,
                                       "scope": {"tenant": tenant}})
    assert r.status_code == 200, r.text
    doc: dict = r.json()
    return doc


def test_status_page_loads_without_a_token_and_its_data_needs_the_admin_token() -> None:
    """The page itself holds no figure (it asks for the token); every route it reads
    answers 401 without the token and 403 with a wrong one."""
    with served(None, series_interval_s=QUIET) as (client, _):
        page = client.get("/admin/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert 'id="login"' in page.text and "sessionStorage" in page.text
        assert not re.search(r"""(src|href)=["']https?:""", page.text)  # nothing from outside
        for path in ("/admin/series", "/admin/usage"):
            assert client.get(path).status_code == 401
            assert client.get(path, headers=auth("not-the-token-0123456789")).status_code == 403
            assert client.get(path, headers=auth()).status_code == 200


def test_series_samples_agree_with_admin_stats() -> None:
    """A sample holds the store's counters as /admin/stats gives them, every tier's bytes
    against its budget, and the tokens the node's matches covered."""
    with served(None, series_interval_s=QUIET) as (client, node):
        fill(node.bank, 6, seed=1, scope=Scope("acme"))
        prompt = list(range(10_000, 10_000 + 6 * P))
        got = [_match(client, [*prompt[: k * P], 7], "acme")["resume"]["tokens"] for k in (2, 4, 6)]
        _match(client, [3] * (3 * P), "acme")  # a miss
        admin_of(client.app).series.sample()  # type: ignore[union-attr]
        point = client.get("/admin/series", headers=auth()).json()["points"][-1]
        stats = client.get("/admin/stats", headers=auth()).json()
        store = stats["bank"]["store"]
        assert {k: point[k] for k in ("gets", "hits", "misses", "puts", "rows")} == {
            k: store[k] for k in ("gets", "hits", "misses", "puts", "rows")}
        assert point["tiers"] == {t["kind"].lower(): {
            "used": t["used_bytes"], "budget": t["budget_bytes"], "rows": t["rows"], "hits": t["hits"],
            "demotions": t["demotions"], "promotions": t["promotions"], "evictions": t["evictions"]}
            for t in stats["tiers"] if t["enabled"]}
        assert point["matches"] == 4 and point["tokens_matched"] == sum(got) == 2 * P + 4 * P + 6 * P
        assert point["tokens_asked"] == sum(k * P + 1 for k in (2, 4, 6)) + 3 * P
        assert point["leases"] == stats["bank"]["live_leases"]
        assert point["tier_moved"] == {}  # one tier: nothing moves


def test_series_samples_the_page_bytes_moved_between_tiers(tmp_path: Path) -> None:
    """A host of a few pages demotes to disk and a read promotes back: a sample holds
    the page bytes moved per pair of tiers as /admin/tiers gives them."""
    with served(tmp_path, host_bytes=16 * PAGE, series_interval_s=QUIET) as (client, node):
        fill(node.bank, 40, seed=6)
        assert client.post("/admin/flush", json={"timeout_s": 30}, headers=auth()).status_code == 200
        m = node.bank.match(FA.layout_id, list(range(60_000, 60_000 + P + 1)))  # the first row: on disk
        assert node.bank.fetch(m, out={0: torch.zeros((1, PAGE), dtype=torch.uint8)}).complete
        admin_of(client.app).series.sample()  # type: ignore[union-attr]
        point = client.get("/admin/series", headers=auth()).json()["points"][-1]
        host = {t["kind"]: t for t in client.get("/admin/tiers", headers=auth()).json()["tiers"]}["HOST"]
    assert host["demotions"] > 0
    assert point["tier_moved"] == {"host/disk": host["demotions"] * PAGE, "disk/host": PAGE}


def test_series_ring_keeps_its_last_points_and_answers_after_since() -> None:
    """The ring is bounded: the oldest sample falls out; ``after`` answers the newer ones."""
    with served(None, series_interval_s=QUIET) as (_, node):
        s = Series(node.bank, Traffic(), metrics=None, interval_s=QUIET, points=5)
        taken = [s.sample()["n"] for _ in range(8)]
        assert taken == list(range(1, 9))
        assert [p["n"] for p in s.answer()["points"]] == [4, 5, 6, 7, 8]
        assert [p["n"] for p in s.answer(after=6)["points"]] == [7, 8]
        assert s.answer(after=8)["points"] == []


def test_latency_quantiles_interpolate_inside_the_bucket() -> None:
    """As Prometheus' histogram_quantile: linear inside the bucket the rank falls in."""
    bounds = (0.001, 0.01, 0.1, float("inf"))
    counts = (0.0, 50.0, 100.0, 100.0)  # cumulative: 50 in (1 ms, 10 ms], 50 in (10, 100]
    assert quantile(0.5, bounds, counts) == pytest.approx(0.01)
    assert quantile(0.25, bounds, counts) == pytest.approx(0.001 + 0.009 * 0.5)
    assert quantile(0.99, bounds, counts) == pytest.approx(0.01 + 0.09 * 0.98)
    assert quantile(0.5, bounds, (0.0, 0.0, 0.0, 0.0)) is None
    assert quantile(0.99, bounds, (0.0, 0.0, 10.0, 20.0)) == pytest.approx(0.1)  # in +Inf: the last bound


def test_series_latency_covers_the_routes_called() -> None:
    with served(None, series_interval_s=QUIET) as (client, node):
        fill(node.bank, 2, seed=2)
        for _ in range(5):
            _match(client, [*range(20_000, 20_000 + 2 * P), 1])
        admin_of(client.app).series.sample()  # type: ignore[union-attr]
        lat = client.get("/admin/series", headers=auth()).json()["latency"]
        row = lat["POST /v1/match"]
        assert row["requests"] == 5 and 0 < row["p50"] <= row["p90"] <= row["p99"]


def test_usage_counts_rows_and_bytes_by_model_layout_and_tenant() -> None:
    """Each namespace's rows and bytes as the store holds them, named by the tenant the
    node saw it under, with the tokens its matches covered."""
    with served(None, series_interval_s=QUIET) as (client, node):
        fill(node.bank, 5, seed=3, scope=Scope("acme"))
        fill(node.bank, 3, seed=4, scope=Scope("globex"))
        _match(client, [*range(30_000, 30_000 + 5 * P), 1], "acme")
        _match(client, [*range(40_000, 40_000 + 3 * P), 1], "globex")
        doc = client.get("/admin/usage", headers=auth()).json()
        rows = {r["tenant"]: r for r in doc["rows"]}
        assert set(rows) == {"acme", "globex"} and all(r["bytes_exact"] for r in doc["rows"])
        assert (rows["acme"]["rows"], rows["acme"]["bytes"]) == (5, 5 * PAGE)
        assert (rows["globex"]["rows"], rows["globex"]["bytes"]) == (3, 3 * PAGE)
        assert rows["acme"]["model"] == FA.model and rows["acme"]["layout_id"] == FA.layout_id.hex()
        assert rows["acme"]["hit_rate"] == pytest.approx(5 * P / (5 * P + 1), abs=1e-4)
        node.bank.admin.evict(fill(node.bank, 5, seed=3, scope=Scope("acme"))[:2])
        again = {r["tenant"]: r["rows"] for r in usage(node.bank, node.traffic)["rows"]}
        assert again == {"acme": 3, "globex": 3}  # counted in the index as it is now


def test_docs_work_offline() -> None:
    """/docs loads Swagger UI from the node itself: every script, style and icon it names
    is served by the node, none from a CDN."""
    with served(None, series_interval_s=QUIET) as (client, _):
        page = client.get("/docs")
        assert page.status_code == 200
        refs = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
        assert refs and all(r.startswith("/docs/assets/") for r in refs), refs
        assert "cdn" not in page.text.lower()
        for r in refs:
            got = client.get(r)
            assert got.status_code == 200 and len(got.content) > 500, r
        assert client.get("/docs/assets/swagger-ui-bundle.js").headers["content-type"].startswith("text/javascript")
        assert client.get("/docs/assets/..%2Fstatus.html").status_code == 404
        assert client.get("/docs/assets/index.html").status_code == 404


def _queried_metrics(doc: dict) -> set[str]:
    names: set[str] = set()
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            names.update(re.findall(r"\bkvbank_\w+", target["expr"]))
    return names


def test_grafana_dashboard_queries_only_metrics_the_node_exports(tmp_path: Path) -> None:
    """Every series docs/grafana-kvbank.json queries is one /metrics serves (after a put,
    a match and a fetch on a node with a disk, so the labelled series exist)."""
    doc = json.loads(GRAFANA.read_text())
    wanted = _queried_metrics(doc)
    assert len(wanted) >= 20
    with served(tmp_path, series_interval_s=QUIET) as (client, node):
        fill(node.bank, 2, seed=5)
        m = _match(client, [*range(50_000, 50_000 + 2 * P), 1])
        assert client.post("/v1/fetch", json={"match": m}).status_code == 200
        text = client.get("/metrics").text
    exported = set(re.findall(r"^(kvbank_\w+)", text, flags=re.M))
    missing = sorted(wanted - exported)
    assert not missing, f"the dashboard queries series /metrics does not serve: {missing}"
    assert doc["templating"]["list"][0]["query"]["query"] == "label_values(kvbank_ready, instance)"
