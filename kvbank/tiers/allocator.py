"""Slot bookkeeping for the memory tiers (host slab, device pool): classes, chunks, budget.

The tier's memory is one flat address space of ``n_units`` units of ``unit`` bytes, with
``n_units * unit <= budget``. A *chunk* is a run of units claimed for one *slot class*
(the slot capacity: a row's size rounded up to 64 bytes, or to 4 KiB from 4 KiB up) and
cut into equal slots. A slot is named by its byte offset in the address space, so the
owner needs no per-row record besides that offset.

Lifecycle of memory: a chunk is claimed (``on_grow`` makes its bytes real: fallocate on
the shared-memory file, a tensor on the device) only when its class has no free slot, so
the tier grows in chunks up to its budget and claimed chunks count fully against it.
Empty chunks stay claimed (their class will likely need them again) until another class
needs units that are not free; then they are released (``on_release``) and reused.

Not thread-safe: the owner serialises calls (the store holds its lock).
"""

from __future__ import annotations

import abc
from collections.abc import Callable

SMALL_ALIGN = 64  # a cache line: small rows (tests, tiny state snapshots) waste little
PAGE_ALIGN = 4096  # rows from 4 KiB up get page-aligned slots (DMA, pinning, mmap offsets)
MAX_UNIT = 64 << 20
UNITS_PER_BUDGET = 64  # unit ~ budget/64: at most ~1.6 % of the budget is left unusable


