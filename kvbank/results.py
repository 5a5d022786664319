"""What the bank's queries and fetches answer: plain frozen values (no torch, no I/O).

- :class:`Match` — where each row of a prompt's prefix is, the resume bound, and every
  usable boundary (``boundaries``); ``via`` names the rows found only under another
  shard count (fetched by resharding).
- :class:`Presence` — where each page is for every tensor-parallel shard of a layout,
  from one store lookup, and the boundary every shard can resume at.
- :class:`FetchResult` — what one fetch call delivered and the bound those rows allow.
- :class:`Fetched` — a prompt matched and fetched in one call (``fetch_prefix``): the
  match, the fetch's result and the buffers the rows went into.
- :class:`BankStats` — the bank's counters and its store's (:class:`StoreStats`, one
  :class:`TierStats` per tier); :class:`StoreHealth` / :class:`TierHealth`.
- The store's admin answers: :class:`RowInfo` (a listing), :class:`EvictResult`, and
  the change feed's :class:`RowEvent`.

Each has a JSON form in :mod:`kvbank.wire.forms`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbank.errors import InvalidInput
from kvbank.keys import ROW_NAME_BYTES, Scope, shard_of
from kvbank.lender.resume import ResumeBound
from kvbank.tiers.base import TierKind


class HealthState(enum.Enum):
    OK = "ok"
    OFF = "off"  # not configured, or switched off (device without a GPU)
    DEGRADED = "degraded"  # enabled but failing (a full or broken disk)


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counters of one tier since the store opened (rows/bytes are current)."""

    kind: TierKind
    enabled: bool
    rows: int
    used_bytes: int  # slot capacity in use (memory tiers) or frame bytes (disk)
    allocated_bytes: int  # memory held: claimed chunks, or the frame bytes on disk
    budget_bytes: int
    hits: int
    misses: int
    evictions: int  # rows dropped out of the store from this tier
    demotions: int  # rows moved (or copied, then dropped) to a lower tier
    promotions: int  # rows copied into this tier from a lower one on read
    # Rows found corrupt and dropped: on disk a frame that failed its checks (deleted); in
    # memory a copy whose bytes no longer matched its checksum (the read a miss).
    corrupt_rows: int
    # Page bytes of the rows held, as stored before any codec: with ``used_bytes`` of a
    # compressed tier (disk), the codec ratio. Rebuilt with the index at open.
    raw_bytes: int = 0
    victims_first: int = 0  # rows the eviction rule took out (dropped or demoted), never reused
    victims_reused: int = 0  # ... reused ones that aged out
    admitted_bytes: int = 0  # page bytes of puts stored into the tier
    rejected_bytes: int = 0  # page bytes of puts refused for want of room
    # Page bytes of the moves ``demotions`` and ``promotions`` count, by the other tier of
    # each: the tier a demotion went to, the tier a promotion came from. One count per
    # tier, in TierKind order (device, host, disk): see :meth:`demoted_to`.
    demoted_bytes: tuple[int, ...] = (0, 0, 0)
    promoted_bytes: tuple[int, ...] = (0, 0, 0)

    def demoted_to(self, kind: TierKind) -> int:
        """Page bytes this tier's demotions moved to tier ``kind``."""
        return self.demoted_bytes[kind.rank]

    def promoted_from(self, kind: TierKind) -> int:
        """Page bytes this tier's promotions copied in from tier ``kind``."""
        return self.promoted_bytes[kind.rank]


@dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot of the store's counters.

    They agree: ``gets == hits + misses``; ``hits`` is the tiers' hits plus
    ``remote_hits``; a read counts in each enabled tier it asked, fastest first (a hit in
    one, a miss in each faster one), so the slowest tier's misses are the local misses.
    A read whose frame fails its checks is a miss (and one of ``corrupt_rows``)."""

    tiers: tuple[TierStats, ...]  # fastest first, enabled or not
    rows: int
    locked_names: int
    reserved_slots: int
    queued_jobs: int
    queued_bytes: int
    puts: int
    gets: int
    hits: int
    misses: int
    pinned_rows: int = 0
    pinned_bytes: int = 0
    events_dropped: int = 0  # change-feed events lost to overflow since open
    remote_hits: int = 0  # local misses the remote tier answered (in ``hits`` too)

    def tier(self, kind: TierKind) -> TierStats:
        return next(t for t in self.tiers if t.kind is kind)

    def moved_bytes(self) -> dict[tuple[TierKind, TierKind], int]:
        """Page bytes moved from one tier to another, for every ordered pair of enabled
        tiers (zero where none moved): the first's demotions to the second and the
        second's promotions from the first."""
        on = [t for t in self.tiers if t.enabled]
        return {(a.kind, b.kind): a.demoted_to(b.kind) + b.promoted_from(a.kind)
                for a in on for b in on if a is not b}


