"""kvbank as a storage plugin of LMCache's in-process engine (LMCache 0.5.6, ``StoragePluginInterface``).

LMCache's in-process cache engine (LMCache inside a vLLM worker, configured by YAML)
loads storage backends by module path::

    storage_plugins: ["kvbank"]
    extra_config:
      storage_plugin.kvbank.module_path: kvbank.integrations.lmcache.inproc
      storage_plugin.kvbank.class_name: KvbankStoragePlugin
      storage_plugin.kvbank.url: http://127.0.0.1:7410

Every other ``storage_plugin.kvbank.*`` key is one of the L2 adapter's ``adapter_params``
(:mod:`.adapter`). The plugin is that adapter's work, called synchronously: an engine key
``model@world_size@worker_id@chunk_hash@dtype`` becomes an ``ObjectKey`` of the same model
and chunk hash on ``kv_rank`` (world size, worker id), and the object is a ``KV_2LTD``
chunk of the engine's ``kv_shape`` and ``kv_dtype``, so rows are named exactly as the L2
adapter names them (:mod:`.layout`).

- ``contains(key, pin)`` — a lookup under a READ lease; kept as the pin with ``pin=True``
  (``unpin`` drops it), else released at once.
- ``batched_submit_put_task`` — a synchronous put; the callback runs per key stored.
- ``get_blocking`` — a buffer from LMCache's CPU allocator, filled from the node's memory
  (under the pin's lease if there is one); ``None`` on a miss.
- ``remove`` — not supported (``False``): the node evicts by its own budgets.

Limits: only full chunks are found again (a get cannot know a partial chunk's length, so
a partial last chunk is stored but never read); failures are misses, as in the adapter.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from kvbank.integrations.lmcache.adapter import KvbankL2Adapter

__all__ = ["KvbankStoragePlugin"]

logger = logging.getLogger(__name__)

PREFIX = "storage_plugin.kvbank."
_LOADER_KEYS = ("module_path", "class_name")


def object_key(key: Any) -> ObjectKey:
    """The L2 ``ObjectKey`` of an in-process engine's ``CacheEngineKey``."""
    h = int(key.chunk_hash)
    raw = h.to_bytes((h.bit_length() + 8) // 8, "big", signed=True)
    rank = ObjectKey.ComputeKVRank(int(key.world_size), int(key.worker_id), int(key.world_size),
                                   int(key.worker_id))
    return ObjectKey(chunk_hash=raw, model_name=str(key.model_name), kv_rank=rank)


class KvbankStoragePlugin(StoragePluginInterface):  # type: ignore[misc,unused-ignore]
    """See the module docstring."""

    def __init__(self, dst_device: str = "cpu", config: Any = None, metadata: Any = None,
                 local_cpu_backend: Any = None, loop: Any = None) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        extra = dict(getattr(config, "extra_config", None) or {})
        params = {k[len(PREFIX):]: v for k, v in extra.items()
                  if k.startswith(PREFIX) and k[len(PREFIX):] not in _LOADER_KEYS}
        self.objects = KvbankL2Adapter(params)
        layers, _, tokens, heads, dim = (int(d) for d in metadata.kv_shape)
        self.shape = torch.Size([2, layers, tokens, heads * dim])
        self.dtype = metadata.kv_dtype
        self.desc = {0: MemoryLayoutDesc(shapes=[self.shape], dtypes=[self.dtype])}
        self._lock = threading.Lock()
        self._putting: set[Any] = set()

    def __str__(self) -> str:
        return "KvbankStoragePlugin"

    def contains(self, key: Any, pin: bool = False) -> bool:
        ok = object_key(key)
        if not self.objects.lock_objects([ok], self.desc):
            return False
        if not pin:
            self.objects.unlock_objects([ok])
        return True

    def exists_in_put_tasks(self, key: Any) -> bool:
        with self._lock:
            return key in self._putting

    def batched_submit_put_task(self, keys: Sequence[Any], objs: list[Any], transfer_spec: Any = None,
                                on_complete_callback: Callable[[Any], None] | None = None) -> None:
        with self._lock:
            self._putting.update(keys)
        try:
            stored = self.objects.store_objects([object_key(k) for k in keys], list(objs))
        finally:
            with self._lock:
                self._putting.difference_update(keys)
        if stored >= 0 and on_complete_callback is not None:
            for k in keys:
                try:
                    on_complete_callback(k)
                except Exception as exc:  # the engine's callback, not ours to fail on
                    logger.warning("kvbank: a put's completion callback raised: %s", exc)
        return None

    def get_blocking(self, key: Any) -> Any:
        obj = self.local_cpu_backend.allocate(self.shape, self.dtype, fmt=MemoryFormat.KV_2LTD)
        if obj is None:
            return None
        if self.objects.load_objects([object_key(key)], [obj]):
            return obj
        obj.ref_count_down()
        return None

    def pin(self, key: Any) -> bool:
        return bool(self.objects.lock_objects([object_key(key)], self.desc))

    def unpin(self, key: Any) -> bool:
        self.objects.unlock_objects([object_key(key)])
        return True

    def remove(self, key: Any, force: bool = True) -> bool:
        return False

    def get_allocator_backend(self) -> Any:
        return self.local_cpu_backend

    def close(self) -> None:
        self.objects.close()
