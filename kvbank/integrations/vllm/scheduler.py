"""The connector's scheduler half: lookups, load plans, save plans, failure memory.

Lifecycle of a request, as vLLM's scheduler drives it:

1. ``get_num_new_matched_tokens`` — one kvbank ``match`` by vLLM's block hashes as page
   keys (shard 0: the scheduler speaks for every rank; each rank checks its own shard
   when it loads). Side-effect free: nothing is leased. Answers ``r - local`` tokens,
   async when the model has more than one KV-cache group (see :mod:`.config`).
2. ``update_state_after_alloc`` — with external tokens, a :class:`LoadSpec` (keys up to
   ``r``, the local hit, vLLM's block ids) goes into the next step's metadata.
3. ``build_connector_meta`` — the loads, and a :class:`SaveSpec` for every prompt page a
   scheduled request completes in this step (block ids tracked from the scheduler output:
   new requests' lists, appended blocks, resumed requests' replaced lists).
4. ``update_connector_output`` — requests whose load failed on any rank are remembered
   and never offered again (vLLM resets a failed async load to 0 computed tokens and asks
   again: answering from the same rows would loop forever).
5. ``request_finished`` — forget the request; blocks are never held (saves copy the pages
   out inside the step that computed them).

A sampled share of hits is declined and audited instead (``audit_fraction``, :mod:`.audit`).

Opt-out per request: ``SamplingParams(extra_args={"kv_transfer_params": {"kvbank": False}})``
(neither load nor save), or ``{"kvbank_load": False}`` / ``{"kvbank_save": False}``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from kvbank import Client, Scope
from kvbank.integrations.vllm.audit import SchedulerAudit
from kvbank.integrations.vllm.config import ConnectorConfig, Guard, registered, safe
from kvbank.integrations.vllm.layout import VllmLayout, layout_for, page_keys_of, scope_for
from kvbank.integrations.vllm.metadata import (
    KvbankMetadata,
    KvbankWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvbank.keys import engine_keys

__all__ = ["KvbankScheduler", "wants"]

logger = logging.getLogger(__name__)


def wants(request: Any, what: str) -> bool:
    """Whether ``request`` lets kvbank ``load`` or ``save`` (its kv_transfer_params)."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict):
        return True
    return params.get("kvbank", True) is not False and params.get(f"kvbank_{what}", True) is not False


@dataclass
class _Req:
    request: Any
    block_ids: list[list[int]] = field(default_factory=list)
    saved_pages: int = 0  # prompt pages [0, saved_pages) are stored (or were loaded)


@dataclass(frozen=True, slots=True)
class _Lookup:
    local: int  # the block-aligned local hit the answer was for
    tokens: int  # r


