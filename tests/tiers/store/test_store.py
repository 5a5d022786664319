"""The tiered store: placement, eviction, movement, locks, in-place slots, restart."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbank.codec import checksum
from kvbank.errors import (
    InvalidInput,
    InvalidRowName,
    PageSizeMismatch,
    RowLocked,
    TierFull,
    TierUnavailable,
)
from kvbank.results import HealthState
from kvbank.testing.diskrot import flip_frame_byte
from kvbank.testing.tiers import name_of, page_of, size_of, stored
from kvbank.tiers.base import HostSlot, TierKind
from kvbank.tiers.device import DevicePool, gpu_memory
from kvbank.tiers.disk import DiskTier
from kvbank.tiers.host import HostSlab, attach
from kvbank.tiers.store.store import Copier, TieredStore

from ..conftest import MakeStore

H, D, K = TierKind.HOST, TierKind.DISK, TierKind.DEVICE
P = 4096  # page size of most tests


def read(store, i: int, size: int = P) -> bytes | None:
    out = bytearray(size)
    n = store.get_into(name_of(i), out)
    return None if n is None else bytes(out[:n])


# -- placement, reads, bad input ---------------------------------------------------------


def test_store_put_get_locate_size(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=1 << 20)
    s.put(name_of(1), page_of(1, P))
    assert read(s, 1) == page_of(1, P)
    assert read(s, 2) is None
    assert s.locate([name_of(1), name_of(2)]) == [H, None]
    assert stored(s, [name_of(1), name_of(2)]) == [True, False]
    assert size_of(s, name_of(1)) == P and size_of(s, name_of(2)) is None
    st = s.stats()
    assert (st.gets, st.hits, st.misses, st.puts, st.rows) == (2, 1, 1, 1, 1)


def test_store_bad_input_is_typed_and_stores_nothing(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=1 << 20)
    s.put(name_of(1), page_of(1, P))
    with pytest.raises(PageSizeMismatch):
        s.put(name_of(1), page_of(1, P // 2))
    assert read(s, 1) == page_of(1, P)
    with pytest.raises(InvalidRowName):
        s.put(b"short", b"x")
    with pytest.raises(InvalidInput):
        s.put(name_of(2), b"")
    with pytest.raises(InvalidInput):
        s.put(name_of(2), b"x" * 10, dtype="complex64")
    with pytest.raises(InvalidInput):
        s.get_into(name_of(1), bytearray(10))
    assert stored(s, [name_of(2)]) == [False]
    # a lookup of many names checks them all before it answers any
    for bad in ([name_of(1), b"short"], [name_of(1), bytearray(name_of(2))], [name_of(1), 7]):
        with pytest.raises(InvalidRowName):
            s.locate(bad)  # type: ignore[arg-type]
    assert s.locate([name_of(2), name_of(1)]) == [None, TierKind.HOST]
    assert s.stats().rows == 1


def test_store_lookups_touch_nothing(make_store: MakeStore) -> None:
    """locate/contains/size_of neither lock nor refresh LRU: a probed row is still the
    first victim."""
    s = make_store(data_dir=None, host_bytes=64 * 1024, high_watermark=0.99, low_watermark=0.9)
    for i in range(10):
        s.put(name_of(i), page_of(i, P))
    for _ in range(5):
        s.locate([name_of(0)])
        stored(s, [name_of(0)])
        size_of(s, name_of(0))
    assert not s.locks.is_locked(name_of(0))
    for i in range(10, 17):
        s.put(name_of(i), page_of(i, P))
    assert stored(s, [name_of(0)]) == [False]


# -- eviction ----------------------------------------------------------------------------


def test_store_lru_evicts_least_recently_used(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=64 * 1024, high_watermark=0.99, low_watermark=0.9)
    for i in range(14):
        s.put(name_of(i), page_of(i, P))
    assert read(s, 0) is not None  # touch 0: now 1 is the oldest
    for i in range(14, 17):
        s.put(name_of(i), page_of(i, P))
    s.flush()
    present = stored(s, [name_of(i) for i in range(17)])
    assert present[0] and not present[1]
    assert s.stats().tier(H).evictions >= 1


def test_store_chain_is_evicted_from_its_tail(make_store: MakeStore) -> None:
    """Regression: a prefix page is never evicted while its child is evictable in the same
    tier, even when the prefix is older; what survives is a prefix of the chain."""
    s = make_store(data_dir=None, host_bytes=64 * 1024, high_watermark=0.99, low_watermark=0.6)
    for i in range(8):  # chain 0 <- 1 <- ... <- 7, oldest first
        s.put(name_of(i), page_of(i, P), parent=name_of(i - 1) if i else None)
    for i in range(100, 108):  # unrelated, newer rows
        s.put(name_of(i), page_of(i, P))
    for i in range(200, 204):  # pressure
        s.put(name_of(i), page_of(i, P))
    s.flush()
    chain = stored(s, [name_of(i) for i in range(8)])
    assert not all(chain), "the pressure should have reached the old chain"
    kept = chain.index(False) if False in chain else 8
    assert chain == [True] * kept + [False] * (8 - kept), f"not a prefix: {chain}"


def test_store_locked_child_does_not_pin_its_parent(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=32 * 1024, high_watermark=0.99, low_watermark=0.5)
    s.put(name_of(0), page_of(0, P))
    s.put(name_of(1), page_of(1, P), parent=name_of(0))
    s.locks.lock([name_of(1)], "lease")
    for i in range(10, 20):
        s.put(name_of(i), page_of(i, P))
    s.flush()
    assert stored(s, [name_of(0), name_of(1)]) == [False, True]
    s.locks.unlock_all("lease")


def test_store_tier_full_when_everything_is_locked(make_store: MakeStore) -> None:
    # high watermark 1.0: no background eviction between the puts and the lock
    s = make_store(data_dir=None, host_bytes=32 * 1024, high_watermark=1.0)
    names = []
    for i in range(8):
        s.put(name_of(i), page_of(i, P))
        names.append(name_of(i))
    s.locks.lock(names, "lease")
    with pytest.raises(TierFull):
        s.put(name_of(99), page_of(99, P))
    assert all(read(s, i) == page_of(i, P) for i in range(8))  # still serving
    s.locks.unlock(names, "lease")
    s.put(name_of(99), page_of(99, P))


# -- locks -------------------------------------------------------------------------------


def test_store_locks_are_counted_per_holder(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=1 << 20)
    s.put(name_of(1), page_of(1, P))
    s.locks.lock([name_of(1), name_of(1)], "a")
    s.locks.lock([name_of(1)], "b")
    with pytest.raises(RowLocked):
        s.put(name_of(1), page_of(2, P))
    with pytest.raises(RowLocked):
        s.delete(name_of(1))
    s.locks.unlock([name_of(1)], "a")
    s.locks.unlock_all("b")
    assert s.locks.is_locked(name_of(1))
    with pytest.raises(InvalidInput):
        s.locks.unlock([name_of(1)], "b")
    s.locks.unlock([name_of(1)], "a")
    assert not s.locks.is_locked(name_of(1))
    assert s.delete(name_of(1)) is True
    s.locks.lock([name_of(5)], "w")  # a name may be locked before it exists (write lease)
    with pytest.raises(RowLocked):
        s.put(name_of(5), page_of(5, P))
    s.locks.unlock_all("w")


# -- movement between tiers --------------------------------------------------------------


def test_store_write_back_demotes_to_disk_and_promotes_on_read(make_store: MakeStore) -> None:
    s = make_store(host_bytes=64 * 1024, disk_bytes=1 << 20)
    for i in range(40):
        s.put(name_of(i), page_of(i, P))
    s.flush()
    st = s.stats()
    assert st.rows == 40
    assert st.tier(H).demotions > 0 and st.tier(D).rows > 0
    assert st.tier(H).allocated_bytes <= 64 * 1024
    first = s.locate([name_of(0)])[0]
    assert first is D
    assert read(s, 0) == page_of(0, P)
    assert s.locate([name_of(0)]) == [H]  # promoted, disk copy kept (clean)
    assert s.stats().tier(H).promotions == 1
    for i in range(40):
        assert read(s, i) == page_of(i, P), i
    s.check_invariants()


S = 4000  # a page size that is not a slot size: moves count page bytes, not slot bytes


def test_store_counts_the_page_bytes_moved_between_each_pair_of_tiers(make_store: MakeStore) -> None:
    """Every demotion counts its row's page bytes on (its tier, the tier it went to), every
    promotion on (its tier, the tier it came from): N rows of S bytes count N x S."""
    s = make_store(host_bytes=64 * 1024, disk_bytes=1 << 20)
    for i in range(40):
        s.put(name_of(i), page_of(i, S))
    s.flush()
    host = s.stats().tier(H)
    assert host.demotions > 0
    assert host.demoted_to(D) == host.demotions * S and host.demoted_bytes == (0, 0, host.demotions * S)
    assert host.promoted_bytes == (0, 0, 0) and s.stats().tier(D).demoted_bytes == (0, 0, 0)
    assert s.locate([name_of(0)]) == [D]
    assert read(s, 0, S) == page_of(0, S)
    assert s.locate([name_of(0)]) == [H]  # promoted
    host = s.stats().tier(H)
    assert host.promotions == 1 and host.promoted_bytes == (0, 0, S)


def test_store_counts_the_page_bytes_moved_to_and_from_the_device(make_store: MakeStore) -> None:
    """Device rows demoted count on (device, the tier they went to); a row staged into
    the device counts on (device, the tier it came from)."""
    s = make_store(device="cpu", device_bytes=32 * 1024, host_bytes=64 * 1024, disk_bytes=1 << 20)
    for i in range(30):
        s.put(name_of(i), page_of(i, S))
    s.flush()
    dev = s.stats().tier(K)
    assert dev.demotions > 0 and dev.demoted_to(H) > 0
    assert dev.demoted_to(H) + dev.demoted_to(D) == dev.demotions * S and dev.demoted_to(K) == 0
    assert dev.promoted_bytes == (0, 0, 0)
    (src,) = s.locate([name_of(0)])
    assert src in (H, D)
    s.locks.lock([name_of(0)], "d")
    assert s.device.stage(name_of(0)) is not None
    s.locks.unlock_all("d")
    dev = s.stats().tier(K)
    assert dev.promotions == 1 and dev.promoted_from(src) == S and sum(dev.promoted_bytes) == S


def test_store_disk_eviction_keeps_disk_budget(make_store: MakeStore) -> None:
    pages = [np.random.default_rng(i).bytes(P) for i in range(80)]  # incompressible
    s = make_store(host_bytes=32 * 1024, disk_bytes=96 * 1024)
    for i, page in enumerate(pages):
        s.put(name_of(i), page)
    s.flush()
    st = s.stats()
    assert st.tier(D).used_bytes <= 96 * 1024
    assert st.tier(D).evictions > 0
    assert read(s, 79) == pages[79]
    assert read(s, 0) is None  # the oldest left the store


def test_store_restart_recovers_every_row_committed_to_disk(
    make_store: MakeStore, tmp_path: Path
) -> None:
    s = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20, write_policy="write-through")
    for i in range(30):
        s.put(name_of(i), page_of(i, P), parent=name_of(i - 1) if i else None)
    s.close()
    again = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20)
    assert again.stats().rows == 30
    assert again.locate([name_of(0)]) == [D]
    for i in range(30):
        assert read(again, i) == page_of(i, P)
        assert size_of(again, name_of(i)) == P


def test_store_write_back_restart_keeps_demoted_rows(make_store: MakeStore) -> None:
    s = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20)
    for i in range(20):
        s.put(name_of(i), page_of(i, P))
    s.flush()
    on_disk = [i for i, t in enumerate(s.locate([name_of(i) for i in range(20)])) if t is D]
    assert on_disk
    s.close()
    again = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20)
    for i in on_disk:
        assert read(again, i) == page_of(i, P)


def test_store_corrupt_disk_row_is_a_miss_and_counted(make_store: MakeStore, tmp_path: Path) -> None:
    s = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20, write_policy="write-through")
    s.put(name_of(1), page_of(1, P))
    s.put(name_of(2), page_of(2, P))
    s.close()
    flip_frame_byte(tmp_path / "data", name_of(1), -1, 0xFF)
    again = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20)
    assert read(again, 1) is None
    assert stored(again, [name_of(1)]) == [False]
    assert again.stats().tier(D).corrupt_rows == 1
    assert read(again, 2) == page_of(2, P)


def test_store_disk_full_is_typed_and_upper_tiers_keep_serving(make_store: MakeStore) -> None:
    pages = [np.random.default_rng(i).bytes(P) for i in range(10)]  # incompressible
    s = make_store(host_bytes=32 * 1024, disk_bytes=16 * 1024, write_policy="write-through")
    for i in range(3):
        s.put(name_of(i), pages[i])
    s.locks.lock([name_of(i) for i in range(3)], "lease")
    with pytest.raises(TierFull):
        s.put(name_of(9), pages[9])
    assert stored(s, [name_of(9)]) == [False]
    assert all(read(s, i) == pages[i] for i in range(3))
    health = s.health()
    assert not health.ok
    assert next(t for t in health.tiers if t.kind is D).state is HealthState.DEGRADED
    s.locks.unlock_all("lease")


def test_store_bf16_pages_round_trip_through_the_codec(make_store: MakeStore) -> None:
    rng = np.random.default_rng(3)
    pages = [rng.standard_normal(8192, dtype=np.float32).astype(np.float16).tobytes()
             for _ in range(12)]
    s = make_store(host_bytes=64 * 1024, disk_bytes=1 << 20)
    for i, p in enumerate(pages):
        s.put(name_of(i), p, dtype="float16")
    s.flush()
    assert s.stats().tier(D).rows > 0
    assert s.stats().tier(D).used_bytes < sum(len(p) for p in pages)
    for i, p in enumerate(pages):
        assert read(s, i, len(p)) == p


# -- in-place slots ----------------------------------------------------------------------


def test_store_reserve_commit_abort_host(make_store: MakeStore) -> None:
    s = make_store(host_bytes=64 * 1024, disk_bytes=1 << 20)
    slot = s.host.reserve(P, "w1")
    assert s.stats().reserved_slots == 1
    view, close = attach(slot)
    view[:] = page_of(7, P)
    view.release()
    close()
    assert read(s, 7) is None  # invisible before commit
    s.host.commit(name_of(7), slot, parent=None)
    assert read(s, 7) == page_of(7, P)
    with pytest.raises(InvalidInput):
        s.host.commit(name_of(8), slot)  # a slot commits once
    slot2 = s.host.reserve(P, "w1")
    s.host.abort(slot2)
    with pytest.raises(InvalidInput):
        s.host.abort(slot2)
    assert s.stats().reserved_slots == 0
    whole = s.host.segment
    assert whole is not None and whole.segment == slot.segment and whole.offset == 0
    assert whole.size <= 64 * 1024
    slot3 = s.host.reserve(P, "w2")
    with pytest.raises(PageSizeMismatch):
        s.host.commit(name_of(7), type(slot3)(slot3.segment, slot3.offset, P))  # ok size
        s.put(name_of(7), page_of(7, P // 2))


def test_store_commit_keeps_reservation_when_refused(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=64 * 1024)
    s.put(name_of(1), page_of(1, P))
    s.locks.lock([name_of(1)], "reader")
    slot = s.host.reserve(P, "writer")
    with pytest.raises(RowLocked):
        s.host.commit(name_of(1), slot)
    s.host.abort(slot)  # still reserved after the refusal
    s.locks.unlock_all("reader")


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
def test_store_commit_many_publishes_all_of_its_rows_or_none(make_store: MakeStore,
                                                             policy: str) -> None:
    """A write lease's commit is all or nothing (served-node review D2): one row refused
    publishes none and keeps every reservation; the same commit once the refusal is
    gone publishes every row (in one disk transaction under write-through)."""
    s = make_store(host_bytes=64 * 1024, disk_bytes=1 << 20, write_policy=policy)
    s.put(name_of(3), page_of(3, P))
    s.locks.lock([name_of(3)], "reader")  # row 3 refuses a new copy while read
    slots = [s.host.reserve(P, "writer") for _ in range(5)]
    for i, slot in enumerate(slots):
        view, close = attach(slot)
        view[:] = page_of(10 + i, P)
        view.release()
        close()
    rows = [(name_of(10 + i), slot, "uint8", None) for i, slot in enumerate(slots)]
    rows[2] = (name_of(3), slots[2], "uint8", None)
    published: list[bytes] = []
    with pytest.raises(RowLocked):
        s.host.commit_many(rows, published)
    assert published == []
    assert [read(s, i) for i in (10, 11, 13, 14)] == [None] * 4 and read(s, 3) == page_of(3, P)
    assert s.stats().reserved_slots == 5
    s.locks.unlock_all("reader")
    s.host.abort(slots[2])
    del rows[2]
    s.host.commit_many(rows, published)
    assert published == [name_of(i) for i in (10, 11, 13, 14)]
    assert [read(s, i) for i in (10, 11, 13, 14)] == [page_of(i, P) for i in (10, 11, 13, 14)]
    assert s.stats().reserved_slots == 0
    s.flush()
    if policy == "write-through":
        assert all(TierKind.DISK in r for r in s.residency([name_of(i) for i in (10, 11, 13, 14)]))


def test_store_reserved_slots_are_never_evicted(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=32 * 1024)
    slots = [s.host.reserve(P, "w") for _ in range(8)]
    with pytest.raises(TierFull):
        s.host.reserve(P, "w")
    with pytest.raises(TierFull):
        s.put(name_of(1), page_of(1, P))
    for slot in slots:
        s.host.abort(slot)
    s.put(name_of(1), page_of(1, P))


def test_store_reserve_many_is_all_or_none(make_store: MakeStore) -> None:
    s = make_store(data_dir=None, host_bytes=32 * 1024)  # room for 8 slots of P
    got = s.host.reserve_many([P] * 5, "w")
    assert len({x.offset for x in got}) == 5 and all(x.size == P for x in got)
    assert s.stats().reserved_slots == 5
    with pytest.raises(TierFull):
        s.host.reserve_many([P] * 4, "w2")  # 3 fit, the 4th does not: none stays
    assert s.stats().reserved_slots == 5
    more = s.host.reserve_many([P] * 3, "w2")  # the 3 that fit are still free
    assert s.stats().reserved_slots == 8
    for x in got + more:
        s.host.abort(x)
    assert s.stats().reserved_slots == 0
    with pytest.raises(InvalidInput):
        s.host.reserve_many([P, 0], "w")
    assert s.host.reserve_many([], "w") == []


def test_store_stage_host_brings_a_disk_row_into_shared_memory(make_store: MakeStore) -> None:
    s = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20, write_policy="write-through")
    s.put(name_of(1), page_of(1, P))
    s.close()
    again = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20)
    again.locks.lock([name_of(1)], "lease")
    slot = again.host.stage(name_of(1))
    assert slot is not None and slot.size == P
    assert again.locate([name_of(1)]) == [H]
    view = again.host.view(slot)
    assert view.tobytes() == page_of(1, P)
    view.release()
    mapped, close = attach(slot, writable=False)
    assert mapped.tobytes() == page_of(1, P)
    mapped.release()
    close()
    assert again.host.stage(name_of(2)) is None
    again.locks.unlock_all("lease")


# -- device tier (on the CPU device) ------------------------------------------------------


_CUDA = pytest.param("cuda", marks=[
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_store_device_tier_places_demotes_and_stages(make_store: MakeStore, device: str) -> None:
    """Device rows demote to host (copied by the mover outside the store lock), stage
    both ways, reserve/commit/abort in place; on the CPU device and, with one, on CUDA."""
    s = make_store(device=device, device_bytes=32 * 1024, host_bytes=64 * 1024,
                   disk_bytes=1 << 20)
    for i in range(30):
        s.put(name_of(i), page_of(i, P))
    s.flush()
    st = s.stats()
    assert st.tier(K).enabled and st.tier(K).rows > 0
    assert st.tier(K).demotions > 0
    s.put(name_of(30), page_of(30, P))  # the mover left room below the watermark
    assert s.locate([name_of(30)]) == [K]
    for i in range(31):
        assert read(s, i) == page_of(i, P), i
    s.locks.lock([name_of(0)], "d")
    dslot = s.device.stage(name_of(0))
    assert dslot is not None and dslot.device.startswith(device)
    assert bytes(s.device.view(dslot).cpu().numpy()) == page_of(0, P)
    s.locks.unlock_all("d")
    w = s.device.reserve(P, "dw")
    s.device.view(w).copy_(torch.frombuffer(bytearray(page_of(77, P)), dtype=torch.uint8))
    s.device.commit(name_of(77), w)
    assert read(s, 77) == page_of(77, P)
    w2 = s.device.reserve(P, "dw")
    s.device.abort(w2)
    # a device row staged into host: both copies, then the device copy can go
    s.locks.lock([name_of(77)], "h")
    hslot = s.host.stage(name_of(77))
    assert hslot is not None
    s.check_invariants()
    s.locks.unlock_all("h")


def test_store_device_off_is_said_once_and_never_raises(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvbank.tiers.store.store"):
        s = make_store(data_dir=None, device="cuda", device_bytes=None)
    assert gpu_memory() is None or s.stats().tier(K).enabled
    if not s.stats().tier(K).enabled:
        said = [r for r in caplog.records if "device tier off" in r.getMessage()]
        assert len(said) == 1
        # W20: no device budget was asked for; on a machine without a GPU that is the
        # default, not a fault: said at info, never a warning on every CPU start
        assert said[0].levelno == (logging.WARNING if torch.cuda.is_available() else logging.INFO)
        dev = next(t for t in s.health().tiers if t.kind is K)
        assert dev.state is HealthState.OFF and "device tier off" in dev.detail
        assert s.health().ok
        with pytest.raises(TierUnavailable):
            s.device.reserve(P, "x")
    s2 = make_store(data_dir=None, device="cpu", device_bytes=None)
    assert not s2.stats().tier(K).enabled  # NVML cannot size a CPU device
    if not torch.cuda.is_available():  # a budget asked for and not granted: a warning
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvbank.tiers.store.store"):
            make_store(data_dir=None, device="cuda", device_bytes=1 << 20)
        said = [r for r in caplog.records if "device tier off" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING]


# -- threads, lifecycle ------------------------------------------------------------------


def test_store_concurrent_workers_never_read_wrong_bytes(make_store: MakeStore) -> None:
    s = make_store(host_bytes=48 * 1024, disk_bytes=1 << 20)
    errors: list[BaseException] = []

    def work(base: int) -> None:
        out = bytearray(P)
        try:
            for k in range(60):
                i = base + k % 12
                s.put(name_of(i), page_of(i, P), parent=name_of(i - 1) if i % 12 else None)
                n = s.get_into(name_of(base + (k * 7) % 12), out)
                if n is not None and bytes(out) != page_of(base + (k * 7) % 12, P):
                    raise AssertionError("wrong bytes")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(100 * t,)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    s.flush()
    s.check_invariants()


def test_store_close_is_idempotent_and_unlinks_shared_memory(make_store: MakeStore) -> None:
    from kvbank.tiers.host import SHM_DIR

    s = make_store(host_bytes=1 << 20)
    slot = s.host.reserve(P, "w")
    s.host.abort(slot)
    assert (SHM_DIR / slot.segment).exists()
    s.close()
    s.close()
    assert not (SHM_DIR / slot.segment).exists()
    with pytest.raises(TierUnavailable):
        s.put(name_of(1), page_of(1, P))


# -- batch staging (a lease's rows in one call) -------------------------------------------


def _disk_only_store(make_store: MakeStore, n: int, **kw: object):
    """A store whose rows 0..n-1 are on disk only (written through, then reopened)."""
    first = make_store(host_bytes=64 * 1024, disk_bytes=1 << 20, write_policy="write-through")
    for i in range(n):
        first.put(name_of(i), page_of(i, P))
    first.close()
    fields: dict[str, object] = {"host_bytes": 64 * 1024, "disk_bytes": 1 << 20}
    fields.update(kw)
    return make_store(**fields)


@pytest.mark.parametrize("path", ["device-to-host", "host-to-disk"])
def test_a_demotion_in_flight_keeps_a_row_pinned_meanwhile(make_store: MakeStore,
                                                           path: str) -> None:
    """The mover copies (or encodes) a victim with no lock held; a pin taken in that
    window keeps the row where it was: the demotion completes without dropping the
    pinned copy. (The device state machine found this by timing luck.)"""
    entered, gate = threading.Event(), threading.Event()

    class Held(Copier):
        def between_many(self, host: HostSlab, dev: DevicePool,
                         copies: Sequence[tuple[int, int, int]], *, to_host: bool) -> None:
            if to_host and path == "device-to-host":
                entered.set()
                assert gate.wait(60)
            super().between_many(host, dev, copies, to_host=to_host)

        def encode(self, frames, pool, off, size, dtype):
            if path == "host-to-disk":
                entered.set()
                assert gate.wait(60)
            return super().encode(frames, pool, off, size, dtype)

    if path == "device-to-host":
        s = make_store(device="cpu", device_bytes=32 * 1024, host_bytes=1 << 20,
                       disk_bytes=1 << 22, pin_bytes=1 << 20, copier=Held())
        tier, count = K, 12
    else:
        s = make_store(host_bytes=256 * 1024, disk_bytes=1 << 23, high_watermark=0.5,
                       low_watermark=0.25, dirty_expire_s=0, pin_bytes=1 << 20, copier=Held())
        tier, count = H, 48
    names = [name_of(i) for i in range(count)]
    try:
        for i, n in enumerate(names):
            s.put(n, page_of(i, P))
        assert entered.wait(60), "no demotion started"
        held = [n for n, r in zip(names, s.residency(names), strict=True) if tier in r]
        assert held
        assert s.pin(held) == ()  # the row in flight too
    finally:
        gate.set()
    s.flush()
    assert all(tier in r for r in s.residency(held))
    for n in held:
        assert read(s, names.index(n)) == page_of(names.index(n), P)
    s.check_invariants()


def test_store_stage_host_many_matches_stage_host(make_store: MakeStore) -> None:
    """Hits in host, disk-only rows, misses and a repeated name give what stage_host gives
    row by row: the same misses, slots holding the row's bytes, rows left in host."""
    names = [name_of(i) for i in (0, 1, 2, 50, 3, 1, 51)]
    results = []
    for batch in (False, True):
        s = _disk_only_store(make_store, 4)
        s.put(name_of(3), page_of(3, P))  # an overwrite: in host, its disk copy purged
        s.locks.lock(names, "lease")
        got = s.host.stage_many(names) if batch else [s.host.stage(n) for n in names]
        results.append([None if g is None else (g.size, s.host.view(g).tobytes()) for g in got])
        assert s.locate(names) == [H, H, H, None, H, H, None]
        assert s.stats().tier(H).promotions == 3
        s.check_invariants()
        s.locks.unlock_all("lease")
        s.close()
    assert results[0] == results[1]
    assert results[1][:3] == [(P, page_of(i, P)) for i in range(3)]
    assert results[1][3] is None and results[1][6] is None


