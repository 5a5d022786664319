"""The READ side of the lender: lock and stage leased rows, copy them out; slot locations.

Primitives, each called by :class:`~kvbank.lender.lender.Lender` (which holds the lease
tables and decides *when*; these say *what* happens in the store):

- :func:`stage` — a READ lend's rows: the rows the store holds are locked under the
  lease's id, then staged into the lease's memory kind (disk rows are read into host
  slots); a row evicted in between is listed ``MISSING``, never handed out half-moved.
- :func:`copy_out` — copy one leased row into a caller's buffer (the lender then checks
  the lease outlived the copy).
- :func:`location` — where a slot's bytes lie, as a lease row tells a borrower (a host
  slot as it stands; a device slot with its pool's CUDA IPC handle).

Lifecycle::

    stage (lock + stage) ──► copy_out / views ──► check_live ──► release: unlock
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from itertools import repeat
from operator import is_
from typing import cast

from kvbank.errors import InvalidInput
from kvbank.lender.base import (
    Delivery,
    DeviceLocation,
    LeaseRow,
    LendingStore,
    Location,
    MemoryKind,
    PageShape,
    Region,
    lease_rows,
)
from kvbank.tiers.base import DeviceSlot, HostSlot

Slot = HostSlot | DeviceSlot
# what lending produced: rows, names locked, slots, WRITE chain parents
Parts = tuple[tuple[LeaseRow, ...], tuple[bytes, ...], dict[bytes, Slot], dict[bytes, bytes | None]]

_READY = Delivery.READY
_MISSING = Delivery.MISSING
_NO_REGIONS: tuple[Region, ...] = ()
_is_none = partial(is_, None)  # by identity: `None in slots` would call each slot's __eq__


def stage(
    store: LendingStore,
    lease_id: str,
    rows: tuple[bytes, ...],
    shapes: Sequence[PageShape | None],
    kind: MemoryKind,
) -> Parts:
    """A READ lend's rows, the names locked under ``lease_id`` and their staged slots."""
    # Lock what locate reports present *before* staging: a row evicted between the two
    # calls then stages as None and is listed MISSING, never handed out half-moved.
    where = store.locate(rows)
    present = rows if None not in where else [n for n, w in zip(rows, where, strict=True) if w is not None]
    staged: list[HostSlot | None] | list[DeviceSlot | None] = []
    if present:
        store.locks.lock(present, lease_id)
        try:
            if kind is MemoryKind.HOST:
                staged = store.host.stage_many(present)  # one pass for the whole lease
            else:
                staged = [store.device.stage(n) for n in present]
        except BaseException:
            store.locks.unlock_all(lease_id)
            raise
    n_rows = len(rows)
    regions = _regions(shapes)
    if kind is MemoryKind.HOST and len(staged) == n_rows and not any(map(_is_none, staged)):
        # Every row staged, the common case: a host slot is its lease location as it
        # stands (HostLocation is HostSlot), and the rows are built column by column.
        host = cast("list[HostSlot]", staged)
        out = lease_rows(rows, repeat(True, n_rows), host, regions, repeat(_READY, n_rows))
        return out, rows, dict(zip(rows, host, strict=True)), {}
    slots: dict[bytes, Slot] = {
        n: s for n, s in zip(present, staged, strict=True) if s is not None
    }
    if len(slots) < len(present):  # evicted between the locate and the lock
        store.locks.unlock([n for n in present if n not in slots], lease_id)
    got = list(map(slots.get, rows))
    out = lease_rows(
        rows,
        [s is not None for s in got],
        [None if s is None else location(store, s) for s in got],
        regions,
        [_MISSING if s is None else _READY for s in got],
    )
    return out, tuple(slots), slots, {}


def copy_out(store: LendingStore, slot: Slot, name: bytes, out: memoryview | bytearray) -> int:
    """Copy a leased row's bytes into ``out``; the byte count."""
    dst = memoryview(out).cast("B")
    if len(dst) < slot.size:
        raise InvalidInput(f"out: {len(dst)} bytes, the row holds {slot.size}")
    if isinstance(slot, HostSlot):
        with store.host.view(slot) as src:  # released at once: the slab may close
            dst[: slot.size] = src
        return slot.size
    import torch

    from kvbank.kernels.faults import TORCH_ERRORS, torch_fault

    dev = store.device.view(slot)[: slot.size]
    try:
        torch.frombuffer(dst, dtype=torch.uint8, count=slot.size).copy_(dev)
    except TORCH_ERRORS as exc:
        raise torch_fault(f"reading leased row {name.hex()[:16]}…", exc) from exc
    return slot.size


def location(store: LendingStore, slot: Slot) -> Location:
    """Where ``slot``'s bytes lie, as a lease row tells a borrower."""
    if isinstance(slot, HostSlot):
        return slot  # HostLocation is HostSlot
    return DeviceLocation(slot.pool, slot.device, slot.offset, slot.size, _ipc(store, slot))


def _ipc(store: LendingStore, slot: DeviceSlot) -> bytes | None:
    """The CUDA IPC memory handle of the slot's pool (None off CUDA).

    The same handle torch.multiprocessing shares; a peer opens it and adds ``offset``.
    """
    if not slot.device.startswith("cuda"):
        return None
    storage = store.device.view(slot).untyped_storage()
    handle = storage._share_cuda_()[1]  # type: ignore[no-untyped-call]  # (device, handle, …)
    return bytes(handle)


def _regions(shapes: Sequence[PageShape | None]) -> Iterable[tuple[Region, ...]]:
    """The regions column of a lease's rows (one shared tuple for a chain)."""
    first = shapes[0]
    if shapes.count(first) == len(shapes):
        return repeat(_NO_REGIONS if first is None else first.regions, len(shapes))
    return [_NO_REGIONS if p is None else p.regions for p in shapes]
