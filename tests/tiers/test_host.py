"""The host tier: conformance, shared-memory segments, cross-process slots."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvbank.errors import InvalidInput, TierUnavailable
from kvbank.testing.pools import SlotPoolTests
from kvbank.testing.tiers import page_of
from kvbank.tiers.base import HostSlot, SlotPool
from kvbank.tiers.host import (
    MADV_POPULATE_WRITE,
    SHM_DIR,
    HostSlab,
    SlotMapping,
    attach,
    cleanup_stale,
    madvise,
    map_segment,
)


class TestHostSlab(SlotPoolTests):
    def make_pool(self, budget: int) -> SlotPool:
        return HostSlab(budget, prefix="kvbank-test")


def _slot_with(slab: HostSlab, data: bytes) -> HostSlot:
    off = slab.alloc(len(data))
    assert off is not None
    slab.write(off, memoryview(data))
    return slab.slot(off, len(data))


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
    slab = HostSlab(1 << 20, prefix="kvbank-test")
    try:
        slot = _slot_with(slab, page_of(1, 5000))
        view, close = attach(slot)
        try:
            assert view.tobytes() == page_of(1, 5000)
            view[:4] = b"abcd"
        finally:
            view.release()
            close()
        out = memoryview(bytearray(5000))
        slab.read_into(slot.offset, 5000, out)
        assert out[:4].tobytes() == b"abcd"
    finally:
        slab.close()


def test_host_attach_refuses_bad_slots() -> None:
    with pytest.raises(TierUnavailable):
        SlotMapping(HostSlot("kvbank-test-0-nosuchsegment", 0, 10))
    with pytest.raises(InvalidInput):
        SlotMapping(HostSlot("../etc/passwd", 0, 10))
    with pytest.raises(InvalidInput):
        map_segment(".hidden", writable=False)
    slab = HostSlab(1 << 20, prefix="kvbank-test")
    try:
        slot = _slot_with(slab, b"x" * 100)
        with pytest.raises(InvalidInput):
            SlotMapping(HostSlot(slot.segment, (1 << 20) - 10, 100))
    finally:
        slab.close()


def _child_fill(slot: HostSlot, payload: bytes) -> None:
    with SlotMapping(slot) as view:
        assert len(view) == slot.size
        view[:] = payload


def test_host_slot_is_filled_by_another_process_without_tracker_warnings() -> None:
    """A spawned process maps the slot by name, writes it, exits; the owner sees the
    bytes and its segment is still there (no resource tracker unlinked it)."""
    slab = HostSlab(1 << 20, prefix="kvbank-test")
    try:
        slot = _slot_with(slab, bytes(8192))
        ctx = mp.get_context("spawn")
        proc = ctx.Process(target=_child_fill, args=(slot, page_of(7, 8192)))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
        assert (SHM_DIR / slot.segment).exists()
        out = memoryview(bytearray(8192))
        slab.read_into(slot.offset, 8192, out)
        assert out.tobytes() == page_of(7, 8192)
    finally:
        slab.close()


def test_host_cleanup_stale_removes_segments_of_dead_processes(tmp_path: Path) -> None:
    code = (
        "import os\n"
        "from kvbank.tiers.host import HostSlab\n"
        "t = HostSlab(1 << 20, prefix='kvbank-stale')\n"
        "t.alloc(10)\n"
        "print(t.segment, flush=True)\n"
        "os._exit(0)\n"  # dies without close: the segment leaks like after kill -9
    )
    seg = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=60).stdout.strip()
    assert (SHM_DIR / seg).exists()
    mine = HostSlab(1 << 20, prefix="kvbank-stale")  # a new slab reclaims at open
    try:
        assert seg in mine.reclaimed
        assert not (SHM_DIR / seg).exists()
        assert cleanup_stale("kvbank-stale") == []
        assert (SHM_DIR / mine.segment).exists(), "a live process's segment was removed"
    finally:
        mine.close()



def _longest_stall(populate: Callable[[], None]) -> float:
    """The longest this thread went without a step while ``populate`` ran on another
    one, as a fraction of how long ``populate`` took."""
    took: list[float] = []

    def run() -> None:
        t0 = time.monotonic()
        populate()
        took.append(time.monotonic() - t0)

    t = threading.Thread(target=run)
    last, worst = time.monotonic(), 0.0
    t.start()
    while t.is_alive():
        now = time.monotonic()
        worst, last = max(worst, now - last), now
    t.join()
    return worst / took[0]


def test_madvise_leaves_the_gil_to_other_threads() -> None:
    """A reservation pre-faults the segment from a background thread (HostSlab.prefault,
    through tiers.host.madvise): the node's other threads (its event loop, its bank
    calls) keep running meanwhile. Python's own ``mmap.madvise`` holds the GIL for the
    whole call: with it, the same check finds no step at all (shown here too)."""
    slab = HostSlab(512 << 20, prefix="kvbank-test")
    try:
        n = slab.space_bytes
        os.posix_fallocate(slab._fd, 0, n)  # tmpfs blocks first: only page tables are built below
        assert slab._mm is not None
        mm, addr = slab._mm, int(slab._arr.ctypes.data)
        assert _longest_stall(lambda: madvise(addr, n, MADV_POPULATE_WRITE)) < 0.5
        mm.madvise(mmap.MADV_DONTNEED, 0, n)  # this mapping's page tables dropped again
        assert _longest_stall(lambda: mm.madvise(MADV_POPULATE_WRITE, 0, n)) > 0.5
    finally:
        slab.close()
