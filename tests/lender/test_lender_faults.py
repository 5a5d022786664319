"""Lender guarantees tested directly (issue 9's planted bugs passed the suite before):
renew's TTL cap and refusals, a read that completes after expiry, and a demotion in flight
that never frees the memory copy of a row a lease locked meanwhile (made deterministic
through the Copier seam)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvbank.config import BankConfig
from kvbank.errors import InvalidInput, LeaseExpired
from kvbank.lender.lender import Lender
from kvbank.testing.lender_model import FakeClock
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.base import TierKind
from kvbank.tiers.store.store import Copier, TieredStore

P = 4096


def _store(tmp_path: Path, **kw: object) -> TieredStore:
    fields: dict[str, object] = {"data_dir": tmp_path, "host_bytes": 1 << 20,
                                 "disk_bytes": 1 << 23, "device_bytes": 0, "disk_sync": False,
                                 "lease_ttl_s": 5, "max_lease_ttl_s": 60}
    fields.update(kw)
    copier = fields.pop("copier", None)
    return TieredStore(BankConfig(**fields), copier=copier)  # type: ignore[arg-type]


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf"), True, "3", 60.5])
def test_renew_refuses_bad_ttls_and_ttls_past_the_cap(tmp_path: Path, ttl: object) -> None:
    clock = FakeClock()
    store = _store(tmp_path)
    lender = Lender(store, store.config, clock=clock, reaper=False)
    try:
        store.put(name_of(0), page_of(0, P))
        lease = lender.lend([name_of(0)], ttl_s=5)
        with pytest.raises(InvalidInput, match="ttl_s"):
            lender.renew(lease.id, ttl_s=ttl)  # type: ignore[arg-type]
        clock.now += 4.9  # the refused renewal changed nothing: still the first deadline
        lender.check_live(lease.id)
        clock.now += 0.2
        with pytest.raises(LeaseExpired):
            lender.check_live(lease.id)
    finally:
        lender.close()
        store.close()


def test_renew_extends_to_now_plus_ttl_up_to_the_cap(tmp_path: Path) -> None:
    clock = FakeClock()
    store = _store(tmp_path)
    lender = Lender(store, store.config, clock=clock, reaper=False)
    try:
        store.put(name_of(0), page_of(0, P))
        lease = lender.lend([name_of(0)], ttl_s=5)
        clock.now += 4
        lender.renew(lease.id, ttl_s=60)  # exactly the cap: allowed
        clock.now += 59.9
        lender.check_live(lease.id)
        clock.now += 0.2
        with pytest.raises(LeaseExpired):
            lender.check_live(lease.id)
    finally:
        lender.close()
        store.close()


def test_a_read_that_completes_after_expiry_is_refused(tmp_path: Path) -> None:
    """The lease is live when the copy starts, expired when it completes: the bytes must
    not be used (the clock jumps inside the read)."""
    clock = FakeClock()
    store = _store(tmp_path)
    lender = Lender(store, store.config, clock=clock, reaper=False)
    try:
        store.put(name_of(0), page_of(0, P))
        lease = lender.lend([name_of(0)], ttl_s=5)
        assert lender.read(lease.id, name_of(0)) == page_of(0, P)  # live throughout
        clock.jump_after(1, clock.now + 10)  # the slot lookup is live, the check is not
        with pytest.raises(LeaseExpired):
            lender.read_into(lease.id, name_of(0), bytearray(P))
    finally:
        lender.close()
        store.close()


def test_a_demotion_in_flight_never_frees_a_row_a_lease_locked_meanwhile(tmp_path: Path) -> None:
    """The mover encodes a host row for disk with no lock held; a lease locks the row in
    that window. The demotion must keep the memory copy (the lease reads it in place).
    Before, only the store state machine caught this, by timing luck."""
    entered, gate = threading.Event(), threading.Event()

    class HeldEncode(Copier):
        def encode(self, frames, pool, off, size, dtype):
            entered.set()
            assert gate.wait(60)
            return super().encode(frames, pool, off, size, dtype)

    store = _store(tmp_path, host_bytes=256 * 1024, copier=HeldEncode(),
                   high_watermark=0.5, low_watermark=0.25, dirty_expire_s=0)
    lender = Lender(store, store.config, reaper=False)
    try:
        names = [name_of(i) for i in range(48)]  # past the high watermark: demotions start
        try:
            for i, n in enumerate(names):
                store.put(n, page_of(i, P))
            assert entered.wait(60), "no demotion started"
            held = [n for n, r in zip(names, store.residency(names), strict=True)
                    if TierKind.HOST in r]
            lease = lender.lend(held, ttl_s=60)  # locks every memory row, the one in flight too
        finally:
            gate.set()
        store.flush()
        assert all(TierKind.HOST in r for r in store.residency(held))
        for n in held:
            assert lender.read(lease.id, n) == page_of(names.index(n), P)
        lender.release(lease.id)
        store.check_invariants()
    finally:
        gate.set()
        lender.close()
        store.close()
