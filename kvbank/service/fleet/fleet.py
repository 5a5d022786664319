"""A node's part in the fleet: keep its registration and index entries in Redis, and
fetch a prompt's missing rows from the peer that holds them.

Primitives:

- :class:`Fleet` — owns a :class:`~kvbank.service.fleet.index.FleetIndex` and one
  background thread. Every ``heartbeat_s`` it beats (``ZADD`` of its timestamp) and
  follows the bank's change feed: rows PUBLISHED are added to their index entries,
  WITHDRAWN ones removed. Only a (re)join — the first start, a lost registration (Redis
  came back empty), a degraded spell — or a feed OVERFLOW republishes from a scan of
  every held row. Entries carry a TTL, so a live node refreshes what it published a
  slice a beat (from its own list, not a store scan): every row once per
  ``entry_ttl/4``.
- :meth:`Fleet.complete` — the fleet half of a match: after the local match, it asks the
  index about the missing rows of each group's chain (one probe read per Redis node,
  :meth:`~kvbank.service.fleet.index.FleetIndex.lookup`), takes the live peers by the
  rows they hold, and fetches from the first of them (its data API: a streamed,
  resumable fetch through :class:`~kvbank.client.client.Client`). The rows are
  received straight into this node's host slots under a WRITE lease and committed as
  they arrived whole (no temporary copy; with no host slot to lease, they are stored by
  name instead). The next peer is asked only when rows it lists are still missing. The
  local match is then taken again: what the worker sees is what this node holds. A peer
  that dies mid-fetch leaves its undelivered rows misses and its index entries for them
  are withdrawn.
- Degraded mode: any Redis fault sets ``degraded`` (health: ``degraded: fleet``); local
  serving never waits on Redis (the index is skipped while degraded). The loop keeps
  trying every ``heartbeat_s``; once Redis answers again the node re-registers and
  republishes within one beat plus the republish time.

Lifecycle: ``Fleet(bank, client, ...)`` → :meth:`start` (registers in the background)
→ :meth:`complete` from request threads → :meth:`close` (stops the thread, withdraws
nothing: entries of a stopped node expire, and its heartbeat ages out).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvbank._version import __version__
from kvbank.bank.bank import Bank
from kvbank.errors import Forbidden, KvbankError, TierUnavailable, Unauthorized
from kvbank.lender.base import Lease, LeaseMode, MemoryKind
from kvbank.results import EventKind, FetchResult, Match
from kvbank.service.fleet.index import DEFAULT_ENTRY_TTL_S, FleetIndex, NodeInfo
from kvbank.tiers.redis_client import RedisClient

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 1.0
_NOT_YET = "not registered yet"


class Fleet:
    """This node in the fleet; see the module docstring."""

    def __init__(self, bank: Bank, client: RedisClient | None, *, name: str, address: str,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 entry_ttl_s: float = DEFAULT_ENTRY_TTL_S,
                 tenants: tuple[tuple[str, str], ...] = (), **index_args: Any) -> None:
        self.bank = bank
        # A fleet's nodes share their tenant tokens: a peer fetch for a tenant's match
        # goes to the peer under that tenant's token, so the peer holds it to the same scope.
        self._tenant_tokens = dict(tenants)
        self.index = FleetIndex(client, entry_ttl_s=entry_ttl_s, **index_args)
        self.name = name
        self.address = address
        self.heartbeat_s = heartbeat_s
        self.republish_s = entry_ttl_s / 4
        self.node_id: int | None = None
        self.degraded = True  # until the first registration
        self.last_error: str | None = _NOT_YET
        self.published = 0
        self.peer_rows = 0  # rows fetched from peers
        self.peer_misses = 0  # rows a peer was listed for but did not deliver whole
        self.peer_copied = 0  # peer rows stored from buffers (no WRITE lease to be had)
        self._held: set[bytes] = set()  # rows this node has published (what it holds)
        self._refresh: collections.deque[bytes] = collections.deque()  # TTL refresh order
        self.republishes = 0  # full republishes (joins, rejoins, feed overflows)
        self._peers: dict[tuple[str, str | None], Any] = {}  # (address, token) -> a Client kept for reuse
        self._peers_lock = threading.Lock()  # apart from _lock: a match never waits on a beat
        self._live: set[int] = set()  # live peers, read once a beat (not on every match)
        self._last_full = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvbank-fleet", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.bank.admin.take_events(0)  # subscribe: the feed records from now on
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for c in peers:
            c.close()
        with contextlib.suppress(Exception):  # closing a client of a Redis that is gone
            self.index.close()

    def health(self) -> dict[str, Any]:
        return {"state": "degraded" if self.degraded else "ok", "node_id": self.node_id,
                "error": self.last_error if self.degraded else None,
                "published": len(self._held), "peer_rows": self.peer_rows,
                "peer_misses": self.peer_misses, "peer_copied": self.peer_copied,
                "forged_entries": self.index.forged,
                "failover_retries": self.index.retries, "republishes": self.republishes}

    def nodes(self) -> list[NodeInfo]:
        return self.index.nodes()

    def document(self) -> dict[str, Any]:
        """The registry as ``GET /admin/fleet`` answers it (blocking: one Redis read)."""
        return {"self": self.node_id, "nodes": [
            {"node_id": n.node_id, "name": n.name, "address": n.address, "version": n.version,
             "layouts": list(n.layouts), "rows": n.rows,
             "heartbeat_age_s": round(max(0.0, n.heartbeat_age_s), 3),
             "state": "live" if n.heartbeat_age_s <= self.index.deadline_s else "dead"}
            for n in self.nodes()]}

    # -- the loop ----------------------------------------------------------------------

    def _layouts(self) -> list[str]:
        return sorted(lid.hex() for lid in self.bank.fleet.layout_ids())

    def step(self) -> None:
        """One beat: register if needed, follow the feed, refresh a slice of the TTLs."""
        with self._lock:
            try:
                events = self.bank.admin.take_events(None)
                full = self.node_id is None or any(e.kind is EventKind.OVERFLOW for e in events)
                if self.node_id is not None and not self.index.heartbeat(
                        self.node_id, self.name, len(self._held), self._layouts()):
                    full = True
                    self.node_id = None
                if self.node_id is None:
                    self.node_id = self.index.register(self.name, self.address, __version__,
                                                       self._layouts())
                    logger.info("fleet: registered as node %d", self.node_id)
                self._live = self.index.live()
                if full or self._last_full == 0.0:
                    self._republish()
                else:
                    self._follow(events)
                    self._refresh_slice()
                if self.degraded and self.last_error != _NOT_YET:
                    logger.warning("fleet: Redis answers again; node %d republished",
                                   self.node_id)
                self.degraded, self.last_error = False, None
            except TierUnavailable as exc:
                if not self.degraded:
                    logger.warning("fleet: degraded: %s", exc)
                self.degraded, self.last_error = True, str(exc)
                self._last_full = 0.0  # what changed meanwhile: the next beat republishes

    def _follow(self, events: Sequence[Any]) -> None:
        assert self.node_id is not None
        add = [e.name for e in events if e.kind is EventKind.PUBLISHED]
        gone = [e.name for e in events if e.kind is EventKind.WITHDRAWN]
        if add:
            self.index.publish(add, self.node_id)
            self._held.update(add)
        if gone:
            self.index.withdraw(gone, self.node_id)
            self._held.difference_update(gone)

    def _refresh_slice(self) -> None:
        """Re-publish (refresh the TTL of) the next slice of this node's rows, sized so
        that every row is refreshed once per ``republish_s``."""
        assert self.node_id is not None
        n = min(len(self._held), math.ceil(len(self._held) * self.heartbeat_s / self.republish_s))
        todo: list[bytes] = []
        refilled = False
        while len(todo) < n:
            if not self._refresh:
                if refilled:
                    break
                self._refresh.extend(self._held)  # the next round of the cycle
                refilled = True
            name = self._refresh.popleft()
            if name in self._held:
                todo.append(name)
        if todo:
            self.index.publish(todo, self.node_id)

    def _republish(self) -> None:
        """Publish every held row (a scan of the bank) and withdraw what is gone."""
        assert self.node_id is not None
        held: set[bytes] = set()
        for names in self.bank.fleet.held_names():
            self.index.publish(names, self.node_id)
            held.update(names)
        stale = self._held - held
        if stale:
            self.index.withdraw(sorted(stale), self.node_id)
        self._held = held
        self._refresh.clear()
        self._last_full = time.monotonic()
        self.republishes += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # never let the fleet thread kill the node; health shows it
                logger.exception("fleet: step failed: %s: %s", type(exc).__name__, exc)
                self.degraded, self.last_error = True, f"fleet step failed: {type(exc).__name__}: {exc}"
            self._stop.wait(self.heartbeat_s)

    # -- match and peer fetch ----------------------------------------------------------

    def complete(self, match: Match, args: dict[str, Any]) -> bool:
        """Fetch the match's missing rows from the live peers that hold them, most rows
        first, and keep them locally; ``True`` when rows arrived (take the match again).
        Never raises for a fleet fault: a degraded fleet or a dead peer is a local miss.
        ``args`` (the match's own arguments) is kept for the callers: the peer is asked
        for ``match``'s rows directly, not for a match of its own."""
        if self.degraded or self.node_id is None:
            return False
        chains = [[n for n, t in zip(names, tiers, strict=True) if t is None]
                  for names, tiers in zip(match.names, match.tiers, strict=True)]
        if not any(chains):
            return False
        try:  # one probe read per Redis node; liveness comes from the last beat
            listed = self.index.lookup(chains)
            if any(h not in self._live for h in listed):
                self._live = self.index.live()  # a node newer than the last beat
            self.index.forged += sum(1 for h in listed if h not in self._live)
        except TierUnavailable as exc:
            self.degraded, self.last_error = True, str(exc)
            return False
        peers = sorted((h for h in listed if h in self._live and h != self.node_id),
                       key=lambda h: -listed[h])
        flat = [n for chain in chains for n in chain]

        def fetch(peer: int) -> int:
            try:
                return self._fetch_from(peer, match, flat[:listed[peer]])
            except TierUnavailable as exc:
                logger.warning("fleet: peer %d failed: %s", peer, exc)
                return 0

        return fetch_in_order(listed, peers, fetch) > 0

    def _peer_client(self, address: str, token: str | None) -> Any:
        from kvbank.client.client import Client

        with self._peers_lock:  # one client per peer: making one costs ~50 ms (TLS context)
            client = self._peers.pop((address, token), None)
        if client is None:
            client = Client(address, timeout_s=5.0, retry_s=1.0, same_host=False, token=token)
        return client

    def _keep_client(self, address: str, token: str | None, client: Any) -> None:
        with self._peers_lock:
            old = self._peers.pop((address, token), None)
            self._peers[(address, token)] = client
        if old is not None:
            old.close()

    def _fetch_from(self, peer: int, match: Match, listed: list[bytes]) -> int:
        """Rows fetched whole from ``peer`` and kept here (``listed``: the missing rows
        the index has it hold, about). The peer is asked to stream the match as if it
        held every missing row: it sends what it has, reports the rest missing, and the
        fetch's bound covers only what arrived whole (no round trip for its own match).
        The peer's entries for listed rows it did not deliver are withdrawn. With tenant
        tokens, the peer is asked under the match's tenant's token."""
        address = self.index.address(peer)
        if address is None:
            return 0
        token: str | None = None
        if self._tenant_tokens:
            token = self._tenant_tokens.get(match.scope.tenant)
            if token is None:
                return 0  # no tenant to ask the peer as: a local miss
        client = self._peer_client(address, token)
        pm = self.bank.fleet.as_if_held(match)
        lease: Lease | None = None
        try:
            client.layout(match.layout_id)  # known to the peer (kept by the client)
            lease, out = self._receive(pm)
            res = client.fetch(pm, out=out)
        except Exception as exc:  # a peer's fault of any kind (typed or a socket's) is a miss
            if lease is not None:
                self.bank.release(lease.id)
            client.close()
            if isinstance(exc, Unauthorized | Forbidden):
                # the peer refused us, not its rows: its index entries are not stale
                raise TierUnavailable(f"fleet: node {peer} refused the fetch: {exc}") from exc
            self._withdraw_peer(peer, listed)
            raise TierUnavailable(f"fleet: fetch from node {peer}: {exc}") from exc
        self._keep_client(address, token, client)
        arrived, undelivered = _outcome(pm, res)
        try:
            if lease is not None:
                leased = {r.name for r in lease.rows}  # rows held here were not leased
                stored = len(self.bank.commit(lease.id, [n for n in arrived if n in leased])
                             .committed)
            else:
                stored = self._store_copies(pm, out, set(arrived))
                self.peer_copied += stored
        except KvbankError as exc:  # full, busy, the lease expired: the rows stay misses
            logger.warning("fleet: %d rows from node %d not kept: %s", len(arrived), peer, exc)
            if lease is not None:
                self.bank.release(lease.id)
            stored = 0
        stale = set(undelivered).intersection(listed)
        if stale:
            self.peer_misses += len(stale)
            self._withdraw_peer(peer, sorted(stale))
        self.peer_rows += stored
        return stored

    def _receive(self, pm: Match) -> tuple[Lease | None, dict[int, list[memoryview]]]:
        """Where each row of the peer's match lands: the host slot a WRITE lease reserved
        for it (rows already here land in one scratch row per group, and are dropped), or
        scratch rows of their own when no lease can be had (no host tier, a conflict)."""
        layout = self.bank.layout(pm.layout_id)
        names = [n for rows in pm.resume.rows for n in rows]
        # Only rows missing here are leased: a row held here may be under a reader's lease,
        # which a WRITE lease on it would conflict with.
        names = [n for n, t in zip(names, self.bank.locate(names), strict=True) if t is None]
        lease: Lease | None = None
        try:
            self.bank.register_scope(pm.layout_id, pm.scope)
            if names:
                lease = self.bank.lend(names, mode=LeaseMode.WRITE, kind=MemoryKind.HOST)
        except KvbankError as exc:  # TierFull, LeaseConflict, no host tier: copy instead
            logger.debug("fleet: no WRITE lease for a peer's rows (%s); storing copies", exc)
        fill = {r.name for r in lease.rows if r.location is not None} if lease else set()
        out: dict[int, list[memoryview]] = {}
        for g, rows in enumerate(pm.resume.rows):
            if not rows:
                continue
            size = layout.group_page_bytes[g]
            if lease is None:
                out[g] = [memoryview(bytearray(size)) for _ in rows]
                continue
            scratch = memoryview(bytearray(size))
            out[g] = [self.bank.view(lease.id, n) if n in fill else scratch for n in rows]
        return lease, out

    def _store_copies(self, pm: Match, out: dict[int, list[memoryview]],
                      arrived: set[bytes]) -> int:
        stored = 0
        for g, rows in enumerate(pm.resume.rows):
            got = [(n, out[g][j]) for j, n in enumerate(rows) if n in arrived]
            if got:
                stored += self.bank.fleet.put_rows(pm.layout_id, got)
        return stored

    def _withdraw_peer(self, peer: int, names: Sequence[bytes]) -> None:
        """Remove a failed peer's stale entries (best effort: Redis may be down too)."""
        if not names:
            return
        with contextlib.suppress(TierUnavailable):
            self.index.withdraw(list(names), peer)


def fetch_in_order(listed: dict[int, int], peers: Sequence[int],
                   fetch: Callable[[int], int]) -> int:
    """Fetch from ``peers`` (most rows listed first) until one delivers every row it is
    listed for, or the next lists no more than the most any delivered; the rows
    delivered in all. A peer that delivers less than listed (holes in its set, rows gone
    since it published) lets the next one fill in."""
    total = best = 0
    for peer in peers:
        if total and listed[peer] <= best:
            break
        got = fetch(peer)
        total += got
        best = max(best, got)
        if got and got >= listed[peer]:
            break
    return total


def _outcome(pm: Match, res: FetchResult) -> tuple[list[bytes], list[bytes]]:
    """The names of the peer's rows that arrived whole, and of those that did not."""
    arrived: list[bytes] = []
    undelivered: list[bytes] = []
    for g, (keys, names) in enumerate(zip(pm.resume.pages, pm.resume.rows, strict=True)):
        at = {k: j for j, k in enumerate(keys)}  # out[g][j] holds page keys[j]
        arrived.extend(names[at[k]] for k in (res.delivered[g] if g < len(res.delivered) else ()))
        undelivered.extend(names[at[k]] for k in (res.missing[g] if g < len(res.missing) else ()))
    return arrived, undelivered


def where_redis(url: str | None, seeds: Sequence[str]) -> str:
    """The fleet's Redis for a log or the ready line: host and port only (a URL may hold
    a password)."""
    if seeds:
        return "Redis Cluster " + ",".join(seeds)
    from urllib.parse import urlsplit

    parts = urlsplit(url or "")
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"Redis {parts.scheme}://{parts.hostname or ''}{'' if port is None else f':{port}'}"


def health_reasons(fleet: Fleet) -> list[str]:
    """The node's degraded reasons from its fleet: none while it is registered and Redis
    answers; else why (a node that cannot reach its Redis serves locally, but is not in
    the fleet: no peer fetches, no index)."""
    if not fleet.degraded:
        return []
    why = fleet.last_error
    why = "not registered yet" if why in (None, _NOT_YET) else why
    return [why if why.startswith("fleet") else f"fleet: {why}"]  # errors of the fleet name it already


def join_fleet(bank: Bank, config: Any) -> Fleet | None:
    """The node's fleet membership from its service config (``None`` without Redis).
    Redis unreachable at start is not fatal: the node starts degraded and joins later."""
    from kvbank.tiers.redis_client import connect

    if config.redis is None and config.redis_cluster is None:
        return None
    seeds = [s.strip() for s in (config.redis_cluster or "").split(",") if s.strip()]

    def dial() -> RedisClient:  # the loop retries, not the call
        return connect(config.redis, cluster=seeds, retries=2,
                       field="redis_cluster" if seeds else "redis")

    # A cluster client reads the slot table when it is made, so it cannot be made before
    # a seed answers: the index makes it on its first call, and the loop retries until then.
    fleet = Fleet(bank, None, name=config.url, address=config.url, connect=dial,
                  tenants=config.tenants)
    logger.info("fleet: joining through %s", where_redis(config.redis, seeds))
    fleet.start()
    return fleet
