"""The host tier: conformance, shared-memory segments, cross-process slots."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbank.errors import InvalidInput, TierUnavailable
from kvbank.testing.tiers import TierTests, name_of, page_of
from kvbank.tiers.base import HostSlot, Tier
from kvbank.tiers.host import SHM_DIR, HostSlab, HostTier, SlotMapping, attach, cleanup_stale


class TestHostTier(TierTests):
    def make_tier(self, budget: int) -> Tier:
        return HostTier(budget, prefix="kvbank-test")


def test_host_segment_is_unlinked_on_close_and_sparse_until_used() -> None:
    slab = HostSlab(64 << 20, prefix="kvbank-test")
    path = SHM_DIR / slab.segment
    assert path.exists()
    assert path.stat().st_blocks == 0, "the segment should hold no memory before a row"
    off = slab.alloc(1 << 20)
    assert off is not None
    assert slab.allocated_bytes > 0
    assert path.stat().st_blocks * 512 >= slab.allocated_bytes
    slab.close()
    slab.close()
    assert not path.exists()


def test_host_segment_names_are_unique_per_instance() -> None:
    a, b = HostSlab(1 << 20, prefix="kvbank-test"), HostSlab(1 << 20, prefix="kvbank-test")
    try:
        assert a.segment != b.segment
        assert a.segment.startswith(f"kvbank-test-{os.getpid()}-")
    finally:
        a.close()
        b.close()


def test_host_released_chunk_returns_memory_to_tmpfs() -> None:
    """Rows of a new size class reuse the room of an emptied class (no leak of budget)."""
    slab = HostSlab(1 << 20, prefix="kvbank-test")
    try:
        offs = []
        while (off := slab.alloc(4096)) is not None:
            offs.append(off)
        assert slab.allocated_bytes <= 1 << 20
        assert slab.alloc(8192) is None  # the budget is all claimed by 4 KiB slots
        for off in offs:
            slab.free(off)
        assert slab.alloc(8192) is not None  # empty chunks were released and re-claimed
        slab.allocator.check()
    finally:
        slab.close()


def test_host_attach_reads_and_writes_in_place() -> None:
    tier = HostTier(1 << 20, prefix="kvbank-test")
    try:
        tier.put(name_of(1), page_of(1, 5000))
        slot = tier.locate(name_of(1))
        assert slot is not None and slot.size == 5000
        view, close = attach(slot)
        try:
            assert view.tobytes() == page_of(1, 5000)
            view[:4] = b"abcd"
        finally:
            view.release()
            close()
        out = bytearray(5000)
        tier.get_into(name_of(1), out)
        assert out[:4] == b"abcd"
    finally:
        tier.close()


def test_host_attach_refuses_bad_slots() -> None:
    with pytest.raises(TierUnavailable):
        SlotMapping(HostSlot("kvbank-test-0-nosuchsegment", 0, 10))
    with pytest.raises(InvalidInput):
        SlotMapping(HostSlot("../etc/passwd", 0, 10))
    tier = HostTier(1 << 20, prefix="kvbank-test")
    try:
        tier.put(name_of(1), b"x" * 100)
        slot = tier.locate(name_of(1))
        assert slot is not None
        with pytest.raises(InvalidInput):
            SlotMapping(HostSlot(slot.segment, (1 << 20) - 10, 100))
    finally:
        tier.close()


def _child_fill(slot: HostSlot, payload: bytes) -> None:
    with SlotMapping(slot) as view:
        assert len(view) == slot.size
        view[:] = payload


def test_host_slot_is_filled_by_another_process_without_tracker_warnings() -> None:
    """A spawned process maps the slot by name, writes it, exits; the owner sees the
    bytes and its segment is still there (no resource tracker unlinked it)."""
    tier = HostTier(1 << 20, prefix="kvbank-test")
    try:
        tier.put(name_of(1), bytes(8192))
        slot = tier.locate(name_of(1))
        assert slot is not None
        ctx = mp.get_context("spawn")
        proc = ctx.Process(target=_child_fill, args=(slot, page_of(7, 8192)))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
        assert (SHM_DIR / slot.segment).exists()
        out = bytearray(8192)
        tier.get_into(name_of(1), out)
        assert bytes(out) == page_of(7, 8192)
    finally:
        tier.close()


def test_host_cleanup_stale_removes_segments_of_dead_processes(tmp_path: Path) -> None:
    code = (
        "import os\n"
        "from kvbank.tiers.host import HostTier\n"
        "t = HostTier(1 << 20, prefix='kvbank-stale')\n"
        "t.put(b'n' * 54, b'x' * 10)\n"
        "print(t.slab.segment, flush=True)\n"
        "os._exit(0)\n"  # dies without close: the segment leaks like after kill -9
    )
    seg = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=60).stdout.strip()
    assert (SHM_DIR / seg).exists()
    mine = HostTier(1 << 20, prefix="kvbank-stale")
    try:
        removed = cleanup_stale("kvbank-stale")
        assert seg in removed
        assert not (SHM_DIR / seg).exists()
        assert (SHM_DIR / mine.slab.segment).exists(), "a live process's segment was removed"
    finally:
        mine.close()


def test_host_zero_budget_holds_nothing() -> None:
    tier = HostTier(0, prefix="kvbank-test")
    try:
        from kvbank.errors import TierFull

        with pytest.raises(TierFull):
            tier.put(name_of(1), b"x")
    finally:
        tier.close()