def slot_class(size: int) -> int:
    """The slot capacity that holds a row of ``size`` bytes."""
    align = PAGE_ALIGN if size >= PAGE_ALIGN else SMALL_ALIGN
    return -(-size // align) * align


def choose_unit(budget: int) -> int:
    """The unit size for a budget: ~budget/64, 4 KiB-aligned when the budget allows."""
    raw = min(MAX_UNIT, budget // UNITS_PER_BUDGET)
    if raw >= PAGE_ALIGN:
        return raw // PAGE_ALIGN * PAGE_ALIGN
    return max(SMALL_ALIGN, raw // SMALL_ALIGN * SMALL_ALIGN)


class _Chunk:
    __slots__ = ("cls", "free", "in_use", "n_units", "next_unused", "nslots", "start")

    def __init__(self, start: int, n_units: int, cls: int, nslots: int) -> None:
        self.start = start  # byte offset of the chunk
        self.n_units = n_units
        self.cls = cls  # slot capacity in bytes
        self.nslots = nslots
        self.next_unused = 0  # slots below this index were handed out at least once
        self.free: list[int] = []  # offsets of slots given back
        self.in_use = 0

    def has_room(self) -> bool:
        return bool(self.free) or self.next_unused < self.nslots


class SlotAllocator:
    """Fixed-size slots per size class in chunks of a budgeted flat address space."""

    def __init__(
        self,
        budget: int,
        *,
        on_grow: Callable[[int, int], None],
        on_release: Callable[[int, int], None],
    ) -> None:
        self.budget = budget
        self.unit = choose_unit(budget) if budget > 0 else SMALL_ALIGN
        self.n_units = budget // self.unit if budget > 0 else 0
        self.space_bytes = self.n_units * self.unit
        self._on_grow = on_grow
        self._on_release = on_release
        self._unit_chunk: list[_Chunk | None] = [None] * self.n_units
        self._open: dict[int, list[_Chunk]] = {}  # class -> chunks with a free slot
        self._chunks: dict[int, _Chunk] = {}  # start -> chunk
        self.allocated_bytes = 0  # bytes of claimed chunks (what the budget caps)
        self.used_bytes = 0  # capacity of slots handed out

    # -- chunk layout ------------------------------------------------------------------

    def _units_for(self, cls: int) -> int:
        """Units per chunk of a class: 1 when a slot fits a unit, else the run (of the
        smallest 8 candidates) that wastes the least."""
        if cls <= self.unit:
            return 1
        lo = -(-cls // self.unit)
        best, best_waste = lo, 1.0
        for k in range(lo, lo + 8):
            span = k * self.unit
            waste = (span % cls) / span
            if waste < best_waste - 1e-9:
                best, best_waste = k, waste
        return best

    def _find_units(self, k: int) -> int | None:
        run = 0
        for i, owner in enumerate(self._unit_chunk):
            run = run + 1 if owner is None else 0
            if run == k:
                return i - k + 1
        return None

    def release_empty(self) -> int:
        """Release every claimed chunk with no slot in use; the bytes released."""
        freed = 0
        for chunk in [c for c in self._chunks.values() if c.in_use == 0]:
            self._release(chunk)
            freed += chunk.n_units * self.unit
        return freed

    def _release(self, chunk: _Chunk) -> None:
        nbytes = chunk.n_units * self.unit
        self._on_release(chunk.start, nbytes)
        first = chunk.start // self.unit
        for i in range(first, first + chunk.n_units):
            self._unit_chunk[i] = None
        del self._chunks[chunk.start]
        self._open[chunk.cls].remove(chunk)
        self.allocated_bytes -= nbytes

    def _grow(self, cls: int) -> _Chunk | None:
        k = self._units_for(cls)
        if k > self.n_units:
            return None
        first = self._find_units(k)
        if first is None and self.release_empty():
            first = self._find_units(k)
        if first is None:
            return None
        nbytes = k * self.unit
        start = first * self.unit
        self._on_grow(start, nbytes)  # may raise (TierFull on ENOSPC); nothing changed yet
        chunk = _Chunk(start, k, cls, nbytes // cls)
        for i in range(first, first + k):
            self._unit_chunk[i] = chunk
        self._chunks[start] = chunk
        self._open.setdefault(cls, []).append(chunk)
        self.allocated_bytes += nbytes
        return chunk

    # -- slots -------------------------------------------------------------------------

    def fits(self, size: int) -> bool:
        """Whether a row of ``size`` bytes could ever get a slot (empty tier)."""
        return self.n_units > 0 and self._units_for(slot_class(size)) <= self.n_units

    def alloc(self, size: int) -> int | None:
        """A free slot for ``size`` bytes (its offset), growing if the budget allows;
        ``None`` when there is no room without evicting."""
        cls = slot_class(size)
        open_ = self._open.get(cls)
        chunk = open_[-1] if open_ else self._grow(cls)
        if chunk is None:
            return None
        if chunk.free:
            off = chunk.free.pop()
        else:
            off = chunk.start + chunk.next_unused * cls
            chunk.next_unused += 1
        chunk.in_use += 1
        self.used_bytes += cls
        if not chunk.has_room():
            self._open[cls].pop()  # only the last open chunk hands out slots
        return off

    def free(self, offset: int) -> None:
        """Give a slot back."""
        chunk = self._unit_chunk[offset // self.unit]
        if chunk is None or (offset - chunk.start) % chunk.cls:
            raise ValueError(f"offset {offset} is not a slot")  # an owner bug, never input
        if not chunk.has_room():
            self._open[chunk.cls].append(chunk)
        chunk.free.append(offset)
        chunk.in_use -= 1
        self.used_bytes -= chunk.cls

    def capacity(self, offset: int) -> int:
        """The capacity of the slot at ``offset``."""
        chunk = self._unit_chunk[offset // self.unit]
        if chunk is None:
            raise ValueError(f"offset {offset} is not in a claimed chunk")
        return chunk.cls

    def is_slot(self, offset: int) -> bool:
        """Whether ``offset`` starts a slot of a claimed chunk (not whether it is in use)."""
        if not 0 <= offset < self.space_bytes:
            return False
        chunk = self._unit_chunk[offset // self.unit]
        return (
            chunk is not None
            and (offset - chunk.start) % chunk.cls == 0
            and offset - chunk.start < chunk.nslots * chunk.cls
        )

    def slots_in_use(self) -> int:
        return sum(c.in_use for c in self._chunks.values())

    def chunk_spans(self) -> list[tuple[int, int]]:
        """(start, nbytes) of every claimed chunk."""
        return [(c.start, c.n_units * self.unit) for c in self._chunks.values()]

    def check(self) -> None:
        """Internal consistency (used by the store's check_invariants)."""
        total = sum(c.n_units for c in self._chunks.values()) * self.unit
        if total != self.allocated_bytes:
            raise AssertionError(f"slab: allocated_bytes {self.allocated_bytes} != chunks {total}")
        if self.allocated_bytes > self.budget:
            raise AssertionError(f"slab: allocated {self.allocated_bytes} > budget {self.budget}")
        used = sum(c.in_use * c.cls for c in self._chunks.values())
        if used != self.used_bytes:
            raise AssertionError(f"slab: used_bytes {self.used_bytes} != slots in use {used}")
        for c in self._chunks.values():
            if c.in_use != c.next_unused - len(c.free):
                raise AssertionError(f"slab: chunk at {c.start} counts {c.in_use} in use, "
                                     f"{c.next_unused} handed out, {len(c.free)} free")


class AllocatorBacked(abc.ABC):
    """The slot bookkeeping a pool delegates to its :class:`SlotAllocator`.

    The host slab and the device pool differ in where the bytes live, not in how slots
    are counted; both mix this in and set ``_alloc``.
    """

    _alloc: SlotAllocator

    @abc.abstractmethod
    def _check_open(self) -> None:
        """Raise TierUnavailable if the pool is closed (each pool names itself)."""

    @property
    def budget(self) -> int:
        return self._alloc.budget

    @property
    def used_bytes(self) -> int:
        """Capacity of slots in use (rows and reservations)."""
        return self._alloc.used_bytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes of claimed chunks: the memory the pool holds (<= budget)."""
        return self._alloc.allocated_bytes

    @property
    def allocator(self) -> SlotAllocator:
        return self._alloc

    def fits(self, size: int) -> bool:
        return self._alloc.fits(size)

    def alloc(self, size: int) -> int | None:
        """A free slot's offset, or None when the budget has no room without eviction."""
        self._check_open()
        return self._alloc.alloc(size)

    def free(self, offset: int) -> None:
        self._alloc.free(offset)

    def capacity(self, offset: int) -> int:
        return self._alloc.capacity(offset)
