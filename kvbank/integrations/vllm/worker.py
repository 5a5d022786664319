"""The connector's worker half: loads into and saves out of one TP rank's paged cache.

Each TP rank is one kvbank shard (``shard_count`` = TP, ``shard_index`` = rank). A load
redeems the scheduler's lookup by its handle with ``fetch_into(handle, shard=rank)``:
the node translates the shard-0 match to this rank's rows (never loading rank 0's heads),
and the rows from the engine's local hit on are copied once, from the node's segment
straight into this rank's paged cache (:func:`~.blocks.pool_views`). Where the handle
has ended (its ``hold_s``, a node restart), the rank matches and fetches by the load's
page keys with ``fetch_prefix(shard=rank)`` and scatters what *its* shard holds. A rank
whose rows are missing or short fails the load; vLLM unions the ranks' failures and
recomputes.

Lifecycle per step (the metadata is bound by vLLM):

- ``start_load_kv`` — sync loads (one KV-cache group) run here, before the forward;
  async loads go to a loader thread and are reported by ``get_transfer_results``
  (failed ones also in ``failed_recving``). A failed sync load reports its blocks in
  ``get_block_ids_with_load_errors``; both kinds go to the scheduler in
  ``build_connector_worker_meta``.
- ``wait_for_save`` — the pages this step completed are copied out of the cache now
  (vLLM may reuse the blocks after the step) and put on a saver thread, off the
  critical path: one ``put_from`` a request, every KV-cache group in it. ``shutdown``
  drains the saver (a put still running when vLLM kills the worker is lost: a future
  miss, never a wrong row). Pages an audit marks are compared with the stored rows
  first, on the same thread (:mod:`.audit`).

Loads write only blocks vLLM allocated for them: non-null blocks of pages between the
engine's local hit and ``r``. A page vLLM expects that kvbank did not deliver fails the load.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kvbank import Client, Scope
from kvbank.errors import FetchNotFound
from kvbank.integrations.guard import ThreadClients
from kvbank.integrations.vllm.audit import WorkerAudit
from kvbank.integrations.vllm.blocks import (
    BlockAdapter,
    Interior,
    PagePool,
    gather_group,
    pool_views,
    scatter_group,
)
from kvbank.integrations.vllm.config import ConnectorConfig, Guard, registered, safe
from kvbank.integrations.vllm.layout import UnsupportedCache, VllmLayout, layout_for, scope_for
from kvbank.integrations.vllm.metadata import (
    KvbankMetadata,
    KvbankWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvbank.layout import Role

__all__ = ["KvbankWorker", "tp_rank"]

logger = logging.getLogger(__name__)

SHUTDOWN_DRAIN_S = 4.0  # vLLM force-kills workers 5 s after shutdown starts


def tp_rank(vllm_config: Any) -> int:
    """This process's TP rank (0 when vLLM's groups are not set up: tests, TP 1)."""
    if int(vllm_config.parallel_config.tensor_parallel_size) == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class KvbankWorker:
    """See the module docstring. One per TP rank, in the worker's process."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig,
                 rank: int | None = None, interior: Interior | None = None) -> None:
        self.cfg = cfg
        self.rank = tp_rank(vllm_config) if rank is None else rank
        self.vl: VllmLayout = layout_for(vllm_config, kv_cache_config, shard_index=self.rank)
        self.scope: Scope = scope_for(vllm_config, cfg.tenant)
        self.order = str(getattr(kv_cache_config, "kv_cache_layout", None) or "LBHNC")
        if interior is None:
            from vllm.platforms import current_platform

            interior = Interior.SPLIT_N if current_platform.is_cpu() else Interior.SPLIT_C
        self.interior = interior
        self._specs = {name: gs.kv_cache_spec for gs in kv_cache_config.kv_cache_groups
                       for name in gs.layer_names}
        self.adapters: dict[str, BlockAdapter] = {}
        self.cache_views: dict[tuple[int, Role], torch.Tensor] = {}  # fetch_into's pool
        self.pool = PagePool()  # staging for fallback fetches and saves, reused (see PagePool)
        self.guard = Guard(cfg.breaker_s)
        # one Client a thread role (main, loader, saver), each registering the layout once
        self.clients = ThreadClients(cfg.url, timeout_s=cfg.timeout_s, retry_s=cfg.retry_s,
                                     token=cfg.token, layouts=lambda: [self.vl.layout])
        self.audit = WorkerAudit(self.vl, self.scope, self.rank, self.clients, self.guard)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvbank-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvbank-save")
        self._loading: dict[str, Future[bool]] = {}
        self._saves: list[Future[None]] = []
        self._load_errors: set[int] = set()
        self._failed: set[str] = set()

    # ---- caches --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adapters for every layer of the layout; an unknown order or shape is refused."""
        adapters = {}
        for names in self.vl.group_layers:
            for name in names:
                cache = kv_caches.get(name)
                if cache is None:
                    raise UnsupportedCache(f"kv cache of {name}: vLLM registered no tensor for it")
                spec = self._specs[name]
                hv = spec.head_size_v if spec.head_size_v is not None else spec.head_size
                adapters[name] = BlockAdapter.of(name, cache, self.order, self.interior,
                                                 int(spec.head_size), int(hv))
        self.adapters = adapters
        self.cache_views = pool_views(self.vl, adapters)

    # ---- loads ---------------------------------------------------------------------

    def start_load_kv(self, meta: KvbankMetadata) -> None:
        for spec in meta.loads:
            if spec.is_async:
                self._loading[spec.req_id] = self._loader.submit(self._load_guarded, spec)
            elif not self._load_guarded(spec):
                self._failed.add(spec.req_id)
                self._load_errors |= set(self._target_blocks(spec, 0))

    def _load_guarded(self, spec: LoadSpec) -> bool:
        ok = self.guard.call(f"load of {spec.req_id}", lambda: self._load(spec), False)
        if not ok:
            logger.warning("kvbank: rank %d could not load %d tokens of %s; vLLM recomputes",
                           self.rank, spec.tokens - spec.local_tokens, spec.req_id)
        return ok

    def _target_blocks(self, spec: LoadSpec, group: int) -> list[int]:
        """Block ids vLLM expects this load to write in ``group`` (pages local..r)."""
        p = self.vl.tokens_per_page
        ids = spec.block_ids[group] if group < len(spec.block_ids) else ()
        return [ids[k] for k in range(spec.local_tokens // p, min(spec.tokens // p, len(ids)))
                if ids[k] != 0]

    def _load(self, spec: LoadSpec) -> bool:
        """This rank's rows for ``spec`` into its cache; False = the load failed."""
        if spec.handle is not None:
            ok = self._load_by_handle(spec, spec.handle)
            if ok is not None:
                return ok
        return self._load_by_keys(spec)

    def _load_by_handle(self, spec: LoadSpec, handle: str) -> bool | None:
        """``fetch_into`` by the lookup's handle, from the local hit on; None where the
        node no longer keeps it (match by keys instead)."""
        p = self.vl.tokens_per_page
        n = spec.tokens // p
        if n == 0 or not spec.block_ids:
            return False
        ids = {g: [b if b != 0 else None for b in blocks[:n]] for g, blocks in enumerate(spec.block_ids)}
        client = self.clients.get()
        try:
            got = registered(client, self.vl.layout, lambda: client.fetch_into(
                handle, pool=self.cache_views, block_ids=ids, start_page=spec.local_tokens // p, shard=self.rank))
        except FetchNotFound:
            return None
        for g in range(len(self.vl.layout.groups)):
            delivered = {ids[g][j] for j in got.delivered[g]} if g in ids else set()
            if not set(self._target_blocks(spec, g)) <= delivered:
                return False  # vLLM expects a block kvbank did not deliver
        return True

    def _load_by_keys(self, spec: LoadSpec) -> bool:
        """Fetch this rank's rows for ``spec`` by its keys and scatter them."""
        p = self.vl.tokens_per_page
        n = spec.tokens // p
        if n == 0 or len(spec.keys) < n or not spec.block_ids or spec.local_tokens >= spec.tokens:
            return False  # the scheduler could not plan this load
        client = self.clients.get()
        sizes = self.vl.layout.group_page_bytes
        out = {g: self.pool.take(n, size) for g, size in enumerate(sizes)}
        try:
            return self._fetch_scatter(spec, client, out)
        finally:
            for buf in out.values():
                self.pool.give(buf)

    def _fetch_scatter(self, spec: LoadSpec, client: Client, out: dict[int, torch.Tensor]) -> bool:
        p = self.vl.tokens_per_page
        n = spec.tokens // p
        # Only the pages past vLLM's own hit: a row's name is its page key's (the key chains
        # the whole prefix), so keys [lo, n) matched as a prompt of their own name exactly
        # those rows; its page k is page lo + k here. A window group's pages before lo are
        # vLLM's own, never planned for a load.
        lo = spec.local_tokens // p
        got = registered(client, self.vl.layout, lambda: client.fetch_prefix(
            self.vl.layout_id, keys=list(spec.keys[lo:n]), prompt_tokens=spec.tokens - lo * p + 1,
            scope=self.scope, shard=self.rank, out=out))
        if got.tokens + lo * p < spec.tokens or got.result is None:
            return False
        plans: list[tuple[int, list[int], list[int]]] = []
        for g, planned in enumerate(got.match.resume.pages):
            ids = spec.block_ids[g] if g < len(spec.block_ids) else ()
            delivered = {lo + k for k in got.result.delivered[g]}
            rows, blocks, covered = [], [], set()
            for pos, rel in enumerate(planned):
                k = lo + rel
                if k >= n or k >= len(ids) or ids[k] == 0:
                    continue
                if k not in delivered:
                    return False
                rows.append(pos)
                blocks.append(ids[k])
                covered.add(ids[k])
            if not set(self._target_blocks(spec, g)) <= covered:
                return False  # vLLM expects a block kvbank did not deliver
            plans.append((g, rows, blocks))
        for g, rows, blocks in plans:
            if blocks:
                scatter_group(self.vl, self.adapters, g, out[g], blocks, rows)
        return True

    def get_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished receiving, failed receiving) of the async loads done by now."""
        done = {rid for rid, f in self._loading.items() if f.done()}
        failed = set()
        for rid in done:
            ok = self._loading.pop(rid).result()  # _load_guarded never raises
            if not ok:
                failed.add(rid)
        self._failed |= failed
        return done, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_worker_meta(self) -> KvbankWorkerMetadata | None:
        if not self._failed:
            return None
        out, self._failed = KvbankWorkerMetadata(self._failed), set()
        return out

    # ---- saves ---------------------------------------------------------------------

    def wait_for_save(self, meta: KvbankMetadata) -> None:
        self._saves = [f for f in self._saves if not f.done()]
        for spec in meta.saves:
            job = self.guard.call(f"save of {spec.req_id}", partial(self._gather, spec), None)
            if job is None:
                continue
            bound = meta.audits.get(spec.req_id, 0)
            for g, first, pages in job.runs:
                if bound > first:  # compared with the stored rows before the put (.audit)
                    self._saves.append(self._saver.submit(self.audit.check, spec, g, first, pages, bound))
            self._saves.append(self._saver.submit(self._put, spec, job))

    def _gather(self, spec: SaveSpec) -> _Gathered | None:
        """The step's pages of every group copied out of the cache (vLLM may reuse the
        blocks after the step) into reused buffers, as a pool ``put_from`` takes: per group,
        canonical pages viewed per buffer, and the page's row in them (None: vLLM's null
        block, skipped); plus the runs of consecutive pages an audit compares."""
        out = _Gathered({}, {}, [], [])
        sizes = self.vl.layout.group_page_bytes
        try:
            for g, ids in enumerate(spec.block_ids):
                real = [b for b in ids if b != 0]
                if not real:
                    continue
                buf = self.pool.take(len(real), sizes[g])
                out.bufs.append(buf)
                pages = gather_group(self.vl, self.adapters, g, real, buf)
                out.views.update(self.vl.layout.views(pages, g))
                k = iter(range(len(real)))
                out.rows[g] = [None if b == 0 else next(k) for b in ids]
                row = 0
                for start, run in _runs(ids):
                    out.runs.append((g, spec.first_page + start, pages[row : row + len(run)]))
                    row += len(run)
        except BaseException:
            self._give(out)
            raise
        if not out.rows:
            self._give(out)
            return None
        return out

    def _give(self, job: _Gathered) -> None:
        for buf in job.bufs:
            self.pool.give(buf)
        job.bufs.clear()

    def _put(self, spec: SaveSpec, job: _Gathered) -> None:
        def put() -> None:
            client = self.clients.get()
            registered(client, self.vl.layout, lambda: client.put_from(
                self.vl.layout_id, pool=job.views, block_ids=job.rows, keys=list(spec.keys),
                first_page=spec.first_page, scope=self.scope, shard=self.rank))

        try:
            self.guard.call(f"save of {spec.req_id}", put, None)
        finally:
            self._give(job)

    def drain(self, timeout_s: float = SHUTDOWN_DRAIN_S) -> None:
        """Wait (bounded) for the saves still running."""
        for f in self._saves:
            try:
                f.result(timeout=timeout_s)
            except Exception as exc:  # a put past the deadline is a future miss
                logger.warning("kvbank: a save did not finish at shutdown: %s", exc)
        self._saves = []

    def shutdown(self) -> None:
        self.drain()
        self._saver.shutdown(wait=False)
        self._loader.shutdown(wait=False)
        safe("close", self.clients.close, None)


@dataclass
class _Gathered:
    """A save's pages copied out of the cache: the pool ``put_from`` takes (``views``,
    ``rows``), the runs an audit compares (group, first page, pages) and the reused
    buffers they live in (given back after the put)."""

    views: dict[tuple[int, Role], torch.Tensor]
    rows: dict[int, list[int | None]]
    runs: list[tuple[int, int, torch.Tensor]]
    bufs: list[torch.Tensor]


def _runs(ids: Sequence[int]) -> list[tuple[int, list[int]]]:
    """Runs of non-null block ids: (offset of the run's first page, its block ids)."""
    runs: list[tuple[int, list[int]]] = []
    for k, b in enumerate(ids):
        if b == 0:
            continue
        if runs and runs[-1][0] + len(runs[-1][1]) == k:
            runs[-1][1].append(b)
        else:
            runs.append((k, [b]))
    return runs