@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_store_stage_host_many_copies_device_rows_and_keeps_both(make_store: MakeStore,
                                                                  device: str) -> None:
    """A lease's device rows reach host as one batch of copies (one wait, not one per
    row), each slot holding its row's bytes."""
    batches: list[int] = []

    class Counting(Copier):
        def between_many(self, host: HostSlab, dev: DevicePool,
                         copies: Sequence[tuple[int, int, int]], *, to_host: bool) -> None:
            if to_host:
                batches.append(len(copies))
            super().between_many(host, dev, copies, to_host=to_host)

    s = make_store(device=device, device_bytes=32 * 1024, host_bytes=64 * 1024,
                   disk_bytes=1 << 20, copier=Counting())
    for i in range(4):
        s.put(name_of(i), page_of(i, P))
    assert s.locate([name_of(i) for i in range(4)]) == [K] * 4
    names = [name_of(i) for i in range(4)]
    s.locks.lock(names, "lease")
    batches.clear()
    slots = s.host.stage_many(names)
    assert batches == [4]
    for i, slot in enumerate(slots):
        assert slot is not None and s.host.view(slot).tobytes() == page_of(i, P)
    assert s.residency(names) == [frozenset({K, H})] * 4
    s.check_invariants()
    s.locks.unlock_all("lease")


