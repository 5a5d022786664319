"""``KvbankHiCacheStorage``: kvbank as SGLang's HiCache storage backend (its L3 tier).

SGLang 0.5.23 loads it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name":"kvbank",
      "module_path":"kvbank.integrations.sglang","class_name":"KvbankHiCacheStorage",
      "interface_v1":1,"kvbank_url":"http://127.0.0.1:7410"}'

Keys of the extra config this backend reads (all optional; SGLang's own —
``backend_name``, ``module_path``, ``class_name``, ``interface_v1`` — are its):

| key | default | meaning |
| --- | --- | --- |
| ``kvbank_url`` (or ``url``) | ``http://127.0.0.1:7410`` | the ``kvbank serve`` node of this host |
| ``tenant`` | ``""`` | goes into the scope: tenants never share pages |
| ``token`` | none | a tenant token, when the node requires one |
| ``timeout_s`` | 5 | one kvbank call's socket timeout |
| ``retry_s`` | 0.5 | how long idempotent calls are retried |
| ``breaker_s`` | 10 | after a node failure, kvbank is skipped (every call a miss) this long |

Keys: SGLang's page hash (hex SHA-256, chained over the prompt's pages and seeded by the
request's extra key, LoRA and cache salt) is the kvbank page key as it is; the scope is
``Scope(tenant="sglang/<tenant>")``; each host pool is a kvbank layout of its own
(:mod:`.pools`: the model name with its storage format tag, dtype, layout, layer range).
Row names hold only a page's own key, so SGLang's batches (a span of the chain) are
matched as they come; ``prefix_keys[-1]``, when SGLang passes it, is stored as the chain's
parent (kvbank evicts a chain from its tail).

The calls SGLang makes, and what each does:

- ``batch_exists`` — one ``match`` of the KV layout: the leading pages present.
- ``batch_exists_v2`` — one ``match`` a pool: ``ALL_PAGES`` pools (attention sidecars)
  count their leading pages, ``TRAILING_PAGES`` pools the pages ``p - n .. p - 1`` (or the
  snapshot at ``p``, a state pool: its match's ``boundaries``); ``restorable_prefix_pages``
  are the KV match's ``boundaries`` that every pool allows.
- ``batch_get_v1`` / ``batch_set_v1`` — ``fetch_into`` (of the hit query's match, when
  the load follows one: :class:`_Recent`; else a new ``match``) / ``put_from`` between
  the node's memory and the host pool's slots (on the node's host: its shared memory, one
  copy a page, under a READ or WRITE lease taken and ended inside the call; elsewhere
  kvbank's streamed path).
- ``batch_get_v2`` / ``batch_set_v2`` — the same per sidecar pool; a state pool's snapshot
  goes through a staging buffer (SGLang's slot is several tensors) with ``fetch_prefix``
  and ``put_state``.
- ``batch_get`` / ``batch_set`` (``interface_v1`` off) and ``get``/``set``/``exists`` —
  the same, through a batch of SGLang's flat pages.
- ``clear`` — kvbank is a shared store: it is not emptied by one engine (False, logged).
  ``get_stats`` — SGLang's ``StorageMetrics`` since the last call. ``close`` — the clients.

Failures: every kvbank error, a dead node or a timeout is a miss (``False``, ``None`` or 0
pages) with a warning, never an exception into SGLang; a node found unreachable is skipped
for ``breaker_s`` (:class:`~kvbank.integrations.guard.Guard`). Threads: SGLang calls from
its prefetch, IO and backup threads at once; each thread has its own client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from kvbank.client.engine import PreparedLoad
from kvbank.errors import InvalidInput
from kvbank.integrations.guard import Guard, ThreadClients, registered, safe
from kvbank.integrations.settings import (
    CONNECTION_KEYS,
    DEFAULT_BREAKER_S,
    DEFAULT_RETRY_S,
    DEFAULT_URL,
    Reader,
)
from kvbank.integrations.sglang.pools import PoolMap, UnsupportedPool, pool_map
from kvbank.keys import Scope
from kvbank.results import Match

__all__ = ["KvbankHiCacheStorage", "StorageSettings"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
KV = "kv"
# the extra config's keys that are SGLang's (the factory's and the controller's)
RECENT_S = 10.0  # how long a hit query's match serves the load after it
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})


@dataclass(frozen=True, slots=True)
class StorageSettings:
    """The backend's keys of SGLang's ``--hicache-storage-backend-extra-config``."""

    url: str = DEFAULT_URL
    tenant: str = ""
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    retry_s: float = DEFAULT_RETRY_S
    breaker_s: float = DEFAULT_BREAKER_S

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> StorageSettings:
        r = Reader(extra, "hicache extra config")
        # other backends' keys are harmless there; a typo of ours is worth a word
        r.refuse_unknown(CONNECTION_KEYS, foreign=SGLANG_KEYS, warn_only=True)
        return cls(url=r.url(), tenant=r.text("tenant", ""), token=r.token(),
                   timeout_s=r.seconds("timeout_s", DEFAULT_TIMEOUT_S, positive=True),
                   retry_s=r.seconds("retry_s", DEFAULT_RETRY_S),
                   breaker_s=r.seconds("breaker_s", DEFAULT_BREAKER_S))


def _key(k: str) -> bytes:
    """SGLang's hex page hash as kvbank's page key (SHA-256: 32 bytes, used as it is)."""
    try:
        return bytes.fromhex(k)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"keys: expected SGLang's hex page hashes, got {k!r}") from exc


class _Metrics:
    """Pages moved and bandwidth per call since SGLang last asked (``get_stats``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prefetch_pgs: list[int] = []
        self.backup_pgs: list[int] = []
        self.prefetch_bandwidth: list[float] = []
        self.backup_bandwidth: list[float] = []

    def add(self, get: bool, pages: int, nbytes: int, seconds: float) -> None:
        gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        with self._lock:
            (self.prefetch_pgs if get else self.backup_pgs).append(pages)
            (self.prefetch_bandwidth if get else self.backup_bandwidth).append(gbps)

    def drain(self) -> tuple[list[int], list[int], list[float], list[float]]:
        with self._lock:
            out = (self.prefetch_pgs, self.backup_pgs, self.prefetch_bandwidth, self.backup_bandwidth)
            self.prefetch_pgs, self.backup_pgs = [], []
            self.prefetch_bandwidth, self.backup_bandwidth = [], []
        return out


class _Recent:
    """The KV matches of the latest hit queries, for the load that follows each: SGLang asks
    ``batch_exists`` for a span, then loads (a prefix of) the same span; the load reuses the
    query's match instead of matching again (a match is a pure query: rows gone since are
    not delivered, a miss). Each is used once, and only within ``RECENT_S``.

    On the node's host a hit query is a prepared load (``Client.prepare_load``: its match
    and a READ lease on the hit's rows, in one call), so the load is only the copies. At
    most ``held`` of them keep their leases here (the oldest beyond are handed back by
    :meth:`add`); one never loaded (SGLang revoked the prefetch) is handed back by
    :meth:`take` or :meth:`add` when found stale, else its lease ends at its ttl."""

    def __init__(self, keep: int = 64, held: int = 8) -> None:
        self._keep, self._held = keep, held
        self._lock = threading.Lock()
        self._by_first: OrderedDict[tuple[bytes, bytes], tuple[float, tuple[bytes, ...], Any]] = OrderedDict()

    def add(self, layout_id: bytes, keys: Sequence[bytes], match: Any) -> list[PreparedLoad]:
        """Keep ``match`` (a Match or a PreparedLoad); the prepared loads put out by it,
        whose leases the caller gives back."""
        if not keys:
            return [match] if isinstance(match, PreparedLoad) else []
        now = time.monotonic()
        with self._lock:
            out = self._by_first.pop((layout_id, keys[0]), None)
            dropped = [] if out is None else [out[2]]
            self._by_first[(layout_id, keys[0])] = (now, tuple(keys), match)
            while len(self._by_first) > self._keep:
                dropped.append(self._by_first.popitem(last=False)[1][2])
            held = [k for k, (t, _, m) in self._by_first.items() if isinstance(m, PreparedLoad) and m.doc is not None]
            for k in held[: max(0, len(held) - self._held)]:
                dropped.append(self._by_first.pop(k)[2])
            for k in [k for k, (t, _, _) in self._by_first.items() if now - t > RECENT_S]:
                dropped.append(self._by_first.pop(k)[2])
        return [m for m in dropped if isinstance(m, PreparedLoad)]

    def take(self, layout_id: bytes, keys: Sequence[bytes]) -> tuple[Any, PreparedLoad | None]:
        """The match of a query whose keys start with ``keys`` (None: none recent), and a
        prepared load found stale instead (its lease for the caller to give back)."""
        if not keys:
            return None, None
        with self._lock:
            got = self._by_first.pop((layout_id, keys[0]), None)
        if got is None or time.monotonic() - got[0] > RECENT_S or got[1][: len(keys)] != tuple(keys):
            return None, (got[2] if got is not None and isinstance(got[2], PreparedLoad) else None)
        return got[2], None


class KvbankHiCacheStorage(HiCacheStorage):  # type: ignore[misc,unused-ignore]
    """See the module docstring. One per TP rank, in that rank's scheduler process."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings = StorageSettings.from_extra(storage_config.extra_config)
        self.scope = Scope(tenant=f"sglang/{self.settings.tenant}")
        self.guard = Guard(self.settings.breaker_s)
        self._lock = threading.Lock()
        self._pools: dict[str, PoolMap] = {}
        self.metrics = _Metrics()
        self.recent = _Recent()
        s = self.settings
        self.clients = ThreadClients(s.url, timeout_s=s.timeout_s, retry_s=s.retry_s, token=s.token,
                                     layouts=self._layouts)

    # ---- pools -----------------------------------------------------------------------

    def _layouts(self) -> list[Any]:
        with self._lock:
            return [pm.layout for pm in self._pools.values()]

    def _add_pool(self, name: str, host: Any) -> None:
        with self._lock:
            kv = self._pools.get(KV)
            pm = pool_map(name, host, self.storage_config,
                          kv_page_size=None if kv is None else kv.tokens_per_page)
            self._pools[name] = pm
        logger.debug("kvbank: pool %s registered as layout %s", name, pm.layout_id.hex()[:12])

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._add_pool(KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == KV and host_pool is getattr(self, "mem_pool_host", None):
            return  # the anchor, registered already
        self._add_pool(name, host_pool)

    def _pool(self, name: Any) -> PoolMap:
        with self._lock:
            pm = self._pools.get(str(name))
        if pm is None:
            raise UnsupportedPool(f"pool {str(name)!r} was never registered with the kvbank backend")
        return pm

    @property
    def writer(self) -> bool:
        """Whether this rank stores KV pages (MLA's latent: one writer for all ranks)."""
        return bool(self.storage_config.is_storage_writer)

    # ---- kvbank calls ----------------------------------------------------------------

    def _match(self, pm: PoolMap, keys: Sequence[bytes]) -> Any:
        """The pool's rows of ``keys`` (a span of the chain matched as a prompt of its own:
        a row's name holds only its page key), every page usable (``prompt_tokens``)."""
        c = self.clients.get()
        return registered(c, pm.layout, lambda: c.match(
            pm.layout_id, keys=list(keys), prompt_tokens=len(keys) * pm.tokens_per_page + 1,
            scope=self.scope, shard=pm.shard))

    def _prepared(self, pm: PoolMap, keys: Sequence[bytes]) -> Match:
        """A hit query of ``keys`` as a prepared load (its match, and on the node's host
        its lease: ``Client.prepare_load``), kept for the load SGLang makes next; its match."""
        c = self.clients.get()
        p: PreparedLoad = registered(c, pm.layout, lambda: c.prepare_load(
            pm.layout_id, keys=list(keys), prompt_tokens=len(keys) * pm.tokens_per_page + 1,
            scope=self.scope, shard=pm.shard, ttl_s=RECENT_S))
        for stale in self.recent.add(pm.layout_id, keys, p):
            c.release_prepared(stale)
        return p.match

    def _leading(self, pm: PoolMap, keys: Sequence[bytes]) -> int:
        """The leading pages of ``keys`` present."""
        if not keys:
            return 0
        return int(self._prepared(pm, keys).resume.tokens) // pm.tokens_per_page

    def _chain(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None
               ) -> tuple[list[bytes], int]:
        """``keys`` as page keys, after their parent when SGLang passed the prefix; and the
        index of ``keys[0]`` in that list."""
        kb = [_key(k) for k in keys]
        prefix = extra_info.prefix_keys if extra_info is not None else None
        if prefix:
            return [_key(prefix[-1]), *kb], 1
        return kb, 0

    def _load(self, pm: PoolMap, keys: Sequence[bytes], blocks: list[int], pool: Any) -> list[bool]:
        """Rows of ``keys`` into ``pool``'s ``blocks``; per page, whether it arrived whole."""
        if not keys:
            return []
        t0 = time.perf_counter()
        c = self.clients.get()
        m, stale = self.recent.take(pm.layout_id, keys)
        if stale is not None:
            c.release_prepared(stale)
        if isinstance(m, PreparedLoad):
            if m.match.resume.tokens == 0:
                return [False] * len(keys)
            # its pages past the load's keys (a prefix of the query's) have no block: not moved
            prepared = m
            got = registered(c, pm.layout, lambda: c.load_prepared(prepared, pool=pool, block_ids={0: blocks}))
            ok = set(got.delivered[0])
            self.metrics.add(True, len(ok), int(got.nbytes), time.perf_counter() - t0)
            return [i in ok for i in range(len(keys))]
        if m is None:
            m = self._match(pm, keys)
        elif m.resume.tokens > len(keys) * pm.tokens_per_page:  # the load is a prefix of the query
            m = c.resume_at(m, len(keys) * pm.tokens_per_page)
        if m.resume.tokens == 0:
            return [False] * len(keys)
        got = registered(c, pm.layout, lambda: c.fetch_into(m, pool=pool, block_ids={0: blocks},
                                                            shard=pm.shard))
        ok = set(got.delivered[0])
        out = [i in ok for i in range(len(keys))]
        self.metrics.add(True, len(ok), int(got.nbytes), time.perf_counter() - t0)
        return out

    def _store(self, pm: PoolMap, chain: list[bytes], first: int, blocks: list[int], pool: Any) -> None:
        t0 = time.perf_counter()
        c = self.clients.get()
        registered(c, pm.layout, lambda: c.put_from(
            pm.layout_id, pool=pool, block_ids={0: blocks}, keys=chain, first_page=first,
            scope=self.scope, shard=pm.shard))
        self.metrics.add(False, len(blocks), len(blocks) * pm.layout.group_page_bytes[0],
                         time.perf_counter() - t0)

    # ---- KV pages --------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self.guard.call("exists", lambda: self._leading(self._pool(KV), [_key(k) for k in keys]), 0)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        def get() -> list[bool]:
            pm = self._pool(KV)
            return self._load(pm, [_key(k) for k in keys], pm.blocks(host_indices, len(keys)), pm.views)

        return self.guard.call("get", get, [False] * len(keys))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        if not self.writer:
            return [True] * len(keys)  # another rank stores the replicated latent

        def put() -> list[bool]:
            pm = self._pool(KV)
            chain, first = self._chain(keys, extra_info)
            self._store(pm, chain, first, pm.blocks(host_indices, len(keys)), pm.views)
            return [True] * len(keys)

        return self.guard.call("set", put, [False] * len(keys))

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Pages into SGLang's flat pages ``target_locations`` (one staging copy: they are
        separate tensors); each filled page, or None from the first that is missing."""
        if not keys:
            return []

        def get() -> list[torch.Tensor | None]:
            pm = self._pool(KV)
            targets = list(target_locations) if target_locations is not None else \
                [pm.host.get_dummy_flat_data_page() for _ in keys]
            staging = torch.empty((len(keys), targets[0].numel()), dtype=pm.dtype)
            ok = self._load(pm, [_key(k) for k in keys], list(range(len(keys))), pm.flat_views(staging))
            out: list[torch.Tensor | None] = []
            for i, t in enumerate(targets):
                if not ok[i]:
                    break
                t.view(-1).copy_(staging[i])
                out.append(t)
            return out + [None] * (len(keys) - len(out))

        return self.guard.call("get", get, [None] * len(keys))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """SGLang's flat pages ``values`` stored (stacked first: one copy); True when all were."""
        if not keys:
            return True
        if not self.writer:
            return True

        def put() -> bool:
            pm = self._pool(KV)
            if values is None or len(values) != len(keys):
                raise InvalidInput(f"values: expected {len(keys)} flat pages")
            pages = torch.stack([v.reshape(-1) for v in values])
            self._store(pm, [_key(k) for k in keys], 0, list(range(len(keys))), pm.flat_views(pages))
            return True

        return self.guard.call("set", put, False)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    # ---- sidecar pools ---------------------------------------------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        return self.guard.call("exists", lambda: self._exists_v2(keys, pool_transfers or []),
                               PoolTransferResult(0, {}, []))

    def _exists_v2(self, keys: list[str], transfers: list[PoolTransfer]) -> PoolTransferResult:
        kb = [_key(k) for k in keys]
        kv = self._pool(KV)
        p = kv.tokens_per_page
        m = self._prepared(kv, kb) if kb else None
        kv_pages = 0 if m is None else int(m.resume.tokens) // p
        hits: dict[str, int] = {KV: kv_pages} if kv_pages else {}
        restorable = [b // p for b in (m.boundaries if m is not None else ()) if b // p <= kv_pages]
        for t in transfers:
            if not restorable:
                break
            pm = self._pool(t.name)
            sm = self._match(pm, kb[:kv_pages])
            present = [tier is not None for tier in sm.tiers[0]]
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                allowed = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                n = max(1, len(t.keys) if t.keys else 1)
                if pm.is_state and n == 1:  # a snapshot at p: the state match's boundaries
                    allowed = {b // p for b in sm.boundaries}
                else:
                    allowed = {q for q in range(1, kv_pages + 1) if all(present[max(0, q - n):q])}
                boundary = max(allowed, default=0)
            else:
                raise UnsupportedPool(f"pool {str(t.name)!r}: hit policy {t.hit_policy} is not "
                                      "supported by the kvbank backend")
            if boundary:
                hits[str(t.name)] = boundary
            restorable = [q for q in restorable if q in allowed]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            n = len(t.keys or [])
            out[str(t.name)] = self.guard.call(f"get of pool {t.name}", partial(self._get_v2, t), [False] * n)
        return out

    def _get_v2(self, t: PoolTransfer) -> list[bool]:
        pm = self._pool(t.name)
        keys = [_key(k) for k in t.keys or []]
        blocks = pm.blocks(t.host_indices, len(keys))
        if not pm.is_state:
            return self._load(pm, keys, blocks, pm.views)
        out: list[bool] = []
        for k, slot in zip(keys, blocks, strict=True):
            if out and not out[-1]:
                out.append(False)  # SGLang counts the leading hits only
                continue
            out.append(self._get_state(pm, k, slot * pm.slot_pages))
        return out

    def _get_state(self, pm: PoolMap, key: bytes, slot: int) -> bool:
        t0 = time.perf_counter()
        c = self.clients.get()
        buf = torch.empty((1, pm.layout.group_page_bytes[0]), dtype=torch.uint8)
        got = registered(c, pm.layout, lambda: c.fetch_prefix(
            pm.layout_id, keys=[key], prompt_tokens=pm.tokens_per_page + 1, scope=self.scope,
            shard=pm.shard, out={0: buf}))
        if got.tokens < pm.tokens_per_page:
            return False
        size = pm.layout.regions[0][0].nbytes  # the page is padded to a cache line
        pm.host.set_from_flat_data_page(slot, buf[0, :size])
        self.metrics.add(True, 1, size, time.perf_counter() - t0)
        return True

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            n = len(t.keys or [])
            out[str(t.name)] = self.guard.call(f"set of pool {t.name}", partial(self._set_v2, t, extra_info),
                                               [False] * n)
        return out

    def _set_v2(self, t: PoolTransfer, extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        pm = self._pool(t.name)
        keys = list(t.keys or [])
        if not keys:
            return []
        blocks = pm.blocks(t.host_indices, len(keys))
        chain, first = self._chain(keys, extra_info)
        if not pm.is_state:
            if pm.layout.shard_count == 1 and not self.writer:
                return [True] * len(keys)
            self._store(pm, chain, first, blocks, pm.views)
            return [True] * len(keys)
        c = self.clients.get()
        page = torch.zeros(pm.layout.group_page_bytes[0], dtype=torch.uint8)  # padding stays 0
        size = pm.layout.regions[0][0].nbytes
        for j, slot in enumerate(blocks):
            t0 = time.perf_counter()
            state = pm.host.get_data_page(slot * pm.slot_pages, flat=True)
            page[:size].copy_(state.contiguous().view(torch.uint8).reshape(-1))
            data = page
            upto = chain[: first + j + 1]  # the snapshot after page j: named by its key
            registered(c, pm.layout, partial(c.put_state, pm.layout_id, keys=upto, group=0, state=data,
                                             at=len(upto) * pm.tokens_per_page, scope=self.scope,
                                             shard=pm.shard))
            self.metrics.add(False, 1, data.numel(), time.perf_counter() - t0)
        return [True] * len(keys)

    # ---- admin -----------------------------------------------------------------------

    def clear(self) -> bool:
        """kvbank's rows are shared by every engine of the fleet: one engine's cache flush
        does not empty them (the node's admin API evicts)."""
        logger.warning("kvbank: clear() leaves the kvbank node's rows in place (they are "
                       "shared); evict through the node's admin API")
        return False

    def get_stats(self) -> Any:
        prefetch, backup, pbw, bbw = self.metrics.drain()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        return StorageMetrics(prefetch_pgs=prefetch, backup_pgs=backup, prefetch_bandwidth=pbw,
                              backup_bandwidth=bbw)

    def close(self) -> None:
        safe("close", self.clients.close, None)
