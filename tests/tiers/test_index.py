"""The row index: clock renumbering keeps the LRU order and the ages; id compaction."""

from __future__ import annotations

import numpy as np

from kvbank.testing.tiers import name_of
from kvbank.tiers.index import HOST, RowIndex


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_index_renumber_keeps_the_lru_order_and_the_ages() -> None:
    clock = Clock()
    ix = RowIndex(1 << 20, clock)
    for i in range(10):
        rid = ix.add(name_of(i), 100, 0, -1)
        ix.where[rid] = HOST
        clock.now += 1.0
    ix.touch(3)
    order = list(np.argsort(ix.atime[:10]))
    ages = [ix.age_s(r) for r in range(10)]
    ix.renumber()
    assert list(np.argsort(ix.atime[:10])) == order
    assert ix.clock == 10 and sorted(ix.atime[:10].tolist()) == list(range(1, 11))
    assert [ix.age_s(r) for r in range(10)] == ages
    assert ages[3] == 0.0 and ages[0] == 10.0


def test_index_ages_stay_bounded_with_many_marks() -> None:
    clock = Clock()
    ix = RowIndex(1 << 20, clock)
    rid = ix.add(name_of(0), 100, 0, -1)
    for _ in range(10_000):
        clock.now += 0.1
        ix.touch(rid)
    assert ix.marks <= 4096  # thinned, never unbounded
    clock.now += 5
    assert abs(ix.age_s(rid) - 5) < 1e-6  # the newest mark stays exact


def test_index_removed_ids_are_reused_only_after_parent_links_are_cleared() -> None:
    ix = RowIndex(1 << 20)
    parent = ix.add(name_of(0), 100, 0, -1)
    child = ix.add(name_of(1), 100, 0, parent)
    ix.remove(parent)
    for i in range(2, 70):  # enough removals to trigger the vectorised pass
        ix.remove(ix.add(name_of(i), 100, 0, -1))
    assert int(ix.parent[child]) == -1
    again = ix.add(name_of(99), 100, 0, -1)
    assert again != child and ix.names[again] == name_of(99)
