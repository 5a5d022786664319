"""The embedded bank: the one object a worker embeds (and the node service wraps).

Lifecycle::

    from kvbank import Bank, full_attention

    with Bank.open(host_bytes="256M") as bank:                   # a BankConfig + overrides
        lid = bank.register(full_attention("my-model@rev", num_layers=2,
                                           num_kv_heads=4, head_dim=64))
        bank.put(lid, tokens, group=0, pages=pages)              # uint8 [n, page_bytes]
        m = bank.match(lid, tokens + more_tokens)                # never leases, never locks
        got = bank.fetch(m, out={0: buf})                        # resume at got.resume.tokens

Primitives:

- :meth:`Bank.register` — declare a :class:`~kvbank.layout.PageLayout`; returns its
  32-byte layout id (idempotent). Every other call names a registered id
  (:class:`~kvbank.errors.UnknownLayout` otherwise).
- :meth:`Bank.put` — pages of one group for a token sequence (or a key chain) under a
  scope; :meth:`Bank.put_state` — a ``STATE`` group's snapshot at a page boundary. Page
  sizes are checked against the layout before anything is stored
  (:class:`~kvbank.errors.PageSizeMismatch`).
- :meth:`Bank.match` — a :class:`Match`: per row presence and tier, and the
  :class:`~kvbank.lender.resume.ResumeBound` (where to resume, exactly which rows).
- :meth:`Bank.fetch` — copy a match's needed rows into caller buffers through the fetch
  ledger; the returned bound is recomputed from the rows that arrived whole, and a broken
  fetch resumes (same ``fetch_id``) from its first undelivered row.
- :meth:`Bank.lend` / :meth:`Bank.lend_all` / :meth:`Bank.renew` /
  :meth:`Bank.release` / :meth:`Bank.commit` — leases for in-place reads and fills in
  host (shared memory, other processes too) or device memory; see
  :mod:`kvbank.lender.lender` for locks, conflicts and expiry.
- :meth:`Bank.stats`, :meth:`Bank.close`.

Every method validates its input and raises a typed error naming the field
(:class:`~kvbank.errors.InvalidInput` subclasses). The bank is thread-safe: the lender,
the ledger and the store each guard their own state; the bank's own tables (layouts and
the namespaces it has seen) sit behind one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import numpy as np
import torch

from kvbank.config import BankConfig
from kvbank.errors import InvalidInput, PageSizeMismatch, RowLocked, UnknownLayout
from kvbank.keys import DEFAULT_SCOPE, PAGE_KEY_BYTES, Scope, TokenIds, namespace, page_keys
from kvbank.keys import row_names as _row_names
from kvbank.layout import GroupKind, PageLayout
from kvbank.lender.base import CommitResult, Lease, LeaseMode, MemoryKind, PageShape
from kvbank.lender.ledger import FetchLedger
from kvbank.lender.lender import Lender
from kvbank.lender.resume import ResumeBound, resume_bound
from kvbank.tiers.base import TierKind
from kvbank.tiers.store import StoreStats, TieredStore

logger = logging.getLogger(__name__)

MAX_NAMESPACES = 65_536  # (scope, layout) pairs whose rows a lease can describe

Clock = Callable[[], float]  # monotonic seconds
Pages = torch.Tensor | Sequence[bytes | bytearray | memoryview]  # uint8 [n, page_bytes] or n buffers
OutBuffers = Mapping[int, torch.Tensor | Sequence[bytearray | memoryview]]  # group -> rows


@dataclass(frozen=True, slots=True)
class Match:
    """What the bank holds of a prompt. Taking one never leases, locks or renews."""

    layout_id: bytes
    scope: Scope
    prompt_tokens: int
    resume: ResumeBound  # where to resume and the rows needed for it
    names: tuple[tuple[bytes, ...], ...]  # per group, the row name of every keyed page
    tiers: tuple[tuple[TierKind | None, ...], ...]  # per group, where each row is (None = miss)

    def present(self, group: int, index: int) -> bool:
        return self.tiers[group][index] is not None

    @property
    def needed(self) -> list[bytes]:
        """The rows the resume bound needs, group by group (what to fetch or lend)."""
        return self.resume.needed()


@dataclass(frozen=True, slots=True)
class FetchResult:
    """What one fetch call delivered, and the bound those rows allow."""

    fetch_id: str
    delivered: tuple[tuple[int, ...], ...]  # per group, key indices that arrived whole
    missing: tuple[tuple[int, ...], ...]  # per group, planned key indices that did not
    resume: ResumeBound  # recomputed from the delivered rows alone
    nbytes: int  # bytes delivered by this call
    complete: bool  # every planned row arrived (the ledger entry is closed)


@dataclass(frozen=True, slots=True)
class BankStats:
    """A snapshot of the bank's counters and its store's."""

    layouts: int
    live_leases: int
    leases_expired: int
    open_fetches: int
    store: StoreStats


class Bank:
    """A worker's KV-cache bank over a tiered store. See the module docstring."""

    def __init__(
        self,
        config: BankConfig | None = None,
        *,
        clock: Clock = time.monotonic,
        reaper: bool = True,
    ) -> None:
        if config is not None and not isinstance(config, BankConfig):
            raise InvalidInput(f"config: expected a BankConfig, got {type(config).__name__}")
        self.config = config if config is not None else BankConfig()
        self._lock = threading.Lock()
        self._layouts: dict[bytes, PageLayout] = {}
        # Shards registered per layout id. The id leaves the shard index out (every rank of
        # a layout shares it), so the shard a call names must come from the caller: taking
        # the first registration's index would hand one rank another rank's rows.
        self._shards: dict[bytes, set[int]] = {}
        # 16-byte namespace -> layout id, most recently used last. Bounded: a fleet with a
        # cache salt per request would otherwise grow it forever. A namespace that fell out
        # is re-learnt by the next put or match under it (leases follow those).
        self._namespaces: OrderedDict[bytes, bytes] = OrderedDict()
        self._shapes: dict[tuple[bytes, int], PageShape] = {}
        self._store = TieredStore(self.config)
        try:
            self._lender = Lender(
                self._store, self.config, clock=clock, describe=self._describe, reaper=reaper
            )
        except BaseException:
            self._store.close()
            raise
        self._ledger = FetchLedger(self.config.fetch_ttl_s, clock)
        self._closed = False

    @classmethod
    def open(cls, config: BankConfig | None = None, **overrides: Any) -> Bank:
        """A bank from ``config`` (default: defaults + ``KVBANK_*`` environment) with
        ``overrides`` applied, e.g. ``Bank.open(host_bytes="256M", data_dir=path)``."""
        base = config if config is not None else BankConfig.from_env()
        return cls(base.replace(**overrides) if overrides else base)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- layouts and names ---------------------------------------------------------------

    def register(self, layout: PageLayout) -> bytes:
        """Declare a layout; returns its layout id. Registering it again is a no-op."""
        if not isinstance(layout, PageLayout):
            raise InvalidInput(f"layout: expected a PageLayout, got {type(layout).__name__}")
        with self._lock:
            self._layouts.setdefault(layout.layout_id, layout)
            self._shards.setdefault(layout.layout_id, set()).add(layout.shard_index)
        return layout.layout_id

    def layout(self, layout_id: bytes) -> PageLayout:
        """The registered layout ``layout_id`` (:class:`UnknownLayout` otherwise)."""
        with self._lock:
            layout = self._layouts.get(layout_id) if isinstance(layout_id, bytes) else None
        if layout is None:
            shown = layout_id.hex() if isinstance(layout_id, bytes) else repr(layout_id)
            raise UnknownLayout(f"layout_id: {shown} was never registered with this bank")
        return layout

    def _shard(self, layout_id: bytes, shard: int | None) -> int:
        """The shard index a call means: the one given (it must be registered), or the only
        one registered for ``layout_id``."""
        with self._lock:
            shards = sorted(self._shards.get(layout_id, ()))
        if shard is None:
            if len(shards) == 1:
                return shards[0]
            raise InvalidInput(
                f"shard: layout {layout_id.hex()[:16]}… is registered for shards {shards}; "
                "name the shard this call is for"
            )
        if isinstance(shard, bool) or not isinstance(shard, int) or shard not in shards:
            raise UnknownLayout(
                f"shard: shard {shard!r} of layout {layout_id.hex()[:16]}… was never registered "
                f"(registered shards: {shards})"
            )
        return shard

    def _namespace(self, layout_id: bytes, scope: Scope) -> bytes:
        if not isinstance(scope, Scope):
            raise InvalidInput(f"scope: expected a Scope, got {type(scope).__name__}")
        ns = namespace(layout_id, scope)
        with self._lock:
            self._namespaces[ns] = layout_id
            self._namespaces.move_to_end(ns)
            if len(self._namespaces) > MAX_NAMESPACES:
                self._namespaces.popitem(last=False)
        return ns

    def _describe(self, name: bytes) -> PageShape | None:
        """A row's page size and regions, for names under a namespace this bank has seen."""
        with self._lock:
            lid = self._namespaces.get(name[:16])
            if lid is None:
                return None
            group = int.from_bytes(name[48:50], "big")
            shape = self._shapes.get((lid, group))
            if shape is None:
                layout = self._layouts[lid]
                if group >= len(layout.groups):
                    return None
                shape = self._shapes[(lid, group)] = PageShape.of(layout, group)
            return shape

    def _keys(
        self, layout: PageLayout, tokens: TokenIds | None, keys: Sequence[bytes] | None, scope: Scope
    ) -> list[bytes]:
        if (tokens is None) == (keys is None):
            raise InvalidInput("tokens: give either tokens or keys (a page-key chain), not both or neither")
        if tokens is not None:
            return page_keys(tokens, layout.tokens_per_page, scope)
        if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
            raise InvalidInput(f"keys: expected a sequence of page keys, got {type(keys).__name__}")
        out = list(keys)
        for i, k in enumerate(out):
            if type(k) is not bytes or len(k) != PAGE_KEY_BYTES:
                raise InvalidInput(f"keys[{i}]: expected a {PAGE_KEY_BYTES}-byte page key")
        return out

    @staticmethod
    def _group(layout: PageLayout, group: int, kind: GroupKind, what: str) -> int:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(layout.groups):
            raise InvalidInput(f"group: expected a group index in [0, {len(layout.groups)}), got {group!r}")
        g = layout.groups[group]
        if g.kind is not kind:
            other = "put_state" if g.kind is GroupKind.STATE else "put"
            raise InvalidInput(f"group: group {group} is a {g.kind.name} group; {what} takes {kind.name} groups (use {other})")
        if layout.group_page_bytes[group] == 0:
            raise InvalidInput(f"group: group {group} transfers no bytes (every buffer transferred=False)")
        return group

    def row_names(
        self,
        layout_id: bytes,
        tokens: TokenIds | None = None,
        *,
        group: int,
        scope: Scope = DEFAULT_SCOPE,
        keys: Sequence[bytes] | None = None,
        shard: int | None = None,
    ) -> list[bytes]:
        """The row names of every full page of ``tokens`` (or of ``keys``) for ``group``.

        ``shard`` is the tensor-parallel rank (default: the only registered one)."""
        layout = self.layout(layout_id)
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(layout.groups):
            raise InvalidInput(f"group: expected a group index in [0, {len(layout.groups)}), got {group!r}")
        ns = self._namespace(layout_id, scope)
        return _row_names(ns, self._keys(layout, tokens, keys, scope), group,
                          layout.shard_count, self._shard(layout_id, shard))

    # ---- storing -------------------------------------------------------------------------

    @staticmethod
    def _page_views(pages: Pages, size: int, field: str) -> list[memoryview]:
        """Flat byte views of the pages, each checked against the layout's page size."""
        if isinstance(pages, torch.Tensor):
            if pages.dtype != torch.uint8 or pages.dim() != 2:
                raise InvalidInput(f"{field}: expected a uint8 tensor [n, page_bytes], got {pages.dtype} {tuple(pages.shape)}")
            if pages.shape[1] != size:
                raise PageSizeMismatch(f"{field}: pages of {pages.shape[1]} bytes, the layout's page is {size} bytes")
            arr = pages.detach().cpu().contiguous().numpy()
            return [memoryview(arr[i]) for i in range(arr.shape[0])]
        if isinstance(pages, (bytes, bytearray, memoryview, str)) or not isinstance(pages, Sequence):
            raise InvalidInput(f"{field}: expected a uint8 tensor or a sequence of bytes-likes, got {type(pages).__name__}")
        out: list[memoryview] = []
        for i, p in enumerate(pages):
            if not isinstance(p, (bytes, bytearray, memoryview, np.ndarray)):
                raise InvalidInput(f"{field}[{i}]: expected a bytes-like page, got {type(p).__name__}")
            mv = memoryview(p)
            if not mv.c_contiguous:
                raise InvalidInput(f"{field}[{i}]: the buffer must be C-contiguous")
            mv = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
            if len(mv) != size:
                raise PageSizeMismatch(f"{field}[{i}]: {len(mv)} bytes, the layout's page is {size} bytes")
            out.append(mv)
        return out

    def put(
        self,
        layout_id: bytes,
        tokens: TokenIds | None = None,
        *,
        group: int,
        pages: Pages,
        scope: Scope = DEFAULT_SCOPE,
        keys: Sequence[bytes] | None = None,
        first_page: int = 0,
        shard: int | None = None,
    ) -> list[bytes]:
        """Store pages ``first_page, first_page+1, …`` of an ATTENTION group; their names.

        Every page is checked before any is stored. Pages are stored in chain order with
        their parent named, so eviction takes a chain from its tail: a page goes only after
        the pages that extend it. A page whose row is already stored (or being filled under
        a WRITE lease) is skipped: equal names mean equal bytes, so re-storing a shared
        prefix costs no copy and never collides with a lease reading it.
        """
        layout = self.layout(layout_id)
        self._group(layout, group, GroupKind.ATTENTION, "put")
        views = self._page_views(pages, layout.group_page_bytes[group], "pages")
        chain = self.row_names(layout_id, tokens, group=group, scope=scope, keys=keys, shard=shard)
        if isinstance(first_page, bool) or not isinstance(first_page, int) or first_page < 0:
            raise InvalidInput(f"first_page: must be a non-negative integer, got {first_page!r}")
        if first_page + len(views) > len(chain):
            raise InvalidInput(
                f"pages: {len(views)} pages from page {first_page} exceed the {len(chain)} "
                "full pages of the tokens (a partial last page is never stored)"
            )
        names = chain[first_page : first_page + len(views)]
        where = self._store.locate(names)
        for i, (mv, held) in enumerate(zip(views, where, strict=True)):
            if held is None:
                j = first_page + i
                self._put_new(chain[j], mv, parent=chain[j - 1] if j else None)
        return names

    def _put_new(self, name: bytes, data: memoryview, *, parent: bytes | None = None) -> None:
        """Store a row found missing a moment ago. If a lease locked it meanwhile, it is
        stored or being filled with the same bytes (equal names, equal bytes): nothing to do."""
        try:
            self._store.put(name, data, parent=parent)
        except RowLocked:
            logger.debug("put: row %s is locked by a lease; it holds these bytes already",
                         name.hex()[:16])

    def put_state(
        self,
        layout_id: bytes,
        tokens: TokenIds | None = None,
        *,
        group: int,
        state: torch.Tensor | bytes | bytearray | memoryview,
        at: int | None = None,
        scope: Scope = DEFAULT_SCOPE,
        keys: Sequence[bytes] | None = None,
        shard: int | None = None,
    ) -> bytes:
        """Store a STATE group's snapshot after ``at`` tokens (a page boundary; default: all
        full pages of ``tokens``). It is keyed by the key of the page ending at ``at``."""
        layout = self.layout(layout_id)
        self._group(layout, group, GroupKind.STATE, "put_state")
        size = layout.group_page_bytes[group]
        if isinstance(state, torch.Tensor):
            state = state.reshape(1, -1) if state.dim() == 1 else state
            if state.dim() != 2 or state.shape[0] != 1:
                raise InvalidInput(f"state: expected one snapshot, got shape {tuple(state.shape)}")
            (view,) = self._page_views(state, size, "state")
        else:
            (view,) = self._page_views([state], size, "state")
        chain = self.row_names(layout_id, tokens, group=group, scope=scope, keys=keys, shard=shard)
        p = layout.tokens_per_page
        boundary = len(chain) * p if at is None else at
        if isinstance(boundary, bool) or not isinstance(boundary, int) or boundary <= 0 or boundary % p:
            raise InvalidInput(f"at: must be a positive multiple of tokens_per_page {p}, got {boundary!r}")
        if boundary // p > len(chain):
            raise InvalidInput(f"at: boundary {boundary} is beyond the {len(chain)} full pages given")
        name = chain[boundary // p - 1]
        if self._store.locate([name]) == [None]:
            self._put_new(name, view)
        return name

    # ---- matching and fetching -----------------------------------------------------------

    def match(
        self,
        layout_id: bytes,
        tokens: TokenIds,
        *,
        scope: Scope = DEFAULT_SCOPE,
        shard: int | None = None,
    ) -> Match:
        """Where each row of ``tokens``'s prefix is, and the resume bound. Never leases.

        ``shard`` is the tensor-parallel rank (default: the only registered one)."""
        layout = self.layout(layout_id)
        index = self._shard(layout_id, shard)
        ns = self._namespace(layout_id, scope)
        keys = page_keys(tokens, layout.tokens_per_page, scope)
        t = len(tokens)
        names = tuple(
            tuple(_row_names(ns, keys, g, layout.shard_count, index))
            for g in range(len(layout.groups))
        )
        flat = [n for gi, g in enumerate(names) if layout.group_page_bytes[gi] for n in g]
        where = iter(self._store.locate(flat) if flat else [])
        tiers = tuple(
            tuple(next(where) for _ in g) if layout.group_page_bytes[gi] else tuple(None for _ in g)
            for gi, g in enumerate(names)
        )
        bound = resume_bound(layout, t, lambda g, j: tiers[g][j] is not None, names)
        return Match(layout_id, scope, t, bound, names, tiers)

    def _out_views(self, layout: PageLayout, plan: ResumeBound, out: OutBuffers) -> dict[int, list[memoryview]]:
        if not isinstance(out, Mapping):
            raise InvalidInput(f"out: expected a mapping group -> buffers, got {type(out).__name__}")
        views: dict[int, list[memoryview]] = {}
        for g, pages in enumerate(plan.pages):
            if not pages:
                continue
            size = layout.group_page_bytes[g]
            buf = out.get(g)
            if buf is None:
                raise InvalidInput(f"out[{g}]: missing; group {g} needs {len(pages)} rows of {size} bytes")
            if isinstance(buf, torch.Tensor):
                if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != size or buf.shape[0] < len(pages):
                    raise InvalidInput(
                        f"out[{g}]: expected uint8 [>= {len(pages)}, {size}], got {buf.dtype} {tuple(buf.shape)}"
                    )
                if buf.device.type != "cpu" or not buf.is_contiguous():
                    raise InvalidInput(f"out[{g}]: expected a contiguous CPU tensor, got {buf.device}")
                arr = buf.numpy()
                views[g] = [memoryview(arr[i]) for i in range(len(pages))]
                continue
            if isinstance(buf, (bytes, str)) or not isinstance(buf, Sequence) or len(buf) < len(pages):
                raise InvalidInput(f"out[{g}]: expected {len(pages)} writable buffers")
            vs = []
            for i in range(len(pages)):
                try:
                    mv = memoryview(buf[i])
                except TypeError:
                    mv = None
                if mv is None or mv.readonly or not mv.c_contiguous or mv.nbytes < size:
                    raise InvalidInput(
                        f"out[{g}][{i}]: expected a writable, C-contiguous buffer of >= {size} bytes"
                    )
                vs.append(mv.cast("B"))
            views[g] = vs
        return views

    def fetch(
        self,
        match: Match,
        *,
        out: OutBuffers,
        fetch_id: str | None = None,
        max_rows: int | None = None,
    ) -> FetchResult:
        """Copy ``match``'s needed rows into ``out`` (``out[g][k]`` receives
        ``match.resume.pages[g][k]``); the bound is recomputed from what arrived whole.

        A row gone since the match is a miss, never "loaded". An incomplete fetch keeps its
        ledger entry: call again with the same ``fetch_id`` (and ``out``) to resume from
        its first undelivered row. ``max_rows`` bounds the rows this call copies.
        """
        if not isinstance(match, Match):
            raise InvalidInput(f"match: expected a Match, got {type(match).__name__}")
        layout = self.layout(match.layout_id)
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0):
            raise InvalidInput(f"max_rows: must be a non-negative integer, got {max_rows!r}")
        if fetch_id is not None and (not isinstance(fetch_id, str) or not fetch_id):
            raise InvalidInput(f"fetch_id: must be a non-empty string, got {fetch_id!r}")
        views = self._out_views(layout, match.resume, out)
        if fetch_id is not None and fetch_id in self._ledger:
            if [(r.group, r.name) for r in self._ledger.plan(fetch_id)] != [
                (g, n) for g, rows in enumerate(match.resume.rows) for n in rows
            ]:
                raise InvalidInput(f"fetch_id: {fetch_id!r} was opened for another match")
        else:
            fetch_id = self._ledger.open(layout, match.prompt_tokens, match.names, match.resume, fetch_id)
        todo = self._ledger.pending(fetch_id)
        if max_rows is not None:
            todo = todo[:max_rows]
        moved = 0
        try:
            for row in todo:
                size = layout.group_page_bytes[row.group]
                got = self._store.get_into(row.name, views[row.group][row.slot])
                # Only a row that arrived whole counts; anything else stays undelivered.
                if got == size:
                    self._ledger.record(fetch_id, [row.name])
                    moved += size
        except BaseException as exc:
            exc.add_note(f"kvbank fetch {fetch_id}: resume it with fetch_id={fetch_id!r}")
            raise
        return self._fetch_result(fetch_id, len(layout.groups), moved)

    def _fetch_result(self, fetch_id: str, n_groups: int, moved: int) -> FetchResult:
        plan = self._ledger.plan(fetch_id)
        got = self._ledger.delivered(fetch_id)
        bound = self._ledger.bound(fetch_id)
        delivered = tuple(tuple(r.index for r in plan if r.group == g and r.name in got) for g in range(n_groups))
        missing = tuple(tuple(r.index for r in plan if r.group == g and r.name not in got) for g in range(n_groups))
        complete = not any(missing)
        if complete:
            self._ledger.close(fetch_id)
        return FetchResult(fetch_id, delivered, missing, bound, moved, complete)

    # ---- leases ----------------------------------------------------------------------------

    def lend(
        self,
        rows: Match | Sequence[bytes],
        *,
        mode: LeaseMode = LeaseMode.READ,
        kind: MemoryKind = MemoryKind.HOST,
        ttl_s: float | None = None,
    ) -> Lease:
        """A NAMED lease on rows (a Match lends the rows its resume bound needs)."""
        names = rows.needed if isinstance(rows, Match) else rows
        return self._lender.lend(names, kind=kind, mode=mode, ttl_s=ttl_s)

    def lend_all(
        self,
        *,
        kind: MemoryKind = MemoryKind.HOST,
        mode: LeaseMode = LeaseMode.READ,
        ttl_s: float | None = None,
    ) -> Lease:
        """An ALL lease: the tier's pools, for a transfer engine's one-time registration."""
        return self._lender.lend_all(kind=kind, mode=mode, ttl_s=ttl_s)

    def renew(self, lease_id: str, ttl_s: float | None = None) -> Lease:
        return self._lender.renew(lease_id, ttl_s)

    def release(self, lease_id: str) -> bool:
        return self._lender.release(lease_id)

    def commit(self, lease_id: str, arrived: Sequence[bytes] | Sequence[bool]) -> CommitResult:
        """Publish the WRITE lease's rows that arrived whole; the rest are discarded."""
        return self._lender.commit(lease_id, arrived)

    def read(self, lease_id: str, name: bytes) -> bytes:
        """A leased row's bytes, only if the lease outlived the copy (else LeaseExpired)."""
        return self._lender.read(lease_id, name)

    @property
    def store(self) -> TieredStore:
        """The tiered store underneath (for the node service and tests)."""
        return self._store

    @property
    def lender(self) -> Lender:
        """The lender, for in-place views (``view``, ``finish_read``, ``write``)."""
        return self._lender

    # ---- the rest --------------------------------------------------------------------------

    def stats(self) -> BankStats:
        with self._lock:
            layouts = len(self._layouts)
        return BankStats(layouts, len(self._lender), self._lender.expired_count, len(self._ledger),
                         self._store.stats())

    def check_invariants(self) -> None:
        """The lender's tables, the ledger and the store agree (for tests)."""
        self._lender.check_invariants()
        self._ledger.check_invariants()
        self._store.check_invariants()

    def close(self) -> None:
        """End every lease, then close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._lender.close()
        finally:
            self._store.close()
