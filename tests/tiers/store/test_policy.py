"""The eviction rules (kvbank.tiers.store.policy): the value rule's order, its bounds,
and the guarantees both rules keep (kept, busy and moving rows never chosen, chains
from their tail)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.config import BankConfig, EvictionPolicy
from kvbank.errors import ConfigError
from kvbank.testing.tiers import name_of
from kvbank.tiers.index import HOST, MOVING, ReuseHistory, RowIndex
from kvbank.tiers.store import policy

from ..conftest import MakeStore

VALUE, LRU = EvictionPolicy.VALUE, EvictionPolicy.LRU


def _index(n: int, parents: list[int] | None = None) -> RowIndex:
    ix = RowIndex(1 << 30)
    for i in range(n):
        rid = ix.add(name_of(i), 64, 0, parents[i] if parents else -1)
        ix.where[rid] = HOST
        ix.set_off(rid, 64 * i)
    return ix


def _victims(ix: RowIndex, need: int, rule: EvictionPolicy, keep: tuple[int, ...] = (),
             busy: frozenset[int] = frozenset()) -> list[int]:
    return policy.victims(ix, HOST, need, keep=keep, busy_offs=set(busy), host_copy={},
                          charge=lambda rid: 64, rule=rule)


def test_value_rule_keeps_a_reused_row_that_lru_evicts() -> None:
    """A row read once since its put (used twice) outlives rows put after it that were
    never read; LRU takes it first because its last use is the oldest. (The head start
    is REUSE_SPAN times the rows the index held at the read: eight here.)"""
    ix = _index(8)
    ix.touch(0)  # read: used twice
    for i in range(1, 8):
        ix.remove(i)
    fresh = []
    for i in range(8, 15):
        rid = ix.add(name_of(i), 64, 0, -1)
        ix.where[rid] = HOST
        ix.set_off(rid, 64 * rid)
        fresh.append(rid)
    assert _victims(ix, 64, LRU) == [0]
    assert _victims(ix, 64, VALUE) == [fresh[0]]
    assert 0 not in _victims(ix, 64 * 7, VALUE)[:7]
    assert _victims(ix, 64 * 8, VALUE)[-1] == 0  # the last to go, but it can go


def test_value_rule_head_start_is_bounded() -> None:
    """A reused row that stops being used ages out: once more than REUSE_SPAN index-fulls
    of first-time rows came after it, it goes before them."""
    n = 4
    ix = _index(n)
    ix.touch(0)  # reused: a head start of REUSE_SPAN * 4 stamps
    others = list(range(1, n))
    # Fresh first-time rows replace the others, one stamp each: row 0 goes first exactly
    # when the oldest of them is newer than its stamp plus the head start.
    for i in range(policy.REUSE_SPAN * n + n - 1):
        assert _victims(ix, 64, VALUE) != [0]
        ix.remove(others.pop(0))
        rid = ix.add(name_of(100 + i), 64, 0, -1)
        ix.where[rid] = HOST
        ix.set_off(rid, 64 * rid)
        others.append(rid)
    assert _victims(ix, 64, VALUE) == [0]
    assert _victims(ix, 64, LRU) == [0]


def test_value_keys_are_written_at_each_use() -> None:
    """The index writes the value key beside the stamp: twice the stamp for a first-time
    row, twice the stamp plus the head start, plus one, for a reused row; a renumbering
    keeps the order and the head start."""
    n = 6
    ix = _index(n)
    ix.touch(2)
    ix.touch_many(np.asarray([4, 5], dtype=np.int64))
    head = policy.REUSE_SPAN * n
    for rid in range(n):
        reused = int(ix.freq[rid]) >= policy.REUSED
        assert reused == (rid in (2, 4, 5))
        assert int(ix.vkey[rid]) == 2 * (int(ix.atime[rid]) + reused * head) + reused
    idx = np.arange(n, dtype=np.int64)
    before = idx[np.argsort(policy.keys(ix, idx, VALUE))].tolist()
    assert before == [0, 1, 3, 2, 4, 5]
    ix.renumber()
    assert idx[np.argsort(policy.keys(ix, idx, VALUE))].tolist() == before
    assert int(ix.vkey[2]) == 2 * (int(ix.atime[2]) + head) + 1


def test_reuse_history_remembers_an_evicted_row() -> None:
    """A row that leaves the index and is put again starts as reused (the history), so a
    prompt that comes back is told from a one-time prompt."""
    ix = _index(2)
    ix.remove(0)
    again = ix.add(name_of(0), 64, 0, -1)
    assert int(ix.freq[again]) == 2
    assert int(ix.freq[1]) == 1


def test_reuse_history_halves_and_grows_without_losing_counts() -> None:
    h = ReuseHistory(bits=8)
    names = [name_of(i) for i in range(8)]
    for name in names:
        h.note(name)
    h.note(names[0])
    assert h.seen(names[0]) >= 2 and h.seen(b"never noted" * 5) <= 1
    h.fit(1024)  # tiles: every count stays readable under the wider mask
    assert h.counts.shape[0] >= 4096
    assert h.seen(names[0]) >= 2 and all(h.seen(n) >= 1 for n in names)
    for i in range(h.counts.shape[0]):  # a quarter of the table in notes halves it
        h.note(b"other" + i.to_bytes(4, "big"))
    assert h.seen(names[0]) <= 1


@settings(max_examples=60, deadline=None)
@given(data=st.data(), rule=st.sampled_from([VALUE, LRU]))
def test_victims_keep_every_guarantee(data: st.DataObject, rule: EvictionPolicy) -> None:
    """Under either rule: no kept, busy or moving row is chosen, no row twice, a row
    never before an evictable child (chains go from their tail), enough bytes freed when
    enough are evictable, and the chunked order equals one full sort of the keys."""
    n = data.draw(st.integers(1, 80))
    parents = [data.draw(st.integers(-1, i - 1)) if i else -1 for i in range(n)]
    ix = _index(n, parents)
    if data.draw(st.booleans()):  # a late clock: the next use renumbers stamps and value keys
        ix.clock = 2**31
    for rid in data.draw(st.lists(st.integers(0, n - 1), max_size=60)):
        ix.touch(rid)
    keep = tuple(data.draw(st.lists(st.integers(0, n - 1), max_size=10)))
    moving = data.draw(st.lists(st.integers(0, n - 1), max_size=5))
    for rid in moving:
        ix.flags[rid] |= MOVING
    busy = frozenset(64 * r for r in data.draw(st.lists(st.integers(0, n - 1), max_size=5)))
    need = data.draw(st.integers(1, 64 * n))
    out = _victims(ix, need, rule, keep, busy)
    assert len(out) == len(set(out))
    banned = set(keep) | set(moving) | {o // 64 for o in busy}
    assert not set(out) & banned
    evictable = set(range(n)) - banned
    for pos, rid in enumerate(out):  # each evictable child of rid went before it
        kids = [c for c in evictable if parents[c] == rid]
        assert all(c in out[:pos] for c in kids), (rid, kids, out)
    if 64 * len(evictable) >= need:
        assert 64 * len(out) >= need
    full = policy.victims(ix, HOST, need, keep=keep, busy_offs=set(busy), host_copy={},
                          charge=lambda rid: 64, rule=rule, first_k=10**9)
    chunked = policy.victims(ix, HOST, need, keep=keep, busy_offs=set(busy), host_copy={},
                             charge=lambda rid: 64, rule=rule, first_k=1)
    assert chunked == full == out
    idx = np.asarray(sorted(set(range(n)) - set(moving)), dtype=np.int64)
    by_keys = idx[np.argsort(policy.keys(ix, idx, rule))].tolist()
    assert list(policy.order(ix, idx, need, 1, rule)) == by_keys


def test_store_evicts_first_time_rows_before_reused_ones(make_store: MakeStore) -> None:
    """End to end through the store: with the value rule the default, a full host tier
    drops pages that were put once before a page that was read back."""
    store = make_store(data_dir=None, host_bytes=8 * 4096, high_watermark=1.0, low_watermark=0.9)
    assert store.config.eviction_policy is VALUE
    page = b"\x01" * 4096
    store.put(name_of(0), page)
    out = bytearray(4096)
    assert store.get_into(name_of(0), out) == 4096
    for i in range(1, 12):
        store.put(name_of(i), page)
    assert store.get_into(name_of(0), out) == 4096
    assert store.get_into(name_of(1), out) is None


def test_eviction_policy_setting() -> None:
    assert BankConfig().eviction_policy is VALUE
    assert BankConfig(eviction_policy="lru").eviction_policy is LRU  # type: ignore[arg-type]
    assert BankConfig.from_env({"KVBANK_EVICTION_POLICY": "lru"}).eviction_policy is LRU
    with pytest.raises(ConfigError, match="eviction_policy"):
        BankConfig(eviction_policy="arc")  # type: ignore[arg-type]


def test_store_counts_victims_by_reason_and_bytes_admitted_and_refused(
        make_store: MakeStore) -> None:
    """The host tier counts what its puts stored, what it refused for want of room (all
    rows locked, no disk), and each victim as first-time or reused."""
    from kvbank.errors import TierFull
    from kvbank.tiers.base import TierKind

    store = make_store(data_dir=None, host_bytes=4 * 4096, high_watermark=1.0, low_watermark=0.9)
    page = b"\x01" * 4096
    out = bytearray(4096)
    store.put(name_of(0), page)
    store.get_into(name_of(0), out)  # reused
    for i in range(1, 4):
        store.put(name_of(i), page)
    for i in range(4, 7):  # three first-time rows go
        store.put(name_of(i), page)
    for _ in range(4 * policy.REUSE_SPAN + 1):  # keep the others in use until row 0 ages out
        for i in range(4, 7):
            store.get_into(name_of(i), out)
    store.put(name_of(7), page)
    host = store.stats().tier(TierKind.HOST)
    assert (host.victims_first, host.victims_reused) == (3, 1)
    assert host.admitted_bytes == 8 * 4096 and host.rejected_bytes == 0
    store.locks.lock([name_of(i) for i in (4, 5, 6, 7)], "t")
    with pytest.raises(TierFull):
        store.put(name_of(8), page)
    assert store.stats().tier(TierKind.HOST).rejected_bytes == 4096
    store.locks.unlock_all("t")


@settings(max_examples=60, deadline=None)
@given(picks=st.integers(0, 300).flatmap(lambda n: st.lists(st.integers(0, 40), min_size=n, max_size=n)),
       notes=st.integers(0, 63))
def test_reuse_history_notes_a_batch_as_one_by_one(picks: list[int], notes: int) -> None:
    """``note_many`` leaves the same counts as ``note`` of each name in turn: repeats in
    one batch add up, a count stops at 255, and the halving falls after the same note
    (a table of 256 slots halves every 64 notes, some of them before the batch)."""
    one, many = ReuseHistory(bits=8), ReuseHistory(bits=8)
    for i in range(notes):
        one.note(b"before" + bytes([i]))
        many.note(b"before" + bytes([i]))
    start = np.minimum(one.counts.astype(np.int64) * 60, 255).astype(np.uint8)  # near the cap
    one.counts[:] = start
    many.counts[:] = start
    names = [name_of(i) for i in picks]
    for name in names:
        one.note(name)
    many.note_many(names)
    assert np.array_equal(one.counts, many.counts)
    assert one._notes == many._notes
