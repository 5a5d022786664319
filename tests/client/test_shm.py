"""The borrower's mappings: page tables built up front (``populate=True``) show the
owner's bytes, and a close during population stops it before unmapping; batch copies
(one lane or two) move exactly each row, and a READ batch is refused after expiry."""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.client.shm import HASH_CHUNK, LANE_MIN_BYTES, POPULATE_STEP, Borrower, _cut, _halves
from kvbank.codec.frame import checksum
from kvbank.errors import InvalidInput, LeaseExpired
from kvbank.lender.base import (
    Delivery,
    HostLocation,
    Lease,
    LeaseMode,
    LeaseRow,
    MemoryKind,
    Selection,
)
from kvbank.tiers.host import SHM_DIR


@pytest.fixture
def segment() -> Iterator[tuple[str, np.ndarray]]:
    """A resident shared-memory segment of three populate steps, filled by its owner."""
    name = f"kvbank-test-borrow-{secrets.token_hex(4)}"
    size = 3 * POPULATE_STEP
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    np.frombuffer(mm, dtype=np.uint8)[:] = data
    try:
        yield name, data
    finally:
        mm.close()
        os.unlink(SHM_DIR / name)


@pytest.mark.parametrize("writable", [False, True])
def test_borrow_populated_mapping_shows_the_owners_bytes(segment: tuple[str, np.ndarray],
                                                         writable: bool) -> None:
    name, data = segment
    with Borrower(writable=writable, populate=True) as b:
        assert b.wait_populated(name, timeout=120.0)
        assert np.array_equal(np.frombuffer(b.segment(name), dtype=np.uint8), data)


def test_borrow_close_during_population_unmaps_cleanly(segment: tuple[str, np.ndarray]) -> None:
    name, data = segment
    b = Borrower(populate=True)
    view = b.segment(name)
    assert view[:16] == data[:16].tobytes()
    b.close()  # joins the populating thread (at most one step) before unmapping
    assert b.wait_populated(name, timeout=120.0)  # maps it again, populates again
    b.close()


def test_borrow_without_populate_starts_no_thread(segment: tuple[str, np.ndarray]) -> None:
    name, _ = segment
    with Borrower() as b:
        assert b.wait_populated(name, timeout=0.0)  # nothing to wait for


def _lease(name: str, rows: int, size: int, expires_at: float, mode: LeaseMode) -> Lease:
    """A lease on ``rows`` rows of ``size`` bytes, every other slot of the segment."""
    out = tuple(LeaseRow(bytes([i]) * 54, True, HostLocation(name, (2 * i + 1) * size, size), (),
                         Delivery.READY if mode is LeaseMode.READ else Delivery.RESERVED)
                for i in range(rows))
    return Lease("L", MemoryKind.HOST, mode, Selection.NAMED, expires_at, 0.0, out)


@pytest.mark.parametrize("rows", [1, 6])  # one lane, and a batch split over two (>= 2 MiB)
def test_borrow_copy_rows_moves_exactly_each_row(segment: tuple[str, np.ndarray], rows: int) -> None:
    name, data = segment
    size = 2 << 20
    got = np.zeros((rows, size), dtype=np.uint8)
    with Borrower(clock=lambda: 0.0) as b:
        lease = _lease(name, rows, size, 10.0, LeaseMode.READ)
        b.copy_rows(lease, [(r.name, memoryview(got[i])) for i, r in enumerate(lease.rows)], into_rows=False)
    for i in range(rows):
        off = (2 * i + 1) * size
        assert np.array_equal(got[i], data[off : off + size])
    pages = np.random.default_rng(5).integers(0, 256, (rows, size), dtype=np.uint8)
    with Borrower(writable=True, clock=lambda: 0.0) as w:
        lease = _lease(name, rows, size, 10.0, LeaseMode.WRITE)
        w.copy_rows(lease, [(r.name, memoryview(pages[i])) for i, r in enumerate(lease.rows)], into_rows=True)
        seg = np.frombuffer(w.segment(name), dtype=np.uint8)
        for i in range(rows):
            off = (2 * i + 1) * size
            assert np.array_equal(seg[off : off + size], pages[i])
            assert np.array_equal(seg[off - size : off], data[off - size : off])  # neighbours untouched
        del seg