def test_store_stage_host_many_is_all_or_nothing_when_host_is_too_small(
    make_store: MakeStore,
) -> None:
    """Regression: a lease whose rows do not all fit the host tier gets TierFull and leaves
    no row staged (nor any slot claimed) beyond what was there before."""
    s = _disk_only_store(make_store, 12, host_bytes=32 * 1024, high_watermark=1.0)
    s.put(name_of(40), page_of(40, P))
    names = [name_of(i) for i in range(12)] + [name_of(40)]
    s.locks.lock(names, "lease")
    before = s.residency(names)
    used = s.stats().tier(H).used_bytes
    with pytest.raises(TierFull, match="12 rows"):
        s.host.stage_many(names)
    assert s.residency(names) == before
    assert s.stats().tier(H).used_bytes == used
    s.check_invariants()
    s.locks.unlock_all("lease")
    s.locks.lock(names[:6], "small")
    assert all(x is not None for x in s.host.stage_many(names[:6]))  # a lease that fits
    s.locks.unlock_all("small")


def test_store_stage_host_many_corrupt_disk_row_is_a_miss(
    make_store: MakeStore, tmp_path: Path
) -> None:
    first = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20, write_policy="write-through")
    for i in range(3):
        first.put(name_of(i), page_of(i, P))
    first.close()
    flip_frame_byte(tmp_path / "data", name_of(1), -1, 0xFF)
    s = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20)
    names = [name_of(i) for i in range(3)]
    s.locks.lock(names, "lease")
    slots = s.host.stage_many(names)
    assert slots[1] is None and slots[0] is not None and slots[2] is not None
    assert s.host.view(slots[2]).tobytes() == page_of(2, P)
    assert s.stats().tier(D).corrupt_rows == 1
    s.locks.unlock_all("lease")


