"""Store faults from issue 9 made deterministic: races at the seams, not by timing luck.

Each test injects the racing call at the exact point (a wrapped ``DiskTier.write_frame``
or the Copier seam) instead of hoping two threads interleave.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvbank.errors import RowLocked
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.base import TierKind
from kvbank.tiers.disk import DiskTier

from ..conftest import MakeStore

P = 4096


def test_write_through_put_refused_by_a_lock_after_its_disk_write_leaves_no_frame(
        make_store: MakeStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock that arrived between the disk write and the index update made the put
    raise RowLocked (which Bank.put swallows) and left the frame on disk: charged to the
    budget, never evictable, back after a restart. Fails on 5ba5ecc (no delete of the
    refused frame; the fix is d5d00e8)."""
    store = make_store(host_bytes=1 << 20, disk_bytes=1 << 22, write_policy="write-through")
    name = name_of(1)
    real = DiskTier.write_frame

    def write_then_lock(self: DiskTier, n: bytes, frame: bytes, **kw: object) -> None:
        real(self, n, frame, **kw)  # type: ignore[arg-type]
        if n == name:
            store.locks.lock([n], "lease-racing")  # disk lock held, store lock free

    monkeypatch.setattr(DiskTier, "write_frame", write_then_lock)
    with pytest.raises(RowLocked):
        store.put(name, page_of(1, P))
    monkeypatch.undo()
    store.locks.unlock([name], "lease-racing")
    assert store.residency([name]) == [frozenset()]
    assert store.stats().tier(TierKind.DISK).used_bytes == 0
    store.check_invariants()
    store.close()
    again = make_store(host_bytes=1 << 20, disk_bytes=1 << 22)
    assert again.residency([name]) == [frozenset()]  # not back after a restart
    assert again.stats().tier(TierKind.DISK).used_bytes == 0


def test_the_checker_never_races_a_write_through_put(
        make_store: MakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """check_invariants reported "rows in LMDB are not in the index" while a put sat
    between its disk commit and its index update (4 of 6 checks under load). Here the
    check runs at exactly that point; it must wait for the put, not report it."""
    store = make_store(host_bytes=1 << 20, disk_bytes=1 << 22, write_policy="write-through")
    real = DiskTier.write_frame
    errors: list[BaseException] = []

    def check() -> None:
        try:
            store.check_invariants()
        except BaseException as exc:  # reported below
            errors.append(exc)

    def write_then_check(self: DiskTier, n: bytes, frame: bytes, **kw: object) -> None:
        real(self, n, frame, **kw)  # type: ignore[arg-type]
        checker = threading.Thread(target=check)
        checker.start()
        # A checker that does not wait for the put ends here with its verdict; one that
        # waits is still blocked when this join gives up, and finishes after the put.
        checker.join(1.0)
        pending.append(checker)

    pending: list[threading.Thread] = []
    monkeypatch.setattr(DiskTier, "write_frame", write_then_check)
    for i in range(3):
        store.put(name_of(i), page_of(i, P))
    monkeypatch.undo()
    for t in pending:
        t.join(60)
    assert not errors, errors[0]
    store.check_invariants()


def test_write_back_rows_reach_disk_within_the_dirty_age_and_survive_a_crash(
        make_store: MakeStore) -> None:
    """An idle write-back bank never wrote its host rows to disk: a kill -9 seconds after
    the last put lost 20-29 acknowledged rows a round. With ``dirty_expire_s`` the mover
    writes them (memory copies kept); ``close(persist=False)`` drops memory as a crash
    would. The loop below has a hang detector only, no bound on how fast it must be."""
    import time

    store = make_store(host_bytes=1 << 20, disk_bytes=1 << 22, dirty_expire_s=0.2)
    names = [name_of(i) for i in range(8)]
    for i, n in enumerate(names):
        store.put(n, page_of(i, P))
    give_up = time.monotonic() + 120
    while not all(TierKind.DISK in r for r in store.residency(names)):
        assert time.monotonic() < give_up, "dirty rows never reached disk"
        time.sleep(0.05)
    assert all(TierKind.HOST in r for r in store.residency(names))  # memory copy kept
    store.check_invariants()
    store.close(persist=False)
    again = make_store(host_bytes=1 << 20, disk_bytes=1 << 22)
    out = bytearray(P)
    for i, n in enumerate(names):
        assert again.get_into(n, out) == P and bytes(out) == page_of(i, P)


def test_dirty_age_zero_leaves_write_back_as_it_was(make_store: MakeStore) -> None:
    store = make_store(host_bytes=1 << 20, disk_bytes=1 << 22, dirty_expire_s=0)
    store.put(name_of(0), page_of(0, P))
    store.flush()
    assert store.residency([name_of(0)]) == [frozenset({TierKind.HOST})]


def test_a_put_over_a_pinned_row_is_refused_and_the_row_stays(make_store: MakeStore) -> None:
    """Found by the device state machine: re-putting a pinned row with the device full
    put the new copy in host and dropped the pinned device copy."""
    store = make_store(host_bytes=1 << 20, disk_bytes=1 << 22)
    store.put(name_of(0), page_of(0, P))
    before = store.residency([name_of(0)])
    store.pin([name_of(0)])
    with pytest.raises(RowLocked, match="pinned"):
        store.put(name_of(0), page_of(1, P))
    assert store.residency([name_of(0)]) == before
    out = bytearray(P)
    assert store.get_into(name_of(0), out) == P and bytes(out) == page_of(0, P)
    store.unpin([name_of(0)])
    store.put(name_of(0), page_of(1, P))  # unpinned: overwritable again
