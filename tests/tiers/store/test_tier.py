"""The tiered store through the Tier conformance suite (public API only, via StoreTier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbank.config import BankConfig
from kvbank.testing.tiers import StoreTier, TierTests
from kvbank.tiers.base import Tier
from kvbank.tiers.store.store import TieredStore


class TestStoreHostOnly(TierTests):
    def make_tier(self, budget: int) -> Tier:
        return StoreTier(TieredStore(BankConfig(data_dir=None, host_bytes=budget,
                                                device_bytes=0)))


class TestStoreOverDisk(TierTests):
    """Host over disk: a quarter of the budget in host, the rest on disk."""

    @pytest.fixture(autouse=True)
    def _data_dir(self, tmp_path: Path) -> None:
        self.data_dir = tmp_path

    def make_tier(self, budget: int) -> Tier:
        return StoreTier(TieredStore(BankConfig(
            data_dir=self.data_dir, host_bytes=budget // 4, disk_bytes=budget - budget // 4,
            device_bytes=0, disk_sync=False)))

    def reopen(self, tier: Tier) -> Tier:
        tier.close()
        return self.make_tier(self.budget_pages * self.page_size)
