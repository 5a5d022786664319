"""The embedded bank: the one object a worker embeds (and the node service wraps).

Lifecycle::

    from kvbank import Bank, full_attention

    with Bank.open(host_bytes="256M") as bank:                   # a BankConfig + overrides
        lid = bank.register(full_attention("my-model@rev", num_layers=2,
                                           num_kv_heads=4, head_dim=64))
        bank.put(lid, tokens, group=0, pages=pages)              # uint8 [n, page_bytes]
        m = bank.match(lid, tokens + more_tokens)                # a pure query
        got = bank.fetch(m, out={0: buf})                        # resume at got.resume.tokens

Primitives (value objects in :mod:`kvbank.results`, JSON forms in :mod:`kvbank.wire.forms`):

- layouts and names: :meth:`~Bank.register` (idempotent; returns the 32-byte layout id),
  :meth:`~Bank.register_scope`, :meth:`~Bank.layout`, :meth:`~Bank.row_names`.
- storing: :meth:`~Bank.put` (pages of an ATTENTION group), :meth:`~Bank.put_state` (a
  STATE group's snapshot at a page boundary) and :meth:`~Bank.put_states` (several of
  them, the chain hashed once). Sizes are checked before anything is stored.
- queries, which change nothing (no lease, lock, renewal, recency or table write):
  :meth:`~Bank.match` (per-row tiers, the resume bound, every usable boundary),
  :meth:`~Bank.resume_at` (the same match resumed at a lower boundary),
  :meth:`~Bank.presence` (every shard of a layout in one lookup), :meth:`~Bank.locate`.
  Prompts are given as token ids or as an engine's own page-key chain (``keys=``; see
  :func:`kvbank.keys.engine_keys` for keys that are not 32 bytes).
- :meth:`~Bank.fetch` — copy a match's needed rows into caller buffers (sized by
  :meth:`~Bank.out_buffers`, or the caller's own) through the fetch ledger; the bound is
  recomputed from the rows that arrived whole, and a broken fetch
  resumes (same ``fetch_id``) from its first undelivered row. :meth:`~Bank.fetch_prefix`
  matches a prompt and fetches its prefix in one call (on a served node, one round trip).
- leases for in-place reads and fills (host shared memory, other processes too, or device
  memory): :meth:`~Bank.lend`, :meth:`~Bank.lend_all`, :meth:`~Bank.renew`,
  :meth:`~Bank.release`, :meth:`~Bank.commit`; the bytes through :meth:`~Bank.view`,
  :meth:`~Bank.device_view`, :meth:`~Bank.write`, :meth:`~Bank.read`,
  :meth:`~Bank.read_into`; :meth:`~Bank.check_live` after reading in place (bytes read
  under an expired lease must not be used). See :mod:`kvbank.lender.lender`.
- operations: :attr:`~Bank.reservation` (the host budget pre-faulted since open, with
  ``reserve_host``), :meth:`~Bank.leases`, :meth:`~Bank.fetches`, :meth:`~Bank.stats`,
  :meth:`~Bank.health`, :meth:`~Bank.flush`, :meth:`~Bank.check_invariants`,
  :meth:`~Bank.close`.
- the operator's calls (rows, evict, pin, unpin, touch, the change feed, a row's encoded
  frame) on ``bank.admin`` (:class:`~kvbank.bank.admin.BankAdmin`); what the fleet needs
  (layout ids, every held name, storing a peer's rows by name, recalling rows from the
  remote tier) on ``bank.fleet`` (:class:`~kvbank.bank.fleet.BankFleet`). They are not
  the worker's calls, so they are not the bank's own methods.

Namespaces. A row name starts with ``SHA-256(scope, layout id)[:16]``, a one-way digest:
to describe a row (its page size and buffer regions, for a lease) the bank must have
seen the (scope, layout) pair. It learns pairs on commands only — ``register`` (the
default scope), ``register_scope``, ``put``/``put_state`` and ``lend`` of a Match — never
on a query, into a bounded LRU table. A WRITE lease on names of another scope needs a
``register_scope`` first.

Deadlines. ``timeout=`` (seconds, on the bank's clock) bounds ``put`` (checked before
each page: :class:`~kvbank.errors.Busy` names how many were stored), ``fetch`` (it stops
at the deadline and answers what arrived; resume it with the same ``fetch_id``) and
``lend`` (a lease handed back after the deadline is released at once, then ``Busy``: the
caller has given up on it). One store call is not interrupted: the store takes no
deadline of its own yet.

Closed. After :meth:`~Bank.close` every public method but ``close`` (idempotent) raises
:class:`~kvbank.errors.TierUnavailable` naming the bank, queries and ``stats`` included.

Every method validates its input and raises a typed error naming the field
(:class:`~kvbank.errors.InvalidInput` subclasses). The bank is thread-safe: the lender,
the ledger and the store each guard their own state; the bank's tables sit behind one lock.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Self

import torch

from kvbank import checks
from kvbank.bank import lookup, puts
from kvbank.bank.admin import BankAdmin
from kvbank.bank.catalog import Catalog
from kvbank.bank.closing import refused_once_closed
from kvbank.bank.cross_shard import CrossLocate, ReshardReader, ShardCounts
from kvbank.bank.engine import EngineOps
from kvbank.bank.fetch import GetMany, fetch_rows, one_by_one
from kvbank.bank.fleet import BankFleet
from kvbank.bank.leases import LeaseOps
from kvbank.bank.quarantine import BankAudit
from kvbank.buffers import (
    OutBuffers,
    Pages,
    fetched,
    out_buffers,
    out_views,
    page_views,
)
from kvbank.config import BankConfig, check_settings
from kvbank.errors import Busy, InvalidInput, LayoutError, RowLocked, TierUnavailable
from kvbank.keys import DEFAULT_SCOPE, Scope, TokenIds, group_of, namespace
from kvbank.keys import row_names as _row_names
from kvbank.layout import GroupKind, PageLayout
from kvbank.lender.base import Lease, LeaseMode, MemoryKind
from kvbank.lender.ledger import FetchInfo, FetchLedger
from kvbank.lender.lender import Lender
from kvbank.results import (
    BankStats,
    Fetched,
    FetchResult,
    Match,
    Presence,
    StoreHealth,
    check_shard,
)
from kvbank.tiers.base import TierKind
from kvbank.tiers.store.reserve import Reservation
from kvbank.tiers.store.store import TieredStore

logger = logging.getLogger(__name__)

__all__ = ["Bank", "BankStats", "FetchResult", "Match", "Presence"]

Clock = Callable[[], float]  # seconds: monotonic (clock), or since the epoch (wall_clock)
PUT_BATCH_PAGES = 64  # pages per store batch (and disk transaction) of a put


@refused_once_closed("bank")
class Bank(LeaseOps, EngineOps):
    """A worker's KV-cache bank over a tiered store. See the module docstring."""

    def __init__(self, config: BankConfig | None = None, *, clock: Clock = time.monotonic,
                 wall_clock: Clock = time.time, reaper: bool = True) -> None:
        if config is not None and not isinstance(config, BankConfig):
            raise InvalidInput(f"config: expected a BankConfig, got {type(config).__name__}")
        self.config = config if config is not None else BankConfig()
        self._clock = clock
        self._lock = threading.Lock()  # guards _closed
        # Layouts persist in the data dir when rows do (a disk tier): restored at open.
        cfg = self.config
        keep = cfg.data_dir if cfg.data_dir is not None and cfg.disk_bytes > 0 else None
        self._catalog = Catalog(data_dir=keep)
        self._counts = ShardCounts()  # registered shard counts by logical id
        self._store = TieredStore(self.config, clock=clock)  # row ages in the bank's time
        try:
            for layout in self._catalog.restore(self._refuses, self._has_rows):
                self._counts.add(layout)
            if self._store.disk_created and self._catalog.persisted_pairs:
                # LMDB starts a missing data.mdb empty: say the rows it held are gone
                lost = (f"disk tier: {keep}/lmdb/data.mdb was missing at open, although the "
                        f"catalog records puts of {self._catalog.persisted_pairs} scope and "
                        "layout pairs: the rows it held are lost; the disk tier starts empty")
                logger.warning("%s", lost)
                self._store.note(lost)
            # the reuse audit's quarantine, kept beside the layouts (kvbank.bank.quarantine)
            self.audit = BankAudit(keep, known=self._catalog.layout, closed=lambda: self._closed)
            self._lender = Lender(self._store, self.config, clock=clock, wall_clock=wall_clock,
                                  describe=self._catalog.describe, reaper=reaper)
        except BaseException:
            self._store.close()
            self._catalog.close()
            raise
        self._ledger = FetchLedger(self.config.fetch_ttl_s, clock)
        self._closed = False
        # Not the worker's calls: objects of their own over the same store and catalog,
        # refused once the bank is closed like the bank's own calls.
        self.admin = BankAdmin(self._store, self._catalog, closed=lambda: self._closed)
        self.fleet = BankFleet(self._store, self._catalog, closed=lambda: self._closed)

    @classmethod
    def open(cls, config: BankConfig | None = None, **overrides: object) -> Bank:
        """A bank from ``config`` (default: defaults + ``KVBANK_*`` environment) with
        ``overrides`` applied, e.g. ``Bank.open(host_bytes="256M", data_dir=path)``. A key
        that is not a setting is :class:`ConfigError` naming it."""
        check_settings(overrides)
        base = config if config is not None else BankConfig.from_env()
        return cls(base.replace(**overrides) if overrides else base)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def reservation(self) -> Reservation | None:
        """With ``reserve_host``: the host budget being claimed and pre-faulted in the
        background since open (``target_bytes``, ``done_bytes``, ``wait(timeout)``)."""
        return self._store.reservation

    @property
    def clock(self) -> Clock:
        """The bank's monotonic clock (its leases' deadlines are on it): a service passes
        ``now=bank.clock()`` to :func:`kvbank.wire.forms.to_dict` for a lease's ``ttl_s``."""
        return self._clock

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("bank: closed", field="bank")

    # ---- layouts and names ---------------------------------------------------------------

    def register(self, layout: PageLayout) -> bytes:
        """Declare a layout; returns its layout id. Registering it again is a no-op."""
        self._check_open()
        if not isinstance(layout, PageLayout):
            raise LayoutError(f"layout: expected a PageLayout, got {type(layout).__name__}")
        why = self._refuses(layout)
        if why is not None:  # refused now, not at the first put
            raise LayoutError(why, field=why.split(":", 1)[0])
        lid = self._catalog.register(layout)
        self._catalog.learn(lid, DEFAULT_SCOPE)
        self._counts.add(layout)
        return lid

    def _refuses(self, layout: PageLayout) -> str | None:
        """Why the store could never hold one of the layout's pages (``groups[g]: …``)."""
        for g, size in enumerate(layout.group_page_bytes):
            why = self._store.refuses(size) if size else None
            if why is not None:
                return f"groups[{g}]: {why}"
        return None

    def _has_rows(self, ns: bytes) -> bool:
        return bool(self._store.scan(ns, limit=1))

    def register_scope(self, layout_id: bytes, scope: Scope) -> bytes:
        """Let leases describe rows of ``scope`` under ``layout_id``; the 16-byte namespace."""
        self.layout(layout_id)
        return self._catalog.learn(layout_id, scope)

    def layout(self, layout_id: bytes) -> PageLayout:
        """The registered layout ``layout_id`` (:class:`UnknownLayout` otherwise)."""
        return self._catalog.layout(layout_id)

    def _chain(self, layout_id: bytes, tokens: TokenIds | None, keys: Sequence[bytes] | None,
               scope: Scope, shard: int | None) -> tuple[PageLayout, list[bytes], int]:
        layout = self._catalog.layout(layout_id)
        chain = lookup.chain_keys(layout, tokens, keys, scope)
        return layout, chain, self._catalog.shard(layout_id, shard)

    def row_names(self, layout_id: bytes, tokens: TokenIds | None = None, *, group: int,
                  scope: Scope = DEFAULT_SCOPE, keys: Sequence[bytes] | None = None,
                  shard: int | None = None) -> list[bytes]:
        """The row names of every full page of ``tokens`` (or of ``keys``) for ``group``.

        ``shard`` is the tensor-parallel rank (default: the only registered one)."""
        layout, chain, index = self._chain(layout_id, tokens, keys, scope, shard)
        checks.count(group, "group", 0, len(layout.groups) - 1)
        return _row_names(namespace(layout_id, scope), chain, group, layout.shard_count, index)

    # ---- storing -------------------------------------------------------------------------

    def put(self, layout_id: bytes, tokens: TokenIds | None = None, *, group: int, pages: Pages,
            scope: Scope = DEFAULT_SCOPE, keys: Sequence[bytes] | None = None,
            first_page: int = 0, shard: int | None = None, timeout: float | None = None) -> list[bytes]:
        """Store pages ``first_page, first_page+1, …`` of an ATTENTION group; their names.

        Every page is checked before any is stored. Pages are stored in chain order with
        their parent named, so eviction takes a chain from its tail: a page goes only after
        the pages that extend it. A page whose row is already stored (or being filled under
        a WRITE lease) is skipped: equal names mean equal bytes, so re-storing a shared
        prefix costs no copy and never collides with a lease reading it.
        """
        deadline = self._deadline(timeout)
        layout = self.layout(layout_id)
        puts.put_group(layout, group, GroupKind.ATTENTION, other="put_state")
        views = page_views(_host_pages(pages, "pages"), layout.group_page_bytes[group], "pages")
        chain = self.row_names(layout_id, tokens, group=group, scope=scope, keys=keys, shard=shard)
        names = puts.page_rows(chain, first_page, len(views))
        self._catalog.learn(layout_id, scope)
        dtype = layout.page_dtype(group)
        todo = [(chain[j], mv, chain[j - 1] if j else None)
                for j, (mv, held) in enumerate(zip(views, self._store.locate(names), strict=True),
                                               first_page) if held is None]
        step = max(1, min(PUT_BATCH_PAGES, self.config.host_bytes // 4 // layout.group_page_bytes[group]))
        i = 0
        while i < len(todo):
            # The deadline is checked before each page is planned; a batch is planned whole.
            k = 0
            while k < step and i + k < len(todo) and (deadline is None or self._clock() < deadline):
                k += 1
            # A row a lease locked meanwhile is stored or being filled with the same bytes
            # (equal names, equal bytes): put_many skips it.
            if k:
                self._store.put_many(todo[i : i + k], dtype=dtype)
            i += k
            if i < len(todo) and k < step:
                raise Busy(f"timeout: put stored {i} of {len(todo)} new pages before its {timeout} s "
                           "deadline; the rest were not stored", field="timeout")
        return names

    def _put_new(self, name: bytes, data: memoryview, *, dtype: str,
                 parent: bytes | None = None) -> None:
        """Store a row found missing a moment ago. If a lease locked it meanwhile, it is
        stored or being filled with the same bytes (equal names, equal bytes): nothing to do."""
        try:
            self._store.put(name, data, dtype=dtype, parent=parent)
        except RowLocked:
            logger.debug("put: row %s is locked by a lease; it holds these bytes already",
                         name.hex()[:16])

    def _put_resharded(self, layout: PageLayout, name: bytes, data: memoryview,
                       parent: bytes | None) -> None:
        """Keep a row a fetch built from another shard count's rows, so the next is direct."""
        self._put_new(name, data, dtype=layout.page_dtype(group_of(name)), parent=parent)

    def put_state(self, layout_id: bytes, tokens: TokenIds | None = None, *, group: int,
                  state: torch.Tensor | bytes | bytearray | memoryview, at: int | None = None,
                  scope: Scope = DEFAULT_SCOPE, keys: Sequence[bytes] | None = None,
                  shard: int | None = None) -> bytes:
        """Store a STATE group's snapshot after ``at`` tokens (a page boundary; default: all
        full pages of ``tokens``). It is keyed by the key of the page ending at ``at``."""
        layout = self.layout(layout_id)
        puts.put_group(layout, group, GroupKind.STATE, route="put_state", other="put")
        size = layout.group_page_bytes[group]
        if isinstance(state, torch.Tensor):
            state = state.reshape(1, -1) if state.dim() == 1 else state
            if state.dim() != 2 or state.shape[0] != 1:
                raise InvalidInput(f"state: expected one snapshot, got shape {tuple(state.shape)}")
            (view,) = page_views(_host_pages(state, "state"), size, "state")
        else:
            (view,) = page_views([state], size, "state")
        chain = self.row_names(layout_id, tokens, group=group, scope=scope, keys=keys, shard=shard)
        name = puts.state_row(chain, at, layout.tokens_per_page)
        self._catalog.learn(layout_id, scope)
        if self._store.locate([name]) == [None]:
            self._put_new(name, view, dtype=layout.page_dtype(group))
        return name

    def put_states(self, layout_id: bytes, tokens: TokenIds | None = None, *, group: int,
                   states: Pages, at: Sequence[int], scope: Scope = DEFAULT_SCOPE,
                   keys: Sequence[bytes] | None = None, shard: int | None = None) -> list[bytes]:
        """:meth:`put_state` for several snapshots of one prompt: ``states[i]`` after
        ``at[i]`` tokens. The chain is hashed once; every snapshot and boundary is checked
        before any is stored. Returns their row names, in the order given."""
        layout = self.layout(layout_id)
        puts.put_group(layout, group, GroupKind.STATE, route="put_state", other="put")
        views = page_views(states, layout.group_page_bytes[group], "states")
        chain = self.row_names(layout_id, tokens, group=group, scope=scope, keys=keys, shard=shard)
        names = puts.state_rows(chain, at, len(views), layout.tokens_per_page)
        self._catalog.learn(layout_id, scope)
        todo = [(name, view, None) for name, view, held
                in zip(names, views, self._store.locate(names), strict=True) if held is None]
        if todo:  # one batch; a row a lease locked meanwhile is skipped (same bytes)
            self._store.put_many(todo, dtype=layout.page_dtype(group))
        return names

    def lend_put(self, layout_id: bytes, tokens: TokenIds | None = None, *, group: int,
                 group_kind: GroupKind, count: int = 1, first_page: int = 0,
                 at: int | None = None, page_bytes: int | None = None,
                 scope: Scope = DEFAULT_SCOPE, keys: Sequence[bytes] | None = None,
                 shard: int | None = None, kind: MemoryKind = MemoryKind.HOST,
                 ttl_s: float | None = None, fields: str = "",
                 lease: bool = True) -> tuple[list[bytes], Lease | None]:
        """A put planned and its WRITE lease taken in one call (the counterpart of a
        match and a READ lease): the row names of ``count`` pages from ``first_page`` of an
        ATTENTION group, or of the snapshot at ``at`` of a STATE group, and a lease
        reserving slots for those not stored yet (None: every one is stored already).

        The names are looked up once here and once at commit: the lease reserves what this
        lookup found absent, and a row stored in between is kept at commit (equal names
        are equal bytes). ``page_bytes`` is the caller's declared page size, checked;
        ``fields`` prefixes the field names of refusals (``"header."``); ``lease=False``
        plans only (the names, no lookup, no lease)."""
        layout = self.layout(layout_id)
        other = "put_state" if group_kind is GroupKind.ATTENTION else "put"
        g = puts.put_group(layout, group, group_kind, field=f"{fields}group",
                           route="this route" if fields else "put", other=None if fields else other)
        if page_bytes is not None:
            puts.check_page_bytes(layout, g, page_bytes, f"{fields}page_bytes")
        chain = self.row_names(layout_id, tokens, group=g, scope=scope, keys=keys, shard=shard)
        if group_kind is GroupKind.ATTENTION:
            names = puts.page_rows(chain, first_page, count, field=f"{fields}pages",
                                   first_field=f"{fields}first_page")
        else:
            names = [puts.state_row(chain, at, layout.tokens_per_page, field=f"{fields}at")]
        # A put is a command: the bank learns the (scope, layout) pair, so the lease can
        # describe its rows (their page size and regions).
        self._catalog.learn(layout_id, scope)
        if not lease:
            return names, None
        todo = [n for n, held in zip(names, self._store.locate(names), strict=True) if held is None]
        if not todo:
            return names, None
        return names, self._lender.lend(todo, kind=kind, mode=LeaseMode.WRITE, ttl_s=ttl_s,
                                        absent=True)

    # ---- queries ---------------------------------------------------------------------------

    def match(self, layout_id: bytes, tokens: TokenIds | None = None, *, scope: Scope = DEFAULT_SCOPE,
              shard: int | None = None, keys: Sequence[bytes] | None = None,
              prompt_tokens: int | None = None) -> Match:
        """Where each row of the prompt's prefix is, the resume bound and every usable
        boundary. A pure query: it leases, locks, renews and records nothing.

        The prompt is ``tokens``, or an engine's page-key chain ``keys`` with its length
        ``prompt_tokens`` (default: exactly the keyed pages, so the last-token rule keeps the
        last page to compute). When no row at all is stored under the layout and scope
        (a cold cache, or pages stored under another model fingerprint) the bound's reason
        is ``Obstacle.NOTHING_STORED``, not ``MISSING_PAGE``."""
        layout, chain, index = self._chain(layout_id, tokens, keys, scope, shard)
        t = lookup.prompt_length(layout, tokens, chain, prompt_tokens)
        # Rows missing under the caller's shard may be stored under another shard count.
        locate = CrossLocate(self._located(layout_id), layout, index, scope, self._counts.others(layout))
        return locate.annotate(lookup.build_match(layout, scope, t, chain, index, locate, self._any_stored))

    def _located(self, layout_id: bytes) -> lookup.Locate:
        """The store's locate, or, for a quarantined layout, one that finds nothing."""
        return _nowhere if self.audit.holds(layout_id) else self._store.locate

    def _any_stored(self, prefix: bytes) -> bool:
        """Some row's name starts with ``prefix`` (a namespace: the layout and scope)."""
        return bool(self._store.scan(prefix, limit=1))

    def resume_at(self, match: Match, tokens: int) -> Match:
        """``match`` resumed at ``tokens``, one of ``match.boundaries`` (or 0): its bound
        needs exactly that boundary's rows, to fetch or lend as any match."""
        if not isinstance(match, Match):
            raise InvalidInput(f"match: expected a Match, got {type(match).__name__}")
        return lookup.resumed_at(self.layout(match.layout_id), match, tokens)

    def presence(self, layout_id: bytes, tokens: TokenIds | None = None, *,
                 scope: Scope = DEFAULT_SCOPE, shards: Sequence[int] | None = None,
                 keys: Sequence[bytes] | None = None, prompt_tokens: int | None = None) -> Presence:
        """Per shard, per group, per page: where the prompt's rows are, in one store lookup
        for every shard (default: all ``shard_count`` of the layout, registered or not), and
        the boundary all of them can resume at. A pure query."""
        layout = self.layout(layout_id)
        chain = lookup.chain_keys(layout, tokens, keys, scope)
        t = lookup.prompt_length(layout, tokens, chain, prompt_tokens)
        return lookup.build_presence(layout, scope, t, chain, shards, self._located(layout_id))

    def locate(self, names: Sequence[bytes]) -> list[TierKind | None]:
        """The fastest tier holding each row (None = a miss). A pure query."""
        return self._store.locate(names)

    # ---- fetching ------------------------------------------------------------------------

    def fetch(self, match: Match, *, out: OutBuffers, fetch_id: str | None = None,
              max_rows: int | None = None, timeout: float | None = None,
              shard: int | None = None) -> FetchResult:
        """Copy ``match``'s needed rows into ``out`` (``out[g][k]`` receives
        ``match.resume.pages[g][k]``); the bound is recomputed from what arrived whole.

        A row gone since the match is a miss, never "loaded". An incomplete fetch keeps its
        ledger entry: call again with the same ``fetch_id`` (and ``out``) to resume from
        its first undelivered row. ``max_rows`` bounds the rows this call copies, and
        ``timeout`` the time it spends (it stops between rows and answers what arrived).
        A row the match found under another shard count (``match.via``) is built from its
        source rows, and counts delivered only when all of them arrived whole.
        ``shard`` (the caller's tensor-parallel rank): a match whose rows are another
        shard's is refused (:class:`InvalidInput`), never loaded.
        """
        if not isinstance(match, Match):
            raise InvalidInput(f"match: expected a Match, got {type(match).__name__}")
        check_shard(match, shard)
        deadline = self._deadline(timeout)
        layout = self.layout(match.layout_id)
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0):
            raise InvalidInput(f"max_rows: must be a non-negative integer, got {max_rows!r}")
        if fetch_id is not None and (not isinstance(fetch_id, str) or not fetch_id):
            raise InvalidInput(f"fetch_id: must be a non-empty string, got {fetch_id!r}")
        views = out_views(layout, match.resume.pages, out)
        if self.audit.holds(match.layout_id):
            max_rows = 0  # quarantined since the match: its rows are not served
        get_many: GetMany = self._store.get_many_into
        if any(any(v) for v in match.via):
            self._catalog.learn(match.layout_id, match.scope)
            keep = functools.partial(self._put_resharded, layout) if self.config.reshard_store else None
            get_many = one_by_one(ReshardReader(match, layout, self._counts.others(layout),
                                                self._store.get_into, keep))
        return fetch_rows(self._ledger, get_many, layout, match, views,
                          fetch_id=fetch_id, max_rows=max_rows, deadline=deadline, clock=self._clock)

    def reshard_rows(self, match: Match) -> int:
        """Build the rows of ``match``'s bound it found under another shard count and store
        them under their own names; how many were built. A served fetch calls it first: it
        streams (or lends) rows by name. A row whose sources are gone stays a miss."""
        if not isinstance(match, Match):
            raise InvalidInput(f"match: expected a Match, got {type(match).__name__}")
        if not any(any(v) for v in match.via):
            return 0
        layout = self.layout(match.layout_id)
        self._catalog.learn(match.layout_id, match.scope)
        keep = functools.partial(self._put_resharded, layout)
        reader = ReshardReader(match, layout, self._counts.others(layout), self._store.get_into, keep)
        built = 0
        for g, counts in enumerate(match.via):
            needed = set(match.resume.rows[g])
            buf = bytearray(layout.group_page_bytes[g])
            for i, count in enumerate(counts):
                name = match.names[g][i]
                if count and name in needed and reader(name, buf) is not None:
                    built += 1
        return built

    def out_buffers(self, match: Match) -> dict[int, torch.Tensor]:
        """Buffers for :meth:`fetch` sized from the layout: ``uint8 [len(pages[g]), page
        bytes of g]`` for every group the match's bound needs rows of (not zeroed: a
        fetch writes each row that arrives whole, and only those may be read)."""
        if not isinstance(match, Match):
            raise InvalidInput(f"match: expected a Match, got {type(match).__name__}")
        return out_buffers(self.layout(match.layout_id), match.resume.pages)

    def fetch_prefix(self, layout_id: bytes, tokens: TokenIds | None = None, *,
                     scope: Scope = DEFAULT_SCOPE, shard: int | None = None,
                     keys: Sequence[bytes] | None = None, prompt_tokens: int | None = None,
                     out: OutBuffers | None = None, max_rows: int | None = None) -> Fetched:
        """:meth:`match` the prompt, then :meth:`fetch` the rows its bound needs into ``out``
        (default: new buffers of :meth:`out_buffers`; ``max_rows`` as for fetch), as one
        call: a served node answers it in one round trip. ``result`` is None when the
        bound is 0 (nothing to fetch); an incomplete fetch resumes with :meth:`fetch`
        under ``result.fetch_id``."""
        m = self.match(layout_id, tokens, scope=scope, shard=shard, keys=keys, prompt_tokens=prompt_tokens)
        return fetched(self.layout(layout_id), m, out, lambda bufs: self.fetch(m, out=bufs, max_rows=max_rows))

    def fetches(self) -> tuple[FetchInfo, ...]:
        """Open fetch-ledger entries (a pure query)."""
        return self._ledger.entries()

    def get_into(self, name: bytes, out: memoryview | bytearray) -> int | None:
        """Copy one stored row into ``out`` without a lease; its size, or ``None`` on a miss
        (absent, or dropped because its frame failed the checksum). Needs no free host
        slot: a disk row decodes straight into ``out``. Records recency like a read."""
        self._check_open()
        return self._store.get_into(name, out)


    # ---- the rest --------------------------------------------------------------------------

    def stats(self) -> BankStats:
        return BankStats(len(self._catalog), len(self._lender), self._lender.expired_count, len(self._ledger),
                         self._store.stats())

    def health(self) -> StoreHealth:
        """The store's health: each tier's state and the mover's."""
        return self._store.health()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until the store's mover is idle (demotions written, watermarks met);
        ``Busy`` after ``timeout_s`` (default: the store's ``wait_timeout_s``)."""
        self._store.flush(timeout_s)

    def check_invariants(self) -> None:
        """The lender's tables, the ledger and the store agree (for tests)."""
        self._lender.check_invariants()
        self._ledger.check_invariants()
        self._store.check_invariants()

    def close(self) -> None:
        """End every lease, then close the store. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._lender.close()
        finally:
            try:
                self._store.close()
            finally:
                self._catalog.close()


def _nowhere(names: Sequence[bytes]) -> list[TierKind | None]:
    return [None] * len(names)


def _host_pages(pages: Pages, field: str) -> Pages:
    """A tensor whose bytes can be copied to the host (a CPU or CUDA tensor); a ``meta``
    tensor (no storage) or another device's is ``InvalidInput`` naming the field."""
    if isinstance(pages, torch.Tensor) and pages.device.type not in ("cpu", "cuda"):
        raise InvalidInput(f"{field}: a tensor on {pages.device} has no bytes to store; "
                           "give a CPU or CUDA tensor", field=field)
    return pages
