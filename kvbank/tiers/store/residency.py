"""Where each row's bytes are: the row index plus the slot ledger of the memory pools.

:class:`Residency` is the only code that adds and removes rows and frees memory slots.
Its tables (all keyed by ``(tier bit, slot offset)`` or row id):

- ``busy`` — slots being copied outside the store lock (a put's private slot, a read, an
  encode): counted, never freed or reused while held;
- ``free_after`` — slots removed from the index while busy: freed by the last release;
- ``reserved`` — write-lease slots: holder and size, invisible to readers, never evicted;
- ``host_copy`` — row id → host offset of a row staged in both device and host (the
  index's ``off`` then holds the device offset).

A row's arrival and departure feed the change feed (``PUBLISHED`` when added,
``WITHDRAWN`` when it leaves the last tier) and departures drop its admin pin.
Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

import numpy as np

from kvbank import fastrows as columns
from kvbank.tiers.base import HostSlot, SlotPool
from kvbank.tiers.index import DEV, DISK, HOST, OFF_SHIFT, RowIndex
from kvbank.tiers.store.events import EventFeed
from kvbank.tiers.store.rowlocks import RowPins

SlotKey = tuple[int, int]  # (tier bit, slot offset)


class Residency:
    def __init__(self, ix: RowIndex, pools: dict[int, SlotPool], events: EventFeed,
                 pins: RowPins) -> None:
        self.ix = ix
        self.pools = pools  # tier bit -> pool, memory tiers that are on
        self.events = events
        self.pins = pins
        self.busy: dict[SlotKey, int] = {}
        self.free_after: set[SlotKey] = set()
        self.reserved: dict[SlotKey, tuple[str, int]] = {}
        self.host_copy: dict[int, int] = {}

    # -- slots -------------------------------------------------------------------------

    def mem_off(self, rid: int, bit: int) -> int:
        if bit == HOST and rid in self.host_copy:
            return self.host_copy[rid]
        return self.ix.get_off(rid)

    def free_slot(self, bit: int, off: int) -> None:
        key = (bit, off)
        if key in self.busy:
            self.free_after.add(key)  # freed by the last release
        else:
            self.pools[bit].free(off)

    def hold(self, bit: int, off: int) -> None:
        key = (bit, off)
        self.busy[key] = self.busy.get(key, 0) + 1

    def release(self, bit: int, off: int) -> bool:
        """Drop one hold; True when the slot became free to move (its last hold)."""
        key = (bit, off)
        left = self.busy[key] - 1
        if left:
            self.busy[key] = left
            return False
        del self.busy[key]
        if key in self.free_after:
            self.free_after.discard(key)
            self.pools[bit].free(off)
        return True

    def fail_slot(self, bit: int, off: int, reserve: tuple[str, int] | None,
                  closed: bool) -> None:
        """A private slot whose publish failed: back to its reservation, or freed."""
        if reserve is not None and not closed:
            self.reserved[(bit, off)] = reserve
        else:
            self.free_slot(bit, off)

    def owned(self, bit: int, off: int) -> bool:
        """Whether a slot is already a row's, reserved, or waiting to be freed."""
        key = (bit, off)
        if key in self.reserved or key in self.free_after:
            return True
        ix = self.ix
        n = ix.high
        enc = off if ix.wide else off >> OFF_SHIFT
        hits = np.flatnonzero((ix.off[:n] == enc) & ((ix.where[:n] & bit) != 0))
        return any(self.mem_off(int(r), bit) == off for r in hits.tolist())

    # -- rows --------------------------------------------------------------------------

    def add_row(self, name: bytes, size: int, code: int, parent: int) -> int:
        rid = self.ix.add(name, size, code, parent)
        self.events.published(name)
        return rid

    def forget_row(self, rid: int) -> None:
        """Take a row out of the index (its copies already dropped) and announce it."""
        name = self.ix.names[rid]
        self.ix.remove(rid)
        if name is not None:
            self.events.withdrawn(name)
            self.pins.drop(name)

    def drop_copy(self, rid: int, bit: int) -> None:
        """Forget the row's copy in one memory tier (the row may live on elsewhere)."""
        ix = self.ix
        off = self.mem_off(rid, bit)
        self.free_slot(bit, off)
        ix.where[rid] = int(ix.where[rid]) & ~bit
        if rid in self.host_copy:
            host_off = self.host_copy.pop(rid)
            if bit == DEV:
                ix.set_off(rid, host_off)  # the host copy becomes the primary offset

    def remove_row(self, rid: int) -> bytes | None:
        """Drop a row from every memory tier and the index; its name if a disk copy is
        left for the caller to purge."""
        ix = self.ix
        where = int(ix.where[rid])
        name = ix.names[rid]
        for bit in (DEV, HOST):
            if where & bit:
                self.drop_copy(rid, bit)
        self.forget_row(rid)
        return name if where & DISK else None

    def host_slots(self, names: Sequence[bytes], segment: str) -> list[HostSlot | None]:
        """The host slot of each row (None: not in host), vectorised over the index."""
        ix = self.ix
        rids = list(map(ix.ids.get, names, repeat(-1)))
        arr = np.asarray(rids, dtype=np.int64)
        safe = np.maximum(arr, 0)
        in_host = ((ix.where[safe] & HOST) != 0) & (arr >= 0)
        offs = ix.off[safe].astype(np.int64)
        if not ix.wide:
            offs <<= OFF_SHIFT
        sizes = ix.size[safe].tolist()
        dual = self.host_copy
        if not dual and bool(in_host.all()):  # every row in host, none staged from device
            return [*columns.build(HostSlot, len(rids), (repeat(segment), offs.tolist(), sizes))]
        out: list[HostSlot | None] = []
        for rid, hit, off, size in zip(rids, in_host.tolist(), offs.tolist(), sizes, strict=True):
            # A row staged from device keeps its host offset in host_copy (`off` is the device's).
            out.append(HostSlot(segment, dual.get(rid, off), size) if hit else None)
        return out
