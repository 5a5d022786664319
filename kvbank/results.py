"""What the bank's queries and fetches answer: plain frozen values (no torch, no I/O).

- :class:`Match` — where each row of a prompt's prefix is, the resume bound, and every
  usable boundary (``boundaries``); ``via`` names the rows found only under another
  shard count (fetched by resharding).
- :class:`Presence` — where each page is for every tensor-parallel shard of a layout,
  from one store lookup, and the boundary every shard can resume at.
- :class:`FetchResult` — what one fetch call delivered and the bound those rows allow.
- :class:`Fetched` — a prompt matched and fetched in one call (``fetch_prefix``): the
  match, the fetch's result and the buffers the rows went into.
- :class:`BankStats` — the bank's counters and its store's.

Each has a JSON form in :mod:`kvbank.wire`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbank.keys import Scope
from kvbank.lender.resume import ResumeBound
from kvbank.tiers.base import TierKind
from kvbank.tiers.store import StoreStats


@dataclass(frozen=True, slots=True)
class Match:
    """What the bank holds of a prompt. Taking one never leases, locks, renews or writes."""

    layout_id: bytes
    scope: Scope
    prompt_tokens: int
    resume: ResumeBound  # where to resume and the rows needed for it
    names: tuple[tuple[bytes, ...], ...]  # per group, the row name of every keyed page
    tiers: tuple[tuple[TierKind | None, ...], ...]  # per group, where each row is (None = miss)
    boundaries: tuple[int, ...]  # every usable resume boundary r > 0, ascending
    # per group, per page: the shard count a row is resharded from (0: the caller's own
    # row, or a miss); empty when no row is resharded. See kvbank.cross_shard.
    via: tuple[tuple[int, ...], ...] = ()

    def present(self, group: int, index: int) -> bool:
        return self.tiers[group][index] is not None

    @property
    def needed(self) -> list[bytes]:
        """The rows the resume bound needs, group by group (what to fetch or lend)."""
        return self.resume.needed()


@dataclass(frozen=True, slots=True)
class Presence:
    """Where each page of a prompt is, for several shards of one layout."""

    layout_id: bytes
    scope: Scope
    prompt_tokens: int
    shards: tuple[int, ...]  # the shard indices asked for, ascending
    tiers: tuple[tuple[tuple[TierKind | None, ...], ...], ...]  # [shard][group][page]; None = miss
    shard_tokens: tuple[int, ...]  # per shard, its resume bound (as Match.resume.tokens)
    tokens: int  # the boundary every shard asked for can resume at (min of shard_tokens)

    def held(self, shard: int, group: int, page: int) -> bool:
        """Shard ``shard`` (an index, not a position) holds page ``page`` of ``group``."""
        return self.tiers[self.shards.index(shard)][group][page] is not None


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
class Fetched:
    """A prompt's stored prefix, matched and fetched: what ``fetch_prefix`` answers."""

    match: Match
    result: FetchResult | None  # None when the match's bound was 0 (nothing fetched)
    pages: Mapping[int, Any]  # group -> the rows' buffers (uint8 [len(match.resume.pages[g]), bytes])

    @property
    def tokens(self) -> int:
        """The bound the delivered rows allow (0 = recompute everything)."""
        return 0 if self.result is None else self.result.resume.tokens


@dataclass(frozen=True, slots=True)
class BankStats:
    """A snapshot of the bank's counters and its store's."""

    layouts: int
    live_leases: int
    leases_expired: int
    open_fetches: int  # open entries of the bank's own fetch ledger (Bank.fetch)
    store: StoreStats
    # open entries of a served node's ledger: fetches through the service (streamed, or
    # read in place by a same-host client), which never enter the bank's ledger. 0 for an
    # embedded bank; ``Client.stats()`` reports the node's.
    served_fetches: int = 0
