"""``/metrics``: the node's figures in the Prometheus text format, on its own registry.

Primitives:

- :class:`Metrics` — one :class:`prometheus_client.CollectorRegistry` per node (no
  global registry, so two nodes in one process, or a test's, never share a series). It
  holds what only the service sees — request counts and latency histograms per route
  (the route's template, never the raw path: a lease id in a path would make a series
  per lease), bytes moved per direction and path — and a collector that reads the bank's
  own counters at scrape time (per tier budget, bytes used, rows, hits, misses,
  evictions, demotions, promotions, corrupt frames; page bytes moved between each pair
  of tiers; live leases, pins, the mover's queue, readiness), so a scrape costs one
  ``bank.stats()`` and the data path pays only for the request histogram.
- :class:`MetricsMiddleware` — the ASGI wrapper that times every request and counts the
  body bytes of put routes (TCP in); bytes out are the page bytes of the rows a fetch's
  acknowledgement records, counted by the ack route on every path (TCP stream, shared
  memory, data port).

Names follow Prometheus conventions: ``kvbank_…_total`` counters, ``_bytes`` sizes,
``_seconds`` durations, base units only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvbank.bank.bank import Bank

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
            0.5, 1.0, 2.5, 5.0, 10.0)
_PUT_ROUTES = frozenset({"/v1/put", "/v1/put_state"})


class _BankCollector(Collector):
    """The bank's counters, read when scraped."""

    def __init__(self, bank: Bank, ready: Callable[[], bool], draining: Callable[[], bool]) -> None:
        self._bank = bank
        self._ready = ready
        self._draining = draining

    def collect(self) -> Iterator[Metric]:
        s = self._bank.stats()
        st = s.store
        tier_gauges = {
            "kvbank_tier_budget_bytes": ("budget of the tier", lambda t: t.budget_bytes),
            "kvbank_tier_used_bytes": ("bytes in use (slot capacity or frame bytes)", lambda t: t.used_bytes),
            "kvbank_tier_allocated_bytes": ("memory held by the tier", lambda t: t.allocated_bytes),
            "kvbank_tier_rows": ("rows held by the tier", lambda t: t.rows),
            "kvbank_tier_raw_bytes": ("page bytes of the rows held, before the codec", lambda t: t.raw_bytes),
        }
        for name, (doc, get) in tier_gauges.items():
            g = GaugeMetricFamily(name, doc, labels=["tier"])
            for t in st.tiers:
                if t.enabled:
                    g.add_metric([t.kind.value], float(get(t)))  # type: ignore[no-untyped-call]
            yield g
        tier_counters = {
            "kvbank_tier_hits": ("reads the tier answered", lambda t: t.hits),
            "kvbank_tier_misses": ("reads the tier could not answer", lambda t: t.misses),
            "kvbank_tier_evictions": ("rows dropped out of the store from the tier", lambda t: t.evictions),
            "kvbank_tier_demotions": ("rows moved to a lower tier", lambda t: t.demotions),
            "kvbank_tier_promotions": ("rows copied into the tier on read", lambda t: t.promotions),
            "kvbank_tier_corrupt_frames": ("rows found corrupt and dropped: disk frames that failed "
                                           "their checks, memory copies whose bytes no longer matched "
                                           "their checksum", lambda t: t.corrupt_rows),
            "kvbank_tier_admitted_bytes": ("page bytes of puts stored into the tier", lambda t: t.admitted_bytes),
            "kvbank_tier_rejected_bytes": ("page bytes of puts refused for want of room",
                                           lambda t: t.rejected_bytes),
        }
        for name, (doc, get) in tier_counters.items():
            c = CounterMetricFamily(name, doc, labels=["tier"])
            for t in st.tiers:
                if t.enabled:
                    c.add_metric([t.kind.value], float(get(t)))  # type: ignore[no-untyped-call]
            yield c
        victims = CounterMetricFamily("kvbank_tier_victims", "rows the eviction rule took out of the "
                                      "tier, by reason: first_time (never reused) or reused (aged out)",
                                      labels=["tier", "reason"])
        for t in st.tiers:
            if t.enabled:
                victims.add_metric([t.kind.value, "first_time"], float(t.victims_first))
                victims.add_metric([t.kind.value, "reused"], float(t.victims_reused))
        yield victims
        moved = CounterMetricFamily("kvbank_tier_moved_bytes", "page bytes moved from one tier to "
                                    "another (demotions and promotions)", labels=["from", "to"])
        for (src, dst), nbytes in st.moved_bytes().items():
            moved.add_metric([src.value, dst.value], float(nbytes))
        yield moved
        for name, doc, value in (
            ("kvbank_puts", "rows stored", st.puts), ("kvbank_gets", "row reads", st.gets),
            ("kvbank_hits", "row reads that hit", st.hits), ("kvbank_misses", "row reads that missed", st.misses),
            ("kvbank_leases_expired", "leases reaped after their TTL", s.leases_expired),
            ("kvbank_events_dropped", "change-feed events lost to overflow", st.events_dropped),
        ):
            yield CounterMetricFamily(name, doc, value=float(value))
        for name, doc, value in (
            ("kvbank_rows", "rows in the store", st.rows),
            ("kvbank_leases", "live leases", s.live_leases),
            ("kvbank_layouts", "registered layouts", s.layouts),
            ("kvbank_open_fetches", "open in-process fetch-ledger entries", s.open_fetches),
            ("kvbank_pinned_rows", "rows pinned by the admin", st.pinned_rows),
            ("kvbank_pinned_bytes", "bytes pinned by the admin", st.pinned_bytes),
            ("kvbank_mover_queued_jobs", "jobs waiting for the mover", st.queued_jobs),
            ("kvbank_mover_queued_bytes", "bytes waiting for the mover", st.queued_bytes),
            ("kvbank_ready", "1 when the node takes new work", int(self._ready())),
            ("kvbank_draining", "1 while the node drains", int(self._draining())),
        ):
            yield GaugeMetricFamily(name, doc, value=float(value))


