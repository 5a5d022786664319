"""Resume bounds: the largest token position a worker can resume from with the rows it has.

A pure function of the layout, the prompt length ``T`` and a presence predicate
(:func:`resume_bound`). Pages have ``P = tokens_per_page`` tokens; the key chain has one
key per *full* page of the prompt (``T // P`` keys, index ``j`` = the page covering
``[j·P, (j+1)·P)``); a partial last page is never keyed, so never stored or required.

The bound ``r`` is the largest page boundary with ``r <= T - 1`` (at least one token is
recomputed to produce logits) such that, for every group whose page carries bytes:

- a full-attention group has every page covering ``[0, r)``;
- a sliding-window group has the pages covering ``[max(0, r - window), r)`` plus its sink
  pages (pages overlapping ``[0, sink_tokens)``, those below ``r``); pages outside the
  window are neither required nor fetched;
- a ``STATE`` group has a snapshot at exactly ``r``. The snapshot at boundary ``i·P`` is
  keyed by the key of the page that ends there, key index ``i - 1``.

Groups whose page is 0 bytes (every buffer ``transferred=False``) never block ``r`` and
need no rows. ``r = 0`` means recompute everything; the first token recomputed is ``r``.

The set of valid ``r`` is not monotone (an evicted window can block a high boundary while
a lower one is whole; a snapshot exists only at some boundaries), so every candidate is
checked from the top down — no binary search. Presence is read once per keyed page and
turned into prefix sums, so each candidate costs O(groups). :func:`resume_boundaries`
lists every usable ``r``; ``resume_bound(..., at=r)`` gives the rows for one of them, and
:func:`resumed_at` a match resumed there (a pure function of the match: Bank and Client
both answer ``resume_at`` with it).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

from kvbank import checks
from kvbank.errors import InvalidInput
from kvbank.layout import GroupKind, PageLayout

if TYPE_CHECKING:
    from kvbank.results import Match

Presence = Callable[[int, int], bool]  # (group index, key index) -> the row is available


class Columns:
    """A :data:`Presence` read from per-group columns: ``columns[g][j]`` is not None when
    the row is available (a match's tiers). The bound reads whole columns at once instead
    of calling it once per page."""

    __slots__ = ("columns",)

    def __init__(self, columns: Sequence[Sequence[object]]) -> None:
        self.columns = columns

    def __call__(self, group: int, key: int) -> bool:
        return self.columns[group][key] is not None

    def column(self, group: int, n: int) -> list[bool]:
        """Availability of key indices ``[0, n)`` of ``group``."""
        col = self.columns[group]
        if len(col) < n:
            raise InvalidInput(f"present[{group}]: {len(col)} pages known, {n} keyed")
        return self._flags(col[:n])

    @staticmethod
    def _flags(col: Sequence[object]) -> list[bool]:
        return [t is not None for t in col]


class Flags(Columns):
    """A :data:`Presence` read from per-group columns of booleans (``columns[g][j]``:
    the row is available), read whole as :class:`Columns` are."""

    __slots__ = ()

    def __call__(self, group: int, key: int) -> bool:
        return bool(self.columns[group][key])

    @staticmethod
    def _flags(col: Sequence[object]) -> list[bool]:
        return [bool(x) for x in col]


def picked(names: Sequence[bytes], pages: Sequence[int]) -> tuple[bytes, ...]:
    """``names[j]`` for each of ``pages`` (ascending key indices); a slice when they are
    ``[0, n)``, as a full-attention group's are."""
    if pages and pages[-1] == len(pages) - 1:
        return tuple(names[: len(pages)])
    return tuple(map(names.__getitem__, pages))


class Obstacle(enum.Enum):
    """Why the next boundary above ``r`` is not usable."""

    MISSING_PAGE = "missing page"  # a full-attention page below it is not available
    WINDOW_EVICTED = "window evicted"  # a sliding-window page inside its window is gone
    SINK_EVICTED = "sink evicted"  # a sliding-window group's sink page is gone
    NO_SNAPSHOT = "no snapshot"  # a STATE group has no snapshot at exactly that boundary
    LAST_TOKEN = "last token"  # it would leave no prompt token to compute logits from
    # Nothing at all is stored under the layout and scope (not a single row of any
    # prompt): a cold cache, or a layout whose model fingerprint differs from the one
    # that stored the pages. Only a match says this (it asks the store); r is 0.
    NOTHING_STORED = "nothing stored"


@dataclass(frozen=True, slots=True)
class ResumeBound:
    """Where a worker resumes and exactly which rows it needs for that."""

    tokens: int  # r: resume at this position; 0 = recompute everything
    prompt_tokens: int  # T
    tokens_per_page: int  # P
    keyed_pages: int  # T // P: pages at index >= this are partial and never keyed
    matched_tokens: int  # contiguous prefix every full-attention group holds (keyed pages)
    pages: tuple[tuple[int, ...], ...]  # per group: key indices needed for r, ascending
    rows: tuple[tuple[bytes, ...], ...]  # per group: their row names (empty without names)
    reason: Obstacle | None  # why r + P is not usable; None when r is the prompt's best
    blocking_group: int | None  # the group that blocks r + P (None for LAST_TOKEN / None)

    @property
    def recompute_from(self) -> int:
        """The first token the worker must compute itself (equal to ``tokens``)."""
        return self.tokens

    @property
    def row_count(self) -> int:
        return sum(len(p) for p in self.pages)

    def needed(self) -> list[bytes]:
        """Every needed row name, group by group (requires names)."""
        return [n for g in self.rows for n in g]


def required_pages(layout: PageLayout, group: int, r: int) -> tuple[int, ...]:
    """Key indices group ``group`` needs to resume at boundary ``r`` (a multiple of P)."""
    p = layout.tokens_per_page
    if r <= 0 or layout.group_page_bytes[group] == 0:
        return ()
    g = layout.groups[group]
    top = r // p  # pages [0, top) cover [0, r)
    if g.kind is GroupKind.STATE:
        return (top - 1,)
    if g.window is None:
        return tuple(range(top))
    lo = max(0, r - g.window) // p
    sink = min(-(-g.sink_tokens // p), top)
    return tuple(sorted(set(range(sink)) | set(range(lo, top))))


class _Availability:
    """Presence of every keyed page, read once, with prefix sums: O(groups) per boundary."""

    def __init__(self, layout: PageLayout, prompt_tokens: int, present: Presence,
                 names: Sequence[Sequence[bytes]] | None) -> None:
        checks.count(prompt_tokens, "prompt_tokens")
        self.layout = layout
        self.p = p = layout.tokens_per_page
        self.t = t = prompt_tokens
        self.keyed = keyed = t // p
        n_groups = len(layout.groups)
        if names is not None:
            if len(names) != n_groups:
                raise InvalidInput(f"names: {len(names)} groups given, the layout has {n_groups}")
            for gi, gn in enumerate(names):
                if layout.group_page_bytes[gi] and len(gn) < keyed:
                    raise InvalidInput(f"names[{gi}]: {len(gn)} names for {keyed} keyed pages")
        self.active = [gi for gi in range(n_groups) if layout.group_page_bytes[gi] > 0]
        # have[g][j] for keyed pages; prefix[g][k] = number available among j < k
        if isinstance(present, Columns):
            self.have = {gi: present.column(gi, keyed) for gi in self.active}
        else:
            self.have = {gi: [bool(present(gi, j)) for j in range(keyed)] for gi in self.active}
        # prefix[g][k] = number available among j < k: only sliding-window groups ask
        self.prefix = {gi: [0, *accumulate(map(int, self.have[gi]))] for gi in self.active
                       if layout.groups[gi].window is not None}
        self.runs: dict[int, int] = {}  # full-attention group -> pages held contiguously from 0
        for gi in self.active:
            g = layout.groups[gi]
            if g.kind is GroupKind.ATTENTION and g.window is None:
                have = self.have[gi]
                self.runs[gi] = have.index(False) if False in have else keyed
        self.matched_pages = min(self.runs.values(), default=keyed)
        # The largest boundary that leaves a prompt token to compute logits from.
        self.best_candidate = ((t - 1) // p) * p if t > 0 else 0

    def obstacle(self, r: int) -> tuple[Obstacle, int] | None:
        """What blocks boundary ``r`` (a positive multiple of P), or None if it is usable."""
        layout, p, top = self.layout, self.p, r // self.p
        for gi in self.active:
            g = layout.groups[gi]
            if g.kind is GroupKind.STATE:
                if not self.have[gi][top - 1]:
                    return Obstacle.NO_SNAPSHOT, gi
            elif g.window is None:
                if top > self.runs[gi]:
                    return Obstacle.MISSING_PAGE, gi
            else:
                sink = min(-(-g.sink_tokens // p), top)
                if self.prefix[gi][sink] != sink:
                    return Obstacle.SINK_EVICTED, gi
                lo = max(0, r - g.window) // p
                if self.prefix[gi][top] - self.prefix[gi][lo] != top - lo:
                    return Obstacle.WINDOW_EVICTED, gi
        return None

    def above(self, r: int) -> tuple[Obstacle | None, int | None]:
        """Why ``r + P`` is not the bound: its obstacle, LAST_TOKEN, or (None, None)."""
        nxt = r + self.p
        if nxt > self.best_candidate:
            # Blocked by the last-token rule when that page is keyed (T a multiple of P);
            # a partial last page is not a loss.
            last = self.t > 0 and nxt <= self.keyed * self.p
            return (Obstacle.LAST_TOKEN if last else None), None
        hit = self.obstacle(nxt)
        return (None, None) if hit is None else hit

    def boundaries(self) -> tuple[int, ...]:
        """Every usable boundary ``r > 0``, ascending."""
        if len(self.runs) == len(self.active):
            # Only full-attention groups: a boundary is usable exactly when each group
            # holds every page below it, so the usable ones are every boundary up to the
            # shortest run (without asking obstacle() once per page).
            top = min(self.matched_pages * self.p, self.best_candidate)
            return tuple(range(self.p, top + 1, self.p))
        return tuple(r for r in range(self.p, self.best_candidate + 1, self.p) if self.obstacle(r) is None)

    def best(self) -> int:
        """The largest usable boundary (0 when none is)."""
        for cand in range(self.best_candidate, 0, -self.p):
            if self.obstacle(cand) is None:
                return cand
        return 0

    def bound(self, r: int, names: Sequence[Sequence[bytes]] | None) -> ResumeBound:
        layout, n_groups = self.layout, len(self.layout.groups)
        reason, blocking = self.above(r)
        pages = tuple(required_pages(layout, gi, r) for gi in range(n_groups))
        rows: tuple[tuple[bytes, ...], ...]
        if names is None:
            rows = tuple(() for _ in range(n_groups))
        else:
            rows = tuple(picked(names[gi], p) for gi, p in enumerate(pages))
        return ResumeBound(
            tokens=r, prompt_tokens=self.t, tokens_per_page=self.p, keyed_pages=self.keyed,
            matched_tokens=self.matched_pages * self.p, pages=pages, rows=rows, reason=reason,
            blocking_group=blocking,
        )


def resume_bound(
    layout: PageLayout,
    prompt_tokens: int,
    present: Presence,
    names: Sequence[Sequence[bytes]] | None = None,
    *,
    at: int | None = None,
) -> ResumeBound:
    """The bound for a prompt of ``prompt_tokens`` tokens given which rows are available.

    ``present(g, j)`` is asked once for every group ``g`` whose page carries bytes and
    every key index ``j < T // P``. ``names[g][j]``, when given, is the row name of key
    index ``j`` of group ``g`` and fills :attr:`ResumeBound.rows`. ``at`` asks for a lower
    usable boundary than the largest (one of :func:`resume_boundaries`, or 0); its
    ``reason`` then says why ``at + P`` is not usable (None if it is).
    """
    avail = _Availability(layout, prompt_tokens, present, names)
    if at is None:
        return avail.bound(avail.best(), names)
    if isinstance(at, bool) or not isinstance(at, int) or at < 0 or at % avail.p \
            or at > avail.best_candidate or (at and avail.obstacle(at) is not None):
        raise InvalidInput(
            f"at: {at!r} is not a usable resume boundary of this prompt "
            f"(usable: {[0, *avail.boundaries()]})"
        )
    return avail.bound(at, names)


def resume_and_boundaries(layout: PageLayout, prompt_tokens: int, present: Presence,
                          names: Sequence[Sequence[bytes]] | None = None,
                          ) -> tuple[ResumeBound, tuple[int, ...]]:
    """``resume_bound(...)`` and ``resume_boundaries(...)`` of one prompt, with presence
    read once for both (what a match answers)."""
    avail = _Availability(layout, prompt_tokens, present, names)
    return avail.bound(avail.best(), names), avail.boundaries()


def resume_boundaries(layout: PageLayout, prompt_tokens: int, present: Presence) -> tuple[int, ...]:
    """Every usable boundary ``r > 0`` of the prompt, ascending (an engine that caches by
    prefix length asks for all of them; the set is not monotone, see the module text)."""
    return _Availability(layout, prompt_tokens, present, None).boundaries()


def resumed_at(layout: PageLayout, match: Match, tokens: int) -> Match:
    """``match`` with its bound at ``tokens`` (one of ``match.boundaries``, or 0): the rows
    of that boundary, from the tiers the match already found."""
    at = resume_bound(layout, match.prompt_tokens, Columns(match.tiers), match.names, at=tokens)
    return dataclasses.replace(match, resume=at)