def test_borrow_copy_rows_refuses_an_expired_lease_and_a_short_buffer(segment: tuple[str, np.ndarray]) -> None:
    name, _ = segment
    size = 2 << 20
    with Borrower(clock=lambda: 20.0) as b:
        lease = _lease(name, 2, size, 10.0, LeaseMode.READ)
        bufs = [memoryview(bytearray(size)) for _ in range(2)]
        with pytest.raises(LeaseExpired):
            b.copy_rows(lease, list(zip(lease.names, bufs, strict=True)), into_rows=False)
        with pytest.raises(InvalidInput, match="out"):
            b.copy_rows(lease, [(lease.names[0], memoryview(bytearray(size - 1)))], into_rows=False)


def test_borrow_copy_slots_refuses_a_slot_beyond_its_segment_before_copying(
        segment: tuple[str, np.ndarray]) -> None:
    name, data = segment
    size = 1 << 20
    end = len(data)
    with Borrower(writable=True) as w:
        good = np.full(size, 9, dtype=np.uint8)
        for offset in (end - size + 1, -1, end):
            with pytest.raises(InvalidInput, match="beyond segment"):
                # the first slot is fine: nothing may be written before the refusal
                w.copy_slots([(name, 0, size, good.data), (name, offset, size, good.data)],
                             into_slots=True)
        seg = np.frombuffer(w.segment(name), dtype=np.uint8)
        assert np.array_equal(seg[:size], data[:size])
        del seg


def test_lease_row_finds_every_row_by_name_and_the_first_of_a_repeated_name() -> None:
    rows = tuple(LeaseRow(bytes([i % 5]) * 54, True, None, (), Delivery.READY if i < 5 else Delivery.MISSING)
                 for i in range(8))
    lease = Lease("L", MemoryKind.HOST, LeaseMode.READ, Selection.NAMED, 1.0, 0.0, rows)
    for i in range(5):
        assert lease.row(bytes([i]) * 54) is rows[i]
    with pytest.raises(KeyError):
        lease.row(b"\x09" * 54)
    assert lease == Lease("L", MemoryKind.HOST, LeaseMode.READ, Selection.NAMED, 1.0, 0.0, rows)


@pytest.mark.parametrize("sizes", [
    [0, 1, HASH_CHUNK - 1, HASH_CHUNK, HASH_CHUNK + 1],  # one lane: under LANE_MIN_BYTES
    [2 << 20] * 6 + [3 * HASH_CHUNK + 17, 5],  # two lanes, rows cut into chunks and a tail
    [LANE_MIN_BYTES + 12345],  # one row over the lane size: one lane (a hash runs in order)
])
def test_borrow_copy_slots_summed_copies_each_row_and_returns_its_checksum(
        segment: tuple[str, np.ndarray], sizes: list[int]) -> None:
    """A checked read hashes each row as it is copied: every row lands whole, in its own
    buffer, and its digest is the node's checksum of those bytes (the one definition,
    :func:`kvbank.codec.frame.checksum`) whatever the row's size against the chunk."""
    name, data = segment
    offsets = np.cumsum([7, *sizes[:-1]]).tolist()  # odd offsets: no row starts aligned
    bufs = [np.zeros(n + 3, dtype=np.uint8) for n in sizes]  # larger than the row
    with Borrower() as b:
        sums = b.copy_slots_summed([(name, o, n, buf.data) for o, n, buf in zip(offsets, sizes, bufs, strict=True)])
    for o, n, buf, got in zip(offsets, sizes, bufs, sums, strict=True):
        assert np.array_equal(buf[:n], data[o : o + n])
        assert not buf[n:].any()  # nothing past the row is written
        assert got == checksum(data[o : o + n].data)