class Metrics:
    """A node's metrics on its own registry. See the module docstring."""

    def __init__(self, bank: Bank, *, ready: Callable[[], bool], draining: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvbank_requests_total", "requests answered",
                                ["route", "method", "code"], registry=self.registry)
        self.latency = Histogram("kvbank_request_duration_seconds", "request latency",
                                 ["route", "method"], buckets=_BUCKETS, registry=self.registry)
        self.moved = Counter("kvbank_moved_bytes_total", "page bytes moved",
                             ["direction", "path"], registry=self.registry)
        for direction in ("in", "out"):  # at 0 from the start: a dashboard shows 0, not "no data"
            for path in ("tcp", "shm", "data"):
                self.moved.labels(direction, path)
        self.registry.register(_BankCollector(bank, ready, draining))
        self._children: dict[tuple[str, str], Any] = {}
        self._counts: dict[tuple[str, str, int], Any] = {}

    def observe(self, route: str, method: str, code: int, seconds: float) -> None:
        key = (route, method)
        h = self._children.get(key)
        if h is None:
            h = self._children[key] = self.latency.labels(route, method)
        h.observe(seconds)
        ckey = (route, method, code)
        c = self._counts.get(ckey)
        if c is None:
            c = self._counts[ckey] = self.requests.labels(route, method, str(code))
        c.inc()

    def add_moved(self, direction: str, path: str, nbytes: int) -> None:
        if nbytes > 0:
            self.moved.labels(direction, path).inc(nbytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Times every HTTP request by its route template; counts page body bytes."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        code = 500
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
            return msg

        async def counting_send(msg: Message) -> None:
            nonlocal code
            if msg["type"] == "http.response.start":
                code = msg["status"]
            await send(msg)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.observe(template, scope["method"], code, time.perf_counter() - t0)
            if template in _PUT_ROUTES:
                self.metrics.add_moved("in", "tcp", received)
            # bytes out are counted at a fetch's acknowledgement, on every path alike