class _ChangedThenFails(Copier):
    """A copier whose first decode of row ``name`` arrives short (so the batch sees the
    row as changed and stages it again) and whose second raises, after ``between`` runs."""

    def __init__(self, name: bytes, between: Callable[[], None] = lambda: None) -> None:
        self.name = name
        self.calls = 0
        self.hook = between

    def from_frames(self, frames, name, pool, off, size):
        if name != self.name:
            return super().from_frames(frames, name, pool, off, size)
        self.calls += 1
        if self.calls == 1:
            return 0  # not the bytes asked for: the row "changed", staged again
        self.hook()
        raise OSError("injected: copying the row failed")


def test_store_stage_host_many_rollback_spares_a_row_another_holder_staged(
    make_store: MakeStore,
) -> None:
    """Regression: when stage_host_many fails after publishing some rows, its rollback
    used to drop those host copies unchecked. If another holder had locked and staged
    one of them in that window (through the store API), its slot was freed under a live
    lock. The rollback now gives back only copies nobody has staged or locked since."""
    a, b = name_of(0), name_of(1)
    other: dict[str, object] = {}
    holder_store: list[TieredStore] = []

    def another_holder() -> None:  # between the publish and the rollback
        def run() -> None:
            holder_store[0].locks.lock([a], "other")
            other["slot"] = holder_store[0].host.stage(a)

        t = threading.Thread(target=run)
        t.start()
        t.join()

    s = _disk_only_store(make_store, 4, copier=_ChangedThenFails(b, another_holder))
    holder_store.append(s)
    s.locks.lock([a, b], "lease")
    with pytest.raises(OSError, match="injected"):
        s.host.stage_many([a, b])
    slot = other["slot"]
    assert isinstance(slot, HostSlot)
    assert H in s.residency([a])[0]  # the other holder's copy stayed
    assert s.host.stage(a) == slot  # the same slot: it was never freed
    assert s.host.view(slot).tobytes() == page_of(0, P)
    assert s.residency([b]) == [frozenset({D})]  # nothing added for b
    s.check_invariants()
    s.put(name_of(60), page_of(60, P))  # a freed slot would be handed out again here
    assert s.host.view(slot).tobytes() == page_of(0, P)
    s.locks.unlock_all("other")
    s.locks.unlock_all("lease")


