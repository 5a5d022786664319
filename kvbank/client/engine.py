"""A client's engine-facing calls: :mod:`kvbank.bank.engine`'s calls made on a served node.

:class:`EngineCalls` is a base of :class:`~kvbank.client.client.Client`:

- :meth:`~EngineCalls.match_many` — one control call for many prompts, made for a
  scheduler: a short deadline (``timeout``, default :data:`MATCH_TIMEOUT_S`), no retries,
  and a circuit breaker (:class:`Breaker`): a call that finds the node unreachable or too
  slow opens it, and for :data:`BREAKER_S` every call raises
  :class:`~kvbank.errors.TierUnavailable` at once, without touching the network; the
  first call after that probes the node again. A dead node costs a scheduler one
  deadline, then nothing.
- :meth:`~EngineCalls.fetch_into` — on the node's host: one control call (the load's
  plan and a READ lease, from a handle or a match), one copy from the node's segment into
  the engine's pool per run of back-to-back slots and buffer, one call that releases the
  lease and answers what counted (both on the local channel where the client has one and
  the node takes them, LOAD and LOADED, else over HTTP). Elsewhere: the load's match for
  the caller's shard, fetched into staging buffers, then scattered into the pool.
- :meth:`~EngineCalls.prepare_load` / :meth:`~EngineCalls.load_prepared` /
  :meth:`~EngineCalls.release_prepared` — a hit query that takes its load's lease in the
  same call (:class:`PreparedLoad`), the load through that lease, or its lease given back.
- :meth:`~EngineCalls.put_from` — on the node's host: one control call plans every
  group's pages and takes one WRITE lease, the pages are gathered from the pool straight
  into the slots, one commit. Elsewhere: gathered into staging, one ``put`` a group and
  run of pages.
- :meth:`~EngineCalls.release_match` — drop a held match (and its pin).

The calls check their arguments and pick the way; the copies and their checks are
:mod:`kvbank.client.poolio`'s. A lent way the node cannot serve here (its segment cannot
be mapped: :class:`~kvbank.errors.TierUnavailable`, unless the client requires shared
memory; the host tier cannot lend every row at once: :class:`~kvbank.errors.TierFull`)
falls back to staging.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from kvbank import wire
from kvbank.client.io import deadline_of, scope_doc
from kvbank.client.poolio import (
    BlockIds,
    check_ids,
    load_lent,
    load_staged,
    put_lent,
    put_staged,
    same_shard,
)
from kvbank.errors import Busy, InvalidInput, TierFull, TierUnavailable
from kvbank.kernels.strided import PoolViews, check_pool
from kvbank.keys import DEFAULT_SCOPE, Scope
from kvbank.results import Bound, FetchResult, Match

if TYPE_CHECKING:
    from kvbank.client.client import Client

__all__ = ["BREAKER_S", "MATCH_TIMEOUT_S", "Breaker", "EngineCalls", "PreparedLoad"]

MATCH_TIMEOUT_S = 0.5  # match_many's deadline when none is given: a scheduler step's budget
BREAKER_S = 5.0  # how long a failed match_many keeps the breaker open before a probe


class Breaker:
    """A circuit breaker: open for ``cool_s`` after a failure, then one probe."""

    def __init__(self, cool_s: float = BREAKER_S) -> None:
        self.cool_s = cool_s
        self._lock = threading.Lock()
        self._open_until = 0.0
        self._why = ""

    def check(self, url: str) -> None:
        with self._lock:
            left, why = self._open_until - time.monotonic(), self._why
        if left > 0:
            raise TierUnavailable(f"node: {url} did not answer a scheduler call ({why}); not asked "
                                  f"again for {left:.1f} s", field="node")

    def trip(self, why: str) -> None:
        with self._lock:
            self._open_until = time.monotonic() + self.cool_s
            self._why = why

    def close(self) -> None:
        with self._lock:
            self._open_until = 0.0

    @property
    def open(self) -> bool:
        return time.monotonic() < self._open_until


@dataclasses.dataclass(eq=False)
class PreparedLoad:
    """A hit query that also took its load's lease (:meth:`EngineCalls.prepare_load`):
    ``match`` is the query's answer; on the node's host the plan and a READ lease on its
    rows come with it, so the load that follows (:meth:`EngineCalls.load_prepared`) is
    only the copies and a one-way release. Used once; a lease it still holds ends at
    :meth:`EngineCalls.release_prepared` or at its ttl."""

    match: Match
    shard: int | None
    sent: float  # time.monotonic() when the lease was asked for: its deadline counts from here
    doc: dict[str, Any] | None = None  # the LOAD answer (None: no lease, or loaded or given back)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def take(self) -> dict[str, Any] | None:
        """The lent plan, once (None: none, or taken already)."""
        with self._lock:
            doc, self.doc = self.doc, None
        return doc


class EngineCalls:
    """The engine-facing calls of a client (mixed into :class:`~kvbank.client.client.Client`)."""

    url: str

    def _me(self) -> Client:
        return cast("Client", self)

    @property
    def breaker(self) -> Breaker:
        """This client's circuit breaker for :meth:`match_many`."""
        b: Breaker | None = self.__dict__.get("_engine_breaker")
        if b is None:
            b = self.__dict__.setdefault("_engine_breaker", Breaker())
        return b

    # ---- the scheduler's calls -------------------------------------------------------

    def match_many(self, layout_id: bytes, keys: Sequence[Sequence[bytes]], *,
                   prompt_tokens: Sequence[int | None] | None = None,
                   have_pages: Sequence[int] | None = None, scope: Scope = DEFAULT_SCOPE,
                   shard: int | None = None, hold: bool = False, pin: bool = False,
                   ttl_s: float | None = None, timeout: float | None = None) -> list[Bound]:
        """:meth:`Bank.match_many` on the node, in one call, for a scheduler: ``timeout``
        (default :data:`MATCH_TIMEOUT_S`) bounds it, it is never retried, and a node that
        did not answer in time is not asked again for :data:`BREAKER_S` (each call raises
        :class:`TierUnavailable` at once meanwhile)."""
        self.breaker.check(self.url)
        deadline = deadline_of(MATCH_TIMEOUT_S if timeout is None else timeout)
        if not isinstance(layout_id, bytes):
            raise InvalidInput(f"layout_id: expected bytes, got {type(layout_id).__name__}")
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise InvalidInput(f"keys: expected a sequence of key chains, got {type(keys).__name__}")
        hexed = []
        for i, chain in enumerate(keys):
            if isinstance(chain, (str, bytes)) or not isinstance(chain, Sequence):
                raise InvalidInput(f"keys[{i}]: expected a sequence of page keys")
            row = []
            for j, k in enumerate(chain):
                if type(k) is not bytes:
                    raise InvalidInput(f"keys[{i}][{j}]: expected bytes, got {type(k).__name__}")
                row.append(k.hex())
            hexed.append(row)
        body = {"layout_id": layout_id.hex(), "keys": hexed, "scope": scope_doc(scope), "shard": shard,
                "prompt_tokens": None if prompt_tokens is None else list(prompt_tokens),
                "have_pages": None if have_pages is None else list(have_pages),
                "hold": hold, "pin": pin, "ttl_s": ttl_s}
        try:
            doc = self._me()._call("POST", "/v1/engine/match", body=body, deadline=deadline)
        except (TierUnavailable, Busy) as exc:
            self.breaker.trip(type(exc).__name__)
            raise
        self.breaker.close()
        return [wire.from_dict(Bound, d) for d in doc["bounds"]]

    def release_match(self, handle: str) -> bool:
        """:meth:`Bank.release_match` on the node."""
        if not isinstance(handle, str):
            raise InvalidInput(f"handle: expected a string, got {type(handle).__name__}")
        return bool(self._me()._call("POST", "/v1/engine/release", body={"handle": handle})["released"])

    # ---- the worker's calls ----------------------------------------------------------

    def fetch_into(self, match: Match | str, *, pool: PoolViews,
                   block_ids: BlockIds, start_page: int | None = None, shard: int | None = None,
                   timeout: float | None = None) -> FetchResult:
        """:meth:`Bank.fetch_into` on the node: one copy from its segment into ``pool`` on
        its host; elsewhere through staging buffers (module docstring)."""
        c = self._me()
        deadline = deadline_of(timeout)
        body: dict[str, Any] = {"shard": shard, "start_page": start_page}
        if isinstance(match, Match):
            body["match"] = c._match_doc(match)
        elif isinstance(match, str) and match:
            body["handle"] = match
        else:
            raise InvalidInput(f"match: expected a Match or a handle, got {type(match).__name__}")
        if c.same_host:
            link = c._chan()
            own = match if isinstance(match, Match) and same_shard(match, shard) else None
            try:
                return load_lent(c, link if link is not None and link.loads else None, body, pool,
                                  block_ids, deadline, own)
            except TierUnavailable:
                if c._shm.required:
                    raise
                c._off_host()  # the segment cannot be mapped here after all
            except TierFull:
                pass  # the host tier cannot lend every row at once: through staging
        return load_staged(c, body, pool, block_ids, deadline)

    def prepare_load(self, layout_id: bytes, *, keys: Sequence[bytes], prompt_tokens: int | None = None,
                     scope: Scope = DEFAULT_SCOPE, shard: int | None = None,
                     ttl_s: float | None = None) -> PreparedLoad:
        """A hit query for a load that is likely to follow (SGLang asks ``batch_exists``,
        then loads the hit): the match of ``keys`` (as :meth:`match`), and on the node's
        host, in the same call on its local channel, the load's plan and a READ lease on
        its rows for ``ttl_s`` (default: the node's). Load it with :meth:`load_prepared`;
        one that will not be loaded, give back with :meth:`release_prepared` (else its
        lease holds the rows from eviction until its ttl)."""
        c = self._me()
        if not isinstance(layout_id, bytes):
            raise InvalidInput(f"layout_id: expected bytes, got {type(layout_id).__name__}")
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) or any(type(k) is not bytes for k in keys):
            raise InvalidInput("keys: expected a sequence of page keys (bytes)")
        link = c._chan() if c.same_host else None
        sent = time.monotonic()
        if link is not None and link.load_keys_op and keys:  # an older node takes neither form
            # binary where the keys have that form (32 bytes each), else LOAD's JSON by keys
            prompt = c._prompt_columns(layout_id, None, scope, shard, list(keys), prompt_tokens)
            try:
                if prompt is not None:
                    m, doc = link.load_keys(prompt, ttl_s)
                else:
                    doc = link.load({"layout_id": layout_id.hex(), "keys": [k.hex() for k in keys],
                                     "prompt_tokens": prompt_tokens, "scope": scope_doc(scope), "shard": shard,
                                     "ttl_s": ttl_s, "via": "lease"})
                    m = wire.from_dict(Match, doc["match"])
                    doc = doc if doc["lease"] is not None else None
                c.layout(m.layout_id)
                return PreparedLoad(m, shard, sent, doc)
            except TierFull:  # the host tier cannot lend every row at once: the match alone
                pass
            except TierUnavailable:  # a node that lends no memory to this caller (tenant tokens)
                if c._shm.required:
                    raise
        m = c.match(layout_id, keys=list(keys), prompt_tokens=prompt_tokens, scope=scope, shard=shard)
        return PreparedLoad(m, shard, sent)

    def load_prepared(self, prepared: PreparedLoad, *, pool: PoolViews, block_ids: BlockIds,
                      timeout: float | None = None) -> FetchResult:
        """:meth:`fetch_into` of a prepared load's match from its first page: through the
        lease it holds (no control call before the copies), else (none, used already, or a
        channel gone) as :meth:`fetch_into` loads it. ``block_ids`` as there: a page
        whose block is None (or beyond the list's end) is not moved, a miss."""
        c = self._me()
        if not isinstance(prepared, PreparedLoad):
            raise InvalidInput(f"prepared: expected a PreparedLoad, got {type(prepared).__name__}")
        pages = [len(p) for p in prepared.match.resume.pages]
        ids = {g: list(block_ids.get(g, ())) + [None] * max(0, n - len(block_ids.get(g, ())))
               for g, n in enumerate(pages) if n or g in block_ids}
        doc = prepared.take()
        link = c._chan() if doc is not None and c.same_host else None
        if doc is None or link is None or not link.loads:
            if doc is not None:
                c.release(doc["lease"]["id"])
            return self.fetch_into(prepared.match, pool=pool, block_ids=ids, start_page=0, shard=prepared.shard,
                                   timeout=timeout)
        try:
            return load_lent(c, link, {}, pool, ids, deadline_of(timeout), prepared.match, (doc, prepared.sent))
        except TierUnavailable:  # its lease released: loaded as fetch_into loads it
            if c._shm.required:
                raise
            c._off_host()
        return self.fetch_into(prepared.match, pool=pool, block_ids=ids, start_page=0, shard=prepared.shard,
                               timeout=timeout)

    def release_prepared(self, prepared: PreparedLoad) -> None:
        """Give back the lease of a prepared load that will not be loaded (none held, or
        loaded already: nothing to do)."""
        doc = prepared.take()
        if doc is None:
            return
        c = self._me()
        link = c._chan() if c.same_host else None
        ack = {"lease_id": doc["lease"]["id"], "arrived": []}
        if link is not None and link.oneway_loaded:
            link.loaded_oneway(ack)
        elif link is not None and link.loads:
            link.loaded(ack)
        else:
            c.release(ack["lease_id"])

    def put_from(self, layout_id: bytes, *, pool: PoolViews,
                 block_ids: BlockIds, keys: Sequence[bytes], first_page: int = 0,
                 scope: Scope = DEFAULT_SCOPE, shard: int | None = None,
                 timeout: float | None = None) -> dict[int, list[bytes]]:
        """:meth:`Bank.put_from` on the node: every group's pages in one control call, one
        copy into its slots and one commit on its host; elsewhere a ``put`` a run."""
        c = self._me()
        deadline = deadline_of(timeout)
        layout = c.layout(layout_id)
        check_ids(layout, block_ids)
        for g in block_ids:
            check_pool(layout, g, pool)
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) or any(type(k) is not bytes for k in keys):
            raise InvalidInput("keys: expected a sequence of page keys (bytes)")
        if isinstance(first_page, bool) or not isinstance(first_page, int) or first_page < 0:
            raise InvalidInput(f"first_page: expected a page index, got {first_page!r}")
        if c.same_host:
            try:
                return put_lent(c, layout, layout_id, pool, block_ids, keys, first_page, scope, shard,
                                 deadline)
            except TierUnavailable:
                if c._shm.required:
                    raise
                c._off_host()
            except TierFull:
                pass
        return put_staged(c, layout, layout_id, pool, block_ids, keys, first_page, scope, shard, deadline)
