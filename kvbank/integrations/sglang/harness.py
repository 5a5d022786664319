"""SGLang's own HiCache controller on a CPU host, without a server: for tests and the bench.

``sglang.launch_server`` needs a CUDA build of torch (``sgl-kernel``, flashinfer); the
cache controller and the host pools do not. This module sets up what the controller
expects of a server process, and nothing more:

- :func:`cpu_runtime` — an import stub for torchvision (SGLang's config modules import
  it, and PyPI's build would replace the CPU torch), a one-process gloo world, and
  SGLang's parallel context overridden to TP 1 (with a world of one, the controller's
  rank reductions are skipped).
- :func:`mha_pools` — a real device pool, its allocator and a real
  ``MHATokenToKVPoolHost`` on the CPU.
- :func:`mla_pools` — a real ``MLATokenToKVPool`` device pool, its allocator and a real
  ``MLATokenToKVPoolHost`` over its buffers on the CPU (one latent a token and layer).
- :func:`mamba_pool` — a real ``MambaPoolHost`` (conv and temporal state of two layers),
  the sidecar pool SGLang's hybrid controller registers for a Mamba model.
- :func:`storage_config`, :func:`file_backend` — the config SGLang hands a backend (TP 1),
  and SGLang's own ``HiCacheFile`` backend, the bench's baseline.
- :class:`Controller` — SGLang's real ``HiCacheController`` over them, with a storage
  backend attached the way ``--hicache-storage-backend`` attaches it, and the two things
  a scheduler does around it: :meth:`Controller.store` (``write_storage``, waits for the
  backup's acknowledgement) and :meth:`Controller.load` (``prefetch``: the hit query,
  host slots for the hit, the IO thread's load, waits for it).
- :class:`HybridController` — SGLang's real ``HybridCacheController`` over a real
  ``HostPoolGroup`` (the KV anchor and a Mamba state pool), attached the same way, and
  the steps SGLang's ``UnifiedRadixCache`` takes around it for a Mamba model:
  :meth:`HybridController.store` backs up radix nodes (``write_storage`` with the node's
  state slot as a ``TRAILING_PAGES`` pool transfer: the backup thread's ``batch_set_v2``
  of the snapshot, then ``batch_set_v1`` of the KV pages) and
  :meth:`HybridController.load` prefetches (``submit_prefetch`` with the Mamba
  placeholder transfer; the hit query's ``batch_exists_v2``; host slots for the KV hit and
  one state slot; the IO thread's ``batch_get_v1`` then ``batch_get_v2``; its acks).

Nothing here stands in for SGLang but the torchvision stub, the world of one and the
parallel context; no device transfer (H2D, D2H) is driven, so the Mamba entry of the group
has no device pool (SGLang reads an entry's device pool only for those transfers).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

import torch

__all__ = ["Controller", "HybridController", "HybridLoad", "cpu_runtime", "file_backend", "mamba_pool",
           "mha_pools", "mla_pools", "page_hashes", "storage_config"]

HOST_BUDGET_BYTES = 4 << 30  # what the harness's host pools may take (they take MiB)
_READY = threading.Lock()
_done = False


class _Inert(types.ModuleType):
    """A module whose every attribute is another inert module (and callable as a no-op)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Inert(f"{self.__name__}.{name}")
        setattr(self, name, sub)
        return sub

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return None


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``torchvision`` and its submodules with inert modules."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        mod = _Inert(spec.name)
        mod.__path__ = []
        mod.__dict__["__version__"] = "0.0.0+stub"
        return mod

    def exec_module(self, module: Any) -> None:
        return None


def cpu_runtime() -> None:
    """Set up the process for SGLang's controller on the CPU (idempotent)."""
    global _done
    with _READY:
        if _done:
            return
        import importlib.util

        if importlib.util.find_spec("torchvision") is None:
            sys.meta_path.insert(0, _StubFinder())
        import torch.distributed as dist

        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            if "MASTER_PORT" not in os.environ:
                import socket

                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    os.environ["MASTER_PORT"] = str(s.getsockname()[1])
            dist.init_process_group("gloo", rank=0, world_size=1)
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0,
            attn_tp_rank=0, attn_tp_size=1, attn_cp_rank=0, attn_cp_size=1, attn_dp_rank=0)
        _done = True


