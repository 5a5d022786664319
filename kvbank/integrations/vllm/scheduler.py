"""The connector's scheduler half: lookups, load plans, save plans, failure memory.

Lifecycle of a request, as vLLM's scheduler drives it:

1. ``get_num_new_matched_tokens`` — answered from one batched lookup (``match_many``, by
   vLLM's block hashes as page keys, the engine's block-aligned local hit counted as
   held): the request asked and up to ``lookup_batch - 1`` others that arrived since
   (``on_new_request``) in one call, under a short deadline; the others' answers wait
   for their turn (asked again only if the local hit then covers a page the node lacks).
   Shard 0: the scheduler speaks for every rank. A lookup that offers rows leaves a
   *handle* on the node (and, with ``pin``, every rank's rows held in place) for the
   workers to load by; vLLM sees no side effect. Answers ``r - local`` tokens, async
   when the model has more than one KV-cache group (see :mod:`.config`).
2. ``update_state_after_alloc`` — with external tokens, a :class:`LoadSpec` (the handle,
   keys up to ``r``, the local hit, vLLM's block ids) goes into the next step's metadata.
3. ``build_connector_meta`` — the loads, and a :class:`SaveSpec` for every prompt page a
   scheduled request completes in this step (block ids tracked from the scheduler output:
   new requests' lists, appended blocks, resumed requests' replaced lists).
4. ``update_connector_output`` — requests whose load failed on any rank are remembered
   and never offered again (vLLM resets a failed async load to 0 computed tokens and asks
   again: answering from the same rows would loop forever).
5. ``request_finished`` — forget the request; blocks are never held (saves copy the pages
   out inside the step that computed them).

Handles are released (on a thread of their own, off the scheduler loop) once their load
is over — a sync load by the next step, an async one when vLLM reports it done or failed
— and when their request finishes, is preempted or is looked up again; the node ends any
other at ``hold_s``.

A sampled share of hits is declined and audited instead (``audit_fraction``, :mod:`.audit`).

Opt-out per request: ``SamplingParams(extra_args={"kv_transfer_params": {"kvbank": False}})``
(neither load nor save), or ``{"kvbank_load": False}`` / ``{"kvbank_save": False}``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
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
from kvbank.results import Bound

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
    handle: str | None = None  # the node's kept match (the workers load by it)
    at: float = 0.0  # time.monotonic() of the answer


@dataclass(frozen=True, slots=True)
class _Answer:
    """A batched lookup's answer for one request, kept until vLLM asks about it."""

    bound: Bound
    have_pages: int  # the local hit (pages) it counted as held
    at: float  # time.monotonic() of the lookup

    def serves(self, have_pages: int, now: float, max_age: float) -> bool:
        """Whether it answers a lookup with ``have_pages`` held now: the same hit, or a
        larger one covering no page the node lacks (then the bound is the same)."""
        if now - self.at > max_age:
            return False
        if have_pages == self.have_pages:
            return True
        return have_pages > self.have_pages and not any(
            j < have_pages for pages in self.bound.missing for j in pages)


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
        self._answers: dict[str, _Answer] = {}  # looked up in a batch, not asked about yet
        self._queued: dict[str, Any] = {}  # arrived, not looked up yet (batch candidates)
        self._loading: dict[str, str] = {}  # request -> the handle its load is using
        self._sync_done: list[str] = []  # handles of sync loads sent last step
        self._releaser: ThreadPoolExecutor | None = None
        self._release_client = threading.local()
        self.stats = {"lookups": 0, "hit_tokens": 0, "loads_failed": 0, "saves": 0,
                      "match_calls": 0}
        self.audit = SchedulerAudit(cfg.audit_fraction, self.vl.tokens_per_page)

    # ---- kvbank --------------------------------------------------------------------

    def _ready(self) -> Client:
        if self._client is None:
            self._client = Client(self.cfg.url, timeout_s=self.cfg.timeout_s,
                                  retry_s=self.cfg.retry_s, token=self.cfg.token)
            self._client.breaker.cool_s = self.cfg.breaker_s
        if not self._registered:
            self._client.register(self.vl.layout)
            self._registered = True
        return self._client

    def keys(self, request: Any, pages: int) -> list[bytes]:
        """The first ``pages`` page keys of ``request`` as kvbank 32-byte keys."""
        raw = page_keys_of(request.block_hashes, self.vl, pages)
        return engine_keys(raw, self.vl.layout_id, self.scope) if raw else []

    def _prompt(self, request: Any) -> tuple[list[bytes], int] | None:
        """The request's kvbank keys and prompt length for a lookup (None: no full page)."""
        t = int(request.num_tokens)
        p = self.vl.tokens_per_page
        keys = self.keys(request, t // p)
        if not keys:
            return None
        return keys, min(t, len(keys) * p + p - 1)

    def _lookup(self, request: Any, have_pages: int) -> None:
        """One ``match_many`` for ``request`` (with its local hit) and the queued others
        (with none); their answers go to ``_answers``. Keeps a handle only where a load
        may follow."""
        batch: list[tuple[str, Any, int]] = [(request.request_id, request, have_pages)]
        for rid, other in list(self._queued.items()):
            if len(batch) >= self.cfg.lookup_batch:
                break
            if rid != request.request_id and rid not in self._failed and wants(other, "load"):
                batch.append((rid, other, 0))
        asks: list[tuple[str, list[bytes], int, int]] = []
        for rid, req, have in batch:
            self._queued.pop(rid, None)
            prompt = safe("page keys", partial(self._prompt, req), None)
            if prompt is not None:
                asks.append((rid, prompt[0], prompt[1], have))
        if not asks:
            return
        client = self._ready()
        self.stats["match_calls"] += 1
        bounds = registered(client, self.vl.layout, lambda: client.match_many(
            self.vl.layout_id, [k for _, k, _, _ in asks], prompt_tokens=[t for _, _, t, _ in asks],
            have_pages=[h for _, _, _, h in asks], scope=self.scope, shard=0, hold=True,
            pin=self.cfg.pin, ttl_s=self.cfg.hold_s, timeout=self.cfg.lookup_timeout_s))
        now = time.monotonic()
        for (rid, _, _, have), b in zip(asks, bounds, strict=True):
            self._forget_answer(rid)
            self._answers[rid] = _Answer(b, have, now)

    def _answer(self, request: Any, have_pages: int) -> Bound | None:
        """The lookup's answer for ``request`` with ``have_pages`` held (batched)."""
        rid = request.request_id
        got = self._answers.get(rid)
        if got is None or not got.serves(have_pages, time.monotonic(), self.cfg.hold_s / 2):
            self.guard.call("match", lambda: self._lookup(request, have_pages), None)
            got = self._answers.get(rid)
        return None if got is None else got.bound

    # ---- handles ----------------------------------------------------------------------

    def _release(self, handle: str | None) -> None:
        """Release a handle on the releaser thread (never on the scheduler loop)."""
        if handle is None or self.guard.down:
            return  # a down node ends it at its ttl
        if self._releaser is None:
            self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbank-release")
        self._releaser.submit(self.guard.call, "release", lambda: self._release_now(handle), None)

    def _release_now(self, handle: str) -> None:
        c: Client | None = getattr(self._release_client, "client", None)
        if c is None:
            c = self._release_client.client = Client(self.cfg.url, timeout_s=self.cfg.timeout_s,
                                                     retry_s=self.cfg.retry_s, token=self.cfg.token)
        c.release_match(handle)

    def _close_release_client(self) -> None:
        c: Client | None = getattr(self._release_client, "client", None)
        if c is not None:
            safe("close", c.close, None)

    def _forget_answer(self, rid: str) -> None:
        old = self._answers.pop(rid, None)
        if old is not None:
            self._release(old.bound.handle)

    def _forget(self, rid: str) -> None:
        """Everything held for ``rid`` (finished or preempted)."""
        self._forget_answer(rid)
        self._queued.pop(rid, None)
        found = self._lookups.pop(rid, None)
        if found is not None:
            self._release(found.handle)
        self._release(self._loading.pop(rid, None))

    # ---- vLLM scheduler calls ------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._reqs.setdefault(request.request_id, _Req(request))
        if wants(request, "load"):
            self._queued[request.request_id] = request  # looked up with the next batch

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        self._reqs.setdefault(rid, _Req(request))
        if rid in self._failed or not wants(request, "load"):
            return 0, False
        self.stats["lookups"] += 1
        old = self._lookups.get(rid)
        if old is not None and old.local == num_computed_tokens \
                and time.monotonic() - old.at < self.cfg.hold_s / 2:
            return old.tokens - num_computed_tokens, self.load_async  # asked again: not scheduled yet
        p = self.vl.tokens_per_page
        bound = self._answer(request, num_computed_tokens // p)
        old = self._lookups.pop(rid, None)
        if old is not None and (bound is None or old.handle != bound.handle):
            self._release(old.handle)
        r = 0 if bound is None else bound.tokens
        if bound is not None:
            self._answers.pop(rid, None)  # taken: its handle goes with the lookup now
        if r <= num_computed_tokens or self.audit.declines(request, r):
            # a miss, or a hit declined for an audit (.audit)
            self._release(None if bound is None else bound.handle)
            return 0, False
        self._lookups[rid] = _Lookup(num_computed_tokens, r, None if bound is None else bound.handle,
                                     time.monotonic())
        return r - num_computed_tokens, self.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load vLLM just allocated blocks for. Once vLLM counts external tokens a
        load spec must reach the worker: one it cannot serve (no keys) fails there, and
        vLLM recomputes; a missing one would leave the blocks unwritten."""
        rid = request.request_id
        found = self._lookups.pop(rid, None)
        if num_external_tokens <= 0:
            if found is not None:
                self._release(found.handle)
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
        handle = found.handle if found is not None and keys else None
        self._loads.append(LoadSpec(rid, keys, r, local, ids, self.load_async, handle))
        if handle is not None:
            self._release(self._loading.pop(rid, None))
            self._loading[rid] = handle
            if not self.load_async:
                self._sync_done.append(rid)
        req = self._reqs.setdefault(rid, _Req(request))
        req.saved_pages = max(req.saved_pages, r // p)  # those pages are in kvbank already
        self.stats["hit_tokens"] += r - local

    def take_loads(self) -> list[LoadSpec]:
        """The planned loads, once (build_connector_meta sends them)."""
        out, self._loads = self._loads, []
        return out

    def build_connector_meta(self, out: Any) -> KvbankMetadata:
        # the sync loads sent with the last step are over (the worker ran them before its
        # forward): their handles can go. Preempted requests give theirs up too.
        done, self._sync_done = self._sync_done, []
        for rid in done:
            self._release(self._loading.pop(rid, None))
        for rid in getattr(out, "preempted_req_ids", None) or ():
            self._forget(rid)
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
        for rid in getattr(output, "finished_recving", None) or ():  # async loads over
            self._release(self._loading.pop(rid, None))
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
        self._forget(rid)
        self._failed.discard(rid)
        self.audit.forget(rid)
        return False, None

    def shutdown(self) -> None:
        for rid in list(self._answers) + list(self._lookups) + list(self._loading):
            self._forget(rid)
        if self._releaser is not None:
            self._releaser.submit(self._close_release_client)
            self._releaser.shutdown(wait=True)
            self._releaser = None
        if self._client is not None:
            safe("close", self._client.close, None)
            self._client = None
