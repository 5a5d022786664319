"""The device pool: SlotPool conformance on the CPU device, budget from config/NVML,
the CUDA path."""

from __future__ import annotations

import pytest
import torch

from kvbank.config import BankConfig
from kvbank.testing.pools import SlotPoolTests
from kvbank.testing.tiers import page_of
from kvbank.tiers.base import DeviceSlot, SlotPool
from kvbank.tiers.device import DevicePool, device_budget, gpu_memory


class TestDevicePoolOnCpu(SlotPoolTests):
    def make_pool(self, budget: int) -> SlotPool:
        return DevicePool(budget, "cpu")


def test_device_budget_rules() -> None:
    assert device_budget(BankConfig(device_bytes=0))[0] == 0
    assert device_budget(BankConfig(device="cpu", device_bytes=1 << 20)) == (1 << 20, "")
    off, why = device_budget(BankConfig(device="cpu"))
    assert off == 0 and "explicit device_bytes" in why
    if not torch.cuda.is_available():
        off, why = device_budget(BankConfig(device="cuda"))
        assert off == 0 and "no CUDA device" in why
        # W20: on a CPU machine with no device budget asked for, health's DEVICE row says
        # so, not that a device was expected ("device 'cuda' but torch sees no CUDA device")
        assert "none asked for" in why and "but torch" not in why
        off, why = device_budget(BankConfig(device="cuda", device_bytes=1 << 20))
        assert off == 0 and "device 'cuda' but torch sees no CUDA device" in why


def test_device_gpu_memory_reading_is_consistent_or_none() -> None:
    reading = gpu_memory()
    if reading is None:
        pytest.skip("no NVML or no GPU on this machine")
    assert 0 <= reading.free <= reading.total
    assert reading.used <= reading.total


def test_device_pool_slots_name_their_chunk() -> None:
    pool = DevicePool(1 << 20, "cpu")
    try:
        off = pool.alloc(5000)
        assert off is not None
        slot = pool.slot(off, 5000)
        assert isinstance(slot, DeviceSlot) and slot.device == "cpu" and slot.size == 5000
        assert pool.offset_of(slot) == off
        pool.tensor(off, 5000).fill_(7)
        assert int(pool.tensor(off, 5000).sum()) == 7 * 5000
        with pytest.raises(Exception, match="not a chunk"):
            pool.offset_of(DeviceSlot("pool-other/0", "cpu", 0, 10))
    finally:
        pool.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_pool_on_cuda_round_trips_and_budget_from_nvml() -> None:
    pool = DevicePool(8 << 20, "cuda")
    try:
        off = pool.alloc(1 << 20)
        assert off is not None
        pool.write(off, memoryview(page_of(1, 1 << 20)))
        out = memoryview(bytearray(1 << 20))
        pool.read_into(off, 1 << 20, out)
        assert out.tobytes() == page_of(1, 1 << 20)
    finally:
        pool.close()
    budget, why = device_budget(BankConfig(device="cuda", device_fraction=0.01))
    reading = gpu_memory()
    if reading is not None:
        assert 0 < budget <= reading.free * 0.01 + 1, why