@pytest.mark.parametrize("runs", [
    [(40_000, 20)],  # one merged copy of small rows: under LANE_MIN_BYTES, one lane
    [(40_000, 90), (HASH_CHUNK + 5, 3), (7, 1)],  # small rows, rows over a chunk, a lone row
])
def test_borrow_copy_slots_summed_hashes_each_row_of_a_merged_copy(
        segment: tuple[str, np.ndarray], runs: list[tuple[int, int]]) -> None:
    """Rows merged into one copy (back to back in the segment and in the buffer) are
    still each verified on their own: one digest per row, in order, each the checksum of
    that row's bytes, the units of work and the lanes cut between rows."""
    name, data = segment
    slots: list[tuple[str, int, int, memoryview]] = []
    rows: list[int] = []
    want: list[int] = []
    bufs: list[tuple[np.ndarray, int]] = []
    at = 3
    for row, count in runs:
        buf = np.zeros(row * count, dtype=np.uint8)
        bufs.append((buf, at))
        slots.append((name, at, row * count, buf.data))
        rows.append(row)
        want.extend(checksum(data[at + k * row : at + (k + 1) * row].data) for k in range(count))
        at += row * count + 11
    with Borrower() as b:
        got = b.copy_slots_summed(slots, rows=rows)
        with pytest.raises(InvalidInput, match="rows"):
            b.copy_slots_summed(slots[:1], rows=[runs[0][0] + 1])  # not a whole number of rows
        with pytest.raises(InvalidInput, match="rows"):
            b.copy_slots_summed(slots, rows=rows[:-1])
    assert got == want
    for buf, at in bufs:
        assert np.array_equal(buf, data[at : at + buf.nbytes])


def test_borrow_copy_slots_summed_refuses_a_slot_beyond_its_segment_and_a_bad_chunk(
        segment: tuple[str, np.ndarray]) -> None:
    name, data = segment
    size = 1 << 20
    bufs = [np.zeros(size, dtype=np.uint8) for _ in range(2)]
    with Borrower() as b:
        with pytest.raises(InvalidInput, match="beyond segment"):
            b.copy_slots_summed([(name, 0, size, bufs[0].data), (name, len(data) - 1, size, bufs[1].data)])
        with pytest.raises(InvalidInput, match="chunk"):
            b.copy_slots_summed([(name, 0, size, bufs[0].data)], chunk=0)
    assert not bufs[0].any()  # refused before anything was copied


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=2, max_size=8))
def test_lanes_of_whole_rows_split_where_the_bytes_are_nearest_even(sizes: list[int]) -> None:
    """A checked read's lanes split between rows (each lane hashes its rows in order),
    each lane given at least one row, at the cut that leaves the two nearest to even."""
    jobs = [(np.zeros(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)) for n in sizes]
    k = _cut(jobs)
    assert 1 <= k <= len(sizes) - 1
    total = sum(sizes)
    assert abs(total - 2 * sum(sizes[:k])) == min(abs(total - 2 * sum(sizes[:j])) for j in range(1, len(sizes)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=8), st.data())
def test_two_lanes_cover_every_byte_once_whatever_the_cut(sizes: list[int], data: st.DataObject) -> None:
    """A batch is cut into two lanes at a byte count, a copy across the cut split in two
    (one long merged copy still takes both lanes): every byte is copied once, in place."""
    total = sum(sizes)
    half = data.draw(st.integers(0, total))
    src = np.arange(total, dtype=np.uint64).astype(np.uint8) + 1
    dst = np.zeros(total, dtype=np.uint8)
    jobs, at = [], 0
    for n in sizes:
        jobs.append((dst[at : at + n], src[at : at + n]))
        at += n
    first, second = _halves(jobs, half)
    assert sum(d.nbytes for d, _ in first) == half and sum(d.nbytes for d, _ in second) == total - half
    for d, s in first + second:
        assert d.nbytes == s.nbytes
        assert not (d == s).all() or d.nbytes == 0  # no byte is copied twice
        d[:] = s
    assert np.array_equal(dst, src)
