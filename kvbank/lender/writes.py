"""The WRITE side of the lender: reserve slots, fill them, commit what arrived.

Primitives, each called by :class:`~kvbank.lender.lender.Lender` (which holds the lease
tables and decides *when*; these say *what* happens in the store):

- :func:`reserve` — a WRITE lend's rows: rows already stored are listed ``PRESENT``;
  the others get an invisible reserved slot (one ``reserve_many`` call, all or none).
- :func:`fill` — copy one row's bytes into its reserved slot (host or device).
- :func:`arrived_names` — a commit's ``arrived`` argument (names or a row mask) as names.
- :func:`publish` — a commit: rows that arrived whole and are not stored yet become
  visible; a row someone else stored first keeps its bytes (equal names are
  interchangeable bytes); every slot not published goes back (:func:`abort_slots`).

Lifecycle::

    reserve ──► fill (or a borrower writes the slot in place) ──► publish(arrived)
       └──────────────── release / expiry ──► abort_slots
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvbank.errors import InvalidInput, PageSizeMismatch
from kvbank.keys import same_chain
from kvbank.lender.base import (
    CommitResult,
    Delivery,
    Lease,
    LeaseRow,
    LendingStore,
    MemoryKind,
    PageShape,
)
from kvbank.lender.reads import Parts, Slot, location
from kvbank.tiers.base import DeviceSlot, HostSlot


def reserve(
    store: LendingStore,
    lease_id: str,
    rows: tuple[bytes, ...],
    shapes: Sequence[PageShape | None],
    kind: MemoryKind,
    *,
    absent: bool = False,
) -> Parts:
    """A WRITE lend's rows, slots and chain parents; locks nothing. ``absent``: the caller
    found none of ``rows`` stored a moment ago (no second lookup)."""
    where = [None] * len(rows) if absent else store.locate(rows)
    parents: dict[bytes, bytes | None] = {}
    prev: bytes | None = None
    described: list[PageShape] = []
    for n, shape in zip(rows, shapes, strict=True):
        if shape is None:  # pragma: no cover - refused in Lender.lend
            raise InvalidInput("names: undescribed row in a WRITE lease")
        described.append(shape)
        # A chain listed in order: a row's parent (for prefix-aware eviction) is the
        # previous row of the same namespace and group in this lease.
        parents[n] = prev if prev is not None and same_chain(prev, n) else None
        prev = n
    todo = [i for i, w in enumerate(where) if w is None]
    # one reservation call for the lease's rows (all or none)
    pool = store.host if kind is MemoryKind.HOST else store.device
    got: Sequence[Slot] = pool.reserve_many([described[i].size for i in todo], lease_id)
    slots: dict[bytes, Slot] = {rows[i]: slot for i, slot in zip(todo, got, strict=True)}
    try:
        out = [LeaseRow(n, True, None, shape.regions, Delivery.PRESENT) if w is not None
               else LeaseRow(n, False, location(store, slots[n]), shape.regions, Delivery.RESERVED)
               for n, w, shape in zip(rows, where, described, strict=True)]
    except BaseException:
        abort_slots(store, slots)
        raise
    return tuple(out), (), slots, parents


def fill(store: LendingStore, slot: Slot, name: bytes, src: memoryview) -> None:
    """Copy ``src`` (exactly the row's page) into its reserved slot."""
    if len(src) != slot.size:
        raise PageSizeMismatch(f"data: {len(src)} bytes, the row's page is {slot.size}")
    if isinstance(slot, HostSlot):
        with store.host.view(slot) as dst:
            dst[:] = src
        return
    import torch

    from kvbank.kernels.faults import TORCH_ERRORS, torch_fault

    try:
        store.device.view(slot)[: slot.size].copy_(
            torch.frombuffer(bytearray(src), dtype=torch.uint8))
    except TORCH_ERRORS as exc:
        raise torch_fault(f"writing leased row {name.hex()[:16]}…", exc) from exc


def arrived_names(lease: Lease, arrived: Sequence[bytes] | Sequence[bool]) -> set[bytes]:
    """The names a commit publishes: ``arrived`` as names, or one bool per lease row."""
    if hasattr(arrived, "tolist") and not isinstance(arrived, (bytes, bytearray)):
        arrived = arrived.tolist()  # a numpy or torch bool mask
    if isinstance(arrived, (bytes, str)) or not isinstance(arrived, Sequence):
        raise InvalidInput(f"arrived: expected names or a mask, got {type(arrived).__name__}")
    items = list(arrived)
    if items and all(isinstance(a, bool) for a in items):
        if len(items) != len(lease.rows):
            raise InvalidInput(f"arrived: mask of {len(items)} for {len(lease.rows)} lease rows")
        return {r.name for r, a in zip(lease.rows, items, strict=True) if a}
    listed = set(lease.names)
    out: set[bytes] = set()
    for i, a in enumerate(items):
        if type(a) is not bytes or a not in listed:
            raise InvalidInput(f"arrived[{i}]: not a row name of lease {lease.id}")
        out.add(a)
    return out


def publish(
    store: LendingStore,
    lease: Lease,
    slots: dict[bytes, Slot],
    parents: dict[bytes, bytes | None],
    got: set[bytes],
    shape_of: Callable[[bytes], PageShape | None],
    sums: Mapping[bytes, int] | None = None,
) -> CommitResult:
    """Commit a detached WRITE lease: publish the rows in ``got``; ``slots`` ends empty.

    The caller has already taken the lease out of its tables, so nothing else touches
    ``slots``; published slots leave it as the store takes them, the rest go back.
    ``sums``: host rows' checksums as their writer hashed them (``HostSlots.commit_many``).
    """
    committed: list[bytes] = []
    discarded: list[bytes] = []
    already: list[bytes] = []
    pending = dict(slots)
    try:
        arrived = [r.name for r in lease.rows if r.name in pending and r.name in got]
        discarded = [r.name for r in lease.rows if r.name in pending and r.name not in got]
        where = store.locate(arrived) if arrived else []
        host: list[tuple[bytes, HostSlot, str, bytes | None]] = []
        device: list[tuple[bytes, DeviceSlot, str, bytes | None]] = []
        for name, w in zip(arrived, where, strict=True):
            if w is not None:
                already.append(name)  # equal names are equal bytes: keep theirs
                continue
            slot = pending[name]
            shape = shape_of(name)
            dtype, parent = shape.dtype if shape is not None else "uint8", parents.get(name)
            if isinstance(slot, HostSlot):
                host.append((name, slot, dtype, parent))
            else:
                device.append((name, slot, dtype, parent))
        # One batch per memory kind, published in order: on a refusal the rows before
        # it are the store's, the rest go back below with every unpublished slot.
        try:
            if host:
                store.host.commit_many(host, committed, sums)
            if device:
                store.device.commit_many(device, committed)
        finally:
            for name in committed:
                del slots[name]  # published: the store owns it now
    finally:
        # Every slot not published goes back, whatever happened above.
        abort_slots(store, slots)
    return CommitResult(lease.id, tuple(committed), tuple(discarded), tuple(already))


def abort_slots(store: LendingStore, slots: dict[bytes, Slot]) -> None:
    """Give unpublished reserved slots back to the store; ``slots`` ends empty."""
    for slot in slots.values():
        if isinstance(slot, HostSlot):
            store.host.abort(slot)
        else:
            store.device.abort(slot)
    slots.clear()
