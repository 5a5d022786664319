"""The slot allocator of the memory tiers: classes, chunks, the budget, reuse.

Direct tests of :class:`~kvbank.tiers.allocator.SlotAllocator` (the host slab and the device
pool only add where the bytes live), plus a Hypothesis run of random allocs and frees
against the rules every caller relies on: live slots never overlap, each lies inside a
claimed chunk and holds its row, claimed memory never passes the budget, and the
counters agree with the chunks (``check``).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from kvbank.tiers.allocator import PAGE_ALIGN, SMALL_ALIGN, SlotAllocator, choose_unit, slot_class


class _Recorder:
    """The allocator's grow/release callbacks, recorded (what the pools make real)."""

    def __init__(self, fail_grow: bool = False) -> None:
        self.grown: list[tuple[int, int]] = []
        self.released: list[tuple[int, int]] = []
        self.fail_grow = fail_grow

    def grow(self, start: int, nbytes: int) -> None:
        if self.fail_grow:
            raise MemoryError("injected: no memory for the chunk")
        self.grown.append((start, nbytes))

    def release(self, start: int, nbytes: int) -> None:
        self.released.append((start, nbytes))


def _alloc(budget: int, rec: _Recorder | None = None) -> tuple[SlotAllocator, _Recorder]:
    rec = rec or _Recorder()
    return SlotAllocator(budget, on_grow=rec.grow, on_release=rec.release), rec


def test_slots_class_rounds_small_rows_to_64_and_pages_to_4k() -> None:
    assert [slot_class(n) for n in (1, 64, 65, 4095)] == [64, 64, 128, 4096]
    assert [slot_class(n) for n in (4096, 4097, 8192)] == [4096, 8192, 8192]


def test_slots_unit_is_about_a_64th_of_the_budget_and_aligned() -> None:
    assert choose_unit(64 << 20) == 1 << 20
    assert choose_unit(1 << 30) % PAGE_ALIGN == 0
    assert choose_unit(4096) == SMALL_ALIGN  # tiny budgets: 64-byte units
    assert choose_unit(1 << 40) == 64 << 20  # capped


def test_slots_grow_in_chunks_only_when_a_class_has_no_free_slot() -> None:
    a, rec = _alloc(1 << 20)  # 16 KiB units: four 4 KiB slots a chunk
    offs = [a.alloc(4096) for _ in range(4)]
    assert offs == [0, 4096, 8192, 12288]
    assert rec.grown == [(0, a.unit)] and a.allocated_bytes == a.unit
    fifth = a.alloc(4096)
    assert fifth == a.unit and len(rec.grown) == 2  # the second chunk
    assert a.used_bytes == 5 * 4096 and a.slots_in_use() == 5
    a.check()


def test_slots_freed_slot_is_reused_before_a_new_chunk() -> None:
    a, rec = _alloc(1 << 20)
    offs = [a.alloc(4096) for _ in range(4)]
    assert offs[1] is not None
    a.free(offs[1])
    assert a.alloc(4096) == offs[1]
    assert len(rec.grown) == 1
    a.check()


def test_slots_budget_is_never_exceeded_and_a_full_tier_answers_none() -> None:
    a, _ = _alloc(64 * 1024)  # 64 units of 1 KiB
    got = [a.alloc(1024) for _ in range(64)]
    assert None not in got and len(set(got)) == 64
    assert a.alloc(1024) is None and a.alloc(64) is None  # no unit left for another class
    assert a.allocated_bytes == a.budget
    a.check()


def test_slots_empty_chunks_of_one_class_are_released_for_another() -> None:
    a, rec = _alloc(64 * 1024)
    small = [a.alloc(1024) for _ in range(64)]
    for off in small:
        assert off is not None
        a.free(off)
    assert a.allocated_bytes == a.budget  # empty chunks stay claimed ...
    big = a.alloc(8192)  # ... until another class needs their units
    assert big is not None and rec.released
    a.check()


def test_slots_a_row_no_chunk_can_hold_does_not_fit() -> None:
    a, _ = _alloc(64 * 1024)
    assert a.fits(64 * 1024) and not a.fits(64 * 1024 + 1)
    assert a.alloc(64 * 1024 + 1) is None
    empty, _ = _alloc(0)
    assert not empty.fits(64) and empty.alloc(64) is None


def test_slots_failed_grow_changes_nothing() -> None:
    rec = _Recorder(fail_grow=True)
    a, _ = _alloc(1 << 20, rec)
    with pytest.raises(MemoryError):
        a.alloc(4096)
    assert (a.allocated_bytes, a.used_bytes, a.chunk_spans()) == (0, 0, [])
    rec.fail_grow = False
    assert a.alloc(4096) == 0
    a.check()


def test_slots_free_of_a_non_slot_is_refused() -> None:
    a, _ = _alloc(1 << 20)
    off = a.alloc(4096)
    assert off is not None
    with pytest.raises(ValueError, match="not a slot"):
        a.free(off + 64)
    assert a.is_slot(off) and not a.is_slot(off + 64) and not a.is_slot(a.space_bytes)
    assert a.capacity(off) == 4096
    with pytest.raises(ValueError, match="claimed chunk"):
        a.capacity(a.space_bytes - a.unit)


@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.tuples(hs.booleans(), hs.integers(1, 20_000), hs.integers(0, 10**6)),
                max_size=120))
def test_slots_random_allocs_and_frees_keep_every_rule(steps: list[tuple[bool, int, int]]) -> None:
    a, _ = _alloc(256 * 1024)
    live: dict[int, int] = {}  # offset -> capacity
    for is_alloc, size, pick in steps:
        if is_alloc or not live:
            off = a.alloc(size)
            if off is None:
                assert live or not a.fits(size)  # an empty tier refuses only what never fits
                continue
            cap = a.capacity(off)
            assert cap == slot_class(size) and off % (PAGE_ALIGN if cap >= PAGE_ALIGN else SMALL_ALIGN) == 0
            assert off not in live
            live[off] = cap
        else:
            off = sorted(live)[pick % len(live)]
            a.free(off)
            del live[off]
        spans = sorted(live.items())
        for (o1, c1), (o2, _) in itertools.pairwise(spans):
            assert o1 + c1 <= o2, "two live slots overlap"
        assert all(o + c <= a.space_bytes for o, c in spans)
        assert a.used_bytes == sum(live.values()) <= a.allocated_bytes <= a.budget
        a.check()
    for off in list(live):
        a.free(off)
    a.release_empty()
    assert (a.used_bytes, a.allocated_bytes) == (0, 0)