def test_store_stage_host_many_rollback_gives_back_untouched_copies(
    make_store: MakeStore,
) -> None:
    """All or nothing still holds when nobody else used the rows: a copy failure after
    some rows were published leaves no row in host that was not there before."""
    names = [name_of(i) for i in range(3)]
    s = _disk_only_store(make_store, 4, copier=_ChangedThenFails(names[-1]))
    s.locks.lock(names, "lease")
    used = s.stats().tier(H).used_bytes
    with pytest.raises(OSError, match="injected"):
        s.host.stage_many(names)
    assert s.residency(names) == [frozenset({D})] * 3
    assert s.stats().tier(H).used_bytes == used
    s.check_invariants()
    s.locks.unlock_all("lease")


def test_store_stage_host_many_empty_and_host_off(make_store: MakeStore) -> None:
    s = make_store(host_bytes=32 * 1024)
    assert s.host.stage_many([]) == []
    with pytest.raises(InvalidRowName):
        s.host.stage_many([b"short"])
    off = make_store(data_dir=None, host_bytes=0, device="cpu", device_bytes=1 << 16)
    with pytest.raises(TierUnavailable):
        off.host.stage_many([name_of(1)])


# -- demotion on the codec workers -------------------------------------------------------


def test_store_demotions_encode_in_parallel_but_write_in_queue_order(
    make_store: MakeStore, tmp_path: Path
) -> None:
    """Two encoders, one writer: frames reach LMDB in the order the rows were queued (LRU
    order, here the put order), so the write clock still gives the LRU order on restart."""
    s = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20)
    for i in range(60):
        s.put(name_of(i), page_of(i, P))
    s.flush()
    on_disk = [i for i in range(60) if D in s.residency([name_of(i)])[0]]
    s.close(persist=False)
    disk = DiskTier(tmp_path / "data", 1 << 20, sync=False)
    rows = sorted(disk.scan(), key=lambda r: r.seq)
    disk.close()
    assert {int.from_bytes(r.name[-8:], "big") for r in rows} == set(on_disk)
    order = [int.from_bytes(r.name[-8:], "big") for r in rows]
    assert len(order) > 30 and order == sorted(order)


