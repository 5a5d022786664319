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
- :func:`mamba_pool` — a real ``MambaPoolHost`` (conv and temporal state of two layers),
  the sidecar pool SGLang's hybrid controller registers for a Mamba model.
- :func:`storage_config`, :func:`file_backend` — the config SGLang hands a backend (TP 1),
  and SGLang's own ``HiCacheFile`` backend, the bench's baseline.
- :class:`Controller` — SGLang's real ``HiCacheController`` over them, with a storage
  backend attached the way ``--hicache-storage-backend`` attaches it, and the two things
  a scheduler does around it: :meth:`Controller.store` (``write_storage``, waits for the
  backup's acknowledgement) and :meth:`Controller.load` (``prefetch``: the hit query,
  host slots for the hit, the IO thread's load, waits for it).
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
from typing import Any

import torch

__all__ = ["Controller", "cpu_runtime", "file_backend", "mamba_pool", "mha_pools", "page_hashes",
           "storage_config"]

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


class Controller:
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
        while op.completed_tokens < hit and time.monotonic() < deadline:
            time.sleep(0.01)
            if op.is_terminated():
                break
        time.sleep(0.05)  # the IO thread's last batch
        return hit, int(op.completed_tokens), idx

    def close(self) -> None:
        self.cc.detach_storage_backend()
