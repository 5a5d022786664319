"""The borrower's side of a HOST lease, in another process.

A lease crosses the process boundary as plain JSON (``wire.to_json(lease)``): segment
names, offsets and sizes, never pickled objects. :class:`Borrower` maps each shared-memory
segment once through :func:`kvbank.tiers.host.map_segment` (the one segment mapper and
name check, shared with :class:`kvbank.tiers.host.SlotMapping`; plain ``os.open`` +
:mod:`mmap`, so no resource tracker unlinks the owner's segment) and hands out views of
the leased rows.

Lifecycle in the borrowing process::

    lease = wire.from_json(Lease, text)          # sent by the owner
    with Borrower() as b:
        n = b.read_into(lease, name, out)  # copy, then check the deadline again
        b.view(lease, name)[:] = page      # WRITE lease: fill in place; the owner commits
        b.copy_rows(lease, [(name, out), ...], into_rows=False)  # a batch, on two lanes
        sums = b.copy_slots_summed(slots)  # a checked read: each copy hashed as it lands

``Borrower(populate=True)`` also builds this process's page tables for each segment it
maps, in the background (``madvise(MADV_POPULATE_READ/WRITE)`` in 64 MiB steps, through
ctypes so the GIL is free meanwhile: :func:`kvbank.tiers.host.madvise`): a first touch of a shared page from another
process costs a minor fault per 4 KiB — a copy into fresh slots ran at 3-4 GB/s instead
of 17-21 — and a process that maps the segment once for its life pays that once, not on
every put into slots it has not touched yet. Only for a segment its owner keeps resident
(``reserve_host``): populating a sparse segment would claim memory the owner never used.
:meth:`Borrower.wait_populated` waits for it.

The deadline check at completion uses ``lease.expires_at`` on ``time.monotonic`` —
CLOCK_MONOTONIC, shared by every process of a Linux host, which is the lender's default
clock. The owner still enforces expiry on its side (:meth:`Lender.finish_read`).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

import numpy as np
import xxhash

from kvbank.codec.planes import copy_bytes
from kvbank.errors import InvalidInput, LeaseExpired
from kvbank.lender.base import HostLocation, Lease, MemoryKind
from kvbank.tiers.host import MADV_POPULATE_READ, MADV_POPULATE_WRITE, madvise, map_segment

logger = logging.getLogger(__name__)

POPULATE_STEP = 64 << 20  # populated per madvise call: a close waits at most one step
LANE_MIN_BYTES = 2 << 20  # a batch this large is copied on two lanes (below: one; the
# hand-off to the second lane costs ~0.05 ms, a 2 MiB copy ~0.2)
HASH_CHUNK = 512 << 10  # a checked read copies and hashes this much at a time: the chunk
# (and its source, 1 MiB together) is still in this core's L2 (2 MiB a core on the Xeon it
# was tuned on) when it is hashed, so the check reads no byte from memory again. 256 KiB
# to 1 MiB ran alike there; 64-128 KiB paid more per-chunk calls (copy_slots_summed)


Job = tuple[np.ndarray, np.ndarray]  # (destination, source), flat uint8 of one length


def _halves(jobs: list[Job], half: int) -> tuple[list[Job], list[Job]]:
    """``jobs`` cut at ``half`` bytes into two lanes, the job across the cut split in
    two: rows merged into one long copy (back to back in the segment and the
    destination) still take both lanes."""
    acc = 0
    for i, (d, src) in enumerate(jobs):
        if acc + d.nbytes >= half:
            k = half - acc
            first, second = jobs[:i], jobs[i + 1 :]
            if k:
                first.append((d[:k], src[:k]))
            if k < d.nbytes:
                second.insert(0, (d[k:], src[k:]))
            return first, second
        acc += d.nbytes
    return jobs, []


def _copy_all(jobs: Sequence[Job]) -> None:
    for dst, src in jobs:
        copy_bytes(dst, src)  # not np.copyto: it picks the faster routine by length (see it)


Unit = tuple[np.ndarray, np.ndarray, int]  # (destination, source, row size): rows back to back


def _units(jobs: Sequence[Job], rows: Sequence[int], chunk: int) -> list[Unit]:
    """A checked read's jobs (each ``rows[i]``-byte rows back to back) as units of work:
    a row over ``chunk`` alone (hashed as it streams), else as many whole rows as fit in
    ``chunk`` (copied at once, then each row hashed while the unit is still in cache)."""
    units: list[Unit] = []
    for (dst, src), row in zip(jobs, rows, strict=True):
        n = dst.nbytes
        if n == 0:  # an empty row: its digest is that of no bytes
            units.append((dst, src, 0))
            continue
        if row <= 0 or n % row:
            raise InvalidInput(f"rows: a run of {n} bytes is not made of rows of {row}")
        step = row if row > chunk else chunk // row * row
        for pos in range(0, n, step):
            units.append((dst[pos : pos + step], src[pos : pos + step], row))
    return units


def _copy_summed(units: Sequence[Unit], chunk: int) -> list[int]:
    """Copy each unit and return the xxh3-64 of each row copied (that of
    :func:`kvbank.codec.frame.checksum` over the row's destination bytes), in order. A
    row over ``chunk`` is copied ``chunk`` bytes at a time, each chunk fed to the row's
    streaming hash right after it lands; a unit of smaller rows is copied in one go, then
    each row hashed. The copy and xxhash both free the GIL."""
    out: list[int] = []
    for dst, src, row in units:
        n = dst.nbytes
        if row <= chunk:
            copy_bytes(dst, src)
            if row == n:
                out.append(xxhash.xxh3_64_intdigest(dst.data))
            else:
                out.extend(xxhash.xxh3_64_intdigest(dst[k : k + row].data) for k in range(0, n, row))
            continue
        h = xxhash.xxh3_64()
        for pos in range(0, n, chunk):
            d = dst[pos : pos + chunk]
            copy_bytes(d, src[pos : pos + chunk])
            h.update(d.data)
        out.append(h.intdigest())
    return out


def _cut(jobs: Sequence[Job] | Sequence[Unit]) -> int:
    """Where a batch of two or more units of whole rows splits into two lanes of the
    nearest to equal bytes: the first unit of the second lane (1 to ``len(jobs) - 1``)."""
    total = sum(j[0].nbytes for j in jobs)
    acc, best, cut = 0, -1, 1
    for k in range(1, len(jobs)):
        acc += jobs[k - 1][0].nbytes
        gap = abs(total - 2 * acc)
        if best < 0 or gap < best:
            best, cut = gap, k
    return cut


class _Populate:
    """The background population of one mapping's page tables."""

    def __init__(self, name: str, mm: mmap.mmap, writable: bool) -> None:
        arr = np.frombuffer(mm, dtype=np.uint8)  # only to learn the address
        self._addr, self._size = int(arr.ctypes.data), len(arr)
        del arr  # no export may outlive this line: close() must be able to unmap
        self._name = name
        self._advice = MADV_POPULATE_WRITE if writable else MADV_POPULATE_READ
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvbank-populate-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            pos = 0
            while pos < self._size and not self._stop.is_set():
                n = min(POPULATE_STEP, self._size - pos)
                try:
                    madvise(self._addr + pos, n, self._advice)
                except OSError as exc:
                    # EINVAL: a kernel before 5.14. Copies then fault pages in themselves.
                    logger.debug("segment %s: populate stopped at %d: %s", self._name, pos, exc)
                    return
                pos += n
        finally:
            self.done.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Borrower:
    """Maps the host segments of leases (each once) and reads or fills rows in place."""

    def __init__(self, *, writable: bool = False, clock: Callable[[], float] = time.monotonic,
                 populate: bool = False) -> None:
        self._writable = writable
        self._clock = clock
        self._populate = populate
        self._maps: dict[str, mmap.mmap] = {}
        self._views: dict[str, memoryview] = {}
        self._warming: dict[str, _Populate] = {}
        self._pool: ThreadPoolExecutor | None = None  # the second copy lane, on first use

    def segment(self, name: str) -> memoryview:
        """The whole segment ``name``, mapped on first use."""
        mv = self._views.get(name)
        if mv is not None:
            return mv
        mm = map_segment(name, writable=self._writable)
        self._maps[name] = mm
        if self._populate:
            self._warming[name] = _Populate(name, mm, self._writable)
        mv = self._views[name] = memoryview(mm)
        return mv

    def adopt(self, name: str, mm: mmap.mmap) -> None:
        """Know ``mm`` (a mapping its owner passed as a file descriptor) as segment
        ``name``: nothing opens a segment by name for it. The caller keeps ``mm`` open
        until :meth:`close`."""
        self._maps[name] = mm
        if self._populate:
            self._warming[name] = _Populate(name, mm, self._writable)
        self._views[name] = memoryview(mm)

    def wait_populated(self, name: str, timeout: float | None = None) -> bool:
        """Map segment ``name`` (with ``populate=True``: and build its page tables);
        whether that finished within ``timeout`` seconds."""
        self.segment(name)
        warm = self._warming.get(name)
        return warm is None or warm.done.wait(timeout)

    def _location(self, lease: Lease, name: bytes) -> HostLocation:
        if lease.kind is not MemoryKind.HOST:
            raise InvalidInput(f"lease: {lease.id} is a {lease.kind.name} lease, not HOST")
        try:
            row = lease.row(name)
        except KeyError:
            raise InvalidInput(f"name: row {name.hex()[:16]}… is not in lease {lease.id}") from None
        if not isinstance(row.location, HostLocation):
            raise InvalidInput(f"name: row {name.hex()[:16]}… has no bytes in lease {lease.id}")
        return row.location

    def view(self, lease: Lease, name: bytes) -> memoryview:
        """The row's bytes in place; valid while the lease lives."""
        loc = self._location(lease, name)
        seg = self.segment(loc.segment)
        if loc.offset + loc.size > len(seg):
            raise InvalidInput(f"lease: row at {loc.offset}+{loc.size} is beyond segment {loc.segment}")
        return seg[loc.offset : loc.offset + loc.size]

    def check(self, lease: Lease) -> None:
        """Raise :class:`LeaseExpired` if ``lease``'s deadline has passed."""
        if self._clock() >= lease.expires_at:
            raise LeaseExpired(f"lease_id: lease {lease.id} expired")

    def read_into(self, lease: Lease, name: bytes, out: memoryview | bytearray) -> int:
        """Copy the row into ``out``; its size, only if the lease was live when the copy
        completed (bytes copied from an expired lease may be reclaimed memory)."""
        src = self.view(lease, name)
        dst = memoryview(out).cast("B")
        if len(dst) < len(src):
            raise InvalidInput(f"out: {len(dst)} bytes, the row holds {len(src)}")
        dst[: len(src)] = src
        self.check(lease)
        return len(src)

    def copy_rows(self, lease: Lease, pairs: Sequence[tuple[bytes, memoryview]], *,
                  into_rows: bool) -> None:
        """Copy a batch: ``into_rows`` — each page into its row's slot (a WRITE lease);
        else each row into its buffer. Buffers must be at least the row's size; a READ
        batch is then checked against the deadline once (:meth:`check`). See
        :meth:`copy_slots`."""
        slots: list[tuple[str, int, int, memoryview]] = []
        for name, buf in pairs:
            loc = self._location(lease, name)
            slots.append((loc.segment, loc.offset, loc.size, buf))
        self.copy_slots(slots, into_slots=into_rows)
        if not into_rows:
            self.check(lease)

    def copy_slots(self, slots: Sequence[tuple[str, int, int, memoryview]], *, into_slots: bool) -> None:
        """Copy a batch of ``(segment, offset, size, buffer)``: ``into_slots`` — each
        buffer into its slot; else each slot into its buffer (a buffer must hold at least
        ``size`` bytes). A slot beyond its segment is refused before anything is copied.
        Both cores: a batch of ``LANE_MIN_BYTES`` or more is cut into two lanes of equal
        bytes (a copy across the cut split in two, so one long copy of merged rows takes
        both too) and the copies (:func:`~kvbank.codec.planes.copy_bytes`, which frees
        the GIL) run at once. The caller checks its lease's deadline after a read (bytes read
        after it may be another row's)."""
        jobs = self._jobs(slots, into_slots=into_slots)
        total = sum(d.nbytes for d, _ in jobs)
        if total >= LANE_MIN_BYTES:
            first, second = _halves(jobs, total // 2)
            lane = self._lanes().submit(_copy_all, second)
            try:
                _copy_all(first)
            finally:
                lane.result()
        else:
            _copy_all(jobs)
        del jobs  # no array may keep the mapping exported

    def _jobs(self, slots: Sequence[tuple[str, int, int, memoryview]], *, into_slots: bool) -> list[Job]:
        """The ``(destination, source)`` arrays of a batch; a slot beyond its segment or
        a buffer too small refused before anything is copied."""
        jobs: list[Job] = []
        for segment, offset, size, buf in slots:
            seg = self.segment(segment)
            if offset < 0 or size < 0 or offset + size > len(seg):
                raise InvalidInput(f"lease: slot at {offset}+{size} is beyond segment {segment}")
            dst = memoryview(buf).cast("B")
            if len(dst) < size:
                raise InvalidInput(f"out: {len(dst)} bytes, the slot at {segment}+{offset} holds {size}")
            a = np.frombuffer(seg, dtype=np.uint8, count=size, offset=offset)
            b = np.frombuffer(dst, dtype=np.uint8, count=size)
            jobs.append((a, b) if into_slots else (b, a))
        return jobs

    def copy_slots_summed(self, slots: Sequence[tuple[str, int, int, memoryview]], *,
                          rows: Sequence[int] | None = None, chunk: int = HASH_CHUNK,
                          into_slots: bool = False) -> list[int]:
        """Copy each slot of ``(segment, offset, size, buffer)`` into its buffer (with
        ``into_slots``, each buffer into its slot: a put's), as :meth:`copy_slots` does,
        and return the checksum of each row copied (xxh3-64 of the bytes that landed, as
        the node records a row's), in order. ``rows``: the row
        size of each slot, a slot being that many rows back to back in the segment and
        in its buffer (rows merged into one copy); default, each slot is one row.

        A checked read hashes while it copies, in units of ``chunk`` bytes: a larger row
        is copied a chunk at a time and each chunk hashed right after, while it is still
        in cache; smaller rows are copied as many at once as fit in a chunk, then each
        hashed. Copying everything first and hashing after read every byte a second time
        (the check cost a third of a same-host fetch). The lanes split between units (a
        streaming hash runs in order): a batch of ``LANE_MIN_BYTES`` or more of at least
        two units takes both. The caller checks its lease's deadline after."""
        if chunk <= 0:
            raise InvalidInput(f"chunk: must be positive, got {chunk}")
        if rows is not None and len(rows) != len(slots):
            raise InvalidInput(f"rows: {len(rows)} row sizes for {len(slots)} slots")
        jobs = self._jobs(slots, into_slots=into_slots)
        units = _units(jobs, [z for _, _, z, _ in slots] if rows is None else rows, chunk)
        del jobs
        total = sum(d.nbytes for d, _, _ in units)
        try:
            if total < LANE_MIN_BYTES or len(units) < 2:
                return _copy_summed(units, chunk)
            k = _cut(units)
            lane = self._lanes().submit(_copy_summed, units[k:], chunk)
            try:
                first = _copy_summed(units[:k], chunk)
            finally:
                second = lane.result()
            return first + second
        finally:
            del units  # no array may keep the mapping exported

    def _lanes(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbank-borrow-copy")
        return self._pool

    def close(self) -> None:
        """Unmap every segment. Views handed out must no longer be used."""
        for warm in self._warming.values():
            warm.stop()  # before the unmap: it works on the mapping's addresses
        self._warming.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for mv in self._views.values():
            mv.release()
        for mm in self._maps.values():
            mm.close()
        self._views.clear()
        self._maps.clear()

    def __enter__(self) -> Borrower:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