@pytest.mark.parametrize("change", ["overwrite", "delete"])
def test_store_change_during_an_encode_leaves_no_stale_frame(
    make_store: MakeStore, change: str
) -> None:
    """Regression: a row overwritten or deleted while its demotion is being encoded on a
    worker never keeps the old frame on disk (now or after a restart)."""
    entered, gate = threading.Event(), threading.Event()

    class HeldEncode(Copier):
        def encode(self, frames, pool, off, size, dtype):
            entered.set()
            assert gate.wait(10)
            return super().encode(frames, pool, off, size, dtype)

    s = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20, high_watermark=0.6,
                   low_watermark=0.3, encode_workers=2, copier=HeldEncode())
    for i in range(6):
        s.put(name_of(i), page_of(i, P))
    assert entered.wait(10), "no demotion started"
    if change == "overwrite":
        s.put(name_of(0), page_of(500, P))
    else:
        assert s.delete(name_of(0))
    gate.set()
    s.flush()
    s.check_invariants()  # LMDB names == the index's disk rows: no stale frame
    assert read(s, 0) == (page_of(500, P) if change == "overwrite" else None)
    s.close()
    again = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20)
    assert read(again, 0) in ((None, page_of(500, P)) if change == "overwrite" else (None,))


def test_store_encode_workers_is_checked(make_store: MakeStore) -> None:
    with pytest.raises(InvalidInput, match="encode_workers"):
        make_store(encode_workers=0)


