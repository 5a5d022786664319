"""The device tier: a pool of uint8 slots per page-size class in torch tensors.

Primitives:

- :func:`gpu_memory` — the GPU's total/free/used memory read through NVML (``pynvml``),
  or ``None`` when there is no NVML or no GPU. The same reading serves the default budget
  and, later, the admin API.
- :func:`device_budget` — the device tier's budget from the config: ``device_bytes`` when
  set (``0`` = off), else NVML free memory × ``device_fraction``; ``(0, reason)`` when
  the tier is off, so the store can say why once (log warning and ``health()``).
- :class:`DevicePool` — slots over chunks of device memory: the same
  :class:`~kvbank.tiers.allocator.SlotAllocator` as the host slab, each claimed chunk one
  ``torch.empty(n, dtype=uint8, device=...)``. A :class:`~kvbank.tiers.base.DeviceSlot`
  names the chunk tensor (``pool``) and the byte offset in it.

Lifecycle: ``DevicePool(budget, device)`` holds nothing until rows arrive; chunks are
allocated on demand up to the budget and freed when another class needs the room or on
``close()``. With ``device="cpu"`` the pool is ordinary memory, which is how the tests
cover its logic on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from dataclasses import dataclass

import numpy as np
import torch

from kvbank.config import BankConfig
from kvbank.errors import InvalidInput, TierUnavailable
from kvbank.kernels.faults import TORCH_ERRORS, torch_fault
from kvbank.tiers.allocator import AllocatorBacked, SlotAllocator
from kvbank.tiers.base import DeviceSlot

logger = logging.getLogger(__name__)

# TORCH_ERRORS / torch_fault: the one torch error table (kvbank.kernels.faults), kept
# importable from here, where the device tier's callers have always found it.


@dataclass(frozen=True, slots=True)
class GpuMemory:
    """One NVML reading of a GPU's memory, in bytes."""

    index: int
    name: str
    total: int
    free: int
    used: int


def _device_index(device: str) -> int:
    _, _, idx = device.partition(":")
    return int(idx) if idx.isdigit() else 0


def gpu_memory(index: int = 0) -> GpuMemory | None:
    """Read GPU ``index``'s memory through NVML; ``None`` without NVML or that GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        logger.debug("NVML unavailable: %s", exc)
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        info = pynvml.nvmlDeviceGetMemoryInfo(handle)
        raw_name = pynvml.nvmlDeviceGetName(handle)
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        return GpuMemory(index, name, int(info.total), int(info.free), int(info.used))
    except pynvml.NVMLError as exc:
        logger.debug("NVML reading of GPU %d failed: %s", index, exc)
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def device_budget(config: BankConfig) -> tuple[int, str]:
    """``(budget, reason)``: the device tier's budget, and why it is 0 when it is off."""
    if config.device_bytes == 0:
        return 0, "device tier off: device_bytes = 0"
    dev = torch.device(config.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        if config.device_bytes is None:  # the default on a CPU machine, not a fault
            return 0, "device tier off: no CUDA device on this machine (none asked for)"
        return 0, f"device tier off: device {config.device!r} but torch sees no CUDA device"
    if config.device_bytes is not None:
        return config.device_bytes, ""
    if dev.type != "cuda":
        return 0, (f"device tier off: device {config.device!r} needs an explicit "
                   "device_bytes (NVML only sizes GPUs)")
    reading = gpu_memory(_device_index(config.device))
    if reading is None:
        return 0, "device tier off: NVML cannot read the GPU's free memory; set device_bytes"
    return int(reading.free * config.device_fraction), ""


class DevicePool(AllocatorBacked):
    """Slots in chunk tensors on one torch device. Not thread-safe (the owner locks)."""

    def __init__(self, budget: int, device: str) -> None:
        try:
            self.device = str(torch.device(device))
        except TORCH_ERRORS as exc:
            raise TierUnavailable(f"device: torch cannot use device {device!r}: {exc}",
                                  field="device") from exc
        self.pool_id = f"pool-{secrets.token_hex(6)}"
        self._chunks: dict[int, torch.Tensor] = {}  # chunk start -> uint8 tensor
        self._alloc = SlotAllocator(budget, on_grow=self._grow, on_release=self._release)
        self._closed = False

    def _grow(self, start: int, nbytes: int) -> None:
        try:
            self._chunks[start] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except TORCH_ERRORS as exc:
            raise torch_fault(f"allocating a {nbytes}-byte chunk on {self.device}", exc) from exc
        logger.debug("device pool %s: claimed %d bytes at %d", self.pool_id, nbytes, start)

    def _release(self, start: int, nbytes: int) -> None:
        del self._chunks[start]
        logger.debug("device pool %s: released %d bytes at %d", self.pool_id, nbytes, start)

    def _locate(self, offset: int) -> tuple[int, torch.Tensor]:
        start = offset // self._alloc.unit * self._alloc.unit
        while start not in self._chunks:  # a chunk spanning several units starts earlier
            start -= self._alloc.unit
        return start, self._chunks[start]

    def tensor(self, offset: int, size: int) -> torch.Tensor:
        """A uint8 view of the slot's first ``size`` bytes."""
        self._check_open()
        start, chunk = self._locate(offset)
        return chunk[offset - start : offset - start + size]

    def write(self, offset: int, data: memoryview) -> None:
        dst = self.tensor(offset, data.nbytes)
        try:
            if dst.device.type == "cpu":
                np.copyto(dst.numpy(), np.frombuffer(data, dtype=np.uint8))
                return
            # torch warns on (and may write through) read-only buffers; stage those once.
            src = data if not data.readonly else memoryview(bytearray(data))
            dst.copy_(torch.frombuffer(src, dtype=torch.uint8))
        except TORCH_ERRORS as exc:
            raise torch_fault(f"copying {data.nbytes} bytes into {self.device}", exc) from exc

    def read_into(self, offset: int, size: int, out: memoryview) -> None:
        dst = torch.from_numpy(np.frombuffer(out, dtype=np.uint8, count=size))
        src = self.tensor(offset, size)
        try:
            dst.copy_(src)
        except TORCH_ERRORS as exc:
            raise torch_fault(f"copying {size} bytes out of {self.device}", exc) from exc

    def slot(self, offset: int, size: int) -> DeviceSlot:
        start, _ = self._locate(offset)
        return DeviceSlot(f"{self.pool_id}/{start}", self.device, offset - start, size)

    def offset_of(self, slot: DeviceSlot) -> int:
        """The pool offset of a slot handed out by :meth:`slot` (InvalidInput if not ours)."""
        pool, _, start_text = slot.pool.partition("/")
        if pool != self.pool_id or not start_text.isdigit() or int(start_text) not in self._chunks:
            raise InvalidInput(f"slot.pool: {slot.pool!r} is not a chunk of pool {self.pool_id}")
        return int(start_text) + slot.offset

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"device tier: pool {self.pool_id} is closed")

    def close(self) -> None:
        self._closed = True
        self._chunks.clear()
