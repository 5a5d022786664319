"""Unit tests of the row index (:class:`~kvbank.tiers.index.RowIndex`): names and ids,
fields kept across growth, stamps, offsets, dtypes, parents, live rows, ages on a fake
clock. (Renumbering, mark thinning and id compaction: ``test_index.py``.)"""

from __future__ import annotations

import numpy as np
import pytest

from kvbank.errors import InvalidInput
from kvbank.testing.tiers import name_of
from kvbank.tiers.base import TierKind
from kvbank.tiers.index import DEV, DISK, HOST, KIND_OF_BIT, MOVING, RowIndex, tier_bit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _row(ix: RowIndex, i: int, *, size: int = 4096, where: int = HOST, parent: int = -1) -> int:
    rid = ix.add(name_of(i), size, ix.dtype_code("uint8"), parent)
    ix.where[rid] = where
    return rid


def test_index_tier_bits_follow_the_tier_order() -> None:
    assert (DEV, HOST, DISK) == (1, 2, 4)
    assert all(KIND_OF_BIT[tier_bit(k)] is k for k in TierKind)


def test_index_add_names_an_id_and_remove_forgets_it() -> None:
    ix = RowIndex(1 << 20)
    a, b = _row(ix, 0), _row(ix, 1, size=100)
    assert (ix.ids[name_of(0)], ix.ids[name_of(1)]) == (a, b) and len(ix) == 2
    assert (int(ix.size[a]), int(ix.size[b])) == (4096, 100)
    assert ix.names[b] == name_of(1) and ix.high == 2
    ix.remove(a)
    assert name_of(0) not in ix.ids and ix.names[a] is None and len(ix) == 1
    assert int(ix.where[a]) == 0 and int(ix.parent[a]) == -1
    assert ix.high == 2  # an id is never reused at once (a child may still name it)
    assert _row(ix, 2) == 2


def test_index_fields_survive_growing_past_the_first_arrays() -> None:
    ix = RowIndex(1 << 30)
    rids = [_row(ix, i, size=64 + i, where=HOST | DISK, parent=i - 1) for i in range(3000)]
    ix.set_off(rids[5], 5 * 4096)
    assert ix.size.shape[0] >= 3000
    assert [int(ix.size[r]) for r in (0, 1023, 1024, 2999)] == [64, 1087, 1088, 3063]
    assert int(ix.parent[2999]) == 2998 and int(ix.parent[0]) == -1
    assert ix.get_off(rids[5]) == 5 * 4096
    assert int(ix.where[2999]) == HOST | DISK
    assert ix.nbytes() >= 3000 * 18  # ~24 bytes a row of arrays, no object per row


def test_index_touch_stamps_strictly_increase_and_touch_many_keeps_order() -> None:
    ix = RowIndex(1 << 20)
    rids = [_row(ix, i) for i in range(5)]
    first = ix.touch(rids[2])
    assert ix.touch(rids[0]) == first + 1 == int(ix.atime[rids[0]])
    stamps = ix.touch_many(np.asarray([rids[4], rids[1]], dtype=np.int64))
    assert stamps.tolist() == [first + 2, first + 3] and ix.clock == first + 3
    assert int(ix.atime[rids[4]]) < int(ix.atime[rids[1]])
    assert ix.touch_many(np.asarray([], dtype=np.int64)).size == 0 and ix.clock == first + 3


def test_index_offsets_round_trip_narrow_and_wide() -> None:
    narrow = RowIndex(1 << 30)  # offsets >> 6 fit 32 bits
    wide = RowIndex(1 << 40)
    assert not narrow.wide and wide.wide
    a, b = _row(narrow, 0), _row(wide, 0)
    narrow.set_off(a, (1 << 30) - 64)
    wide.set_off(b, (1 << 39) + 64)
    assert narrow.get_off(a) == (1 << 30) - 64 and wide.get_off(b) == (1 << 39) + 64


def test_index_dtype_codes_are_stable_and_bounded() -> None:
    ix = RowIndex(1 << 20)
    assert ix.dtype_code("bfloat16") == ix.dtype_code("bfloat16") == 0
    assert ix.dtype_code("uint8") == 1 and ix.dtypes == ["bfloat16", "uint8"]
    with pytest.raises(InvalidInput, match="dtype"):
        ix.dtype_code("")
    for i in range(253):
        ix.dtype_code(f"d{i}")
    with pytest.raises(InvalidInput, match="255"):
        ix.dtype_code("one-too-many")


def test_index_parent_name_and_live_ids() -> None:
    ix = RowIndex(1 << 20)
    p = _row(ix, 0)
    c = _row(ix, 1, parent=p)
    gone = _row(ix, 2, where=0)  # added, not yet placed in a tier
    assert ix.parent_name(c) == name_of(0) and ix.parent_name(p) is None
    assert ix.live_ids().tolist() == [p, c] and gone not in ix.live_ids().tolist()
    ix.flags[c] |= MOVING
    ix.remove(c)
    assert int(ix.flags[c]) == 0  # a removed row holds no job flag


def test_index_ages_on_a_fake_clock() -> None:
    clock = Clock()
    ix = RowIndex(1 << 20, clock)
    old = _row(ix, 0)
    clock.now += 30
    new = _row(ix, 1)
    clock.now += 2
    assert ix.age_s(old) == 32.0 and ix.age_s(new) == 2.0
    ix.touch(old)
    assert ix.age_s(old) == 0.0
