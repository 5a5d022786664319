"""Matching and fetching rows stored under another tensor-parallel size.

A prefix computed at TP 4 is stored as TP 4 rows; a TP 2 worker asking for it finds its
own rows missing. Every registered layout with the same
:attr:`~kvbank.layout.PageLayout.logical_id` is another shard count the rows may be
stored under, and :func:`kvbank.reshard.plan.plan_reshard` says which of its rows make each of
the caller's.

Primitives:

- :class:`ShardCounts` — the bank's registered layouts by logical id (thread-safe):
  :meth:`~ShardCounts.add` on register, :meth:`~ShardCounts.others` for a match.
- :class:`CrossLocate` — the store's ``locate`` for a match, with the rows missing under
  the caller's shard looked up under the other counts (one store lookup per count, only
  for rows still missing). A row counts present only if *every* source row it needs is;
  its tier is the slowest of them, and ``Match.via`` names the count.
- :class:`ReshardReader` — the ``get_into`` a fetch uses: a row of the caller's own shard
  straight from the store; a resharded row built from its source rows
  (:func:`kvbank.kernels.reshard.reshard_pages`) only once every source arrived whole, so
  the fetch ledger counts it delivered only then. With ``store`` given (the
  ``reshard_store`` setting) the built row is stored under the caller's own name, so the
  next fetch of it is direct.

A resharded row is fetched, never lent: it has no bytes under its own name until a fetch
builds (and stores) it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvbank.errors import InvalidInput, PageSizeMismatch
from kvbank.kernels.reshard import reshard_pages
from kvbank.keys import Scope, group_of, namespace, page_key_of, row_names, shard_of
from kvbank.layout import PageLayout
from kvbank.reshard.plan import ReshardPlan, plan_reshard
from kvbank.results import Match
from kvbank.tiers.base import TierKind

Locate = Callable[[Sequence[bytes]], list[TierKind | None]]  # the store's locate
GetInto = Callable[[bytes, "memoryview | bytearray"], "int | None"]  # the store's get_into
Store = Callable[[bytes, memoryview, "bytes | None"], None]  # put a row (name, bytes, parent)


class ShardCounts:
    """Registered layouts by logical id, one per shard count (its rank 0 form)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_logical: dict[bytes, dict[int, PageLayout]] = {}

    def add(self, layout: PageLayout) -> None:
        with self._lock:
            counts = self._by_logical.setdefault(layout.logical_id, {})
            if layout.shard_count not in counts:
                counts[layout.shard_count] = layout if layout.shard_index == 0 else layout.with_shard(0)

    def others(self, layout: PageLayout) -> tuple[PageLayout, ...]:
        """The registered layouts ``layout``'s rows can be resharded from, fewest source
        rows a destination row first (then by shard count)."""
        with self._lock:
            counts = dict(self._by_logical.get(layout.logical_id, {}))
        counts.pop(layout.shard_count, None)
        return tuple(sorted(counts.values(), key=lambda s: (_fan_in(s, layout), s.shard_count)))


def _fan_in(src: PageLayout, dst: PageLayout) -> int:
    return len(plan_reshard(src, dst).sources)


def _source_names(match: Match, src: PageLayout, plan: ReshardPlan, group: int,
                  pages: Sequence[int]) -> list[list[bytes]]:
    """Per source shard of ``plan``'s group, the row names of ``pages``."""
    ns = namespace(src.layout_id, match.scope)
    keys = [page_key_of(match.names[group][i]) for i in pages]
    return [row_names(ns, keys, group, src.shard_count, s) for s in plan.groups[group].sources]


_RANK = {t: t.rank for t in TierKind}


