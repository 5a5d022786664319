"""The node's recent past, for the status page: a bounded ring of samples taken on a timer,
and the traffic the node sees by layout and tenant.

Primitives:

- :class:`Traffic` — what the node's data path records (:meth:`Node.match` and a fetch's
  completion call it): per (layout, scope) namespace the matches, prompt tokens asked and
  tokens matched (the prefix hit rate in tokens, as engines report theirs), the scope's
  tenant (a namespace is a one-way digest, so only traffic tells whose rows they are), and
  the tokens served (the resume bound of every fetch that completed). One lock and a few
  integer adds per call.
- :class:`Series` — a thread that, every ``interval_s``, reads the bank's counters (one
  ``bank.stats()``), :class:`Traffic`, and the request histogram and byte counters of
  :class:`~kvbank.service.admin.metrics.Metrics` (when ``/metrics`` is on), into a ring of
  ``points`` samples (the oldest falls out). Counters stay cumulative in a sample; the
  page takes differences; each is numbered (``n``). :meth:`Series.answer` is
  ``GET /admin/series``: the ring (or its samples after a number), and
  latency percentiles per route over the last :data:`LATENCY_WINDOW` samples
  (interpolated in the histogram's buckets, as Prometheus' ``histogram_quantile`` does).
- :func:`usage` — ``GET /admin/usage``: rows and bytes held per model, layout and tenant
  (each namespace's rows counted in the store's ordered name index, a bisect), with each
  namespace's hit rate.

Lifecycle: :func:`~kvbank.service.admin.routes.install_admin` builds both and starts the
thread; it ends at :meth:`Series.stop`, or by itself once the bank is closed. Sampling
costs the data path nothing: the thread reads counters the node keeps anyway.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbank.bank.bank import Bank
from kvbank.errors import KvbankError
from kvbank.keys import Scope, namespace
from kvbank.results import Match

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
DEFAULT_POINTS = 600  # ten minutes at one sample a second
LATENCY_WINDOW = 60  # samples the latency percentiles are taken over
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(slots=True)
class _Space:
    layout_id: bytes
    tenant: str
    matches: int = 0
    asked: int = 0  # prompt tokens matched against this namespace
    matched: int = 0  # of those, the tokens the resume bound covered


class Traffic:
    """What the node's data path records for the status page. See the module docstring."""

    MAX_SPACES = 4096  # namespaces remembered (a cache salt per request would grow it forever)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spaces: collections.OrderedDict[bytes, _Space] = collections.OrderedDict()
        self.matches = 0
        self.asked = 0
        self.matched = 0
        self.served = 0  # tokens: the resume bound of every completed fetch

    def match(self, m: Match) -> None:
        """A match answered (called on the bank pool, after :meth:`Node.match`)."""
        ns = namespace(m.layout_id, m.scope)
        asked, got = m.prompt_tokens, m.resume.tokens
        with self._lock:
            s = self._spaces.get(ns)
            if s is None:
                s = self._spaces[ns] = _Space(m.layout_id, m.scope.tenant)
                if len(self._spaces) > self.MAX_SPACES:
                    self._spaces.popitem(last=False)
            s.matches += 1
            s.asked += asked
            s.matched += got
            self.matches += 1
            self.asked += asked
            self.matched += got

    def scope(self, layout_id: bytes, scope: Scope) -> None:
        """A namespace seen on a put or a scope registration: whose rows it holds."""
        ns = namespace(layout_id, scope)
        with self._lock:
            if ns not in self._spaces:
                self._spaces[ns] = _Space(layout_id, scope.tenant)
                if len(self._spaces) > self.MAX_SPACES:
                    self._spaces.popitem(last=False)

    def fetched(self, tokens: int) -> None:
        """A fetch completed; ``tokens`` its resume bound."""
        with self._lock:
            self.served += tokens

    def totals(self) -> dict[str, int]:
        with self._lock:
            return {"matches": self.matches, "tokens_asked": self.asked,
                    "tokens_matched": self.matched, "tokens_served": self.served}

    def spaces(self) -> dict[bytes, _Space]:
        with self._lock:
            return {ns: _Space(s.layout_id, s.tenant, s.matches, s.asked, s.matched)
                    for ns, s in self._spaces.items()}


# The request histogram's cumulative bucket counts of one route: upper bounds, counts.
Buckets = tuple[tuple[float, ...], tuple[float, ...]]


def _histograms(metrics: Any) -> dict[str, Buckets]:
    """``route method`` -> its latency histogram's cumulative buckets, read now."""
    acc: dict[str, dict[float, float]] = {}
    for family in metrics.latency.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                key = f"{s.labels['method']} {s.labels['route']}"
                acc.setdefault(key, {})[float(s.labels["le"])] = s.value
    return {k: (tuple(sorted(v)), tuple(v[b] for b in sorted(v))) for k, v in acc.items()}


def quantile(q: float, bounds: tuple[float, ...], counts: tuple[float, ...]) -> float | None:
    """The ``q`` quantile of a cumulative histogram, interpolated linearly inside its
    bucket (Prometheus' rule); the last finite bound when it falls in ``+Inf``."""
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lo_bound, lo_count = 0.0, 0.0
    for b, c in zip(bounds, counts, strict=True):
        if c >= rank:
            if b == float("inf"):
                return lo_bound
            if c == lo_count:
                return b
            return lo_bound + (b - lo_bound) * (rank - lo_count) / (c - lo_count)
        lo_bound, lo_count = b, c
    return lo_bound


