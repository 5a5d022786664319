"""Matching and fetching rows stored under another tensor-parallel size.

A prefix computed at TP 4 is stored as TP 4 rows; a TP 2 worker asking for it finds its
own rows missing. Every registered layout with the same
:attr:`~kvbank.layout.PageLayout.logical_id` is another shard count the rows may be
stored under, and :func:`kvbank.reshard.plan_reshard` says which of its rows make each of
the caller's.

Primitives:

- :class:`ShardCounts` — the bank's registered layouts by logical id (thread-safe):
  :meth:`~ShardCounts.add` on register, :meth:`~ShardCounts.others` for a match.
- :func:`widen` — a :class:`~kvbank.results.Match` with the rows missing under the
  caller's shard looked up under the other counts (one store lookup per count, only for
  rows still missing). A row counts present only if *every* source row it needs is; its
  tier is the slowest of them, ``Match.via`` names the count, and the resume bound and
  boundaries are recomputed.
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

from kvbank.kernels.reshard import reshard_pages
from kvbank.keys import namespace, page_key_of, row_names, shard_of
from kvbank.layout import PageLayout
from kvbank.lender.resume import resume_bound, resume_boundaries
from kvbank.reshard import ReshardPlan, plan_reshard
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
                counts[layout.shard_count] = layout.with_shard(0)

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


def widen(match: Match, layout: PageLayout, shard_index: int, others: Sequence[PageLayout],
          locate: Locate) -> Match:
    """``match`` with its missing rows looked up under the shard counts of ``others``."""
    n_groups = len(layout.groups)
    missing = {g: [i for i, t in enumerate(match.tiers[g]) if t is None]
               for g in range(n_groups) if layout.group_page_bytes[g]}
    if not others or not any(missing.values()):
        return match
    dst = layout.with_shard(shard_index)
    tiers = [list(t) for t in match.tiers]
    via = [[0] * len(t) for t in match.tiers]
    for src in others:
        plan = plan_reshard(src, dst)
        asked = [(g, pages, _source_names(match, src, plan, g, pages))
                 for g, pages in missing.items() if pages]
        flat = [name for _, _, per in asked for names in per for name in names]
        where = iter(locate(flat))
        for g, pages, per in asked:
            found = [[next(where) for _ in pages] for _ in per]
            for k, i in enumerate(pages):
                held = [f[k] for f in found]
                if all(t is not None for t in held):
                    tiers[g][i] = max(held, key=lambda t: t.rank)  # type: ignore[union-attr]
                    via[g][i] = src.shard_count
            missing[g] = [i for i in pages if tiers[g][i] is None]
        if not any(missing.values()):
            break
    if not any(any(v) for v in via):
        return match
    frozen = tuple(tuple(t) for t in tiers)

    def have(g: int, j: int) -> bool:
        return frozen[g][j] is not None

    t = match.prompt_tokens
    return dataclasses.replace(
        match, tiers=frozen, via=tuple(tuple(v) for v in via),
        resume=resume_bound(layout, t, have, match.names),
        boundaries=resume_boundaries(layout, t, have),
    )


class ReshardReader:
    """``get_into`` for a fetch of ``match``: resharded rows are built from their sources."""

    def __init__(self, match: Match, layout: PageLayout, others: Sequence[PageLayout],
                 get_into: GetInto, store: Store | None) -> None:
        self._get = get_into
        self._store = store
        by_count = {s.shard_count: s for s in others}
        shard_index = next((shard_of(n[0])[1] for n in match.names if n), 0)
        dst = layout.with_shard(shard_index)
        # own row name -> (plan, group, source shard -> source row name, parent row name)
        self._rows: dict[bytes, tuple[ReshardPlan, int, dict[int, bytes], bytes | None]] = {}
        for g, counts in enumerate(match.via):
            for count in sorted(set(counts) - {0}):
                src = by_count.get(count)
                if src is None:  # the layout the match used is no longer registered: a miss
                    continue
                plan = plan_reshard(src, dst)
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
            if self._get(source, memoryview(buf)) != gp.src_page_bytes:
                return None  # a source gone or cut short: this row is a miss, nothing built
            pages[s] = torch.frombuffer(buf, dtype=torch.uint8).view(1, -1)
        dst = torch.from_numpy(np.frombuffer(out, dtype=np.uint8, count=gp.dst_page_bytes))
        reshard_pages(plan, g, pages, dst.view(1, -1))
        if self._store is not None:
            self._store(name, memoryview(out)[: gp.dst_page_bytes], parent)
        return gp.dst_page_bytes