class CrossLocate:
    """The store's ``locate`` for a match, widened: a name it misses is looked up under
    each shard count of ``others`` in turn (one lookup per count, only for names still
    missing) and answers the slowest tier of its source rows when every one is there.
    :meth:`annotate` then records in ``Match.via`` which rows were found so. Used as the
    match's locate, so the resume bound is computed once, on the widened answer."""

    def __init__(self, locate: Locate, layout: PageLayout, shard_index: int, scope: Scope,
                 others: Sequence[PageLayout]) -> None:
        self._locate = locate
        self._layout = layout
        self._index = shard_index
        self._scope = scope
        self._others = others
        self._via: dict[bytes, int] = {}  # own row name -> shard count it was found under

    def __call__(self, names: Sequence[bytes]) -> list[TierKind | None]:
        where = self._locate(names)
        missing = [k for k, t in enumerate(where) if t is None]
        for src in self._others:
            if not missing:
                break
            plan = plan_reshard(src, self._layout, self._index)
            ns = namespace(src.layout_id, self._scope)
            by_group: dict[int, list[int]] = {}
            for k in missing:
                by_group.setdefault(group_of(names[k]), []).append(k)
            asked: list[tuple[list[int], int]] = []  # (positions in names, sources a row)
            flat: list[bytes] = []
            for g, ks in by_group.items():
                keys = [page_key_of(names[k]) for k in ks]
                sources = plan.groups[g].sources
                per = [row_names(ns, keys, g, src.shard_count, s) for s in sources]
                flat.extend(name for row in zip(*per, strict=True) for name in row)
                asked.append((ks, len(sources)))
            found = iter(self._locate(flat))
            for ks, fan in asked:
                # zip(ks, ...) stops on ks before taking another row from ``found``
                for k, held in zip(ks, zip(*[found] * fan, strict=False), strict=False):
                    tier = held[0]
                    if tier is None:
                        continue
                    if held.count(tier) != fan:  # sources in different tiers, or a miss
                        if None in held:
                            continue
                        tier = max(held, key=_RANK.__getitem__)
                    where[k] = tier
                    self._via[names[k]] = src.shard_count
            missing = [k for k in missing if where[k] is None]
        return where

    def annotate(self, match: Match) -> Match:
        """``match`` with ``via`` naming the rows this locate found under another count."""
        if not self._via:
            return match
        via = tuple(tuple(self._via.get(n, 0) for n in g) for g in match.names)
        return dataclasses.replace(match, via=via)


class ReshardReader:
    """``get_into`` for a fetch of ``match``: resharded rows are built from their sources."""

    def __init__(self, match: Match, layout: PageLayout, others: Sequence[PageLayout],
                 get_into: GetInto, store: Store | None) -> None:
        self._get = get_into
        self._store = store
        by_count = {s.shard_count: s for s in others}
        shard_index = next((shard_of(n[0])[1] for n in match.names if n), 0)
        # own row name -> (plan, group, source shard -> source row name, parent row name)
        self._rows: dict[bytes, tuple[ReshardPlan, int, dict[int, bytes], bytes | None]] = {}
        for g, counts in enumerate(match.via):
            for count in sorted(set(counts) - {0}):
                src = by_count.get(count)
                if src is None:  # the layout the match used is no longer registered: a miss
                    continue
                plan = plan_reshard(src, layout, shard_index)
                pages = [i for i, c in enumerate(counts) if c == count]
                per = _source_names(match, src, plan, g, pages)
                for k, i in enumerate(pages):
                    sources = {s: names[k] for s, names in zip(plan.groups[g].sources, per, strict=True)}
                    parent = match.names[g][i - 1] if i else None
                    self._rows[match.names[g][i]] = (plan, g, sources, parent)

    def __call__(self, name: bytes, out: memoryview | bytearray) -> int | None:
        entry = self._rows.get(name)
        got = self._get(name, out)
        if entry is None or got is not None:
            return got  # the caller's own row (stored since the match, perhaps)
        plan, g, sources, parent = entry
        gp = plan.groups[g]
        pages: dict[int, torch.Tensor] = {}
        for s, source in sources.items():
            buf = bytearray(gp.src_page_bytes)
            what = f"source row {source.hex()[:16]}… (shard {s} of {plan.src.shard_count})"
            try:
                got = self._get(source, memoryview(buf))
            except InvalidInput as exc:  # the stored row is larger than its layout's page
                raise PageSizeMismatch(f"{what}: {exc}; its layout's page is "
                                       f"{gp.src_page_bytes} bytes") from exc
            if got is None:
                return None  # a source gone since the match: this row is a miss, nothing built
            if got != gp.src_page_bytes:
                raise PageSizeMismatch(f"{what}: {got} bytes, its layout's page is "
                                       f"{gp.src_page_bytes}")
            pages[s] = torch.frombuffer(buf, dtype=torch.uint8).view(1, -1)
        dst = torch.from_numpy(np.frombuffer(out, dtype=np.uint8, count=gp.dst_page_bytes))
        reshard_pages(plan, g, pages, dst.view(1, -1))
        if self._store is not None:
            self._store(name, memoryview(out)[: gp.dst_page_bytes], parent)
        return gp.dst_page_bytes