def mha_pools(tokens: int = 256, page_size: int = 16, heads: int = 2, head_dim: int = 16,
              layers: int = 2, dtype: torch.dtype = torch.bfloat16, layout: str = "page_first",
              host_ratio: float = 2.0) -> tuple[Any, Any, Any]:
    """(device pool, its allocator, host pool): SGLang's real MHA pools on the CPU."""
    cpu_runtime()
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(size=tokens, page_size=page_size, dtype=dtype, head_num=heads,
                           head_dim=head_dim, layer_num=layers, device="cpu",
                           enable_memory_saver=False, enable_alt_stream=False)
    alloc = PagedTokenToKVPoolAllocator(tokens, page_size, dtype, "cpu", dev, False)
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    # SGLang sizes a host pool against the machine's free memory less a reserve of several
    # GiB: on a shared test host that refuses even a pool of a few MiB. The pool's own
    # size is booked against this budget instead.
    with host_memory_budget_scope(HOST_BUDGET_BYTES):
        host = MHATokenToKVPoolHost(dev._mha_buffer_info(), host_ratio, 0, page_size, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=tokens,
                                    start_layer=0, end_layer=layers)
    return dev, alloc, host


def mla_pools(tokens: int = 256, page_size: int = 16, kv_lora_rank: int = 32, qk_rope_head_dim: int = 8,
              layers: int = 2, dtype: torch.dtype = torch.bfloat16, layout: str = "page_first",
              host_ratio: float = 2.0) -> tuple[Any, Any, Any]:
    """(device pool, its allocator, host pool): SGLang's real MLA pools on the CPU, a latent of
    ``kv_lora_rank + qk_rope_head_dim`` a token and layer. The host pool is built from the
    device pool's buffer info as SGLang's ``_build_mha_mla_host_pool`` builds it
    (``hybrid_cache/hybrid_pool_assembler.py``)."""
    cpu_runtime()
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dev = MLATokenToKVPool(size=tokens, page_size=page_size, dtype=dtype, kv_lora_rank=kv_lora_rank,
                           qk_rope_head_dim=qk_rope_head_dim, layer_num=layers, device="cpu",
                           enable_memory_saver=False)
    alloc = PagedTokenToKVPoolAllocator(tokens, page_size, dtype, "cpu", dev, False)
    with host_memory_budget_scope(HOST_BUDGET_BYTES):  # as in mha_pools
        host = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, host_ratio, 0, page_size,
                                    layout, pin_memory=False, device="cpu", device_capacity_tokens=tokens,
                                    start_layer=dev.start_layer, end_layer=dev.end_layer,
                                    target_layer_num=dev.layer_num, override_kv_cache_dim=dev.kv_cache_dim)
    return dev, alloc, host


def mamba_pool(slots: int = 16, layers: int = 2) -> Any:
    """SGLang's real ``MambaPoolHost`` on the CPU: ``layers`` layers of a float32 temporal
    state ``(4, 8)`` and a bfloat16 conv state ``(3, 16)`` a slot."""
    cpu_runtime()
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(temporal=torch.zeros(layers, slots + 1, 4, 8, dtype=torch.float32),
                                conv=(torch.zeros(layers, slots + 1, 3, 16, dtype=torch.bfloat16),))
    with host_memory_budget_scope(HOST_BUDGET_BYTES):
        return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
                             layout="page_first")


def storage_config(model_name: str, extra: dict[str, Any] | None = None, *, tp_rank: int = 0,
                   tp_size: int = 1, mla: bool = False) -> Any:
    """The ``HiCacheStorageConfig`` SGLang builds for a backend (page-first host pool)."""
    cpu_runtime()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                                enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model_name, extra_config=dict(extra or {}))


def file_backend(model_name: str, path: str) -> Any:
    """SGLang's own ``HiCacheFile`` backend (``--hicache-storage-backend file``) in ``path``."""
    cpu_runtime()
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    return HiCacheFile(storage_config(model_name, {"file_storage_path": path}), file_path=path)


