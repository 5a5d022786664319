"""Lender behaviour case by case: TTLs, conflicts, staging from disk, partial commits,
the reaper thread, existence checks, device leases, ALL leases, lease JSON."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbank import Bank, BankConfig, LeaseMode, MemoryKind, full_attention, wire
from kvbank.config import WritePolicy
from kvbank.errors import (
    InvalidInput,
    LeaseConflict,
    LeaseExpired,
    LeaseNotFound,
    PageSizeMismatch,
    TierFull,
)
from kvbank.lender.base import (
    Delivery,
    DeviceLocation,
    HostLocation,
    Lease,
    LeaseRow,
    Region,
    Selection,
    lease_rows,
)
from kvbank.testing.lender_model import FakeClock
from kvbank.tiers.base import TierKind

LAYOUT = full_attention("lender@1", 1, 2, 32, tokens_per_page=8)  # 2 KiB pages
PAGE = LAYOUT.group_page_bytes[0]


def pages(n: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8))


def toks(n_pages: int, base: int = 0) -> list[int]:
    return list(range(base, base + n_pages * 8))


EPOCH = 1_800_000_000.0  # the fake wall clock's reading when the fake monotonic one reads 0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def bank(clock: FakeClock):
    b = Bank(BankConfig(host_bytes=4 << 20, device_bytes=0, lease_ttl_s=5, max_lease_ttl_s=60),
             clock=clock, wall_clock=lambda: EPOCH + clock.now, reaper=False)
    try:
        yield b
    finally:
        b.close()


def stored(bank: Bank, n: int = 4, base: int = 0) -> tuple[bytes, list[bytes]]:
    lid = bank.register(LAYOUT)
    return lid, bank.put(lid, toks(n, base), group=0, pages=pages(n, base))


def test_ttl_defaults_caps_and_bad_values_name_the_field(bank: Bank, clock: FakeClock) -> None:
    _, names = stored(bank)
    lease = bank.lend(names)
    assert lease.expires_at == clock.now + 5
    assert lease.expires_wall == EPOCH + clock.now + 5  # the injected wall clock, exactly
    assert bank.lend(names, ttl_s=60).expires_at == clock.now + 60
    for bad in (0, -1.0, float("inf"), float("nan"), 60.5, "5", True):
        with pytest.raises(InvalidInput, match="ttl_s"):
            bank.lend(names, ttl_s=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="names"):
        bank.lend([b"short"])
    with pytest.raises(InvalidInput, match="names"):
        bank.lend([names[0], names[0]])
    with pytest.raises(InvalidInput, match="kind"):
        bank.lend(names, kind="HOST")  # type: ignore[arg-type]


def test_conflicts_many_readers_one_writer(bank: Bank) -> None:
    lid, names = stored(bank, 2)
    fresh = bank.row_names(lid, toks(4), group=0)[2:]
    r1 = bank.lend(names)
    r2 = bank.lend(names[:1])  # many READ leases share rows
    with pytest.raises(LeaseConflict, match=f"READ lease {r1.id}"):
        bank.lend(names[1:], mode=LeaseMode.WRITE)
    w = bank.lend(fresh, mode=LeaseMode.WRITE)
    with pytest.raises(LeaseConflict, match="WRITE lease"):
        bank.lend(fresh[:1], mode=LeaseMode.WRITE)
    with pytest.raises(LeaseConflict, match="WRITE lease"):
        bank.lend(fresh[1:])
    for lease in (r1, r2, w):
        assert bank.release(lease.id) is True
    assert bank.lend(names, mode=LeaseMode.WRITE).mode is LeaseMode.WRITE  # free again
    bank.check_invariants()


def test_read_lease_locks_rows_and_missing_rows_are_listed_not_raised(bank: Bank) -> None:
    lid, names = stored(bank, 2)
    absent = bank.row_names(lid, toks(3), group=0)[2]
    lease = bank.lend([*names, absent])
    assert [r.delivery for r in lease.rows] == [Delivery.READY, Delivery.READY, Delivery.MISSING]
    assert lease.rows[2].location is None and not lease.rows[2].present
    loc = lease.rows[0].location
    assert isinstance(loc, HostLocation) and loc.size == PAGE
    assert [(g.layer, g.role) for g in lease.rows[0].regions] == [(0, "KEY"), (0, "VALUE")]
    assert bank.admin.evict([names[0]]).locked == (names[0],)  # a leased row is never evicted
    # Re-storing a leased row is a no-op (equal names, equal bytes), never an overwrite.
    bank.put(lid, toks(1), group=0, pages=pages(1, 9))
    assert bank.read(lease.id, names[0]) == pages(2)[0].numpy().tobytes()
    assert bank.read(lease.id, names[1]) == pages(2)[1].numpy().tobytes()
    bank.release(lease.id)
    assert bank.stats().store.locked_names == 0


def test_disk_only_row_is_staged_into_host_when_lent(tmp_path: Path, clock: FakeClock) -> None:
    # Write-through puts every row on disk too; host pressure then drops the clean host
    # copies, leaving the first rows on disk only.
    cfg = BankConfig(host_bytes=64 * 4096, device_bytes=0, data_dir=tmp_path, disk_sync=False,
                     write_policy=WritePolicy.WRITE_THROUGH)
    with Bank(cfg, clock=clock, reaper=False) as bank:
        lid, names = stored(bank, 4)
        for k in range(60):
            bank.put(lid, toks(4, 1000 * (k + 1)), group=0, pages=pages(4, k + 1))
        assert bank.locate(names) == [TierKind.DISK] * 4
        lease = bank.lend(names)
        assert all(r.delivery is Delivery.READY for r in lease.rows)
        assert bank.locate(names) == [TierKind.HOST] * 4
        assert bank.read(lease.id, names[0]) == pages(4)[0].numpy().tobytes()
        bank.check_invariants()


def test_write_lease_commit_publishes_only_arrived_rows(bank: Bank) -> None:
    lid, _names = stored(bank, 1)
    chain = bank.row_names(lid, toks(4), group=0)
    lease = bank.lend(chain, mode=LeaseMode.WRITE)
    assert [r.delivery for r in lease.rows] == [Delivery.PRESENT] + [Delivery.RESERVED] * 3
    for i, name in enumerate(chain[1:]):
        view = bank.view(lease.id, name)
        view[:] = bytes([i + 1]) * PAGE
        view.release()
    with pytest.raises(PageSizeMismatch):
        bank.write(lease.id, chain[1], b"x")
    with pytest.raises(InvalidInput, match="arrived"):
        bank.commit(lease.id, [b"x" * 54])
    with pytest.raises(InvalidInput, match="mask"):
        bank.commit(lease.id, [True])
    mask = np.array([False, True, False, True])  # a numpy mask in row order
    res = bank.commit(lease.id, mask)  # type: ignore[arg-type]
    assert res.committed == (chain[1], chain[3]) and res.discarded == (chain[2],)
    assert bank.locate(chain) == [TierKind.HOST, TierKind.HOST, None, TierKind.HOST]
    assert bank.match(lid, [*toks(4), 0]).resume.tokens == 16  # page 2 never arrived
    assert bank.stats().store.reserved_slots == 0
    with pytest.raises(LeaseNotFound):
        bank.commit(lease.id, [])
    bank.check_invariants()


def test_row_stored_meanwhile_keeps_its_bytes_at_commit(bank: Bank) -> None:
    lid = bank.register(LAYOUT)
    chain = bank.row_names(lid, toks(1), group=0)
    lease = bank.lend(chain, mode=LeaseMode.WRITE)
    bank.write(lease.id, chain[0], bytes(PAGE))
    bank.put(lid, toks(1), group=0, pages=pages(1, 3))  # another writer got there first
    res = bank.commit(lease.id, chain)
    assert res.already_present == (chain[0],) and not res.committed
    out = bytearray(PAGE)
    assert bank.get_into(chain[0], out) == PAGE
    assert bytes(out) == pages(1, 3)[0].numpy().tobytes()


def test_expired_lease_is_refused_everywhere_and_its_slots_return(bank: Bank, clock: FakeClock) -> None:
    lid, names = stored(bank, 2)
    fresh = bank.row_names(lid, toks(3), group=0)[2:]
    r = bank.lend(names, ttl_s=1)
    w = bank.lend(fresh, mode=LeaseMode.WRITE, ttl_s=1)
    bank.write(w.id, fresh[0], bytes(PAGE))
    clock.now += 1
    with pytest.raises(LeaseExpired):
        bank.read(r.id, names[0])
    with pytest.raises(LeaseExpired):
        bank.commit(w.id, fresh)
    with pytest.raises(LeaseExpired):
        bank.renew(r.id)
    assert bank.release(r.id) is False  # release after expiry is always safe
    assert bank.locate(fresh) == [None]
    stats = bank.stats()
    assert stats.store.reserved_slots == 0 and stats.store.locked_names == 0
    assert stats.leases_expired == 2
    with pytest.raises(LeaseNotFound):
        bank.release("never-lent")


def test_renew_extends_and_release_is_final(bank: Bank, clock: FakeClock) -> None:
    _, names = stored(bank, 1)
    lease = bank.lend(names, ttl_s=2)
    clock.now += 1.5
    assert bank.renew(lease.id, 2).expires_at == clock.now + 2
    clock.now += 1.5
    assert bank.read(lease.id, names[0])  # alive thanks to the renewal
    assert bank.release(lease.id) is True
    assert bank.release(lease.id) is False  # a second release (a `finally`) is safe
    with pytest.raises(LeaseNotFound, match="released"):
        bank.read(lease.id, names[0])
    with pytest.raises(LeaseNotFound):
        bank.check_live(lease.id)


def test_reaper_thread_drops_locks_without_any_lender_call(clock: FakeClock) -> None:
    """The reaper thread alone ends an expired lease: on the bank's (fake) clock, so the
    test asserts no wall-clock figure; the poll has only a generous hang bound."""
    cfg = BankConfig(host_bytes=4 << 20, device_bytes=0, reaper_interval_s=0.01)
    with Bank(cfg, clock=clock) as bank:
        _, names = stored(bank, 2)
        bank.lend(names, ttl_s=5)
        clock.now += 4.9
        assert bank.stats().store.locked_names == 2  # not yet: the TTL has not run out
        clock.now += 0.2
        give_up = time.monotonic() + 60  # a hang bound, far past any reaper tick
        while bank.stats().store.locked_names:  # stats reaps nothing: only the thread does
            assert time.monotonic() < give_up, "the reaper never ended the expired lease"
            time.sleep(0.01)
        assert bank.stats().leases_expired == 1


def test_match_and_contains_never_hold_off_eviction(clock: FakeClock) -> None:
    """A loop of existence checks must not keep rows alive (Mooncake#2187); a lease must."""
    cfg = BankConfig(host_bytes=64 * 4096, device_bytes=0)
    with Bank(cfg, clock=clock, reaper=False) as bank:
        lid, probed = stored(bank, 4)
        _, leased = stored(bank, 4, base=500)
        lease = bank.lend(leased)
        for k in range(40):
            for _ in range(5):
                bank.match(lid, [*toks(4), 0])
                bank.locate(probed)
            bank.put(lid, toks(4, 1000 * (k + 1)), group=0, pages=pages(4, k + 1))
        assert bank.locate(probed) == [None] * 4
        assert bank.locate(leased) == [TierKind.HOST] * 4
        assert bank.stats().store.locked_names == 4
        bank.release(lease.id)


def test_device_leases_on_a_cpu_device_tier(clock: FakeClock) -> None:
    cfg = BankConfig(host_bytes=4 << 20, device="cpu", device_bytes=4 << 20)
    with Bank(cfg, clock=clock, reaper=False) as bank:
        lid, names = stored(bank, 2)
        assert bank.locate(names) == [TierKind.DEVICE] * 2
        lease = bank.lend(names, kind=MemoryKind.DEVICE)
        loc = lease.rows[0].location
        assert isinstance(loc, DeviceLocation) and loc.device == "cpu"
        assert loc.ipc_handle is None  # no CUDA here
        t = bank.device_view(lease.id, names[0])
        assert bytes(t.numpy()) == pages(2)[0].numpy().tobytes()
        assert bank.read(lease.id, names[1]) == pages(2)[1].numpy().tobytes()
        with pytest.raises(InvalidInput, match="DEVICE"):
            bank.view(lease.id, names[0])
        bank.release(lease.id)
        fresh = bank.row_names(lid, toks(3), group=0)[2:]
        w = bank.lend(fresh, kind=MemoryKind.DEVICE, mode=LeaseMode.WRITE)
        bank.device_view(w.id, fresh[0]).fill_(7)
        assert bank.commit(w.id, fresh).committed == tuple(fresh)
        assert bank.match(lid, [*toks(3), 0]).resume.tokens == 24
        with pytest.raises(InvalidInput, match="DEVICE"):
            bank.lend_all(kind=MemoryKind.DEVICE)
        bank.check_invariants()


def test_all_lease_describes_the_host_segment_and_locks_nothing(bank: Bank) -> None:
    stored(bank, 2)
    lease = bank.lend_all(ttl_s=10)
    assert lease.selection is Selection.ALL and lease.rows == ()
    (pool,) = lease.pools
    assert isinstance(pool, HostLocation) and pool.offset == 0 and pool.size >= 4 << 20
    assert pool == bank._store.host.segment  # no probe reservation: the store names it
    assert bank.stats().store.reserved_slots == 0
    assert Path("/dev/shm", pool.segment).exists()
    assert bank.stats().store.locked_names == 0
    with pytest.raises(InvalidInput, match="commit"):
        bank.commit(lease.id, [])
    assert bank.release(lease.id) is True


def test_lease_json_round_trip_has_only_plain_fields(bank: Bank) -> None:
    lid, names = stored(bank, 2)
    lease = bank.lend([*names, bank.row_names(lid, toks(3), group=0)[2]])
    for one in (lease, bank.lend_all()):
        # The JSON carries the seconds left, not the lender's deadline; the reader rebuilds
        # its own deadline on its clock (here the same one, read once).
        back = wire.from_json(Lease, wire.to_json(one, now=100.0), now=100.0)
        assert back.expires_at == pytest.approx(one.expires_at)
        assert dataclasses.replace(back, expires_at=one.expires_at, expires_wall=one.expires_wall) == one


def test_write_lease_needs_rows_the_bank_can_describe(bank: Bank) -> None:
    with pytest.raises(InvalidInput, match="layout"):
        bank.lend([b"\x01" * 54], mode=LeaseMode.WRITE)


def test_shared_read_rows_stay_held_until_their_last_reader_ends(bank: Bank) -> None:
    """Readers are counted per name: ending one of two readers of a row keeps a writer out."""
    _, names = stored(bank, 2)
    r1 = bank.lend(names)
    r2 = bank.lend(names[:1])
    bank.release(r1.id)
    with pytest.raises(LeaseConflict, match=f"READ lease {r2.id}"):
        bank.lend(names[:1], mode=LeaseMode.WRITE)
    w = bank.lend(names[1:], mode=LeaseMode.WRITE)  # r1's other row is free again
    bank.check_invariants()
    bank.release(r2.id)
    bank.release(w.id)
    bank.lend(names, mode=LeaseMode.WRITE)
    bank.check_invariants()


def test_row_evicted_between_locate_and_lock_is_missing_and_not_locked(clock: FakeClock) -> None:
    """A row that vanishes after locate saw it is listed MISSING, holds no lock, and the
    lease's other rows are READY and locked."""
    cfg = BankConfig(host_bytes=4 << 20, device_bytes=0)
    with Bank(cfg, clock=clock, reaper=False) as bank:
        _, names = stored(bank, 3)
        store = bank._store
        real_lock = store.locks.lock
        evicted = names[1]

        def lock_after_eviction(names: Sequence[bytes], holder: str) -> None:
            store.delete(evicted)  # evicted in the gap
            real_lock(names, holder)

        store.locks.lock = lock_after_eviction  # type: ignore[method-assign]
        lease = bank.lend(names)
        del store.locks.lock
        assert [r.delivery for r in lease.rows] == [Delivery.READY, Delivery.MISSING, Delivery.READY]
        assert lease.rows[1].location is None and lease.rows[1].regions == lease.rows[0].regions
        assert [store.locks.is_locked(n) for n in names] == [True, False, True]
        assert bank.read(lease.id, names[2]) == pages(3)[2].numpy().tobytes()
        bank.check_invariants()
        bank.release(lease.id)
        assert bank.stats().store.locked_names == 0


def test_lease_rows_builds_the_rows_the_constructor_would() -> None:
    regions = (Region(0, "KEY", 0, 8),)
    cols = ([b"a" * 54, b"b" * 54], [True, False], [HostLocation("s", 0, 8), None],
            [regions, ()], [Delivery.READY, Delivery.MISSING])
    assert lease_rows(*cols) == tuple(map(LeaseRow, *cols))
    assert lease_rows([], [], [], [], []) == ()
    with pytest.raises(ValueError, match="shorter"):
        lease_rows(cols[0], cols[1], cols[2][:1], cols[3], cols[4])


def test_write_through_a_lease_that_expires_mid_copy_never_lands_in_another_rows_slot(
    bank: Bank, clock: FakeClock
) -> None:
    """Lender.write must never copy into a slot the lease no longer holds: if the reaper
    could end the lease between the liveness check and the copy, the aborted slot could
    already hold another row, and the late copy would overwrite that row's bytes (a
    wrong hit for everyone who reads it afterwards)."""
    import threading

    lid = bank.register(LAYOUT)
    mine = bank.row_names(lid, toks(1, 100), group=0)[0]
    theirs = bank.row_names(lid, toks(1, 200), group=0)[0]
    lease = bank.lend([mine], mode=LeaseMode.WRITE, ttl_s=1)
    their_page = pages(1, 7)
    store = bank._store
    real_view = store.host.view
    done: list[threading.Thread] = []

    def expire_and_reuse() -> None:
        # What the reaper thread and another worker's put do, concurrently.
        clock.now += 2
        bank._lender.reap()  # the lease expires: its reserved slot goes back to the store
        bank.put(lid, toks(1, 200), group=0, pages=their_page)  # ...and is taken again

    def racing_view(slot):
        if not done:
            t = threading.Thread(target=expire_and_reuse)
            done.append(t)
            t.start()
            t.join(0.5)  # a lender that holds its lock over the copy keeps this waiting
        return real_view(slot)

    store.host.view = racing_view  # type: ignore[method-assign]
    try:
        bank.write(lease.id, mine, b"\xee" * PAGE)  # live when it started
    finally:
        store.host.view = real_view  # type: ignore[method-assign]
        done[0].join()
    assert bank.locate([theirs])[0] is not None
    out = bytearray(PAGE)
    assert bank.get_into(theirs, out) == PAGE
    assert bytes(out) == their_page[0].numpy().tobytes()
    with pytest.raises(LeaseExpired):
        bank.commit(lease.id, [mine])
    bank.check_invariants()


def test_release_and_read_refuse_malformed_ids_and_names_naming_the_field(bank: Bank) -> None:
    """A lease id or row name of the wrong type is InvalidInput naming the field (not a
    TypeError from a dict lookup, nor LeaseNotFound for an id that cannot be one); the
    lease is untouched."""
    _, names = stored(bank, 1)
    lease = bank.lend(names)
    for bad in (None, ["x"], 7):
        with pytest.raises(InvalidInput, match="lease_id"):
            bank.release(bad)  # type: ignore[arg-type]
    for bad_name in (["x"], "x", None):
        with pytest.raises(InvalidInput, match="name"):
            bank.read(lease.id, bad_name)  # type: ignore[arg-type]
    assert bank.read(lease.id, names[0]) == pages(1)[0].numpy().tobytes()
    assert bank.release(lease.id) is True


def test_write_through_commit_stores_all_of_its_rows_or_none(tmp_path: Path,
                                                             clock: FakeClock) -> None:
    """Regression (served-node review D2): a write-through WRITE lease's commit wrote
    one disk transaction per row, so a commit stopped part way (a crash, or here a disk
    that cannot hold it all) left a prefix of the put on disk. It is one transaction
    now: a commit the disk cannot hold whole stores none of its rows, and keeps every
    reservation for a retry or a release."""
    cfg = BankConfig(host_bytes=4 << 20, device_bytes=0, data_dir=tmp_path, disk_sync=False,
                     disk_bytes=64 * PAGE, write_policy=WritePolicy.WRITE_THROUGH)
    with Bank(cfg, clock=clock, reaper=False) as bank:
        lid = bank.register(LAYOUT)
        chain = bank.row_names(lid, toks(100), group=0)  # 100 random pages: > the disk
        lease = bank.lend(chain, mode=LeaseMode.WRITE)
        for i, name in enumerate(chain):
            bank.write(lease.id, name, pages(100, 7)[i].numpy().tobytes())
        with pytest.raises(TierFull):
            bank.commit(lease.id, chain)
        assert bank.locate(chain) == [None] * 100
        bank.check_invariants()
    with Bank(cfg, clock=clock, reaper=False) as bank:  # and nothing of it on disk
        assert bank.locate(chain) == [None] * 100
        assert bank.register(LAYOUT) == lid
        small = bank.row_names(lid, toks(8, 5000), group=0)
        lease = bank.lend(small, mode=LeaseMode.WRITE)
        for i, name in enumerate(small):
            bank.write(lease.id, name, pages(8, 8)[i].numpy().tobytes())
        assert bank.commit(lease.id, small).committed == tuple(small)
    with Bank(cfg, clock=clock, reaper=False) as bank:
        assert bank.locate(small) == [TierKind.DISK] * 8
        bank.check_invariants()
