"""The device tier: conformance on the CPU device, budget from config/NVML, CUDA path."""

from __future__ import annotations

import pytest
import torch

from kvbank.config import BankConfig
from kvbank.testing.tiers import TierTests, name_of, page_of
from kvbank.tiers.base import DeviceSlot, Tier
from kvbank.tiers.device import DevicePool, DeviceTier, device_budget, gpu_memory


class TestDeviceTierOnCpu(TierTests):
    def make_tier(self, budget: int) -> Tier:
        return DeviceTier(budget, "cpu")


def test_device_budget_rules() -> None:
    assert device_budget(BankConfig(device_bytes=0))[0] == 0
    assert device_budget(BankConfig(device="cpu", device_bytes=1 << 20)) == (1 << 20, "")
    off, why = device_budget(BankConfig(device="cpu"))
    assert off == 0 and "explicit device_bytes" in why
    if not torch.cuda.is_available():
        off, why = device_budget(BankConfig(device="cuda"))
        assert off == 0 and "no CUDA device" in why


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
def test_device_tier_on_cuda_round_trips_and_budget_from_nvml() -> None:
    tier = DeviceTier(8 << 20, "cuda")
    try:
        tier.put(name_of(1), page_of(1, 1 << 20))
        out = bytearray(1 << 20)
        assert tier.get_into(name_of(1), out) == 1 << 20
        assert bytes(out) == page_of(1, 1 << 20)
    finally:
        tier.close()
    budget, why = device_budget(BankConfig(device="cuda", device_fraction=0.01))
    reading = gpu_memory()
    if reading is not None:
        assert 0 < budget <= reading.free * 0.01 + 1, why
