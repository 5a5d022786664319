"""``KvbankConnector``: vLLM's ``KVConnectorBase_V1`` over a ``kvbank serve`` node.

vLLM builds one instance per role: in the scheduler's process (:mod:`.scheduler` does
the work) and in each worker process (:mod:`.worker`). This class only routes vLLM's
calls to the half of its role and keeps every kvbank failure out of vLLM.

Registration::

    --kv-transfer-config '{"kv_connector":"KvbankConnector",
      "kv_connector_module_path":"kvbank.integrations.vllm","kv_role":"kv_both",
      "kv_connector_extra_config":{"url":"http://127.0.0.1:7410"}}'

A failed load is recomputed: the scheduler half sets ``kv_load_failure_policy`` to
``recompute`` (vLLM's default, ``fail``, would fail the request on a cache miss that
turned up late), unless ``kv_connector_extra_config`` says ``"keep_failure_policy": true``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvbank.integrations.vllm.config import ConnectorConfig, safe
from kvbank.integrations.vllm.metadata import KvbankMetadata
from kvbank.integrations.vllm.scheduler import KvbankScheduler
from kvbank.integrations.vllm.worker import KvbankWorker

__all__ = ["KvbankConnector"]

logger = logging.getLogger(__name__)

try:  # metrics: hits are reported as host memory (the node's shared-memory tier)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HIT_SOURCE: Any = CacheHitSource.HOST
except ImportError:  # pragma: no cover - older vLLM
    _HIT_SOURCE = None


class KvbankConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc,unused-ignore]
    """See the module docstring."""

    if _HIT_SOURCE is not None:
        _cache_hit_source = _HIT_SOURCE

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        keep = bool(extra.pop("keep_failure_policy", False))
        cfg = ConnectorConfig.from_extra(extra)
        self.sched: KvbankScheduler | None = None
        self.worker: KvbankWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            if not keep and self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.info("kvbank: kv_load_failure_policy set to 'recompute' (a failed "
                            "kvbank load is a miss)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            self.sched = KvbankScheduler(vllm_config, kv_cache_config, cfg)
        else:
            self.worker = KvbankWorker(vllm_config, kv_cache_config, cfg)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # ---- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.sched is not None  # vLLM calls this on the scheduler's instance only
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.sched is not None
        # no breaker here: a load promised to vLLM must reach the worker (or fail there)
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.sched is not None
        sched = self.sched
        try:
            meta: KVConnectorMetadata = sched.build_connector_meta(scheduler_output)
        except Exception as exc:  # never into vLLM; the planned loads still go out
            logger.warning("kvbank: build_connector_meta failed: %s: %s", type(exc).__name__, exc)
            meta = KvbankMetadata(loads=sched.take_loads())
        return meta

    def on_new_request(self, request: Any) -> None:
        if self.sched is not None:
            self.sched.on_new_request(request)

    def update_connector_output(self, connector_output: Any) -> None:
        sched = self.sched
        if sched is not None:
            safe("update_connector_output",
                 lambda: sched.update_connector_output(connector_output), None)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.sched is not None
        return self.sched.request_finished(request)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.sched is not None
        return self.sched.request_finished(request)

    # ---- worker side ---------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def _meta(self) -> KvbankMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KvbankMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if self.worker is not None and meta is not None:
            self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # a page holds every layer of its group: loads finish in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # saved whole in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._meta()
        if self.worker is not None and meta is not None:
            self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker is None:
            return KVConnectorTransferResults()
        done, failed = self.worker.get_transfer_results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_worker_meta() if self.worker is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.sched is not None:
            self.sched.shutdown()
