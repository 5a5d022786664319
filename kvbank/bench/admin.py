"""``kvbank bench admin``: what the admin surface costs the data path.

======================  ============================================  =========================
case                    ours                                          baseline (same run)
======================  ============================================  =========================
``match-1000-auth``     p50 ms of ``Client.match`` (1,000 pages) on   the same on a node
                        a node with tenant tokens, with a token       without tenant tokens
``metrics-overhead``    ``fetch-remote`` GB/s (TCP, 2 MiB rows) on a  the same on a node with
                        node with ``/metrics`` on                     ``/metrics`` off
``metrics-overhead-ui`` the same, with the node's status page open    the same
                        in headless Chromium, refreshing (without
                        chromium: a client polling what the page
                        polls, at its pace; the baseline says which,
                        and how often the page refreshed meanwhile)
``rows-list-1m``        ms to list one page (100 rows) of one layout  ``sorted()`` of every
                        from a bank holding 1 M rows                  name, first 100
                        (``bank.admin.rows``)
======================  ============================================  =========================

Targets: ``match-1000-auth`` ratio ≤ 1.05, ``metrics-overhead`` and
``metrics-overhead-ui`` ratio ≥ 0.97,
``rows-list-1m`` ≤ 50 ms. The nodes run as ``kvbank serve`` processes; calls alternate
between the two nodes of a pair so that the shared machine's noise hits both alike.
``--quick`` stores 100 k rows instead of 1 M (the case name stays the contract; its
baseline says the count).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

from kvbank.bench.common import BenchRow, row

SUITE = "admin"
TOKEN = "bench-tenant-token-0123456789"
ADMIN_TOKEN = "bench-admin-token-0123456789"
MATCH_PAGES = 1000
FETCH_ROWS = 64
LIST_PAGE = 100


def _node(stack: ExitStack, tmp: str, name: str, env: dict[str, str]) -> Any:
    from kvbank.service.launch import NodeProcess

    data = os.path.join(tmp, name)
    node = NodeProcess.start(["--data-dir", data, "--host-bytes", "512M", "--disk-bytes", "256M",
                              "--device-bytes", "0", "--max-body-bytes", "512M"],
                             env={**os.environ, **env})
    stack.callback(node.stop)
    return node


def _alternate(a: Any, b: Any, reps: int) -> tuple[list[float], list[float]]:
    ta, tb = [], []
    for _ in range(3):
        a()
        b()
    for i in range(reps):
        first, second = (a, b) if i % 2 == 0 else (b, a)  # neither always goes first
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        t2 = time.perf_counter()
        x, y = (t1 - t0, t2 - t1) if i % 2 == 0 else (t2 - t1, t1 - t0)
        ta.append(x)
        tb.append(y)
    return ta, tb


def _match_auth(tenant_url: str, plain_url: str, reps: int) -> BenchRow:
    import torch

    from kvbank.builders import full_attention
    from kvbank.client.client import Client

    layout = full_attention("bench-admin-match@1", 1, 8, 128, tokens_per_page=16)
    toks = list(range(MATCH_PAGES * 16))
    pages = torch.zeros((MATCH_PAGES, layout.group_page_bytes[0]), dtype=torch.uint8)
    with Client(tenant_url, token=TOKEN) as t, Client(plain_url) as p:
        for c in (t, p):
            lid = c.register(layout)
            c.put(lid, toks, group=0, pages=pages)
        q = [*toks, 1]
        ours, base = _alternate(lambda: t.match(lid, q), lambda: p.match(lid, q), reps)
    return row(SUITE, "match-1000-auth", "ms p50", statistics.median(ours) * 1e3,
               "Client.match, node without tenant tokens", statistics.median(base) * 1e3)


class _PagePoller:
    """Without a browser: what the status page fetches, at its pace, from a thread — the
    series (after the last point seen) every ``max(1, interval_s)`` seconds as the series
    says, and every fifth poll the usage table and, when the series says the node has a
    fleet, the fleet table (``static/status.html``'s ``refresh``)."""

    def __init__(self, url: str, transport: Any = None) -> None:
        import threading

        self._url, self._transport = url, transport
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-page-poller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import httpx

        after = None
        with httpx.Client(base_url=self._url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                          timeout=30, transport=self._transport) as http:
            for tick in itertools.count():
                answer = http.get("/admin/series", params={} if after is None else {"after": after})
                answer.raise_for_status()
                doc = answer.json()
                if doc["points"]:
                    after = doc["points"][-1]["n"]
                if tick % 5 == 0:
                    http.get("/admin/usage").raise_for_status()
                    if doc.get("fleet"):
                        http.get("/admin/fleet").raise_for_status()
                self.polls += 1
                if self._stop.wait(max(1.0, float(doc.get("interval_s") or 1))):
                    return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _open_page(stack: ExitStack, url: str) -> tuple[str, Callable[[], int]]:
    """The node's status page, open and refreshing until ``stack`` closes: in headless
    Chromium when there is one, else polled by a client. Answers which of the two, and a
    call that counts the page's refreshes so far (so a case can show the page refreshed
    while it ran)."""
    from kvbank.bench.browser import Chromium, chromium_binary

    binary = chromium_binary()
    if binary is None:
        poller = _PagePoller(url)
        stack.callback(poller.close)
        return "page polled by a client (no chromium)", lambda: poller.polls
    browser = stack.enter_context(Chromium(binary))
    tab = browser.page()
    stack.callback(tab.close)
    tab.open(url + "/admin/ui")
    tab.wait("!document.getElementById('login').hidden")
    tab.evaluate("document.getElementById('token').focus()")
    tab.type(ADMIN_TOKEN)
    tab.wait("document.querySelectorAll('svg[data-plot=hit_rate]').length > 0", 60)
    if tab.errors:
        raise RuntimeError(f"status page: console errors {tab.errors}")
    return "page open in chromium", lambda: int(tab.evaluate("state.tick"))


def _metrics_overhead(on_url: str, off_url: str, reps: int, rows: int,
                      case: str = "metrics-overhead", with_page: str = "") -> BenchRow:
    import torch

    from kvbank.builders import full_attention
    from kvbank.client.client import Client

    layout = full_attention("bench-admin-fetch@1", 32, 8, 128, tokens_per_page=16)  # 2 MiB pages
    page = layout.group_page_bytes[0]
    toks = list(range(rows * 16))
    src = torch.full((rows, page), 7, dtype=torch.uint8)
    outs = {u: torch.zeros((rows, page), dtype=torch.uint8) for u in (on_url, off_url)}  # pre-touched
    with Client(on_url, same_host=False) as on, Client(off_url, same_host=False) as off:
        matches = {}
        for c, u in ((on, on_url), (off, off_url)):
            lid = c.register(layout)
            c.put(lid, toks, group=0, pages=src)
            matches[u] = c.match(lid, [*toks, 1])

        def fetch(c: Any, u: str) -> None:
            got = c.fetch(matches[u], out={0: outs[u]})
            if not got.complete:
                raise RuntimeError(f"fetch incomplete: {got.missing}")

        ours, base = _alternate(lambda: fetch(on, on_url), lambda: fetch(off, off_url), reps)
    gb = rows * page / 1e9
    return row(SUITE, case, "GB/s", gb / statistics.median(ours),
               "fetch-remote, /metrics off" + (f" ({with_page} on the /metrics-on node)" if with_page else ""),
               gb / statistics.median(base))


def _with_page(stack: ExitStack, on_url: str, off_url: str, reps: int, rows: int) -> BenchRow:
    """``metrics-overhead-ui``: the page open on the /metrics-on node; the baseline says
    how many times it refreshed while the case ran."""
    how, refreshes = _open_page(stack, on_url)
    before = refreshes()
    # enough fetches to span several of the page's refreshes (one a second)
    got = _metrics_overhead(on_url, off_url, reps, rows, "metrics-overhead-ui", how)
    n = refreshes() - before
    return dataclasses.replace(got, baseline=got.baseline[:-1] + f", {n} refreshes during the case)")


def _rows_list(n_rows: int, reps: int) -> BenchRow:
    import torch

    from kvbank.bank.bank import Bank
    from kvbank.builders import full_attention

    layout = full_attention("bench-admin-rows@1", 1, 1, 8, tokens_per_page=16)  # 512-byte pages
    page = layout.group_page_bytes[0]
    budget = max(64 << 20, int(n_rows * page * 1.3))
    with Bank.open(host_bytes=budget, device_bytes=0, disk_bytes=0, data_dir=None) as bank:
        lid = bank.register(layout)
        step = 100_000
        for start in range(0, n_rows, step):  # distinct prompts of 100 k pages each
            k = min(step, n_rows - start)
            toks = list(range(start * 16, (start + k) * 16))
            bank.put(lid, toks, group=0, pages=torch.zeros((k, page), dtype=torch.uint8))
        assert bank.stats().store.rows >= n_rows
        got: list[Any] = []

        def ours() -> None:
            got[:] = bank.admin.rows(lid, limit=LIST_PAGE)

        names = [r.name for r in bank.admin.rows(lid, limit=LIST_PAGE)]
        all_names = list(bank._store._st.ix.ids)  # the naive listing's input, copied once

        def base() -> None:
            sorted(all_names)[:LIST_PAGE]

        t_ours, t_base = _alternate(ours, base, reps)
        if [r.name for r in got] != names:
            raise RuntimeError("rows listing changed between runs")
    label = f"sorted() of every name ({n_rows:,} rows), first {LIST_PAGE}"
    return row(SUITE, "rows-list-1m", "ms", statistics.median(t_ours) * 1e3, label,
               statistics.median(t_base) * 1e3)


def run(quick: bool = False) -> Iterator[BenchRow]:
    reps = 15 if quick else 50
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-admin-") as tmp, ExitStack() as stack:
        tenant = _node(stack, tmp, "tenant", {"KVBANK_TENANTS": f"bench={TOKEN}"})
        plain = _node(stack, tmp, "plain", {})
        yield _match_auth(tenant.url, plain.url, reps)
        stack.close()
        on = _node(stack, tmp, "metrics-on", {"KVBANK_METRICS": "true", "KVBANK_ADMIN_TOKEN": ADMIN_TOKEN})
        off = _node(stack, tmp, "metrics-off", {"KVBANK_METRICS": "false"})
        rows = 16 if quick else FETCH_ROWS
        yield _metrics_overhead(on.url, off.url, 5 if quick else 11, rows)
        with ExitStack() as page:
            yield _with_page(page, on.url, off.url, 11 if quick else 31, rows)
    yield _rows_list(100_000 if quick else 1_000_000, 5 if quick else 9)
