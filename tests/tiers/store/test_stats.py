"""The store's counters agree with each other, corrupt reads included.

A read is counted once in the store (a hit or a miss) and once in each enabled tier it
asked, fastest first: a hit in the tier that answered, a miss in each faster one. A frame
that fails its checks makes the read a miss in the disk tier and in the store, and one of
the disk tier's ``corrupt_rows``: never a hit anywhere.
"""

from __future__ import annotations

from pathlib import Path

from kvbank.results import StoreStats
from kvbank.testing.diskrot import flip_frame_byte
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.base import TierKind
from kvbank.tiers.store.store import TieredStore

from ..conftest import MakeStore

P = 4096
K, H, D = TierKind.DEVICE, TierKind.HOST, TierKind.DISK


def assert_counters_agree(st: StoreStats) -> None:
    """The accounting identities of :class:`StoreStats` (see its docstring)."""
    assert st.gets == st.hits + st.misses, st
    assert st.hits == sum(t.hits for t in st.tiers) + st.remote_hits, st
    asked = st.gets  # reads reaching each enabled tier, fastest first
    for t in st.tiers:
        if not t.enabled:
            assert (t.hits, t.misses) == (0, 0), t  # a tier that is off answers nothing
            continue
        assert t.hits + t.misses == asked, (t, asked)
        asked = t.misses
    assert asked == st.misses + st.remote_hits, st  # the slowest tier's misses


def _corrupt_frames(data_dir: Path, rows: list[int]) -> None:
    """Flip the last byte of each row's stored frame (bit rot in the payload)."""
    for i in rows:
        flip_frame_byte(data_dir, name_of(i), -1, 0xFF)


def _store_on_disk(make_store: MakeStore, tmp_path: Path, corrupt: list[int]) -> TieredStore:
    """Rows 0-5 written through, the store reopened (rows on disk only), some frames damaged."""
    cfg = {"host_bytes": 32 * 1024, "disk_bytes": 1 << 20}
    first = make_store(write_policy="write-through", **cfg)
    for i in range(6):
        first.put(name_of(i), page_of(i, P))
    first.close()
    _corrupt_frames(tmp_path / "data", corrupt)
    return make_store(**cfg)


def test_store_counters_after_a_corrupt_read_count_a_miss_not_a_hit(
        make_store: MakeStore, tmp_path: Path) -> None:
    """Regression: a disk read whose frame failed its checks was counted a hit in the disk
    tier and then turned into a miss in the store's totals only, so the per-tier hits
    disagreed with the store's."""
    s = _store_on_disk(make_store, tmp_path, corrupt=[1])
    assert s.get_into(name_of(1), bytearray(P)) is None
    st = s.stats()
    assert (st.gets, st.hits, st.misses) == (1, 0, 1)
    assert (st.tier(D).hits, st.tier(D).misses, st.tier(D).corrupt_rows) == (0, 1, 1)
    assert_counters_agree(st)


def test_store_counters_agree_over_hits_misses_and_corrupt_rows(
        make_store: MakeStore, tmp_path: Path) -> None:
    s = _store_on_disk(make_store, tmp_path, corrupt=[1, 2, 3])
    out = bytearray(P)
    assert s.get_into(name_of(0), out) == P and bytes(out) == page_of(0, P)  # disk, promoted
    assert s.get_into(name_of(0), out) == P  # now a host hit
    assert s.get_into(name_of(1), out) is None  # corrupt
    assert s.get_into(name_of(99), out) is None  # never stored
    got = s.get_many_into([name_of(i) for i in (2, 3, 4, 5, 98)], [bytearray(P) for _ in range(5)])
    assert got == [None, None, P, P, None]
    st = s.stats()
    assert (st.gets, st.hits, st.misses) == (9, 4, 5)
    assert (st.tier(H).hits, st.tier(D).hits, st.tier(D).corrupt_rows) == (1, 3, 3)
    assert_counters_agree(st)
    s.check_invariants()


def test_store_counters_skip_tiers_that_are_off(make_store: MakeStore) -> None:
    """No device and no disk: a miss is counted in the host tier only."""
    s = make_store(data_dir=None, host_bytes=1 << 20)
    s.put(name_of(1), page_of(1, P))
    s.get_into(name_of(1), bytearray(P))
    s.get_into(name_of(2), bytearray(P))
    st = s.stats()
    assert not st.tier(K).enabled and not st.tier(D).enabled
    assert (st.tier(H).hits, st.tier(H).misses) == (1, 1)
    assert_counters_agree(st)
