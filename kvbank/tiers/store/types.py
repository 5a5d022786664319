"""The store's public value objects (stats, health, admin listings, the change feed) and
its internal job records. All frozen; states are enums, never strings."""

from __future__ import annotations

import enum
from dataclasses import dataclass

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
    corrupt_rows: int
    # Page bytes of the rows held, as stored before any codec: with ``used_bytes`` of a
    # compressed tier (disk), the codec ratio. Rebuilt with the index at open.
    raw_bytes: int = 0


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


class JobKind(enum.Enum):
    DEMOTE = "demote"  # a memory row encoded and written to disk
    COPY_DOWN = "copy-down"  # a device row copied into a host slot
    PURGE = "purge"  # stale disk names deleted


@dataclass(frozen=True, slots=True)
class Job:
    """One unit of the mover's queue."""

    kind: JobKind
    bit: int = 0  # the memory tier the row leaves (DEMOTE, COPY_DOWN)
    rid: int = -1
    name: bytes = b""
    off: int = -1  # the pinned source slot
    size: int = 0
    dst_off: int = -1  # COPY_DOWN: the pinned host slot claimed at planning
    names: tuple[bytes, ...] = ()  # PURGE
    evict: bool = False  # PURGE: a disk eviction batch (the planner waits for it)
