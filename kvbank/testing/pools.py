"""The conformance suite every :class:`~kvbank.tiers.base.SlotPool` passes.

Subclass :class:`SlotPoolTests`, name it ``Test…`` and implement :meth:`make_pool`::

    class TestHostSlab(SlotPoolTests):
        def make_pool(self, budget: int) -> SlotPool:
            return HostSlab(budget, prefix="kvbank-test")

Each rule is checked through the pool's own methods: slots within the budget, distinct
and reusable, capacity of a size class, bytes written read back unchanged (and neighbours
untouched), the allocator's own check after every step, close idempotent.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

import pytest

from kvbank.errors import TierUnavailable
from kvbank.tiers.allocator import slot_class
from kvbank.tiers.base import DeviceSlot, HostSlot, SlotPool

from .tiers import page_of


class SlotPoolTests(abc.ABC):
    budget = 1 << 20

    @abc.abstractmethod
    def make_pool(self, budget: int) -> SlotPool:
        """A fresh, empty pool with this byte budget."""

    @pytest.fixture
    def pool(self) -> Iterator[SlotPool]:
        p = self.make_pool(self.budget)
        try:
            yield p
        finally:
            p.close()

    def test_pool_alloc_gives_distinct_slots_within_the_budget(self, pool: SlotPool) -> None:
        offs = []
        while (off := pool.alloc(4096)) is not None:
            offs.append(off)
            assert pool.allocated_bytes <= pool.budget
        assert offs and len(set(offs)) == len(offs)
        assert pool.used_bytes == len(offs) * slot_class(4096)
        pool.allocator.check()
        for off in offs:
            pool.free(off)
        assert pool.used_bytes == 0
        pool.allocator.check()

    def test_pool_capacity_is_the_size_class(self, pool: SlotPool) -> None:
        for size in (1, 100, 4095, 4096, 5000):
            off = pool.alloc(size)
            assert off is not None
            assert pool.capacity(off) == slot_class(size) >= size
            assert pool.allocator.is_slot(off)
        assert pool.fits(self.budget // 2) and not pool.fits(self.budget * 2)

    def test_pool_write_then_read_round_trips_and_leaves_neighbours(self, pool: SlotPool) -> None:
        a, b = pool.alloc(5000), pool.alloc(5000)
        assert a is not None and b is not None
        pool.write(a, memoryview(page_of(1, 5000)))
        pool.write(b, memoryview(page_of(2, 5000)))
        pool.write(a, memoryview(page_of(3, 5000)))
        out = memoryview(bytearray(5000))
        pool.read_into(b, 5000, out)
        assert out.tobytes() == page_of(2, 5000)
        pool.read_into(a, 5000, out)
        assert out.tobytes() == page_of(3, 5000)

    def test_pool_freed_slot_is_reused(self, pool: SlotPool) -> None:
        off = pool.alloc(4096)
        assert off is not None
        pool.free(off)
        assert pool.alloc(4096) == off

    def test_pool_slot_names_its_location(self, pool: SlotPool) -> None:
        off = pool.alloc(300)
        assert off is not None
        slot = pool.slot(off, 300)
        assert isinstance(slot, (HostSlot, DeviceSlot)) and slot.size == 300

    def test_pool_zero_budget_allocates_nothing(self) -> None:
        p = self.make_pool(0)
        try:
            assert p.alloc(1) is None and not p.fits(1)
        finally:
            p.close()

    def test_pool_close_is_idempotent_and_refuses_copies(self) -> None:
        p = self.make_pool(self.budget)
        off = p.alloc(100)
        assert off is not None
        p.close()
        p.close()
        with pytest.raises(TierUnavailable):
            p.write(off, memoryview(b"x" * 100))