def page_hashes(tokens: Sequence[int], page_size: int) -> list[str]:
    """SGLang's storage keys of the prompt's full pages (its own hash function)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    n = len(tokens) // page_size * page_size
    return list(get_storage_hash_str(list(tokens[:n]), None, page_size=page_size))


class _KvSlots:
    """Random pages into a KV host pool's slots, and the pages back out (both controllers)."""

    host: Any  # SGLang's KV host pool
    page_size: int

    def fill(self, idx: torch.Tensor, seed: int) -> None:
        """Random bytes in the host slots ``idx`` (every layer, K and V)."""
        g = torch.Generator().manual_seed(seed)
        for i in range(0, idx.numel(), self.page_size):
            page = self.host.get_data_page(int(idx[i]), flat=True)
            data = torch.randn(page.numel(), generator=g).to(page.dtype)
            self.host.set_from_flat_data_page(int(idx[i]), data)

    def pages(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """The flat pages at host slots ``idx`` (copies)."""
        return [self.host.get_data_page(int(idx[i]), flat=True).clone()
                for i in range(0, idx.numel(), self.page_size)]


class Controller(_KvSlots):
    """SGLang's ``HiCacheController`` with a storage backend attached (module docstring)."""

    def __init__(self, alloc: Any, host: Any, *, backend: str = "dynamic",
                 extra: dict[str, Any] | None = None, model_name: str = "kvbank-test",
                 page_size: int = 16) -> None:
        cpu_runtime()
        import torch.distributed as dist
        from sglang.srt.managers.cache_controller import HiCacheController

        self.host, self.page_size = host, page_size
        self.cc = HiCacheController(
            alloc, host, page_size, dist.group.WORLD, threading.Event(), storage_backend=backend,
            prefetch_threshold=page_size, model_name=model_name,
            storage_backend_extra_config=extra or {})
        self.backend = self.cc.storage_backend

    def store(self, tokens: Sequence[int], timeout_s: float = 60.0) -> int:
        """The prompt's pages, put in host slots by the caller, written to storage: tokens
        the backup thread reports stored. Host slots: :meth:`fill`."""
        n = len(tokens) // self.page_size * self.page_size
        idx = self.host.alloc(n)
        self.fill(idx, seed=len(tokens))
        op_id = self.cc.write_storage(idx, list(tokens[:n]), hash_value=page_hashes(tokens, self.page_size))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                op = self.cc.ack_backup_queue.get(timeout=0.5)
            except Exception:
                continue
            if op.id == op_id:
                self.stored = idx
                return int(op.completed_tokens)
        raise TimeoutError("the backup thread did not acknowledge the write")

    def load(self, tokens: Sequence[int], timeout_s: float = 60.0) -> tuple[int, int, torch.Tensor | None]:
        """(tokens the hit query found, tokens loaded into host slots, those slots)."""
        op = self.cc.prefetch(f"r{time.monotonic_ns()}", list(tokens))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got = self.cc.prefetch_hit_queue.get(timeout=0.5)
            except Exception:
                if time.monotonic() > deadline:
                    raise TimeoutError("no hit query answer") from None
                continue
            if got is op:
                break
        hit = int(op.storage_hit_count)
        if hit == 0:
            return 0, 0, None
        idx = self.host.alloc(hit)
        op.host_indices = idx
        self.cc.prefetch_buffer.put(op)
        # the IO thread reports through its acks (the operation's own count is not kept)
        loaded = 0
        while True:
            ack = _take(self.cc.ack_prefetch_queue, lambda a: a.operation is op, deadline, "the IO thread")
            if ack.completed_tokens is not None:
                loaded = int(ack.completed_tokens)
            if ack.completed_req:
                return hit, loaded, idx

    def close(self) -> None:
        self.cc.detach_storage_backend()


def _take(queue: Any, want: Any, deadline: float, what: str) -> Any:
    """Items off ``queue`` until ``want(item)``; that item. SGLang's threads answer through
    these queues; the scheduler drains them the same way, one item at a time."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer from {what}")
        try:
            item = queue.get(timeout=min(left, 0.5))
        except Empty:
            continue
        if want(item):
            return item


@dataclass
class HybridLoad:
    """What one prefetch of :meth:`HybridController.load` came to."""

    hit_tokens: int  # the hit query's verdict (after SGLang's trailing-state cut); 0: a miss
    restorable: list[int] = field(default_factory=list)  # resume points (pages) the query found
    loaded_tokens: int = 0  # KV tokens the IO thread loaded (its acks)
    pool_hits: dict[str, int] = field(default_factory=dict)  # pages a sidecar loaded (its ack)
    kv_slots: torch.Tensor | None = None  # the KV host slots loaded into
    state_slot: torch.Tensor | None = None  # the Mamba host slot the state was loaded into


class HybridController(_KvSlots):
    """SGLang's ``HybridCacheController`` over a KV anchor and a Mamba state pool, with a
    storage backend attached (module docstring).

    ``dev``, ``alloc``, ``host``: :func:`mha_pools`; ``mamba``: :func:`mamba_pool`. The
    group is laid out as SGLang's ``build_hybrid_mamba_stack`` lays out a Mamba model's:
    entries made by its ``build_pool_entry``, the KV pool the anchor, the transfer layer ids
    the attention layers' first, then the Mamba layers'.
    """

    def __init__(self, dev: Any, alloc: Any, host: Any, mamba: Any, *, backend: str = "dynamic",
                 extra: dict[str, Any] | None = None, model_name: str = "kvbank-test",
                 page_size: int = 16) -> None:
        cpu_runtime()
        import torch.distributed as dist
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
        from sglang.srt.mem_cache.pool_host import HostPoolGroup

        attn, ssm = int(host.layer_num), int(mamba.num_mamba_layers)
        top = attn + ssm
        self.group = HostPoolGroup([
            build_pool_entry(name=PoolName.KV, host_pool=host, device_pool=dev,
                             layer_mapping={i: i for i in range(attn)}, transfer_layer_id_max=top,
                             is_anchor=True),
            build_pool_entry(name=PoolName.MAMBA, host_pool=mamba, device_pool=None,
                             layer_mapping={attn + i: i for i in range(ssm)}, transfer_layer_id_max=top),
        ])
        self.host, self.mamba, self.page_size = host, mamba, page_size
        self.cc = HybridCacheController(
            alloc, self.group, page_size, dist.group.WORLD, threading.Event(), storage_backend=backend,
            prefetch_threshold=page_size, model_name=model_name,
            storage_backend_extra_config=extra or {}, transfer_layer_id_max=top)
        self.backend = self.cc.storage_backend
        self.kv_stored: list[torch.Tensor] = []  # the KV pages the last :meth:`store` backed up
        self.states_stored: dict[int, torch.Tensor] = {}  # its nodes' end pages -> their states
        self._requests = 0

    def state(self, slot: torch.Tensor) -> torch.Tensor:
        """The bytes of the Mamba host slot ``slot`` (a copy: SGLang's flat page)."""
        page: torch.Tensor = self.mamba.get_data_page(int(slot[0]), flat=True)
        return page.clone()

    def store(self, tokens: Sequence[int], nodes: Sequence[int], seed: int = 0, *,
              prefix_keys: bool = False, timeout_s: float = 60.0) -> list[tuple[int, dict[str, int]]]:
        """Back up the prompt as radix nodes ending at pages ``nodes`` (ascending), each as
        ``UnifiedRadixCache.write_backup_storage`` backs up a node of a Mamba model: the
        node's KV host slots, tokens and page keys go to ``write_storage`` with its state
        slot as a ``TRAILING_PAGES`` transfer keyed by the node's last page (random bytes in
        every slot, put there here). Waits for each backup's ack, as the scheduler drains
        them; per node: (KV tokens stored, pages each sidecar stored). What this call
        stored is kept in :attr:`kv_stored` and :attr:`states_stored`. ``prefix_keys``: each node's
        backup carries the keys of the pages before it, as the scheduler passes them under
        ``hicache_storage_pass_prefix_keys``."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        p = self.page_size
        keys = page_hashes(tokens, p)
        if list(nodes) != sorted(set(nodes)) or not nodes or nodes[0] < 1 or nodes[-1] > len(keys):
            raise ValueError(f"nodes: ascending end pages within the prompt's {len(keys)}, got {nodes}")
        out: list[tuple[int, dict[str, int]]] = []
        self.kv_stored, self.states_stored = [], {}
        start = 0
        for end in nodes:
            idx = self.host.alloc((end - start) * p)
            self.fill(idx, seed=seed * 1000 + end)
            slot = self.mamba.alloc(1 * self.mamba.page_size)
            g = torch.Generator().manual_seed(seed * 1000 + end)
            n = self.mamba.get_dummy_flat_data_page().numel()
            self.mamba.set_from_flat_data_page(int(slot[0]), torch.randint(0, 256, (n,), generator=g,
                                                                           dtype=torch.uint8))
            state = PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=[keys[end - 1]],
                                 hit_policy=PoolHitPolicy.TRAILING_PAGES)
            op_id = self.cc.write_storage(idx, list(tokens[start * p:end * p]), keys[start:end],
                                          keys[:start] if prefix_keys else None, extra_pools=[state])
            op = _take(self.cc.ack_backup_queue, lambda o, i=op_id: o.id == i,
                       time.monotonic() + timeout_s, "the backup thread")
            out.append((int(op.completed_tokens),
                         {str(k): int(v) for k, v in op.pool_storage_result.extra_pool_hit_pages.items()}))
            self.kv_stored.extend(self.pages(idx))
            self.states_stored[end] = self.state(slot)
            start = end
        return out

    def load(self, tokens: Sequence[int], timeout_s: float = 60.0) -> HybridLoad:
        """Prefetch the prompt as ``UnifiedRadixCache`` does for a request of a Mamba model
        that matched nothing locally: ``submit_prefetch`` with the Mamba component's
        placeholder transfer (one trailing page); the hit query's answer off the hit queue
        (``batch_exists_v2``, cut to a page with a state); host slots for the KV hit
        (``allocate_storage_hit``) and one state slot; the operation to the IO thread
        (``batch_get_v1`` of the pages, then ``batch_get_v2`` of the state at the hit's last
        page); its acks until the last. A query that finds less than the threshold is a
        miss, as the scheduler revokes it."""
        from array import array

        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.radix_cache import RadixKey

        deadline = time.monotonic() + timeout_s
        self._requests += 1
        handle = CacheRequestHandle(rid=f"r{self._requests}", attempt_id=0)
        state = PoolTransfer(name=PoolName.MAMBA, keys=["__placeholder__"],
                             hit_policy=PoolHitPolicy.TRAILING_PAGES)
        op = self.cc.submit_prefetch(handle, RadixKey(array("q", tokens)), None, None, [], [state]).operation
        _take(self.cc.prefetch_hit_queue, lambda o: o is op, deadline, "the hit query")
        hit = int(op.storage_hit_count)
        res = HybridLoad(hit, [int(x) for x in op.pool_storage_result.restorable_prefix_pages or []])
        if op.is_terminated() or hit < self.cc.prefetch_threshold:
            return res
        # the scheduler's evict_host frees host nodes of its tree; this one holds none
        kv_slots, alloc_len = self.cc.allocate_storage_hit(
            op, hit, allow_partial=True, min_tokens=self.cc.prefetch_threshold, evict_host=lambda n: 0)
        if kv_slots is None or alloc_len != hit:
            raise RuntimeError(f"host pool full: {alloc_len} of {hit} tokens found room")
        pages = hit // self.page_size
        state.host_indices = self.mamba.alloc(min(len(state.keys or ()), pages) * self.mamba.page_size)
        if state.host_indices is None:
            raise RuntimeError("Mamba host pool full")
        op.hash_value = op.hash_value[:pages]
        op.host_indices = kv_slots
        self.cc.prefetch_buffer.put(op)
        while True:
            ack = _take(self.cc.ack_prefetch_queue, lambda a: a.operation is op, deadline, "the IO thread")
            if ack.completed_tokens is not None:
                res.loaded_tokens = int(ack.completed_tokens)
            if ack.pool_hits is not None:
                res.pool_hits = {str(k): int(v) for k, v in ack.pool_hits.items() if v}
            if ack.completed_req:
                break
        res.kv_slots, res.state_slot = kv_slots, state.host_indices
        return res

    def close(self) -> None:
        self.cc.detach_storage_backend()
