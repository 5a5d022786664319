"""An engine's loads, as pure functions over a :class:`~kvbank.results.Match`: what a
scheduler is told, which rows a load moves, and the bound of what arrived.

- :func:`held_bound` — the bound and boundaries of a match when the engine already holds
  its first ``have_pages`` pages (they count as present, whatever the node holds).
- :func:`missing_pages` — per group, the keyed pages from ``have_pages`` on the node lacks.
- :func:`for_shard` / :func:`names_for_shard` — a row name of another shard: the same
  page of the same chain, only the shard index differs (its bytes are another rank's).
- :func:`load_rows` — the rows a load from page ``start_page`` moves: the bound's rows of
  pages ``>= start_page``, as ``(group, page, name)``.
- :func:`load_result` — the :class:`~kvbank.results.FetchResult` of a load: the rows that
  arrived whole, and the bound they allow with the pages below ``start_page`` taken as the
  engine's own. A row that did not arrive is a miss, never "loaded".
"""

from __future__ import annotations

import struct
from collections.abc import Collection

from kvbank.errors import InvalidInput
from kvbank.keys import NAMESPACE_BYTES, PAGE_KEY_BYTES, ROW_NAME_BYTES, shard_of
from kvbank.layout import PageLayout
from kvbank.lender.resume import Columns, ResumeBound, resume_and_boundaries, resume_bound
from kvbank.results import FetchResult, Match

__all__ = ["for_shard", "held_bound", "load_result", "load_rows", "missing_pages", "names_for_shard"]

_TAIL = struct.Struct(">HHH")
_HEAD = NAMESPACE_BYTES + PAGE_KEY_BYTES

LoadRow = tuple[int, int, bytes]  # (group, page index, row name)


def check_pages(value: object, field: str, limit: int) -> int:
    """A page index in ``[0, limit]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise InvalidInput(f"{field}: expected a page index in [0, {limit}], got {value!r}")
    return value


def held_bound(layout: PageLayout, match: Match, have_pages: int) -> tuple[ResumeBound, tuple[int, ...]]:
    """``match``'s bound and boundaries when the engine holds pages ``[0, have_pages)``."""
    if have_pages == 0:
        return match.resume, match.boundaries
    cols = [[True if j < have_pages or t is not None else None for j, t in enumerate(ts)] for ts in match.tiers]
    return resume_and_boundaries(layout, match.prompt_tokens, Columns(cols), match.names)


def missing_pages(match: Match, have_pages: int) -> tuple[tuple[int, ...], ...]:
    """Per group, the keyed pages from ``have_pages`` on whose rows the node lacks."""
    return tuple(tuple(j for j in range(have_pages, len(ts)) if ts[j] is None) for ts in match.tiers)


def for_shard(name: bytes, shard: int) -> bytes:
    """Row ``name`` of shard ``shard`` (same namespace, page key, group, shard count)."""
    group, count, _ = _TAIL.unpack_from(name, _HEAD)
    if not 0 <= shard < count:
        raise InvalidInput(f"shard: expected a shard index in [0, {count}), got {shard!r}")
    return name[:_HEAD] + _TAIL.pack(group, count, shard)


def names_for_shard(names: tuple[tuple[bytes, ...], ...], shard: int) -> tuple[tuple[bytes, ...], ...]:
    return tuple(tuple(for_shard(n, shard) for n in g) for g in names)


def match_shard(match: Match) -> tuple[int, int] | None:
    """``(shard_count, shard_index)`` of a match's rows; None for a match of no rows."""
    for names in match.names:
        for n in names:
            if len(n) == ROW_NAME_BYTES:
                return shard_of(n)
    return None


def load_rows(match: Match, start_page: int) -> list[LoadRow]:
    """The bound's rows of pages ``>= start_page``, group by group, in page order."""
    out: list[LoadRow] = []
    for g, (pages, rows) in enumerate(zip(match.resume.pages, match.resume.rows, strict=True)):
        out.extend((g, j, name) for j, name in zip(pages, rows, strict=True) if j >= start_page)
    return out


def load_result(layout: PageLayout, match: Match, start_page: int, fetch_id: str,
                arrived: Collection[tuple[int, int]], nbytes: int) -> FetchResult:
    """What a load of ``match`` from ``start_page`` delivered: ``arrived`` holds the
    ``(group, page)`` of every row that arrived whole."""
    planned = load_rows(match, start_page)
    n = len(layout.groups)
    delivered = tuple(tuple(j for g2, j, _ in planned if g2 == g and (g, j) in arrived) for g in range(n))
    missing = tuple(tuple(j for g2, j, _ in planned if g2 == g and (g, j) not in arrived) for g in range(n))
    if not any(missing):
        return FetchResult(fetch_id, delivered, missing, match.resume, nbytes, True)
    got = set(arrived)
    cols = [[True if j < start_page or (g, j) in got else None for j in range(len(ts))]
            for g, ts in enumerate(match.tiers)]
    bound = resume_bound(layout, match.prompt_tokens, Columns(cols), match.names)
    if bound.tokens > match.resume.tokens:  # never past what the match promised
        bound = match.resume
    return FetchResult(fetch_id, delivered, missing, bound, nbytes, False)
