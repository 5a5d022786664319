"""The status page in a real browser (headless Chromium over the DevTools protocol),
against a live ``kvbank serve`` under traffic: what a person would see.

Skips without Debian's ``chromium`` (``apt-get install -y chromium``), except under
``CI=true`` (``.ci/run`` installs it first), where a missing browser fails.
``KVBANK_STATUS_SCREENSHOT=docs/status-page.png`` also saves the page's screenshot there.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from kvbank.bench.browser import INSTALL_HINT, Chromium, chromium_binary
from kvbank.builders import full_attention
from kvbank.client.client import Client
from kvbank.keys import Scope
from kvbank.service.launch import NodeProcess
from kvbank.testing.servers import in_ci
from tests.service.conftest import NODE_ARGS

TOKEN = "status-page-admin-token-0123456789"
ROUNDS = 300  # fetches of the traffic thread (a count, never a span of time)
KEY = "kvbank-admin-token"


@pytest.fixture(scope="module")
def browser() -> Iterator[Chromium]:
    binary = chromium_binary()
    if binary is None:
        if in_ci():
            pytest.fail("CI=true but " + INSTALL_HINT)
        pytest.skip(INSTALL_HINT)
    with Chromium(binary) as b:
        yield b


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    data = tmp_path_factory.mktemp("status-node")
    proc = NodeProcess.start(["--data-dir", str(data), *NODE_ARGS],
                             env={**os.environ, "KVBANK_ADMIN_TOKEN": TOKEN, "KVBANK_SERIES_INTERVAL_S": "0.25"})
    try:
        yield proc
    finally:
        assert proc.stop() == 0, "".join(proc.lines)[-3000:]


def _admin(node: NodeProcess, path: str) -> dict:
    r = httpx.get(node.url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    r.raise_for_status()
    doc: dict = r.json()
    return doc


def _traffic(url: str, served: list[int]) -> None:
    """Two tenants put prompts under two models, then fetch their prefixes ROUNDS times
    (same host and TCP in turn), a miss every tenth round; the tokens each fetch
    delivered go to ``served``."""
    work = []
    with Client(url) as near, Client(url, same_host=False) as far:
        for tenant, model, pages in (("acme", "status-page-model@1", 10), ("globex", "other-model@2", 4)):
            layout = full_attention(model, num_layers=2, num_kv_heads=4, head_dim=64)
            lid = near.register(layout)
            prompt = list(range(5000, 5000 + 16 * pages))
            near.put(lid, prompt, group=0, scope=Scope(tenant),
                     pages=torch.randint(0, 256, (pages, layout.group_page_bytes[0]), dtype=torch.uint8))
            work.append((lid, prompt, Scope(tenant)))
        for i in range(ROUNDS):
            lid, prompt, scope = work[i % 3 == 2]
            got = (near if i % 2 else far).fetch_prefix(lid, [*prompt[: len(prompt) * 3 // 4], 7, 7], scope=scope)
            served.append(got.tokens)
            if i % 10 == 9:
                near.match(lid, [i, 2, 3] * 40, scope=scope)  # a miss: the hit rate is not all 1


def test_status_page_shows_the_node_under_traffic(browser: Chromium, node: NodeProcess, tmp_path: Path) -> None:
    """Logged in with the admin token, the page renders without a console error while
    traffic runs, and once it stops its plots and tables hold the figures /admin/stats
    and /admin/series give: reads and hits, every tier's bytes, the tokens the client was
    served, the bytes moved between tiers, the tenant's rows, the routes' latencies. The
    token stays out of the URL."""
    tab = browser.page()
    try:
        tab.open(node.url + "/admin/ui")
        tab.wait("!document.getElementById('login').hidden")
        tab.evaluate("document.getElementById('token').focus()")
        tab.type(TOKEN)
        tab.wait("document.querySelector('svg[data-plot=hit_rate]') !== null")
        served: list[int] = []  # the traffic runs while the page refreshes
        traffic = threading.Thread(target=_traffic, args=(node.url, served))
        traffic.start()
        traffic.join(120)
        assert not traffic.is_alive() and len(served) == ROUNDS
        ended = _admin(node, "/admin/series")["points"][-1]["t"]
        # a sample taken after the traffic ended, drawn: the page's figures are final
        tab.wait(f"Number(document.querySelector('svg[data-plot=hit_rate]').dataset.t) > {ended}", 60)
        tab.wait("document.querySelector('#p-usage td') !== null", 60)
        stats = _admin(node, "/admin/stats")
        series = _admin(node, "/admin/series")
        page = tab.evaluate("""(() => {
            const hit = document.querySelector('svg[data-plot=hit_rate]');
            const served = [...document.querySelectorAll('svg[data-plot=tokens] g[data-line=tokens_served] circle')];
            return {
              hits: Number(hit.dataset.hits), gets: Number(hit.dataset.gets), t: Number(hit.dataset.t),
              served: served.map(c => Number(c.dataset.total)),
              tiers: Object.fromEntries([...document.querySelectorAll('#p-tiers tr[data-tier]')].map(
                r => [r.dataset.tier, [Number(r.dataset.used), Number(r.dataset.budget)]])),
              moved: Object.fromEntries([...document.querySelectorAll('svg[data-plot=tier_moves] g[data-line]')].map(
                g => [g.dataset.line, [...g.querySelectorAll('circle')].map(c => Number(c.dataset.total))])),
              usage: [...document.querySelectorAll('#p-usage tr')].map(r => r.innerText),
              latency: [...document.querySelectorAll('#p-latency td:first-child')].map(td => td.innerText),
              url: location.href, saved: sessionStorage.getItem(KEY_),
            };
        })()""".replace("KEY_", repr(KEY)))
        store = stats["bank"]["store"]
        assert (page["hits"], page["gets"]) == (store["hits"], store["gets"])
        assert page["served"] and page["served"][-1] == sum(served) > 0
        points = [p for p in series["points"] if p["t"] <= page["t"]]
        assert len(page["served"]) >= 3  # one point per sampling interval, not one per refresh
        assert page["served"] == [p["tokens_served"] for p in points[1:]][-len(page["served"]):]
        assert page["tiers"] == {t["kind"].lower(): [t["used_bytes"], t["budget_bytes"]]
                                 for t in stats["tiers"] if t["enabled"]}
        # one line of page bytes moved per pair of tiers, ending at the last sample's totals
        assert set(page["moved"]) == {"host/disk", "disk/host"}
        assert {k: v[-1] for k, v in page["moved"].items()} == points[-1]["tier_moved"]
        assert any("status-page-model@1" in r and "acme" in r for r in page["usage"]), page["usage"]
        assert any("other-model@2" in r and "globex" in r for r in page["usage"]), page["usage"]
        assert "POST /v1/fetch" in page["latency"]
        assert TOKEN not in page["url"] and page["saved"] == TOKEN
        assert tab.errors == []
        shot = tmp_path / "status-page.png"
        tab.screenshot(shot)
        assert shot.stat().st_size > 10_000
        if os.environ.get("KVBANK_STATUS_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["KVBANK_STATUS_SCREENSHOT"])
    finally:
        tab.close()


def test_status_page_with_a_wrong_token_shows_the_login_form_and_no_data(browser: Chromium,
                                                                         node: NodeProcess) -> None:
    """A refused token leaves the login form up with its reason, draws no plot or table,
    keeps nothing in the session and puts nothing in the URL."""
    tab = browser.page()
    try:
        tab.open(node.url + "/admin/ui")
        tab.wait("!document.getElementById('login').hidden")
        tab.evaluate("document.getElementById('token').focus()")
        wrong = "not-the-admin-token-0123456789"
        tab.type(wrong)
        tab.wait("document.getElementById('login-error').textContent.length > 0")
        seen = tab.evaluate("""({
            app: document.getElementById('app').hidden, login: document.getElementById('login').hidden,
            svg: document.querySelectorAll('svg').length, cells: document.querySelectorAll('td').length,
            error: document.getElementById('login-error').textContent,
            saved: sessionStorage.getItem(KEY_), url: location.href,
        })""".replace("KEY_", repr(KEY)))
        assert seen["app"] is True and seen["login"] is False
        assert seen["svg"] == 0 and seen["cells"] == 0
        assert "token" in seen["error"]
        assert seen["saved"] is None and wrong not in seen["url"]
        # the refusal reached the console as the one error: the collector the first test
        # holds at zero errors sees errors
        assert any("403" in e for e in tab.errors), tab.errors
    finally:
        tab.close()


def test_status_page_lists_the_fleet_nodes_with_their_state(browser: Chromium, redis_server,
                                                            tmp_path: Path) -> None:
    """On a node in a fleet, the fleet table shows every registered node, this one
    marked, with the state /admin/fleet gives."""
    nodes = [NodeProcess.start(["--data-dir", str(tmp_path / name), *NODE_ARGS, "--redis", redis_server.url],
                               env={**os.environ, "KVBANK_ADMIN_TOKEN": TOKEN})
             for name in ("a", "b")]
    tab = browser.page()
    try:
        for n in nodes:  # both registered before the page reads the fleet
            for _ in range(200):
                if len(_admin(n, "/admin/fleet")["nodes"]) == 2:
                    break
                time.sleep(0.05)
        tab.open(nodes[0].url + "/admin/ui")
        tab.wait("!document.getElementById('login').hidden")
        tab.evaluate("document.getElementById('token').focus()")
        tab.type(TOKEN)
        tab.wait("document.querySelectorAll('#p-fleet tr').length === 3", 60)
        shown = tab.evaluate("[...document.querySelectorAll('#p-fleet tr')].slice(1).map(r => "
                             "[...r.children].map(td => td.innerText))")
        fleet = _admin(nodes[0], "/admin/fleet")
        want = {(n["name"] + (" (this node)" if n["node_id"] == fleet["self"] else ""), n["address"], n["state"])
                for n in fleet["nodes"]}
        assert {(r[0], r[1], r[2]) for r in shown} == want
        assert sum("(this node)" in r[0] for r in shown) == 1 and {r[2] for r in shown} == {"live"}
        assert tab.errors == []
    finally:
        tab.close()
        for n in nodes:
            assert n.stop() == 0, "".join(n.lines)[-2000:]
