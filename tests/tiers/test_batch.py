"""Batch puts and reads of the store keep each row's guarantees (put_many, get_many_into)."""

from __future__ import annotations

import pytest

from kvbank.errors import InvalidInput, PageSizeMismatch
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.base import TierKind

from .conftest import MakeStore

P = 64 << 10


def test_put_many_skips_locked_rows_and_stores_the_rest(make_store: MakeStore) -> None:
    store = make_store(host_bytes=8 << 20, copy_threads=2)
    store.locks.lock([name_of(2)], "lease-1")
    rows = [(name_of(i), page_of(i, P), name_of(i - 1) if i else None) for i in range(5)]
    assert store.put_many(rows) == [True, True, False, True, True]
    assert store.locate([name_of(i) for i in range(5)]) == [
        TierKind.HOST, TierKind.HOST, None, TierKind.HOST, TierKind.HOST]
    outs = [bytearray(P) for _ in range(6)]
    got = store.get_many_into([name_of(i) for i in range(6)], outs)
    assert got == [P, P, None, P, P, None]
    assert [bytes(o) for o in outs[:2]] == [page_of(0, P), page_of(1, P)]
    store.locks.unlock_all("lease-1")


def test_put_many_refusal_stores_nothing_and_leaks_no_slot(make_store: MakeStore) -> None:
    store = make_store(host_bytes=8 << 20)
    store.put(name_of(3), page_of(3, P))
    before = store.stats().tiers[1].used_bytes
    rows = [(name_of(i), page_of(i, P if i != 3 else 2 * P), None) for i in range(5)]
    with pytest.raises(PageSizeMismatch):
        store.put_many(rows)
    assert store.locate([name_of(i) for i in (0, 1, 2, 4)]) == [None] * 4
    assert store.stats().tiers[1].used_bytes == before
    store.check_invariants()


def test_put_many_write_through_is_one_durable_batch(make_store: MakeStore, tmp_path) -> None:
    store = make_store(host_bytes=8 << 20, write_policy="write-through", disk_sync=True)
    rows = [(name_of(i), page_of(i, P), None) for i in range(6)]
    assert store.put_many(rows) == [True] * 6
    assert all(TierKind.DISK in r for r in store.residency([n for n, _, _ in rows]))
    store.close(persist=False)  # memory copies dropped as a crash would
    again = make_store(host_bytes=8 << 20)
    outs = [bytearray(P) for _ in rows]
    assert again.get_many_into([n for n, _, _ in rows], outs) == [P] * 6
    assert [bytes(o) for o in outs] == [p for _, p, _ in rows]


def test_put_many_with_no_memory_room_goes_to_disk(make_store: MakeStore) -> None:
    store = make_store(host_bytes=0)
    rows = [(name_of(i), page_of(i, P), None) for i in range(4)]
    assert store.put_many(rows) == [True] * 4
    assert store.locate([n for n, _, _ in rows]) == [TierKind.DISK] * 4
    outs = [bytearray(P) for _ in rows]
    assert store.get_many_into([n for n, _, _ in rows], outs) == [P] * 4
    assert [bytes(o) for o in outs] == [p for _, p, _ in rows]


def test_get_many_into_refuses_a_small_buffer_before_holding_anything(make_store: MakeStore) -> None:
    store = make_store(host_bytes=8 << 20)
    store.put_many([(name_of(i), page_of(i, P), None) for i in range(3)])
    gets = store.stats().gets
    with pytest.raises(InvalidInput, match=r"outs\[1\]"):
        store.get_many_into([name_of(0), name_of(1)], [bytearray(P), bytearray(P - 1)])
    with pytest.raises(InvalidInput, match="outs"):
        store.get_many_into([name_of(0)], [])
    assert store.stats().gets == gets  # nothing was counted or touched
    store.check_invariants()
