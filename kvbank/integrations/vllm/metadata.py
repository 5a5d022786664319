"""What crosses from the scheduler half to the worker half, and back (both picklable).

- :class:`LoadSpec` — one request's load: the handle of the scheduler's lookup on the
  node (each rank loads by it, for its *own* shard: the node translates the shard-0 match),
  its page keys up to the bound ``tokens`` (to match again where the handle has ended),
  the engine's local hit, and vLLM's block ids per group.
- :class:`SaveSpec` — one request's newly completed pages: the key chain up to them, the
  first page, and the block ids of those pages per group (0 = vLLM's null block: skip).
- :class:`KvbankMetadata` — the step's loads and saves (and which saves are audited).
- :class:`KvbankWorkerMetadata` — requests whose load failed on some rank (sync or
  async), unioned over ranks: the scheduler never offers them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["KvbankMetadata", "KvbankWorkerMetadata", "LoadSpec", "SaveSpec"]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    req_id: str
    keys: tuple[bytes, ...]  # page keys [0, tokens / P), as kvbank page keys (32 bytes)
    tokens: int  # r: the engine resumes at r once the load is in
    local_tokens: int  # the engine's own block-aligned hit: pages below it are not written
    block_ids: tuple[tuple[int, ...], ...]  # per group, vLLM's block ids of the request
    is_async: bool
    handle: str | None = None  # the node's kept match of the lookup (None: match by keys)


@dataclass(frozen=True, slots=True)
class SaveSpec:
    req_id: str
    keys: tuple[bytes, ...]  # page keys [0, first_page + pages)
    first_page: int
    block_ids: tuple[tuple[int, ...], ...]  # per group, block ids of pages [first, first + n)


@dataclass
class KvbankMetadata(KVConnectorMetadata):  # type: ignore[misc,unused-ignore]
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # requests whose saves this step are audited (.audit): req id -> pages [0, n) to compare
    audits: dict[str, int] = field(default_factory=dict)


@dataclass
class KvbankWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc,unused-ignore]
    failed: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvbankWorkerMetadata):
            return KvbankWorkerMetadata(self.failed | other.failed)
        return self