class KvbankScheduler:
    """See the module docstring. One per engine, in the scheduler's process."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self.vl: VllmLayout = layout_for(vllm_config, kv_cache_config, shard_index=0)
        self.scope: Scope = scope_for(vllm_config, cfg.tenant)
        groups = len(self.vl.layout.groups)
        self.load_async = groups > 1 if cfg.load_async is None else cfg.load_async
        if groups > 1 and not self.load_async:
            logger.warning("kvbank: load_async=false with %d KV-cache groups: vLLM cannot "
                           "recover a failed sync load of such a model; loading async", groups)
            self.load_async = True
        algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
        if algo.startswith("xxhash") and "PYTHONHASHSEED" not in os.environ:
            logger.warning("kvbank: prefix_caching_hash_algo=%s without PYTHONHASHSEED: vLLM's "
                           "hash chain is random per process, so no other engine will match "
                           "this one's pages", algo)
        self.guard = Guard(cfg.breaker_s)
        self._client: Client | None = None
        self._registered = False
        self._reqs: dict[str, _Req] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._loads: list[LoadSpec] = []
        self._failed: set[str] = set()
        self.stats = {"lookups": 0, "hit_tokens": 0, "loads_failed": 0, "saves": 0}
        self.audit = SchedulerAudit(cfg.audit_fraction, self.vl.tokens_per_page)

    # ---- kvbank --------------------------------------------------------------------

    def _ready(self) -> Client:
        if self._client is None:
            self._client = Client(self.cfg.url, timeout_s=self.cfg.timeout_s,
                                  retry_s=self.cfg.retry_s, token=self.cfg.token)
        if not self._registered:
            self._client.register(self.vl.layout)
            self._registered = True
        return self._client

    def keys(self, request: Any, pages: int) -> list[bytes]:
        """The first ``pages`` page keys of ``request`` as kvbank 32-byte keys."""
        raw = page_keys_of(request.block_hashes, self.vl, pages)
        return engine_keys(raw, self.vl.layout_id, self.scope) if raw else []

    def _match(self, request: Any) -> int:
        """r for ``request``: the bound kvbank can resume it at (shard 0)."""
        t = int(request.num_tokens)
        p = self.vl.tokens_per_page
        keys = self.keys(request, t // p)
        if not keys:
            return 0
        prompt = min(t, len(keys) * p + p - 1)
        client = self._ready()
        m = registered(client, self.vl.layout, lambda: client.match(
            self.vl.layout_id, keys=keys, prompt_tokens=prompt, scope=self.scope, shard=0))
        return int(m.resume.tokens)

    # ---- vLLM scheduler calls ------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._reqs.setdefault(request.request_id, _Req(request))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        self._reqs.setdefault(rid, _Req(request))
        if rid in self._failed or not wants(request, "load"):
            return 0, False
        self.stats["lookups"] += 1
        r = self.guard.call("match", lambda: self._match(request), 0)
        if r <= num_computed_tokens or self.audit.declines(request, r):
            self._lookups.pop(rid, None)  # a miss, or a hit declined for an audit (.audit)
            return 0, False
        self._lookups[rid] = _Lookup(num_computed_tokens, r)
        return r - num_computed_tokens, self.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load vLLM just allocated blocks for. Once vLLM counts external tokens a
        load spec must reach the worker: one it cannot serve (no keys) fails there, and
        vLLM recomputes; a missing one would leave the blocks unwritten."""
        rid = request.request_id
        found = self._lookups.pop(rid, None)
        if num_external_tokens <= 0:
            return
        p = self.vl.tokens_per_page
        local = found.local if found is not None else 0
        r = local + int(num_external_tokens)
        keys: tuple[bytes, ...] = ()
        if found is None or r % p or r > found.tokens:
            logger.warning("kvbank: request %s: vLLM allocated %d external tokens, the lookup "
                           "answered %s; the load will fail and vLLM recomputes", rid,
                           num_external_tokens, None if found is None else found.tokens - local)
        else:
            keys = safe("page keys", lambda: tuple(self.keys(request, r // p)), keys)
        try:
            ids = tuple(tuple(int(b) for b in g) for g in blocks.get_block_ids())
        except Exception as exc:  # never into vLLM; an empty plan fails on the worker
            logger.warning("kvbank: request %s: block ids unreadable: %s", rid, exc)
            ids = ()
        self._loads.append(LoadSpec(rid, keys, r, local, ids, self.load_async))
        req = self._reqs.setdefault(rid, _Req(request))
        req.saved_pages = max(req.saved_pages, r // p)  # those pages are in kvbank already
        self.stats["hit_tokens"] += r - local

    def take_loads(self) -> list[LoadSpec]:
        """The planned loads, once (build_connector_meta sends them)."""
        out, self._loads = self._loads, []
        return out

    def build_connector_meta(self, out: Any) -> KvbankMetadata:
        meta = KvbankMetadata(loads=self.take_loads())
        # the loads are promised to vLLM: whatever goes wrong in planning saves, they go out
        safe("planning saves", lambda: self._plan_saves(meta, out), None)
        meta.audits = safe("audit marks", lambda: self.audit.marks(meta.saves), {})
        return meta

    def _plan_saves(self, meta: KvbankMetadata, out: Any) -> None:
        scheduled: dict[str, int] = dict(out.num_scheduled_tokens)
        for new in out.scheduled_new_reqs:
            req = self._reqs.get(new.req_id)
            if req is None:
                continue
            req.block_ids = [list(g) for g in new.block_ids]
            self._plan_save(meta, new.req_id, req, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = out.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, rid in enumerate(cached.req_ids):
            req = self._reqs.get(rid)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in resumed:
                req.block_ids = [list(g) for g in new_ids] if new_ids is not None else req.block_ids
            elif new_ids is not None:
                for g, more in enumerate(new_ids):
                    while len(req.block_ids) <= g:
                        req.block_ids.append([])
                    req.block_ids[g].extend(more)
            self._plan_save(meta, rid, req, cached.num_computed_tokens[i] + scheduled.get(rid, 0))

    def _plan_save(self, meta: KvbankMetadata, rid: str, req: _Req, done: int) -> None:
        """A SaveSpec for the prompt pages ``done`` tokens complete that are not saved yet."""
        p = self.vl.tokens_per_page
        end = min(done, int(req.request.num_prompt_tokens)) // p
        first = req.saved_pages
        if end <= first or not wants(req.request, "save"):
            return
        none: tuple[bytes, ...] = ()
        keys = safe("page keys", lambda: tuple(self.keys(req.request, end)), none)
        if len(keys) != end:  # block hashes not there yet: try again next step
            return
        ids = tuple(tuple(g[first:end]) if len(g) >= end else () for g in req.block_ids)
        meta.saves.append(SaveSpec(rid, keys, first, ids))
        req.saved_pages = end
        self.stats["saves"] += 1

    def update_connector_output(self, output: Any) -> None:
        failed = set(getattr(output, "failed_recving", None) or ())
        wm = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(wm, KvbankWorkerMetadata):
            failed |= wm.failed
        if failed:
            self.stats["loads_failed"] += len(failed - self._failed)
            logger.warning("kvbank: load failed for %d request(s); they recompute and are "
                           "not offered kvbank pages again", len(failed))
            self._failed |= failed
            for rid in failed:  # its pages are recomputed: store them again
                req = self._reqs.get(rid)
                if req is not None:
                    req.saved_pages = 0

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._reqs.pop(rid, None)
        self._lookups.pop(rid, None)
        self._failed.discard(rid)
        self.audit.forget(rid)
        return False, None

    def shutdown(self) -> None:
        if self._client is not None:
            safe("close", self._client.close, None)
            self._client = None
