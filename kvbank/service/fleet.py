"""A node's part in the fleet: keep its registration and index entries in Redis, and
fetch a prompt's missing rows from the peer that holds them.

Primitives:

- :class:`Fleet` — owns a :class:`~kvbank.service.fleet_index.FleetIndex` and one
  background thread. Every ``heartbeat_s`` it beats (``ZADD`` of its timestamp), follows
  the store's change feed (rows PUBLISHED are added to their index entries, WITHDRAWN
  ones removed; an OVERFLOW, a first start or a lost registration means a full
  republish from a scan of the store), and republishes everything every ``entry_ttl/4``
  so its entries never expire while it lives.
- :meth:`Fleet.complete` — the fleet half of a match: after the local match, it asks the
  index about the chain's missing rows (one round trip per Redis node), picks the live
  peer holding the longest run of them, fetches them from that peer's data API (a
  streamed, resumable fetch through :class:`~kvbank.service.client.Client`) and stores
  the rows that arrived whole in the local tiers. The local match is then taken again:
  what the worker sees is what this node holds. A peer that dies mid-fetch leaves its
  undelivered rows misses and its index entries for them are withdrawn.
- Degraded mode: any Redis fault sets ``degraded`` (health: ``degraded: fleet``); local
  serving never waits on Redis (the index is skipped while degraded). The loop keeps
  trying every ``heartbeat_s``; once Redis answers again the node re-registers and
  republishes within one beat plus the republish time.

Lifecycle: ``Fleet(bank, client, ...)`` → :meth:`start` (registers in the background)
→ :meth:`complete` from request threads → :meth:`close` (stops the thread, withdraws
nothing: entries of a stopped node expire, and its heartbeat ages out).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvbank import __version__
from kvbank.bank import Bank
from kvbank.errors import Forbidden, KvbankError, TierUnavailable, Unauthorized
from kvbank.results import Match
from kvbank.service.fleet_index import DEFAULT_ENTRY_TTL_S, FleetIndex, NodeInfo
from kvbank.tiers.redis_client import RedisClient
from kvbank.tiers.store.types import EventKind

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 1.0
_SCAN_PAGE = 4096
_NOT_YET = "not registered yet"


class Fleet:
    """This node in the fleet; see the module docstring."""

    def __init__(self, bank: Bank, client: RedisClient, *, name: str, address: str,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 entry_ttl_s: float = DEFAULT_ENTRY_TTL_S,
                 tenants: tuple[tuple[str, str], ...] = (), **index_args: Any) -> None:
        self.bank = bank
        # A fleet's nodes share their tenant tokens: a peer fetch for a tenant's match
        # goes to the peer under that tenant's token, so the peer holds it to the same scope.
        self._tenant_tokens = dict(tenants)
        self.store = bank._store  # take_events / scan: Bank wrappers land with the admin API
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
        self._held: set[bytes] = set()  # rows this node has published (what it holds)
        self._peers: dict[tuple[str, str | None], Any] = {}  # (address, token) -> a Client kept for reuse
        self._peers_lock = threading.Lock()  # apart from _lock: a match never waits on a beat
        self._live: set[int] = set()  # live peers, read once a beat (not on every match)
        self._last_full = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvbank-fleet", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.store.take_events(0)  # subscribe: the feed records from now on
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for c in peers:
            c.close()

    def health(self) -> dict[str, Any]:
        return {"state": "degraded" if self.degraded else "ok", "node_id": self.node_id,
                "error": self.last_error if self.degraded else None,
                "published": len(self._held), "peer_rows": self.peer_rows,
                "peer_misses": self.peer_misses, "forged_entries": self.index.forged,
                "failover_retries": self.index.retries}

    def nodes(self) -> list[NodeInfo]:
        return self.index.nodes()

    # -- the loop ----------------------------------------------------------------------

    def _layouts(self) -> list[str]:
        # The catalog's layout ids (a dict copy is atomic; no public listing exists yet).
        return sorted(lid.hex() for lid in list(self.bank._catalog._layouts))

    def step(self) -> None:
        """One beat: register if needed, follow the feed, republish when due."""
        with self._lock:
            try:
                events = self.store.take_events(None)
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
                if full or time.monotonic() - self._last_full >= self.republish_s:
                    self._republish()
                else:
                    self._follow(events)
                if self.degraded and self.last_error != _NOT_YET:
                    logger.warning("fleet: Redis answers again; node %d republished",
                                   self.node_id)
                self.degraded, self.last_error = False, None
            except TierUnavailable as exc:
                if not self.degraded:
                    logger.warning("fleet: degraded: %s", exc)
                self.degraded, self.last_error = True, str(exc)
                self._last_full = 0.0  # what changed meanwhile: the next republish has it

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

    def _republish(self) -> None:
        assert self.node_id is not None
        held: set[bytes] = set()
        after: bytes | None = None
        while True:
            page = self.store.scan(b"", after=after, limit=_SCAN_PAGE)
            if not page:
                break
            names = [r.name for r in page]
            self.index.publish(names, self.node_id)
            held.update(names)
            after = names[-1]
        stale = self._held - held
        if stale:
            self.index.withdraw(sorted(stale), self.node_id)
        self._held = held
        self._last_full = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # never let the fleet thread kill the node; health shows it
                logger.exception("fleet: step failed")
                self.degraded, self.last_error = True, "fleet step failed; see the log"
            self._stop.wait(self.heartbeat_s)

    # -- match and peer fetch ----------------------------------------------------------

    def complete(self, match: Match, args: dict[str, Any]) -> bool:
        """Fetch the match's missing rows from the peer holding the longest run of them
        and keep them locally; ``True`` when rows arrived (take the match again). Never
        raises for a fleet fault: a degraded fleet or a dead peer is a local miss."""
        if self.degraded or self.node_id is None:
            return False
        missing = [n for names, tiers in zip(match.names, match.tiers, strict=True)
                   for n, t in zip(names, tiers, strict=True) if t is None]
        if not missing:
            return False
        try:  # one multi-key round trip per Redis node; liveness comes from the last beat
            listed = self.index.holders(missing)
            if any(h not in self._live for hs in listed for h in hs):
                self._live = self.index.live()  # a node newer than the last beat
            peers = self._live - {self.node_id}
            holders = [tuple(h for h in hs if h in peers) for hs in listed]
            self.index.forged += sum(1 for hs in listed for h in hs
                                     if h not in self._live)
        except TierUnavailable as exc:
            self.degraded, self.last_error = True, str(exc)
            return False
        runs: dict[int, int] = {}
        for hs in holders:
            for h in hs:
                runs[h] = runs.get(h, 0) + 1
        for peer in sorted(runs, key=lambda h: -runs[h]):
            try:
                got = self._fetch_from(peer, match, args)
            except TierUnavailable as exc:
                logger.warning("fleet: peer %d failed: %s", peer, exc)
                got = 0
            if got:
                return True
        return False

    def _fetch_from(self, peer: int, match: Match, args: dict[str, Any]) -> int:
        """Rows fetched whole from ``peer`` and stored here; a peer that fails has its
        entries for the undelivered rows withdrawn."""
        from kvbank.service.client import Client

        address = self.index.address(peer)
        if address is None:
            return 0
        token: str | None = None
        if self._tenant_tokens:
            token = self._tenant_tokens.get(getattr(args.get("scope"), "tenant", ""))
            if token is None:
                return 0  # no tenant to ask the peer as: a local miss
        key = (address, token)
        with self._peers_lock:  # one client per peer: making one costs ~50 ms (TLS context)
            client = self._peers.pop(key, None)
        if client is None:
            client = Client(address, timeout_s=5.0, retry_s=1.0, same_host=False, token=token)
        planned: list[bytes] = []
        ok = False
        try:
            try:
                client.layout(match.layout_id)
                pm = client.match(match.layout_id, **args)
                out = self.bank.out_buffers(pm)
                planned = pm.needed
                res = client.fetch(pm, out=out)
                ok = True
            except (Unauthorized, Forbidden) as exc:
                # the peer refused us, not its rows: its index entries are not stale
                raise TierUnavailable(f"fleet: node {peer} refused the fetch: {exc}") from exc
            except KvbankError as exc:
                self._withdraw_peer(peer, planned or [])
                raise TierUnavailable(f"fleet: fetch from node {peer}: {exc}") from exc
            except Exception as exc:  # a peer's socket fault of any kind is a miss
                self._withdraw_peer(peer, planned or [])
                raise TierUnavailable(f"fleet: fetch from node {peer}: {exc}") from exc
        finally:
            if ok:
                with self._peers_lock:
                    old = self._peers.pop(key, None)
                    self._peers[key] = client
                if old is not None:
                    old.close()
            else:
                client.close()
        stored = 0
        undelivered: list[bytes] = []
        for g, (keys, names) in enumerate(zip(pm.resume.pages, pm.resume.rows, strict=True)):
            at = {k: j for j, k in enumerate(keys)}  # out[g][j] holds page keys[j]
            for k in res.delivered[g] if g < len(res.delivered) else ():
                j = at[k]
                self.store.put(names[j], out[g][j].numpy().data)
                stored += 1
            undelivered.extend(names[at[k]] for k in
                               (res.missing[g] if g < len(res.missing) else ()))
        if undelivered:
            self.peer_misses += len(undelivered)
            self._withdraw_peer(peer, undelivered)
        self.peer_rows += stored
        return stored

    def _withdraw_peer(self, peer: int, names: Sequence[bytes]) -> None:
        """Remove a failed peer's stale entries (best effort: Redis may be down too)."""
        if not names:
            return
        with contextlib.suppress(TierUnavailable):
            self.index.withdraw(list(names), peer)


def join_fleet(bank: Bank, config: Any) -> Fleet | None:
    """The node's fleet membership from its service config (``None`` without Redis).
    Redis unreachable at start is not fatal: the node starts degraded and joins later."""
    from kvbank.tiers.redis_client import connect

    if config.redis is None and config.redis_cluster is None:
        return None
    seeds = [s.strip() for s in (config.redis_cluster or "").split(",") if s.strip()]
    client = connect(config.redis, cluster=seeds, retries=2)  # the loop retries, not the call
    fleet = Fleet(bank, client, name=config.url, address=config.url, tenants=config.tenants)
    fleet.start()
    return fleet