# -- victim selection --------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_policy_victims_by_partial_sort_equal_the_full_sort(seed: int) -> None:
    """Regression: ordering candidates chunk by chunk (argpartition) picks exactly the
    victims a full sort of the LRU stamps picks: same rows, same order, with chains,
    touched rows, kept (locked) rows and size-class targeting."""
    import random

    from kvbank.tiers.allocator import slot_class
    from kvbank.tiers.index import HOST, RowIndex
    from kvbank.tiers.store import policy

    rng = random.Random(seed)
    ix = RowIndex(4 << 20)
    prev = -1
    for i in range(600):
        size = rng.choice((100, 200, 5000))
        chain = prev >= 0 and rng.random() < 0.7
        rid = ix.add(name_of(i), size, 0, prev if chain else -1)
        ix.where[rid] = HOST
        ix.set_off(rid, 64 * i)
        prev = rid
    for _ in range(200):
        ix.touch(rng.randrange(600))
    keep = [rng.randrange(600) for _ in range(30)]

    def charge(rid: int) -> int:
        return slot_class(int(ix.size[rid]))

    for need in (1, 300, 5000, 40_000, 400_000, 10**9):
        for cls in (None, 128, 256, 8192):
            picks = [policy.victims(ix, HOST, need, keep=keep, busy_offs=set(), host_copy={},
                                    charge=charge, cls=cls, first_k=first_k)
                     for first_k in (1, 10**9)]
            assert picks[0] == picks[1], (need, cls)
            assert not set(picks[0]) & set(keep)


# -- graceful close ----------------------------------------------------------------------


def test_store_close_writes_dirty_rows_to_disk_in_lru_order(
    make_store: MakeStore, tmp_path: Path
) -> None:
    """Regression: under write-back a graceful close keeps every host and device row
    (they reach the disk), and the write clocks keep their LRU order for the restart."""
    s = make_store(device="cpu", device_bytes=16 * 1024, host_bytes=1 << 20,
                   disk_bytes=1 << 20)
    for i in range(20):
        s.put(name_of(i), page_of(i, P), parent=name_of(i - 1) if i else None)
    # Where each row sits now depends on the mover's timing (device -> host); only that
    # nothing reached the disk before close is certain under write-back.
    assert s.stats().tier(D).rows == 0
    for i in range(5):
        assert read(s, i) == page_of(i, P)  # rows 0..4 are now the most recent
    s.close()
    again = make_store(host_bytes=1 << 20, disk_bytes=1 << 20)
    assert again.locate([name_of(i) for i in range(20)]) == [D] * 20
    for i in range(20):
        assert read(again, i) == page_of(i, P)
    again.close()
    disk = DiskTier(tmp_path / "data", 1 << 20, sync=False)
    by_seq = [int.from_bytes(r.name[-8:], "big")
              for r in sorted(disk.scan(), key=lambda r: r.seq)]
    disk.close()
    assert by_seq == list(range(5, 20)) + list(range(5))


def test_store_close_writes_back_in_group_commits(make_store: MakeStore, tmp_path: Path) -> None:
    """Regression: a close commits its dirty rows a group per LMDB transaction, not one
    each (every commit is an fsync), and the write clocks still follow the LRU order."""
    import lmdb

    s = make_store(host_bytes=1 << 20, disk_bytes=1 << 20)
    for i in range(40):
        s.put(name_of(i), page_of(i, P), parent=name_of(i - 1) if i else None)
    for i in range(3):
        assert read(s, i) == page_of(i, P)  # rows 0..2 are now the most recent
    assert s.stats().tier(D).rows == 0  # 160 KiB in a 1 MiB host tier: nothing demoted
    s.close()
    env = lmdb.open(str(tmp_path / "data" / "lmdb"), subdir=True, max_dbs=2, lock=True)
    commits = env.info()["last_txnid"]  # every write transaction since the file was made
    env.close()
    assert commits <= 2 + 40 // 4, f"{commits} transactions for 40 rows"
    disk = DiskTier(tmp_path / "data", 1 << 20, sync=False)
    by_seq = [int.from_bytes(r.name[-8:], "big")
              for r in sorted(disk.scan(), key=lambda r: r.seq)]
    disk.close()
    assert by_seq == list(range(3, 40)) + list(range(3))


def test_store_close_without_persist_drops_dirty_rows(make_store: MakeStore) -> None:
    s = make_store(host_bytes=1 << 20, disk_bytes=1 << 20)
    for i in range(5):
        s.put(name_of(i), page_of(i, P))
    s.close(persist=False)
    again = make_store(host_bytes=1 << 20, disk_bytes=1 << 20)
    assert stored(again, [name_of(i) for i in range(5)]) == [False] * 5


