"""The store's admin and fleet operations: scan, evict, pin, touch, the change feed,
read_frame; bounded waits (Busy) and the lock order."""

from __future__ import annotations

import threading

import pytest

from kvbank.codec import decode_into
from kvbank.errors import Busy, InvalidInput, InvalidRowName, PinBudgetExceeded, TierFull
from kvbank.results import EventKind
from kvbank.testing.tiers import name_of, page_of, stored
from kvbank.tiers import lockorder
from kvbank.tiers.base import TierKind
from kvbank.tiers.store.store import Copier, TieredStore

from ..conftest import MakeStore

H, D = TierKind.HOST, TierKind.DISK
P = 4096


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _names(tag: bytes, n: int) -> list[bytes]:
    return [name_of(i, tag) for i in range(n)]


def test_store_scan_pages_in_name_order_by_prefix(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=1 << 20)
    a, b = _names(b"a", 7), _names(b"b", 3)
    for n in b + a:
        s.put(n, page_of(1, 100))
    s.locks.lock([a[2]], "lease-x")
    prefix = a[0][:46]  # the common head of the a-names
    got, after = [], None
    while page := s.scan(prefix, after=after, limit=3):
        got.extend(page)
        after = page[-1].name
    assert [r.name for r in got] == sorted(a)
    assert all(r.size == 100 and r.tiers == frozenset({H}) for r in got)
    assert got[2].holders == frozenset({"lease-x"}) and not got[2].pinned
    assert len(s.scan(limit=100)) == 10
    assert s.scan(b"\xff", limit=5) == []
    s.locks.unlock_all("lease-x")


def test_store_scan_is_pure_and_checks_its_input(make_store: MakeStore) -> None:
    """A listing neither locks nor refreshes LRU: the listed row is still the victim."""
    s = make_store(data_dir=None, host_bytes=64 * 1024, high_watermark=0.99, low_watermark=0.9)
    for i in range(10):
        s.put(name_of(i), page_of(i, P))
    for _ in range(3):
        s.scan(name_of(0), limit=1)
    for i in range(10, 17):
        s.put(name_of(i), page_of(i, P))
    assert stored(s, [name_of(0)]) == [False]
    with pytest.raises(InvalidInput):
        s.scan(limit=0)
    with pytest.raises(InvalidInput):
        s.scan(b"x" * 55, limit=1)
    with pytest.raises(InvalidRowName):
        s.scan(after=b"short", limit=1)


def test_store_scan_reports_age_from_the_store_clock(make_store: MakeStore) -> None:
    clock = FakeClock()
    s = TieredStore(make_store(data_dir=None, host_bytes=1 << 20).config, clock=clock)
    try:
        s.put(name_of(1), page_of(1, 100))
        clock.now += 30
        s.put(name_of(2), page_of(2, 100))
        clock.now += 10
        ages = {r.name: r.age_s for r in s.scan(limit=10)}
        assert ages[name_of(1)] == pytest.approx(40, abs=0.01)
        assert ages[name_of(2)] == pytest.approx(10, abs=0.01)
        assert s.touch([name_of(1), name_of(9)]) == 1  # recency without a read
        assert s.scan(name_of(1), limit=1)[0].age_s == pytest.approx(0, abs=0.01)
    finally:
        s.close()


def test_store_touch_records_recency_so_the_row_outlives_older_ones(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=64 * 1024, high_watermark=0.99, low_watermark=0.9)
    for i in range(14):
        s.put(name_of(i), page_of(i, P))
    s.touch([name_of(0)])
    for i in range(14, 17):
        s.put(name_of(i), page_of(i, P))
    s.flush()
    assert stored(s, [name_of(0), name_of(1)]) == [True, False]
    st = s.stats()
    assert st.gets == 0  # touched, never read


def test_store_evict_drops_rows_everywhere_and_reports_the_rest(make_store: MakeStore) -> None:
    s = make_store(host_bytes=1 << 20, disk_bytes=1 << 20, write_policy="write-through")
    for i in range(4):
        s.put(name_of(i), page_of(i, P))
    s.locks.lock([name_of(1)], "lease")
    s.pin([name_of(2)])
    res = s.evict([name_of(0), name_of(1), name_of(2), name_of(9), name_of(0)])
    assert res.evicted == (name_of(0),) and res.locked == (name_of(1),)
    assert res.pinned == (name_of(2),) and res.missing == (name_of(9),)
    assert stored(s, [name_of(i) for i in range(4)]) == [False, True, True, True]
    s.flush()
    s.check_invariants()  # the disk frame of row 0 is purged too
    s.locks.unlock_all("lease")
    s.close()
    again = make_store(host_bytes=1 << 20, disk_bytes=1 << 20)
    assert stored(again, [name_of(0), name_of(3)]) == [False, True]


def test_store_pinned_rows_are_never_evicted_and_the_budget_is_typed(
    make_store: MakeStore,
) -> None:
    s = make_store(data_dir=None, host_bytes=64 * 1024, high_watermark=0.99,
                   low_watermark=0.9, pin_bytes=3 * P)
    for i in range(3):
        s.put(name_of(i), page_of(i, P))
    assert s.pin([name_of(0), name_of(1), name_of(50)]) == (name_of(50),)
    s.put(name_of(90), page_of(90, P))
    with pytest.raises(PinBudgetExceeded, match="pin_bytes"):
        s.pin([name_of(2), name_of(90)])  # 4 rows of P > the 3 P budget: nothing pinned
    assert [r.pinned for r in s.scan(name_of(0)[:46], limit=10)] == [True, True, False, False]
    for i in range(3, 40):
        s.put(name_of(i), page_of(i, P))
    s.flush()
    assert stored(s, [name_of(0), name_of(1)]) == [True, True]
    assert s.stats().pinned_rows == 2 and s.stats().pinned_bytes == 2 * P
    s.unpin([name_of(0), name_of(1)])
    for i in range(40, 60):
        s.put(name_of(i), page_of(i, P))
    s.flush()
    assert stored(s, [name_of(0), name_of(1)]) == [False, False]
    assert s.stats().pinned_rows == 0