def _moved(metrics: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in metrics.moved.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                out[f"{s.labels['direction']}/{s.labels['path']}"] = s.value
    return out


class Series:
    """A ring of the node's samples, filled by a thread. See the module docstring."""

    def __init__(self, bank: Bank, traffic: Traffic, *, metrics: Any | None,
                 extra: Callable[[], dict[str, int]] | None = None,
                 interval_s: float = DEFAULT_INTERVAL_S, points: int = DEFAULT_POINTS) -> None:
        self.bank = bank
        self.traffic = traffic
        self.metrics = metrics
        self.extra = extra  # the node's own figures (open remote fetches, in flight)
        self.interval_s = interval_s
        self._ring: collections.deque[dict[str, Any]] = collections.deque(maxlen=points)
        self._hist: collections.deque[dict[str, Buckets]] = collections.deque(maxlen=LATENCY_WINDOW + 1)
        self._lock = threading.Lock()
        self._taken = 0  # samples taken: each one's number ``n``, for ``after``
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.interval_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvbank-series", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except KvbankError:  # the bank closed under us: the node is stopping
                logger.debug("series: bank closed, sampling stops")
                return
            except Exception:  # a status figure is never worth the node: stop sampling, say so
                logger.warning("series: sampling failed; the status page's series stops", exc_info=True)
                return
            self._stop.wait(self.interval_s)

    def sample(self) -> dict[str, Any]:
        """Take one sample now and add it to the ring; the sample."""
        s = self.bank.stats()
        st = s.store
        point: dict[str, Any] = {
            "n": 0, "t": round(time.time(), 3),
            "gets": st.gets, "hits": st.hits, "misses": st.misses, "puts": st.puts, "rows": st.rows,
            "leases": s.live_leases, "fetches": s.open_fetches,
            "tiers": {t.kind.value: {"used": t.used_bytes, "budget": t.budget_bytes, "rows": t.rows,
                                     "hits": t.hits, "demotions": t.demotions, "promotions": t.promotions,
                                     "evictions": t.evictions}
                      for t in st.tiers if t.enabled},
            "tier_moved": {f"{a.value}/{b.value}": n for (a, b), n in st.moved_bytes().items()},
            **self.traffic.totals(),
        }
        if self.extra is not None:
            extra = self.extra()
            point["fetches"] += extra.pop("served_fetches", 0)
            point.update(extra)
        if self.metrics is not None:
            point["moved"] = _moved(self.metrics)
            hist = _histograms(self.metrics)
        with self._lock:
            self._taken += 1
            point["n"] = self._taken
            self._ring.append(point)
            if self.metrics is not None:
                self._hist.append(hist)
        return point

    def latency(self) -> dict[str, dict[str, float | None]]:
        """Per route, requests and latency percentiles (seconds) over the window."""
        with self._lock:
            if not self._hist:
                return {}
            first, last = self._hist[0], self._hist[-1]
        out: dict[str, dict[str, float | None]] = {}
        for route, (bounds, counts) in sorted(last.items()):
            base = first.get(route)
            if base is not None and len(self._hist) > 1 and base[0] == bounds:
                counts = tuple(c - b for c, b in zip(counts, base[1], strict=True))
            n = counts[-1] if counts else 0.0
            if n <= 0:
                continue
            out[route] = {"requests": n, **{f"p{round(q * 100)}": quantile(q, bounds, counts)
                                           for q in QUANTILES}}
        return out

    def answer(self, after: int | None = None) -> dict[str, Any]:
        """``GET /admin/series``: the samples numbered above ``after`` (all by default) and
        the latency table."""
        with self._lock:
            points = [p for p in self._ring if after is None or p["n"] > after]
            window = max(0, len(self._hist) - 1)
        return {"interval_s": self.interval_s, "points": points, "metrics": self.metrics is not None,
                "latency_window_s": round(window * self.interval_s, 3), "latency": self.latency()}


def usage(bank: Bank, traffic: Traffic) -> dict[str, Any]:
    """``GET /admin/usage``: rows, bytes and hit rate per (model, layout, tenant). Rows of
    a namespace are counted in the store's ordered name index (a bisect per namespace,
    never a walk over the rows); bytes are rows times the layout's page size, exact when
    its groups share one page size (``bytes_exact``), else rows times their mean. A
    namespace the node saw no traffic for since it started (rows kept across a restart)
    has the tenant ``null``."""
    spaces = traffic.spaces()
    layouts = {x.layout_id: x for x in bank.admin.layouts()}
    owner: dict[bytes, bytes] = {ns: s.layout_id for ns, s in spaces.items()}
    for lid in layouts:
        owner.update(dict.fromkeys(bank.admin.prefixes(lid), lid))
    rows: list[dict[str, Any]] = []
    for ns, lid in sorted(owner.items()):
        space, layout = spaces.get(ns), layouts.get(lid)
        n = bank.admin.count(ns)
        if not n and space is None:
            continue  # a pair the catalog knows (a registration) with no rows and no traffic
        sizes = () if layout is None else layout.group_page_bytes
        rows.append({
            "model": None if layout is None else layout.model, "layout_id": lid.hex(),
            "tokens_per_page": None if layout is None else layout.tokens_per_page,
            "tenant": None if space is None else space.tenant, "namespace": ns.hex(),
            "rows": n, "bytes": round(n * sum(sizes) / len(sizes)) if sizes else None,
            "bytes_exact": len(set(sizes)) == 1,
            "matches": 0 if space is None else space.matches,
            "tokens_asked": 0 if space is None else space.asked,
            "tokens_matched": 0 if space is None else space.matched,
            "hit_rate": None if space is None or not space.asked else round(space.matched / space.asked, 4),
        })
    return {"rows": rows}