@dataclass(frozen=True, slots=True)
class TierHealth:
    kind: TierKind
    enabled: bool
    state: HealthState
    detail: str


@dataclass(frozen=True, slots=True)
class StoreHealth:
    ok: bool  # every enabled tier ok and the mover running
    tiers: tuple[TierHealth, ...]
    mover_running: bool
    notes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RowInfo:
    """One row as an admin listing shows it (:meth:`TieredStore.scan`)."""

    name: bytes
    size: int
    tiers: frozenset[TierKind]
    age_s: float  # seconds since it was last put, read or touched
    holders: frozenset[str]  # page-lock holders (lease ids)
    pinned: bool


@dataclass(frozen=True, slots=True)
class EvictResult:
    """What :meth:`TieredStore.evict` did, name by name."""

    evicted: tuple[bytes, ...]
    locked: tuple[bytes, ...]  # held by a page lock: left in place
    missing: tuple[bytes, ...]
    pinned: tuple[bytes, ...] = ()  # pinned by the admin: left in place


class EventKind(enum.Enum):
    PUBLISHED = "published"  # first visible in the store
    WITHDRAWN = "withdrawn"  # gone from every tier
    OVERFLOW = "overflow"  # ``dropped`` events were lost here: resync with scan()


@dataclass(frozen=True, slots=True)
class RowEvent:
    """One change-feed entry; ``seq`` counts every event the store ever made."""

    kind: EventKind
    name: bytes  # b"" for OVERFLOW
    seq: int
    dropped: int = 0  # OVERFLOW only


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
    # row, or a miss); empty when no row is resharded. See kvbank.bank.cross_shard.
    via: tuple[tuple[int, ...], ...] = ()

    def present(self, group: int, index: int) -> bool:
        return self.tiers[group][index] is not None

    @property
    def needed(self) -> list[bytes]:
        """The rows the resume bound needs, group by group (what to fetch or lend)."""
        return self.resume.needed()

    @property
    def shard(self) -> int | None:
        """The shard index its rows are named under (read from the row names: every
        name of a match carries the caller's shard); None for a match of no rows."""
        for names in self.names:
            if names:
                return shard_of(names[0])[1]
        return None


def check_shard(rows: Match | Sequence[object], shard: int | None) -> None:
    """Refuse to load (fetch or lend) rows of another shard than ``shard``, the caller's
    tensor-parallel rank: a Match (or row names) taken for shard 0 names shard 0's rows,
    the same size as every rank's, so loading them on rank 1 would give it rank 0's KV
    heads. ``shard=None`` checks nothing (the caller's rows are the ones named)."""
    if shard is None:
        return
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 0:
        raise InvalidInput(f"shard: expected a shard index (a non-negative integer), got {shard!r}")
    if isinstance(rows, Match):
        has = rows.shard
        if has is not None and has != shard:
            raise InvalidInput(f"shard: the match names rows of shard {has}, not shard {shard}; "
                               f"match again with shard={shard} (its rows are other bytes)")
        return
    if isinstance(rows, (bytes, bytearray, str)) or not isinstance(rows, Sequence):
        return  # not row names: the lend refuses them itself
    for i, name in enumerate(rows):
        if type(name) is bytes and len(name) == ROW_NAME_BYTES and shard_of(name)[1] != shard:
            raise InvalidInput(f"shard: names[{i}] is a row of shard {shard_of(name)[1]}, not "
                               f"shard {shard}")


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


@dataclass(frozen=True, slots=True)
class Bound:
    """A scheduler's answer for one prompt of ``match_many``: only what it decides by.

    ``tokens`` is the resume bound ``r`` counting the engine's own first ``have_pages``
    pages as held; ``boundaries`` every usable ``r > 0``; ``missing`` per group the keyed
    pages from ``have_pages`` on that the node lacks. With ``hold=True`` and rows to load,
    ``handle`` names the match the node keeps (until its ttl, or ``release_match``) for a
    worker to load by (``fetch_into(handle, ...)``, from any shard); ``pinned``: with
    ``pin=True``, the rows of every shard the load needs are held in place until then."""

    tokens: int
    boundaries: tuple[int, ...]
    missing: tuple[tuple[int, ...], ...]
    handle: str | None = None
    pinned: bool = False