def test_store_close_keeps_the_hottest_rows_within_the_disk_budget(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    pages = [np.random.default_rng(i).bytes(P) for i in range(24)]  # incompressible
    s = make_store(host_bytes=1 << 20, disk_bytes=48 * 1024, write_policy="write-through")
    for i in range(4):
        s.put(name_of(i), pages[i])  # old rows, on disk
    s.close()
    s = make_store(host_bytes=1 << 20, disk_bytes=48 * 1024)
    for i in range(4, 24):
        s.put(name_of(i), pages[i])
    with caplog.at_level(logging.WARNING, logger="kvbank.tiers.store.store"):
        s.close()
    assert any("memory-only rows to disk" in r.getMessage() for r in caplog.records)
    again = make_store(host_bytes=1 << 20, disk_bytes=48 * 1024)
    present = stored(again, [name_of(i) for i in range(24)])
    kept = [i for i, p in enumerate(present) if p]
    assert kept and kept == list(range(24 - len(kept), 24)), kept  # the newest survive
    assert again.stats().tier(D).used_bytes <= 48 * 1024
    for i in kept:
        assert read(again, i) == pages[i]


def test_store_close_stops_at_its_deadline(
    make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    s = make_store(host_bytes=1 << 20, disk_bytes=1 << 20)
    for i in range(5):
        s.put(name_of(i), page_of(i, P))
    with pytest.raises(InvalidInput, match="deadline_s"):
        s.close(deadline_s=-1)
    with caplog.at_level(logging.WARNING, logger="kvbank.tiers.store.store"):
        s.close(deadline_s=0)
    assert any("deadline" in r.getMessage() for r in caplog.records)
    again = make_store(host_bytes=1 << 20, disk_bytes=1 << 20)
    assert again.stats().rows == 0


def test_store_close_runs_queued_purges(make_store: MakeStore) -> None:
    """A row deleted just before close never comes back after the restart."""
    s = make_store(host_bytes=1 << 20, disk_bytes=1 << 20, write_policy="write-through")
    for i in range(10):
        s.put(name_of(i), page_of(i, P))
    for i in range(0, 10, 2):
        s.delete(name_of(i))
    s.close(persist=False)
    again = make_store(host_bytes=1 << 20, disk_bytes=1 << 20)
    assert stored(again, [name_of(i) for i in range(10)]) == [i % 2 == 1 for i in range(10)]


def after_the_first_write(monkeypatch: pytest.MonkeyPatch, take: Callable[[], object]) -> list[bool]:
    """Run ``take`` (a lock or a pin) right after the next ``DiskTier.write_frames``, as
    another thread could between a put's disk write and its publish; the list it returns
    holds True once that happened (a pin's answer, the names not stored, must be none)."""
    write = DiskTier.write_frames
    done: list[bool] = []

    def then_take(self: DiskTier, rows: Sequence[object], **kw: object) -> object:
        out = write(self, rows, **kw)  # type: ignore[arg-type]
        if not done:
            assert take() in (None, ())
            done.append(True)
        return out

    monkeypatch.setattr(DiskTier, "write_frames", then_take)
    return done


@pytest.mark.parametrize("taken", ["lock", "pin"])
@pytest.mark.parametrize("bytes_", ["same", "other"])
def test_a_batch_put_refused_after_its_disk_write_keeps_the_rows_frame(make_store: MakeStore,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       taken: str, bytes_: str) -> None:
    """A batch put of a row already stored on disk writes its frame, then finds the row
    locked (a READ lease) or pinned meanwhile and leaves the row as it was: with the same
    bytes the frame stays, since the index still says the row is there; with other bytes
    the row's memory copy is its own again and goes back to disk with its own bytes. (The
    frame was deleted as an orphan: the row then read as on disk with no frame, found by
    a race test under load.)"""
    s = make_store(host_bytes=1 << 20, disk_bytes=1 << 22, write_policy="write-through",
                   pin_bytes=1 << 20)
    name = name_of(7)
    s.put(name, page_of(7, P))
    assert s.locate([name]) == [H]
    if taken == "lock":
        done = after_the_first_write(monkeypatch, lambda: s.locks.lock([name], "a-read-lease"))
    else:
        done = after_the_first_write(monkeypatch, lambda: s.pin([name]))
    page = page_of(7 if bytes_ == "same" else 8, P)
    assert s.put_many([(name, page, None)]) == [False]  # refused after the write
    assert done == [True]
    s.check_invariants()  # on disk in the index only with its frame in LMDB
    assert read(s, 7) == page_of(7, P)
    if taken == "lock":
        s.locks.unlock([name], "a-read-lease")
    else:
        s.unpin([name])
    s.close()
    again = make_store(host_bytes=1 << 20, disk_bytes=1 << 22)  # from disk alone
    assert again.locate([name]) == [D]
    assert read(again, 7) == page_of(7, P)


def test_a_batch_put_refused_over_a_pinned_disk_only_row_leaves_it_consistent(
        make_store: MakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one case where the refused put's frame must stay with other bytes: the row was
    on disk only, so the write replaced its only copy. The frame is then the row, and its
    checksum follows (a promotion into host memory checks against it)."""
    s = make_store(host_bytes=P // 2, disk_bytes=1 << 22, write_policy="write-through", pin_bytes=1 << 20)
    name = name_of(7)
    s.put(name, page_of(7, P))  # no host room: straight to disk, its checksum recorded
    assert s.locate([name]) == [D]
    done = after_the_first_write(monkeypatch, lambda: s.pin([name]))
    assert s.put_many([(name, page_of(8, P), None)]) == [False]
    assert done == [True]
    s.check_invariants()
    s.unpin([name])
    assert read(s, 7) == page_of(8, P)  # from disk
    ix = s._st.ix  # what a promotion into host memory checks its copy against
    assert ix.get_checksum(ix.ids[name]) == checksum(page_of(8, P))
