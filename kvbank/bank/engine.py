"""A bank's engine-facing calls: what a serving engine's scheduler and workers call, cut
to what they decide and move.

:class:`EngineOps` is a base of :class:`~kvbank.bank.bank.Bank`; ``kvbank.Client`` holds
the same calls (:mod:`kvbank.client.engine`). Lifecycle of one request::

    bounds = bank.match_many(lid, [keys, ...], have_pages=[c, ...], hold=True, pin=True)
    # scheduler: bounds[i].tokens is r, bounds[i].handle goes to the workers
    got = bank.fetch_into(bounds[i].handle, pool=pool, block_ids={g: ids}, shard=rank)
    bank.release_match(bounds[i].handle)          # request finished or preempted
    bank.put_from(lid, pool=pool, block_ids={0: ids0, 1: ids1}, keys=keys)  # every group

- :meth:`~EngineOps.match_many` — many prompts (engine key chains) in one call; each
  answer a :class:`~kvbank.results.Bound`: the bound, the boundaries and the missing
  pages, counting the engine's own first ``have_pages`` pages as held. ``hold=True``
  keeps each match with rows to load under a handle (:class:`Handles`) until ``ttl_s``;
  ``pin=True`` also takes a READ lease on the rows of *every* shard the load needs, so
  nothing is evicted between the decision and the load. Never leases without ``pin``.
- :meth:`~EngineOps.fetch_into` — a match (or a handle) loaded straight into the
  engine's paged pool: one copy from the lent rows into the pool's blocks
  (:func:`kvbank.kernels.strided.scatter_strided`, strided pool views), from
  ``start_page`` on (pages the engine holds move no bytes). A match of another shard is
  translated (the same pages, the caller's shard's rows, located again), never loaded
  as it is. The answer is a :class:`~kvbank.results.FetchResult`: rows that did not
  arrive whole are missing, and the bound is what arrived.
- :meth:`~EngineOps.release_match` — drop a handle and its pin (False if it had ended).
- :meth:`~EngineOps.put_from` — pages of several groups of one key range gathered
  straight from the pool (:func:`~kvbank.kernels.strided.gather_strided`).

The node's routes use :meth:`~EngineOps.lend_load` and :meth:`~EngineOps.lend_put_groups`
(a load's or a put's plan and its lease in one call; not the worker's calls). A handle
is unguessable (128 random bits); the table is bounded (:data:`MAX_HANDLES`, oldest
dropped first, its pin released).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from numbers import Integral

import torch

from kvbank import checks
from kvbank.bank import lookup
from kvbank.bank.catalog import Catalog
from kvbank.config import BankConfig
from kvbank.errors import Busy, FetchNotFound, InvalidInput, KvbankError, LeaseError
from kvbank.kernels.strided import PoolViews, check_pool, gather_strided, scatter_strided
from kvbank.keys import DEFAULT_SCOPE, Scope, TokenIds, namespace, row_names
from kvbank.layout import GroupKind, PageLayout
from kvbank.lender.base import HostLocation, Lease, LeaseMode, MemoryKind
from kvbank.lender.lender import Lender
from kvbank.lender.loads import (
    check_pages,
    for_shard,
    held_bound,
    load_result,
    load_rows,
    match_shard,
    missing_pages,
    names_for_shard,
)
from kvbank.lender.resume import Columns, resume_and_boundaries, resume_bound
from kvbank.results import Bound, FetchResult, Match
from kvbank.tiers.base import TierKind
from kvbank.tiers.store.store import TieredStore

__all__ = ["MAX_HANDLES", "BlockIds", "EngineOps", "Handles", "Load"]

logger = logging.getLogger(__name__)

MAX_HANDLES = 16384  # matches kept for redemption; the oldest goes first (its pin released)
BlockIds = Mapping[int, Sequence[int | None]]  # group -> block id of page j (None: skip the page)


@dataclass(frozen=True, slots=True)
class _Held:
    match: Match  # as the scheduler got it (its shard's rows)
    have_pages: int
    expires_at: float
    lease_id: str | None  # the pin


@dataclass(frozen=True, slots=True)
class Load:
    """A load's plan: the match for the caller's shard, the first page it moves, and the
    rows ``(group, page, name)`` it moves."""

    match: Match
    start_page: int
    rows: list[tuple[int, int, bytes]]


class Handles:
    """Matches kept under an id until they expire or are released (thread-safe)."""

    def __init__(self, clock: Callable[[], float], release: Callable[[str], bool]) -> None:
        self._clock = clock
        self._release = release
        self._lock = threading.Lock()
        self._held: OrderedDict[str, _Held] = OrderedDict()

    def add(self, held: _Held) -> str:
        hid = secrets.token_hex(16)
        with self._lock:
            self._held[hid] = held
            dropped = [self._held.popitem(last=False)[1] for _ in range(len(self._held) - MAX_HANDLES)]
        self._unpin(dropped)
        return hid

    def get(self, hid: str) -> _Held:
        if not isinstance(hid, str) or not hid:
            raise InvalidInput(f"match: expected a Match or a handle, got {hid!r}")
        now = self._clock()
        with self._lock:
            held = self._held.get(hid)
            if held is not None and held.expires_at <= now:
                del self._held[hid]
                expired: _Held | None = held
                held = None
            else:
                expired = None
        if expired is not None:
            self._unpin([expired])
        if held is None:
            raise FetchNotFound(f"match: handle {hid[:16]}… is unknown or expired; match again")
        return held

    def pop(self, hid: str) -> bool:
        with self._lock:
            held = self._held.pop(hid, None)
        if held is None:
            return False
        self._unpin([held])
        return held.expires_at > self._clock()

    def _unpin(self, gone: list[_Held]) -> None:
        for h in gone:
            if h.lease_id is not None:
                try:
                    self._release(h.lease_id)
                except KvbankError as exc:  # the lease ended on its own meanwhile
                    logger.debug("pin %s: %s", h.lease_id, exc)

    def __len__(self) -> int:
        return len(self._held)


def _sequence(value: object, field: str) -> Sequence[object]:
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise InvalidInput(f"{field}: expected a sequence, got {type(value).__name__}")
    return value


def _per_prompt(value: Sequence[int | None] | Sequence[int] | None, n: int, field: str) -> list[int | None]:
    if value is None:
        return [None] * n
    got = _sequence(value, field)
    if len(got) != n:
        raise InvalidInput(f"{field}: {len(got)} values for {n} prompts")
    out: list[int | None] = []
    for i, v in enumerate(got):
        if v is not None:
            checks.count(v, f"{field}[{i}]")
        out.append(v)  # type: ignore[arg-type]
    return out


def check_block_ids(layout: PageLayout, block_ids: BlockIds, field: str = "block_ids") -> None:
    if not isinstance(block_ids, Mapping):
        raise InvalidInput(f"{field}: expected a mapping group -> block ids, got {type(block_ids).__name__}")
    for g, ids in block_ids.items():
        checks.count(g, f"{field} group", 0, len(layout.groups) - 1)
        _sequence(ids, f"{field}[{g}]")


def _pages_view(rows: torch.Tensor | memoryview, size: int) -> torch.Tensor:
    if isinstance(rows, torch.Tensor):
        return rows
    return torch.frombuffer(rows, dtype=torch.uint8, count=size).view(1, size)


class EngineOps:
    """The engine-facing calls of a bank (mixed into :class:`~kvbank.bank.bank.Bank`)."""

    _lender: Lender
    _catalog: Catalog
    _store: TieredStore
    _clock: Callable[[], float]
    config: BankConfig
    layout: Callable[[bytes], PageLayout]
    _deadline: Callable[[float | None], float | None]
    match: Callable[..., Match]
    put: Callable[..., list[bytes]]
    release: Callable[[str], bool]

    def match_with(self, matcher: Callable[..., Match] | None) -> None:
        """Match ``match_many``'s prompts with ``matcher`` (``Bank.match``'s parameters)
        instead of :meth:`match`: a served node's, which completes a match from its remote
        tier and its fleet. None: :meth:`match` again."""
        self.__dict__["_engine_matcher"] = matcher

    @property
    def _handles(self) -> Handles:
        h: Handles | None = self.__dict__.get("_engine_handles")
        if h is None:
            h = self.__dict__.setdefault("_engine_handles", Handles(self._clock, self._lender.release))
        return h

    # ---- the scheduler's calls -------------------------------------------------------

    def match_many(self, layout_id: bytes, keys: Sequence[Sequence[bytes]], *,
                   prompt_tokens: Sequence[int | None] | None = None,
                   have_pages: Sequence[int] | None = None, scope: Scope = DEFAULT_SCOPE,
                   shard: int | None = None, hold: bool = False, pin: bool = False,
                   ttl_s: float | None = None, timeout: float | None = None) -> list[Bound]:
        """Many prompts, each an engine's page-key chain ``keys[i]`` of a prompt of
        ``prompt_tokens[i]`` tokens (default: exactly the keyed pages), matched in one
        call; a :class:`Bound` each. ``have_pages[i]``: pages the engine holds itself
        (they count as present). ``hold``: keep each match with rows to load under a
        handle for ``ttl_s`` (default: the lease ttl); ``pin``: and hold its rows of every
        shard in place until then. ``timeout``: :class:`Busy` once it passed between
        prompts. A pure query without ``hold``."""
        deadline = self._deadline(timeout)
        prompts = _sequence(keys, "keys")
        tokens = _per_prompt(prompt_tokens, len(prompts), "prompt_tokens")
        have = _per_prompt(have_pages, len(prompts), "have_pages")
        if not isinstance(hold, bool) or not isinstance(pin, bool):
            raise InvalidInput(f"hold, pin: expected booleans, got {hold!r}, {pin!r}")
        if pin and not hold:
            raise InvalidInput("pin: pins rows for a held match; set hold=True too")
        ttl = self.config.lease_ttl_s if ttl_s is None else checks.seconds(ttl_s, "ttl_s", positive=True)
        if ttl > self.config.max_lease_ttl_s:
            raise InvalidInput(f"ttl_s: {ttl} exceeds max_lease_ttl_s {self.config.max_lease_ttl_s}")
        layout = self.layout(layout_id)
        out: list[Bound] = []
        for i, chain in enumerate(prompts):
            if deadline is not None and self._clock() >= deadline:
                raise Busy(f"timeout: {i} of {len(prompts)} prompts matched before the {timeout} s "
                           "deadline", field="timeout")
            matcher: Callable[..., Match] = self.__dict__.get("_engine_matcher") or self.match
            m = matcher(layout_id, keys=_sequence(chain, f"keys[{i}]"), scope=scope, shard=shard,
                        prompt_tokens=tokens[i])
            h = check_pages(have[i] or 0, f"have_pages[{i}]", m.resume.keyed_pages)
            bound, boundaries = held_bound(layout, m, h)
            handle, pinned = None, False
            if hold and bound.tokens > h * layout.tokens_per_page:
                m = replace(m, resume=bound, boundaries=boundaries)
                lease_id = self._pin(layout, m, h, ttl) if pin else None
                handle = self._handles.add(_Held(m, h, self._clock() + ttl, lease_id))
                pinned = lease_id is not None
            out.append(Bound(bound.tokens, boundaries, missing_pages(m, h), handle, pinned))
        return out

    def _pin(self, layout: PageLayout, m: Match, have: int, ttl: float) -> str | None:
        """A READ lease on the rows every shard needs to load ``m`` from page ``have``;
        None where the store cannot lend them now (the load may still find them)."""
        rows = [n for _, _, n in load_rows(m, have)]
        names = [for_shard(n, s) for s in range(layout.shard_count) for n in rows]
        held = [n for n, t in zip(names, self._store.locate(names), strict=True) if t is not None]
        if not held:
            return None
        try:
            return self._lender.lend(held, mode=LeaseMode.READ, kind=MemoryKind.HOST, ttl_s=ttl).id
        except KvbankError as exc:  # a full host tier: the match is held unpinned
            logger.debug("pin of %d rows refused: %s", len(held), exc)
            return None

    def release_match(self, handle: str) -> bool:
        """Drop a held match and its pin; False if it had already ended (or never was)."""
        if not isinstance(handle, str):
            raise InvalidInput(f"handle: expected a string, got {type(handle).__name__}")
        return self._handles.pop(handle)

    # ---- the worker's calls ----------------------------------------------------------

    def _resolve(self, match: Match | str, shard: int | None,
                 start_page: int | None) -> tuple[Match, int]:
        """The match a load is for (a handle's, or ``match``) on the caller's shard, and
        its first page."""
        if isinstance(match, Match):
            m, have = match, 0
            self.layout(m.layout_id)
        else:
            held = self._handles.get(match)
            m, have = held.match, held.have_pages
        layout = self.layout(m.layout_id)
        start = have if start_page is None else check_pages(start_page, "start_page", m.resume.keyed_pages)
        own = match_shard(m)
        if shard is not None and own is not None and own[1] != shard:
            checks.count(shard, "shard", 0, layout.shard_count - 1)
            m = self._translated(layout, m, shard, start)
        return m, start

    def _translated(self, layout: PageLayout, m: Match, shard: int, held: int) -> Match:
        """``m``'s pages on shard ``shard``: its rows named and located, pages below
        ``held`` taken as the engine's own, and the bound at most ``m``'s (the highest
        boundary up to it where that shard holds every row it needs)."""
        names = names_for_shard(m.names, shard)
        flat = [n for g in names for n in g]
        where = self._store.locate(flat) if flat else []
        tiers: list[tuple[TierKind | None, ...]] = []
        at = 0
        for g in names:
            tiers.append(tuple(where[at : at + len(g)]))
            at += len(g)
        cols = Columns([[True if j < held or t is not None else None for j, t in enumerate(ts)] for ts in tiers])
        _, boundaries = resume_and_boundaries(layout, m.prompt_tokens, cols, names)
        ok = tuple(b for b in boundaries if b <= m.resume.tokens)
        bound = resume_bound(layout, m.prompt_tokens, cols, names, at=max(ok, default=0))
        return replace(m, names=names, tiers=tuple(tiers), via=(), resume=bound, boundaries=ok)

    def held(self, handle: str) -> Match:
        """The match a live handle names (:class:`FetchNotFound` otherwise)."""
        return self._handles.get(handle).match

    def load_match(self, match: Match | str, *, shard: int | None = None,
                   start_page: int | None = None) -> tuple[Match, int]:
        """The match a load of ``match`` (or a handle) moves for ``shard``, translated
        there where it names another shard's rows, and the load's first page."""
        return self._resolve(match, shard, start_page)

    def lend_load(self, match: Match | str, *, shard: int | None = None,
                  start_page: int | None = None, ttl_s: float | None = None) -> tuple[Load, Lease | None]:
        """A load's plan and a READ HOST lease on its rows (None: no rows to move)."""
        m, start = self._resolve(match, shard, start_page)
        rows = load_rows(m, start)
        if not rows:
            return Load(m, start, rows), None
        self._catalog.learn(m.layout_id, m.scope)
        lease = self._lender.lend([n for _, _, n in rows], mode=LeaseMode.READ, kind=MemoryKind.HOST,
                                  ttl_s=ttl_s)
        return Load(m, start, rows), lease

    def fetch_into(self, match: Match | str, *, pool: PoolViews, block_ids: BlockIds,
                   start_page: int | None = None, shard: int | None = None,
                   timeout: float | None = None) -> FetchResult:
        """Load ``match`` (or the match a handle names) into the engine's paged ``pool``
        (``(layer, role)`` → a ``[blocks, tokens_per_page, *shape]`` view, any strides):
        page ``j`` of group ``g`` goes to block ``block_ids[g][j]``, for the bound's pages
        from ``start_page`` on (default: a handle's ``have_pages``, else 0); a page whose
        block is None is not moved (the engine does not need it) and counts as missing. One copy
        from the lent rows into the pool; the rows are checked live after it, and a row
        that did not arrive whole is missing (its block must not be used). ``shard``: the
        caller's rank; a match of another shard's rows is translated to the caller's.
        ``timeout``: the copies stop at it; rows not copied are missing."""
        deadline = self._deadline(timeout)
        m, start = self._resolve(match, shard, start_page)
        layout = self.layout(m.layout_id)
        plan = Load(m, start, load_rows(m, start))
        targets = _targets(layout, plan, pool, block_ids)  # everything checked before a lease
        plan = Load(m, start, [r for r in plan.rows if block_ids[r[0]][r[1]] is not None])
        if not plan.rows:
            return load_result(layout, m, start, "", (), 0)
        self._catalog.learn(m.layout_id, m.scope)
        lease = self._lender.lend([n for _, _, n in plan.rows], mode=LeaseMode.READ, kind=MemoryKind.HOST)
        arrived: set[tuple[int, int]] = set()
        nbytes = 0
        try:
            for g, j, name in plan.rows:
                if deadline is not None and self._clock() >= deadline:
                    break
                loc = lease.row(name).location
                size = layout.group_page_bytes[g]
                if not isinstance(loc, HostLocation) or loc.size < size:
                    continue
                page = _pages_view(self._lender.view(lease.id, name), size)
                scatter_strided(layout, g, page, targets[g], [int(block_ids[g][j])])  # type: ignore[arg-type]
                arrived.add((g, j))
                nbytes += size
            try:
                self._lender.check_live(lease.id)
            except LeaseError:
                arrived.clear()  # bytes read under an ended lease are not used
                nbytes = 0
        finally:
            self._lender.release(lease.id)
        return load_result(layout, plan.match, plan.start_page, lease.id, arrived, nbytes)

    def lend_put_groups(self, layout_id: bytes, *, pages: Mapping[int, Sequence[int]],
                        keys: Sequence[bytes], first_page: int = 0, scope: Scope = DEFAULT_SCOPE,
                        shard: int | None = None, tokens: TokenIds | None = None,
                        ttl_s: float | None = None) -> tuple[dict[int, list[bytes]], Lease | None]:
        """One put of several ATTENTION groups of one key range planned, and one WRITE
        HOST lease on the rows not stored yet: ``pages[g]`` lists the page indices of
        group ``g`` to store. Their row names per group (in ``pages[g]``'s order)."""
        layout = self.layout(layout_id)
        if not isinstance(pages, Mapping):
            raise InvalidInput(f"pages: expected a mapping group -> page indices, got {type(pages).__name__}")
        chain = lookup.chain_keys(layout, tokens, keys, scope)
        index = self._catalog.shard(layout_id, shard)
        ns = namespace(layout_id, scope)
        names: dict[int, list[bytes]] = {}
        for g, idx in pages.items():
            checks.count(g, "group", 0, len(layout.groups) - 1)
            if layout.groups[g].kind is not GroupKind.ATTENTION:
                raise InvalidInput(f"group: {g} is a STATE group; put_state stores its snapshots")
            all_names = row_names(ns, chain, g, layout.shard_count, index)
            got = []
            for k, j in enumerate(_sequence(idx, f"pages[{g}]")):
                if isinstance(j, bool) or not isinstance(j, int) or not first_page <= j < len(all_names):
                    raise InvalidInput(f"pages[{g}][{k}]: expected a keyed page in [{first_page}, "
                                       f"{len(all_names)}), got {j!r}")
                got.append(all_names[j])
            names[g] = got
        self._catalog.learn(layout_id, scope)
        flat = [n for g in names.values() for n in g]
        todo = [n for n, t in zip(flat, self._store.locate(flat), strict=True) if t is None]
        if not todo:
            return names, None
        return names, self._lender.lend(todo, kind=MemoryKind.HOST, mode=LeaseMode.WRITE, ttl_s=ttl_s,
                                        absent=True)

    def put_from(self, layout_id: bytes, *, pool: PoolViews, block_ids: BlockIds,
                 keys: Sequence[bytes], first_page: int = 0, scope: Scope = DEFAULT_SCOPE,
                 shard: int | None = None, timeout: float | None = None) -> dict[int, list[bytes]]:
        """Store pages of several ATTENTION groups of one key range straight from the
        engine's paged ``pool``: page ``first_page + k`` of group ``g`` from block
        ``block_ids[g][k]`` (None: not stored, e.g. a block outside a sliding window).
        Every group is checked before anything is stored; a page already stored is
        skipped. Per group, the row names of the pages given (in page order)."""
        deadline = self._deadline(timeout)
        layout = self.layout(layout_id)
        check_block_ids(layout, block_ids)
        pages = {g: [first_page + k for k, b in enumerate(ids) if b is not None] for g, ids in block_ids.items()}
        names, lease = self.lend_put_groups(layout_id, pages=pages, keys=keys, first_page=first_page,
                                            scope=scope, shard=shard, tokens=None)
        for g in block_ids:
            check_pool(layout, g, pool)
        if lease is None:
            return names
        arrived: list[bytes] = []
        try:
            for g, ids in block_ids.items():
                blocks = [b for b in ids if b is not None]
                for name, b in zip(names[g], blocks, strict=True):
                    if deadline is not None and self._clock() >= deadline:
                        raise Busy(f"timeout: put_from filled {len(arrived)} pages before its {timeout} s "
                                   "deadline; nothing was stored", field="timeout")
                    try:
                        row = lease.row(name)
                    except KeyError:
                        continue  # stored already
                    if not isinstance(row.location, HostLocation):
                        continue
                    size = layout.group_page_bytes[g]
                    page = _pages_view(self._lender.view(lease.id, name), size)
                    gather_strided(layout, g, pool, [int(b)], page)
                    arrived.append(name)
            self._lender.commit(lease.id, arrived)
        except BaseException:
            self._lender.release(lease.id)
            raise
        return names


def _targets(layout: PageLayout, plan: Load, pool: PoolViews,
             block_ids: BlockIds) -> dict[int, PoolViews]:
    """The pool of each group the plan loads into, checked, and a block (or None: the
    engine does not need the page) for every page it moves, no block twice."""
    check_block_ids(layout, block_ids)
    out: dict[int, PoolViews] = {}
    used: dict[int, set[int]] = {}
    size: dict[int, int] = {}  # each group's pool: its blocks
    for g, j, _ in plan.rows:
        if g not in out:
            out[g] = check_pool(layout, g, pool)
            size[g] = int(next(iter(out[g].values())).shape[0]) if out[g] else 0
        ids = block_ids.get(g)
        if ids is None or j >= len(ids):
            raise InvalidInput(f"block_ids[{g}]: no block for page {j} (the load moves pages "
                               f"from {plan.start_page} on)")
        b = ids[j]
        if b is None:
            continue
        if isinstance(b, bool) or not isinstance(b, Integral) or not 0 <= b < size[g]:
            # refused here, not by the copy of that page: the pages before it would have moved
            raise InvalidInput(f"block_ids[{g}][{j}]: expected a block id in [0, {size[g]}), got {b!r}")
        if b in used.setdefault(g, set()):
            raise InvalidInput(f"block_ids[{g}]: block {b} appears twice (two pages into one block)")
        used[g].add(b)
    return out
