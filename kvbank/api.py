"""``WorkerAPI``: the one engine-facing contract, held by :class:`~kvbank.Bank` (embedded)
and :class:`~kvbank.Client` (a served node) alike.

A worker written against ``WorkerAPI`` switches between ``Bank.open(...)`` and
``Client(url)`` with one line: same method names, same parameters (names, kinds,
defaults), same result types, same exception classes. mypy holds both classes to it (the
``TYPE_CHECKING`` block at the end) and ``tests/test_api.py`` compares every method's
``inspect.signature`` on the two, failing on any difference not named below.

Lifecycle::

    lid = w.register(layout)                                   # once per worker
    w.put(lid, tokens, group=g, pages=pages)                    # store ATTENTION pages
    w.put_state(lid, tokens, group=s, state=snap, at=r)         # … and STATE snapshots
    m = w.match(lid, prompt)                                    # a pure query
    got = w.fetch(m, out=w.out_buffers(m))                      # resume at got.resume.tokens
    got = w.fetch_prefix(lid, prompt)                           # match + fetch, one call

or, for a paged engine (a scheduler deciding, workers loading into their block pools)::

    bounds = w.match_many(lid, [keys, ...], have_pages=[c, ...], hold=True)  # one call
    got = w.fetch_into(bounds[i].handle, pool=pool, block_ids={g: ids}, shard=rank)
    w.release_match(bounds[i].handle)                           # finished or preempted
    w.put_from(lid, pool=pool, block_ids={0: ids0, 1: ids1}, keys=keys)  # every group

or, reading and filling rows in place under a lease::

    lease = w.lend(m)                  # READ (or mode=WRITE) on the rows m's bound needs
    ... read or fill the lease's rows in place ...
    w.check_live(lease.id)             # READ: bytes read under an ended lease are not used
    w.commit(lease.id, arrived)        # WRITE: publish the rows that arrived whole
    w.release(lease.id)                # always, in a finally (False if already ended)

Calls, by step: layouts and names (:meth:`~WorkerAPI.register`, :meth:`~WorkerAPI.layout`,
:meth:`~WorkerAPI.register_scope`, :meth:`~WorkerAPI.row_names`); storing
(:meth:`~WorkerAPI.put`, :meth:`~WorkerAPI.put_state`, :meth:`~WorkerAPI.put_states`);
queries that change nothing (:meth:`~WorkerAPI.match`, :meth:`~WorkerAPI.resume_at`,
:meth:`~WorkerAPI.presence`, :meth:`~WorkerAPI.locate`); fetching
(:meth:`~WorkerAPI.fetch`, :meth:`~WorkerAPI.fetch_prefix`,
:meth:`~WorkerAPI.out_buffers`); a paged engine's (:meth:`~WorkerAPI.match_many`,
:meth:`~WorkerAPI.release_match`, :meth:`~WorkerAPI.fetch_into`,
:meth:`~WorkerAPI.put_from`); leases (:meth:`~WorkerAPI.lend`,
:meth:`~WorkerAPI.lend_all`, :meth:`~WorkerAPI.renew`, :meth:`~WorkerAPI.release`,
:meth:`~WorkerAPI.commit`, :meth:`~WorkerAPI.check_live`, :meth:`~WorkerAPI.leases`); the
rest (:meth:`~WorkerAPI.stats`, :meth:`~WorkerAPI.health`, :meth:`~WorkerAPI.flush`,
:meth:`~WorkerAPI.close`, ``with``). The admin and fleet calls are not part of it.

Where Bank and Client differ, and why (``tests/test_api.py`` keeps the same list):

1. **Not in the contract: the in-place calls** — ``Bank.view``, ``device_view``,
   ``write``, ``read``, ``read_into`` and ``get_into``. They hand out or fill the
   lender's own memory in this process; a node's memory is another process's. A Client
   reads and fills a lease's rows through its page paths (shared memory on the node's
   host, the data port, HTTP) inside ``put``/``fetch``/``fetch_prefix``, and the
   :class:`~kvbank.lender.base.Lease` that ``lend`` answers carries the locations a
   worker maps itself.
2. **Not in the contract: the embedded bank's own housekeeping** — ``Bank.open`` and the
   constructors (a config vs a URL), ``fetches`` (the bank's fetch ledger; a node counts
   the fetches it serves in ``stats().served_fetches``), ``reshard_rows`` (the node calls
   it before serving a fetch), ``lend_put`` (the node's put route: a put planned and its
   WRITE lease taken in one call; a Client's ``put`` makes it on the node),
   ``check_invariants`` (tests of an embedded bank), the
   ``reservation`` and ``clock`` properties, the node's routes of a paged engine's calls
   (``held``, ``load_match``, ``lend_load``, ``lend_put_groups``: a handle's match, a
   load's match on a shard, a load's or a multi-group put's plan and lease in one call;
   ``match_with``: the node's own match, from its remote tier and fleet, for
   ``match_many``; ``checksums``: a READ lease's rows' checksums, which the node sends
   with a lent fetch so its client verifies the copies; ``commit_summed``: a commit that
   keeps the checksums its same-host writer hashed as it copied, for the node's local
   channel);
   and the Client's own ``same_host`` and ``map_host`` (its page path), ``breaker``
   (``match_many``'s circuit breaker), and ``prepare_load``, ``load_prepared`` and
   ``release_prepared`` (a hit query that takes its load's lease on the node's host in
   the same call, for an engine that asks whether pages exist and then loads them, as
   SGLang's HiCache does: an embedded Bank's match and load are in-process calls already).
3. **Deadlines** (``timeout=`` of ``put``, ``fetch``, ``lend``, ``fetch_into``,
   ``put_from``): the same parameter, but
   a Client bounds them on its own side, the node taking no deadline on these routes:
   ``timeout`` caps each wait for the node's control answers and HTTP streams, and the
   retries (page bodies over the data port keep that port's own ``timeout_s``). ``fetch``
   answers what arrived whole by then (resume with the same ``fetch_id``), as a Bank
   does, but raises :class:`~kvbank.errors.Busy` where the node never answered (no fetch
   was opened to resume). ``put`` raises ``Busy`` like a Bank, but cannot say how many
   pages were stored: pages committed before the deadline stay (a put again skips them).
   ``lend`` raises ``Busy`` and releases a lease that came back late; one whose answer
   never came is not known to the client and ends at its ttl.
4. **Transport failures**: a Client raises :class:`~kvbank.errors.TierUnavailable` for a
   node it cannot reach or an answer broken off (a Bank, for a tier it cannot reach).
5. **Defaults the node decides**: ``row_names`` is computed on the client side (pure: it
   needs only the layout), so with ``shard=None`` a Client takes shard 0 of a layout of
   one shard and asks for ``shard=`` otherwise, and checks a given shard against the
   layout's ``shard_count``; a Bank takes the one shard registered, and refuses a shard
   never registered (:class:`~kvbank.errors.UnknownLayout`).
6. **``put_states`` on a Client** is one ``put_state`` call to the node per snapshot (every
   snapshot and boundary is checked first, as a Bank does); a Bank stores them in one
   batch.
7. **A scheduler's match** (``match_many``): a Client bounds it by ``timeout`` or, when
   none is given, by ``kvbank.client.engine.MATCH_TIMEOUT_S`` (a Bank by nothing), never
   retries it, and after a call that failed (the node unreachable or too slow) raises
   :class:`~kvbank.errors.TierUnavailable` at once, without a network call, until its
   breaker's cool-down ends (``Client.breaker``); then the next call probes the node.
8. **Paged pools off the node's host** (``fetch_into``, ``put_from``): a Bank and a
   Client on the node's host move each page once between the lent slots and the pool;
   a Client on another host goes through staging buffers (its fetch and put paths:
   the data port or an HTTP stream), a second copy, with the same answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Self

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import TracebackType

    import torch

    from kvbank.bank.bank import Bank
    from kvbank.bank.engine import BlockIds
    from kvbank.buffers import OutBuffers, Pages
    from kvbank.client.client import Client
    from kvbank.kernels.strided import PoolViews
    from kvbank.keys import Scope, TokenIds
    from kvbank.layout import PageLayout
    from kvbank.lender.base import CommitResult, Lease, LeaseMode, MemoryKind
    from kvbank.results import BankStats, Bound, Fetched, FetchResult, Match, Presence, StoreHealth
    from kvbank.tiers.base import TierKind

__all__ = ["WorkerAPI"]


class WorkerAPI(Protocol):
    """What a worker calls on a bank, embedded or served. See the module docstring."""

    # ---- layouts and names

    def register(self, layout: PageLayout) -> bytes:
        """Declare a layout; its 32-byte layout id (idempotent)."""
        ...

    def layout(self, layout_id: bytes) -> PageLayout:
        """The registered layout (:class:`~kvbank.errors.UnknownLayout` otherwise)."""
        ...

    def register_scope(self, layout_id: bytes, scope: Scope) -> bytes:
        """Let leases describe rows of ``scope`` under ``layout_id``; the 16-byte namespace."""
        ...

    def row_names(self, layout_id: bytes, tokens: TokenIds | None = ..., *, group: int,
                  scope: Scope = ..., keys: Sequence[bytes] | None = ...,
                  shard: int | None = ...) -> list[bytes]:
        """The row names of every full page of the prompt for ``group``."""
        ...

    # ---- storing

    def put(self, layout_id: bytes, tokens: TokenIds | None = ..., *, group: int, pages: Pages,
            scope: Scope = ..., keys: Sequence[bytes] | None = ..., first_page: int = ...,
            shard: int | None = ..., timeout: float | None = ...) -> list[bytes]:
        """Store pages of an ATTENTION group; their row names."""
        ...

    def put_state(self, layout_id: bytes, tokens: TokenIds | None = ..., *, group: int,
                  state: torch.Tensor | bytes | bytearray | memoryview, at: int | None = ...,
                  scope: Scope = ..., keys: Sequence[bytes] | None = ...,
                  shard: int | None = ...) -> bytes:
        """Store a STATE group's snapshot after ``at`` tokens; its row name."""
        ...

    def put_states(self, layout_id: bytes, tokens: TokenIds | None = ..., *, group: int,
                   states: Pages, at: Sequence[int], scope: Scope = ...,
                   keys: Sequence[bytes] | None = ..., shard: int | None = ...) -> list[bytes]:
        """Several snapshots of one prompt, ``states[i]`` after ``at[i]`` tokens; their names."""
        ...

    # ---- queries (they lease, lock, renew and record nothing)

    def match(self, layout_id: bytes, tokens: TokenIds | None = ..., *, scope: Scope = ...,
              shard: int | None = ..., keys: Sequence[bytes] | None = ...,
              prompt_tokens: int | None = ...) -> Match:
        """Where each row of the prompt's prefix is, the resume bound, every usable boundary."""
        ...

    def resume_at(self, match: Match, tokens: int) -> Match:
        """``match`` resumed at one of its ``boundaries`` (or 0)."""
        ...

    def presence(self, layout_id: bytes, tokens: TokenIds | None = ..., *, scope: Scope = ...,
                 shards: Sequence[int] | None = ..., keys: Sequence[bytes] | None = ...,
                 prompt_tokens: int | None = ...) -> Presence:
        """Per shard, per group, per page: where the prompt's rows are."""
        ...

    def locate(self, names: Sequence[bytes]) -> list[TierKind | None]:
        """The fastest tier holding each row (None: a miss)."""
        ...

    # ---- fetching

    def fetch(self, match: Match, *, out: OutBuffers, fetch_id: str | None = ...,
              max_rows: int | None = ..., timeout: float | None = ...,
              shard: int | None = ...) -> FetchResult:
        """Copy the rows ``match``'s bound needs into ``out``; the bound of what arrived whole.
        ``shard``: the caller's rank; a match of another shard's rows is refused."""
        ...

    def fetch_prefix(self, layout_id: bytes, tokens: TokenIds | None = ..., *,
                     scope: Scope = ..., shard: int | None = ...,
                     keys: Sequence[bytes] | None = ..., prompt_tokens: int | None = ...,
                     out: OutBuffers | None = ..., max_rows: int | None = ...) -> Fetched:
        """:meth:`match`, then :meth:`fetch` into ``out`` (or new buffers), as one call."""
        ...

    def out_buffers(self, match: Match) -> dict[int, torch.Tensor]:
        """New buffers for :meth:`fetch`, sized from the layout."""
        ...

    # ---- a paged engine's calls

    def match_many(self, layout_id: bytes, keys: Sequence[Sequence[bytes]], *,
                   prompt_tokens: Sequence[int | None] | None = ...,
                   have_pages: Sequence[int] | None = ..., scope: Scope = ...,
                   shard: int | None = ..., hold: bool = ..., pin: bool = ...,
                   ttl_s: float | None = ..., timeout: float | None = ...) -> list[Bound]:
        """Many prompts' bounds in one call (a scheduler's); ``hold``: a handle each to load
        by, ``pin``: its rows of every shard held in place until released or expired."""
        ...

    def release_match(self, handle: str) -> bool:
        """Drop a held match and its pin (a request finished or preempted)."""
        ...

    def fetch_into(self, match: Match | str, *, pool: PoolViews, block_ids: BlockIds,
                   start_page: int | None = ..., shard: int | None = ...,
                   timeout: float | None = ...) -> FetchResult:
        """Load a match (or a handle) into a paged pool of strided views, from
        ``start_page`` on; another shard's match is translated to ``shard``'s rows."""
        ...

    def put_from(self, layout_id: bytes, *, pool: PoolViews, block_ids: BlockIds,
                 keys: Sequence[bytes], first_page: int = ..., scope: Scope = ...,
                 shard: int | None = ..., timeout: float | None = ...) -> dict[int, list[bytes]]:
        """Store pages of several groups of one key range straight from a paged pool."""
        ...

    # ---- leases

    def lend(self, rows: Match | Sequence[bytes], *, mode: LeaseMode = ...,
             kind: MemoryKind = ..., ttl_s: float | None = ...,
             timeout: float | None = ..., shard: int | None = ...) -> Lease:
        """A NAMED lease on rows (a Match: the rows its bound needs); ``shard`` as in fetch."""
        ...

    def lend_all(self, *, kind: MemoryKind = ..., mode: LeaseMode = ...,
                 ttl_s: float | None = ...) -> Lease:
        """An ALL lease: the tier's pools, for a transfer engine's one-time registration."""
        ...

    def renew(self, lease_id: str, ttl_s: float | None = ...) -> Lease:
        """Extend a live lease."""
        ...

    def release(self, lease_id: str) -> bool:
        """End a lease; False if it had already ended."""
        ...

    def commit(self, lease_id: str, arrived: Sequence[bytes] | Sequence[bool]) -> CommitResult:
        """Publish a WRITE lease's rows that arrived whole; the rest are discarded."""
        ...

    def check_live(self, lease_id: str) -> None:
        """The completion check after reading in place: ``LeaseExpired`` if the lease ended."""
        ...

    def leases(self) -> tuple[Lease, ...]:
        """A snapshot of every live lease."""
        ...

    # ---- the rest

    def stats(self) -> BankStats:
        """The bank's counters and its store's."""
        ...

    def health(self) -> StoreHealth:
        """The store's health: each tier's state and the mover's."""
        ...

    def flush(self, timeout_s: float | None = ...) -> None:
        """Wait until the store's mover is idle (``Busy`` after ``timeout_s``)."""
        ...

    def close(self) -> None:
        """Let everything go. Idempotent."""
        ...

    def __enter__(self) -> Self: ...

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None: ...


if TYPE_CHECKING:
    # mypy holds both implementations to the contract (tests/test_api.py: the signatures).
    def _bank_holds_it(bank: Bank) -> WorkerAPI:
        return bank

    def _client_holds_it(client: Client) -> WorkerAPI:
        return client
