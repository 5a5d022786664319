"""The sampled reuse audit: does a hit hold what this engine would have computed?

A layout's fingerprint says which model made its rows (:func:`.layout.engine_fingerprint`),
but it hashes what the scheduler can see — model name, config, dtypes — not the weights: a
checkpoint replaced in place, a fine-tune under its base's name, or a bug in any adapter
would serve rows of another computation, silently. The audit checks the rows themselves,
on a sample of real traffic:

1. **Scheduler** (:class:`SchedulerAudit`) — when kvbank offers a hit, the request is
   audited with probability ``audit_fraction`` (``kv_connector_extra_config``), or always
   when its ``kv_transfer_params`` say ``{"kvbank_audit": true}`` (never with ``false``). An audited hit is
   declined: vLLM computes the prompt as on a miss. Its pages below the declined bound
   are marked in each step's metadata (``KvbankMetadata.audits``) as they are saved.
2. **Worker** (:class:`WorkerAudit`) — when those pages are saved, on the saver thread
   (off the step), the stored rows of the same pages are fetched for this rank's shard
   and compared with the pages vLLM just computed
   (:func:`kvbank.kernels.compare.compare_pages`, within the dtype's tolerance). The
   verdict goes to the node (``client.audit.report``): a mismatch quarantines the layout
   there — its rows stop being served to every engine until an operator clears it
   (``kvbank admin quarantine --clear``) — and is logged here at warning.

An audit costs the sampled request its hit (it recomputes) and one fetch of the pages
compared; stored rows gone by then make it inconclusive (nothing reported). It never
raises into vLLM.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from kvbank import Scope
from kvbank.integrations.vllm.config import Guard, registered
from kvbank.integrations.vllm.layout import VllmLayout
from kvbank.integrations.vllm.metadata import SaveSpec
from kvbank.kernels.compare import compare_pages

__all__ = ["SchedulerAudit", "WorkerAudit", "asked"]

logger = logging.getLogger(__name__)


def asked(request: Any) -> bool | None:
    """What ``request``'s kv_transfer_params say of an audit of its hit: ``kvbank_audit``
    true (always), false (never), or None (sampled)."""
    params = getattr(request, "kv_transfer_params", None)
    wish = params.get("kvbank_audit") if isinstance(params, dict) else None
    return wish if isinstance(wish, bool) else None


class SchedulerAudit:
    """Which hits are declined for an audit, and how far each is compared."""

    def __init__(self, fraction: float, tokens_per_page: int, rng: random.Random | None = None) -> None:
        self.fraction = fraction
        self._p = tokens_per_page
        self._rng = rng if rng is not None else random.Random()
        self._decided: dict[str, bool] = {}  # once per request: vLLM may ask again
        self._pages: dict[str, int] = {}
        self.audited = 0

    def declines(self, request: Any, r: int) -> bool:
        """Whether the hit at ``r`` tokens is declined for an audit (sampled once a request)."""
        rid = request.request_id
        audit = self._decided.get(rid)
        if audit is None:
            wish = asked(request)
            audit = wish if wish is not None else self.fraction > 0 and self._rng.random() < self.fraction
            self._decided[rid] = audit
            if audit:
                self.audited += 1
        if audit:
            self._pages[rid] = max(self._pages.get(rid, 0), r // self._p)
        return audit

    def marks(self, saves: list[SaveSpec]) -> dict[str, int]:
        """``KvbankMetadata.audits`` for a step's saves: the audited ones' page bounds."""
        return {s.req_id: self._pages[s.req_id] for s in saves
                if self._pages.get(s.req_id, 0) > s.first_page}

    def forget(self, rid: str) -> None:
        self._decided.pop(rid, None)
        self._pages.pop(rid, None)


class WorkerAudit:
    """Compares a rank's freshly computed pages with the rows kvbank holds for them."""

    def __init__(self, vl: VllmLayout, scope: Scope, rank: int, clients: Any, guard: Guard) -> None:
        self.vl, self.scope, self.rank = vl, scope, rank
        self._clients = clients
        self._guard = guard
        self.mismatches = 0

    def check(self, spec: SaveSpec, group: int, first: int, pages: torch.Tensor, bound: int) -> None:
        """Audit pages ``[first, min(first + n, bound))`` of ``group`` (the saver runs it
        before their put); never raises."""
        self._guard.call(f"audit of {spec.req_id}", lambda: self._check(spec, group, first, pages, bound),
                         None)

    def _check(self, spec: SaveSpec, group: int, first: int, pages: torch.Tensor, bound: int) -> None:
        end = min(first + int(pages.shape[0]), bound, len(spec.keys))
        if end <= first:
            return
        vl, p = self.vl, self.vl.tokens_per_page
        client = self._clients.get()
        got = registered(client, vl.layout, lambda: client.fetch_prefix(
            vl.layout_id, keys=list(spec.keys[:end]), prompt_tokens=end * p + 1, scope=self.scope,
            shard=self.rank))
        if got.result is None or group >= len(got.match.resume.pages):
            logger.info("kvbank: audit of %s inconclusive: no stored rows left", spec.req_id)
            return
        delivered = set(got.result.delivered[group])
        pairs = [(k - first, i) for i, k in enumerate(got.match.resume.pages[group])
                 if first <= k < end and k in delivered]
        if not pairs:
            logger.info("kvbank: audit of %s inconclusive: no stored rows left", spec.req_id)
            return
        stored_all = got.pages[group]
        stored_t = stored_all if isinstance(stored_all, torch.Tensor) else torch.as_tensor(stored_all)
        computed = pages[[a for a, _ in pairs]]
        stored = stored_t[[b for _, b in pairs]]
        diff = compare_pages(vl.layout, group, computed, stored)
        detail = f"{vl.layout.model} rank {self.rank}: {diff.describe()}"
        held = client.audit.report(vl.layout_id, ok=diff.ok, pages=diff.pages, error=diff.error,
                                   tolerance=diff.tolerance, detail=detail)
        if diff.ok:
            logger.debug("kvbank: audit of %s passed: %s", spec.req_id, diff.describe())
            return
        self.mismatches += 1
        logger.warning("kvbank: audit of %s FAILED: the stored rows differ from what this engine "
                       "computed (%s); layout %s %s", spec.req_id, detail, vl.layout_id.hex(),
                       "quarantined on the node" if held else "not quarantined")