def test_store_everything_pinned_is_tier_full(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=32 * 1024, high_watermark=1.0, pin_bytes=1 << 20)
    names = [name_of(i) for i in range(8)]
    for i, n in enumerate(names):
        s.put(n, page_of(i, P))
    s.pin(names)
    with pytest.raises(TierFull):
        s.put(name_of(99), page_of(99, P))


def test_store_change_feed_publishes_and_withdraws(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=32 * 1024, high_watermark=0.99, low_watermark=0.5)
    s.put(name_of(0), page_of(0, P))  # before anyone listens: listed by scan, not announced
    assert s.take_events() == []  # subscribes
    s.put(name_of(1), page_of(1, P))
    s.put(name_of(1), page_of(2, P))  # an overwrite: still the same visible row
    s.put(name_of(2), page_of(2, P))
    s.delete(name_of(1))
    ev = s.take_events()
    assert [(e.kind, e.name) for e in ev] == [
        (EventKind.PUBLISHED, name_of(1)), (EventKind.PUBLISHED, name_of(2)),
        (EventKind.WITHDRAWN, name_of(1))]
    assert [e.seq for e in ev] == sorted(e.seq for e in ev)
    assert s.take_events() == []
    for i in range(10, 30):  # eviction withdraws
        s.put(name_of(i), page_of(i, P))
    s.flush()
    ev = s.take_events(max_events=5)
    assert len(ev) == 5
    rest = s.take_events()
    gone = {e.name for e in ev + rest if e.kind is EventKind.WITHDRAWN}
    assert gone and not any(stored(s, sorted(gone)))
    with pytest.raises(InvalidInput):
        s.take_events(-1)


def test_store_change_feed_overflow_is_counted_never_unbounded(make_store: MakeStore) -> None:
    s = TieredStore(make_store(data_dir=None, host_bytes=1 << 20).config, event_capacity=4)
    s.take_events()
    for i in range(10):
        s.put(name_of(i), page_of(i, 64))
    ev = s.take_events()
    assert ev[0].kind is EventKind.OVERFLOW and ev[0].dropped == 6
    assert [e.name for e in ev[1:]] == [name_of(i) for i in range(6, 10)]
    assert s.stats().events_dropped == 6
    assert s.take_events() == []
    s.close()


def test_store_read_frame_as_stored_or_encoded_on_demand(make_store: MakeStore) -> None:
    s = make_store(host_bytes=64 * 1024, disk_bytes=1 << 20)
    s.put(name_of(1), page_of(1, P), dtype="float16")
    frame = s.read_frame(name_of(1))  # memory only: encoded now
    assert frame is not None
    out = bytearray(P)
    assert decode_into(frame, out) == P and bytes(out) == page_of(1, P)
    s.close()
    again = make_store(host_bytes=64 * 1024, disk_bytes=1 << 20)  # close wrote it to disk
    assert again.read_frame(name_of(1)) == frame  # as stored: the same codec, same bytes
    assert again.read_frame(name_of(2)) is None
    off = make_store(data_dir=None, host_bytes=64 * 1024)
    off.put(name_of(3), page_of(3, P))
    frame3 = off.read_frame(name_of(3))
    assert frame3 is not None and decode_into(frame3, out) == P and bytes(out) == page_of(3, P)


def test_store_put_waiting_for_the_mover_is_busy_at_its_deadline(make_store: MakeStore) -> None:
    """A put that needs room only dirty victims can give waits for the mover, and gets
    Busy (not a hang) when its deadline passes; once the mover moves, puts succeed."""
    gate, entered = threading.Event(), threading.Event()

    class StuckEncode(Copier):
        def encode(self, frames, pool, off, size, dtype):
            entered.set()
            assert gate.wait(30)
            return super().encode(frames, pool, off, size, dtype)

    s = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20, high_watermark=1.0,
                   copier=StuckEncode(), encode_workers=1)
    for i in range(8):
        s.put(name_of(i), page_of(i, P))
    with pytest.raises(Busy):
        s.put(name_of(50), page_of(50, P), timeout_s=0.2)
    assert entered.is_set()
    with pytest.raises(Busy):
        s.flush(timeout_s=0.1)
    gate.set()
    s.put(name_of(51), page_of(51, P))
    s.flush()


def test_store_lock_order_is_checked() -> None:
    """The checker refuses a lock taken against the order (here: the lender's lock while
    the store's is held), and allows the order as written."""
    assert lockorder.checking()
    store_lock = lockorder.make_lock(lockorder.Rank.STORE, "store")
    lender_lock = lockorder.make_lock(lockorder.Rank.LENDER, "lender", reentrant=True)
    disk_lock = lockorder.make_lock(lockorder.Rank.DISK_TIER, "disk")
    with lender_lock, lender_lock, store_lock, disk_lock:
        pass
    with store_lock, pytest.raises(lockorder.LockOrderError, match="lender"):
        lender_lock.acquire()
    with store_lock, pytest.raises(lockorder.LockOrderError):
        store_lock.acquire()  # not re-entrant: taking it twice would deadlock
