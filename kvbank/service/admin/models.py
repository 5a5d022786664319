"""Pydantic request and response models of the admin API (they make its OpenAPI schema).

Row names, layout ids and prefixes cross as lowercase hex; tiers by name (``HOST``);
scopes as ``{tenant, cache_salt, lora}``. Every size and count is non-negative.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MAX_NAMES = 10_000  # row names one admin call may name
MAX_LIST = 1_000  # rows one listing page may hold


class _Strict(BaseModel):
    # as strict as the data API's bodies: ``"yes"`` is not a boolean, an unknown key is refused
    model_config = ConfigDict(strict=True, extra="forbid")


class ScopeModel(_Strict):
    tenant: str = Field("", max_length=256)
    cache_salt: str = Field("", max_length=256)
    lora: str = Field("", max_length=256)


class NamesRequest(_Strict):
    names: list[str] = Field(description="row names (hex)", min_length=1, max_length=MAX_NAMES)


class EvictRequest(_Strict):
    names: list[str] | None = Field(None, description="row names (hex)", max_length=MAX_NAMES)
    prefix: str | None = Field(None, description="a row-name prefix (hex)", max_length=108)
    layout_id: str | None = Field(None, description="hex of a 32-byte layout id", max_length=64)
    scope: ScopeModel | None = None


class FlushRequest(_Strict):
    timeout_s: float | None = Field(None, gt=0, le=3600, description="Busy (503) after this")


class DrainRequest(_Strict):
    wait: bool = Field(True, description="answer once in-flight requests are done (or timeout_s)")
    timeout_s: float = Field(30.0, gt=0, le=3600)


class HealthModel(BaseModel):
    live: bool
    ready: bool
    draining: bool
    degraded: list[str] = Field(description="why the node is not fully healthy (empty: it is)")
    in_flight: int = Field(ge=0, description="data requests in progress")
    store: dict[str, Any] = Field(description="the store's StoreHealth (wire form)")


class TierModel(BaseModel):
    kind: str
    enabled: bool
    budget_bytes: int = Field(ge=0)
    used_bytes: int = Field(ge=0)
    allocated_bytes: int = Field(ge=0)
    rows: int = Field(ge=0)
    high_watermark: float
    low_watermark: float
    hits: int = Field(ge=0)
    misses: int = Field(ge=0)
    evictions: int = Field(ge=0)
    demotions: int = Field(ge=0)
    promotions: int = Field(ge=0)
    corrupt_frames: int = Field(ge=0, description="rows found corrupt and dropped: disk frames that "
                                "failed their checks; in a memory tier, copies whose bytes no longer "
                                "matched their checksum")
    raw_bytes: int = Field(ge=0, description="page bytes of the rows held, before any codec")
    codec_ratio: float | None = Field(description="raw_bytes / used_bytes of the disk tier (its frames); "
                                      "null for memory tiers and an empty disk")
    victims_first_time: int = Field(0, ge=0, description="rows the eviction rule took out, never reused")
    victims_reused: int = Field(0, ge=0, description="rows the eviction rule took out, reused but aged out")
    admitted_bytes: int = Field(0, ge=0, description="page bytes of puts stored into the tier")
    rejected_bytes: int = Field(0, ge=0, description="page bytes of puts refused for want of room")
    demoted_bytes: dict[str, int] = Field(default_factory=dict, description="page bytes of the tier's "
                                          "demotions, by the enabled tier below it they went to")
    promoted_bytes: dict[str, int] = Field(default_factory=dict, description="page bytes of the tier's "
                                           "promotions, by the enabled tier they came from (none into the disk)")


class FleetNodeModel(BaseModel):
    node_id: int = Field(ge=0)
    name: str
    address: str = Field(description="the node's data URL")
    version: str
    layouts: list[str] = Field(description="hex layout ids the node has registered")
    rows: int = Field(ge=0, description="rows the node has published to the index")
    heartbeat_age_s: float = Field(ge=0)
    state: str = Field(description="live (heartbeat within the deadline) or dead")


class FleetModel(BaseModel):
    self_id: int | None = Field(alias="self", description="this node's id (null until it registers)")
    nodes: list[FleetNodeModel]

    model_config = ConfigDict(populate_by_name=True)


class TiersModel(BaseModel):
    tiers: list[TierModel]


class StatsModel(BaseModel):
    bank: dict[str, Any] = Field(description="BankStats (wire form)")
    tiers: list[TierModel]
    in_flight: int = Field(ge=0)
    draining: bool
    remote_fetches: int = Field(ge=0, description="open remote fetch-ledger entries")


class LayoutsModel(BaseModel):
    layouts: list[dict[str, Any]] = Field(description="registered layouts (wire form)")


class LeasesModel(BaseModel):
    leases: list[dict[str, Any]] = Field(description="live leases (wire form)")


class ReleasedModel(BaseModel):
    released: bool


class UnregisteredModel(BaseModel):
    unregistered: int = Field(ge=0, description="registrations removed (one per shard)")


class FetchesModel(BaseModel):
    fetches: list[dict[str, Any]] = Field(description="open fetch-ledger entries (FetchInfo)")


class RowModel(BaseModel):
    name: str
    size: int = Field(ge=0)
    tiers: list[str]
    age_s: float = Field(ge=0)
    holders: list[str] = Field(description="lease ids holding the row's page lock")
    pinned: bool


class RowsModel(BaseModel):
    rows: list[RowModel]
    next_cursor: str | None = Field(description="the next page's cursor; null on the last page")


class EvictModel(BaseModel):
    evicted: list[str]
    locked: list[str] = Field(description="held by a lease: left in place")
    missing: list[str]
    pinned: list[str] = Field(description="pinned: left in place")


class FlushModel(BaseModel):
    flushed: bool
    queued_jobs: int = Field(ge=0)


class DrainModel(BaseModel):
    draining: bool
    in_flight: int = Field(ge=0)
    done: bool = Field(description="no data request in progress")


class PinModel(BaseModel):
    pinned: int = Field(ge=0)
    missing: list[str] = Field(description="names not stored (nothing pinned for them)")
    pinned_bytes: int = Field(ge=0)
    pin_budget_bytes: int = Field(ge=0)


class UnpinModel(BaseModel):
    unpinned: int = Field(ge=0)


class CheckModel(BaseModel):
    ok: bool
    problems: list[str]


class CompactModel(BaseModel):
    disk: bool  # False: the node has no disk tier (nothing to compact)
    moved: int
    written_bytes: int
    segments_freed: int
    legacy_moved: int  # rows moved out of the older layout (frames as LMDB values)


class ErrorModel(BaseModel):
    type: str
    field: str | None
    message: str
