"""The lender's contract: the value objects a lease is made of, and what it needs of a store.

Primitives:

- :class:`Lease` — a time-limited right to read (``READ``) or fill (``WRITE``) rows in
  place, in ``HOST`` (POSIX shared memory) or ``DEVICE`` (a torch pool) memory. A
  ``NAMED`` lease lists its rows; an ``ALL`` lease describes a tier's pools without
  naming rows, for registering them once with a transfer engine.
- :class:`LeaseRow` — one row of a lease: its name, whether it is stored, where its bytes
  lie (:class:`HostLocation` or :class:`DeviceLocation`), the buffer regions inside the
  page (:class:`Region`) and its :class:`Delivery` state.
- :class:`CommitResult` — what a ``WRITE`` lease's commit made visible.
- :class:`LendingStore` — the part of the tiered store the lender uses: ``locate``, and
  three namespaces, ``locks`` (:class:`LockOps`), ``host`` (:class:`HostSlots`) and
  ``device`` (:class:`DeviceSlots`). :class:`kvbank.tiers.store.store.TieredStore` satisfies it.

Lifecycle of a lease: ``lend`` → read or fill the bytes in place → ``release`` (READ) or
``commit`` (WRITE, only rows that arrived whole become visible); ``renew`` extends it.
A lease that is neither renewed nor finished expires at its deadline; a reaper drops its
page locks and returns its reserved slots. See :mod:`kvbank.lender.lender`.

Every value object here is a frozen dataclass of plain fields, so :meth:`Lease.to_json`
(:mod:`kvbank.wire.forms`) can hand a lease to another process (which maps the segments by
name) without pickle.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvbank import fastrows as columns
from kvbank.layout import PageLayout
from kvbank.tiers.base import DeviceSlot, HostSlot, TierKind

if TYPE_CHECKING:
    import torch


class MemoryKind(enum.Enum):
    """Where a lease's bytes lie."""

    HOST = "HOST"  # POSIX shared-memory segments of the host tier
    DEVICE = "DEVICE"  # torch pools of the device tier


class LeaseMode(enum.Enum):
    READ = "READ"  # read committed rows in place
    WRITE = "WRITE"  # fill reserved slots in place; commit publishes them


class Selection(enum.Enum):
    NAMED = "NAMED"  # the rows listed by name
    ALL = "ALL"  # every pool of the tier, no rows named (transfer-engine registration)


class Delivery(enum.Enum):
    """A lease row's state when the lease snapshot was taken."""

    READY = "READY"  # READ: the bytes are in place and locked
    MISSING = "MISSING"  # READ: not stored; nothing to read (a miss, never an error)
    PRESENT = "PRESENT"  # WRITE: already stored; no slot was reserved, nothing to fill
    RESERVED = "RESERVED"  # WRITE: an invisible slot waits to be filled


# Bytes in a host shared-memory segment: map ``segment`` by name, read ``size`` bytes at
# ``offset``. It is the store's own HostSlot (the same three plain fields), so a staged slot
# is a lease location as it stands: no per-row conversion on the lend path.
HostLocation = HostSlot


@dataclass(frozen=True, slots=True)
class DeviceLocation:
    """Bytes in a device-tier pool. ``ipc_handle`` is set when the pool lives on CUDA."""

    pool: str
    device: str
    offset: int
    size: int
    ipc_handle: bytes | None = None


Location = HostLocation | DeviceLocation  # where one row's (or one pool's) bytes lie


@dataclass(frozen=True, slots=True)
class Region:
    """One buffer's bytes inside a page (from the layout's ``regions``)."""

    layer: int
    role: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PageShape:
    """What a row name's page looks like: its size and its buffer regions."""

    size: int
    regions: tuple[Region, ...]
    dtype: str = "uint8"  # what the codec is told the page holds (kvbank.buffers.page_dtype)

    @classmethod
    def of(cls, layout: PageLayout, group: int) -> PageShape:
        return cls(
            layout.group_page_bytes[group],
            tuple(
                Region(r.buffer.layer, r.buffer.role.name, r.offset, r.nbytes)
                for r in layout.regions[group]
            ),
            layout.page_dtype(group),
        )


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """One row of a lease."""

    name: bytes
    present: bool  # stored (READ: readable now; WRITE: already stored, nothing to fill)
    location: Location | None  # None when there is nothing to read or fill
    regions: tuple[Region, ...]  # empty when no registered layout describes the name
    delivery: Delivery


def lease_rows(
    names: Iterable[bytes],
    present: Iterable[bool],
    locations: Iterable[Location | None],
    regions: Iterable[tuple[Region, ...]],
    delivery: Iterable[Delivery],
) -> tuple[LeaseRow, ...]:
    """``tuple(map(LeaseRow, names, present, locations, regions, delivery))``, built column
    by column.

    Equal rows, at half the cost for a 64-row lease (:func:`kvbank.fastrows.build`).
    ``names`` sets the number of rows; every other column must have at least as many
    items (``itertools.repeat`` is fine).
    """
    names = tuple(names)
    return tuple(columns.build(LeaseRow, len(names), (names, present, locations, regions, delivery)))


@dataclass(frozen=True, slots=True)
class Lease:
    """A snapshot of a lease when it was lent or renewed. Plain fields only."""

    id: str
    kind: MemoryKind
    mode: LeaseMode
    selection: Selection
    expires_at: float  # deadline on the lender's monotonic clock (CLOCK_MONOTONIC by default)
    expires_wall: float  # the same deadline as a wall-clock time.time(), for display
    rows: tuple[LeaseRow, ...]
    pools: tuple[Location, ...] = ()  # ALL leases: every pool of the tier, offset 0
    # A served READ HOST lease: each row's checksum as the node sent it, in row order (16
    # hex digits of the xxh3-64 it was committed with; None where it has none), for a
    # reader that copies the rows out to verify its copies. Empty where none were sent (a
    # lender's own lease: ``Bank.checksums`` answers them).
    sums: tuple[str | None, ...] = ()
    # name -> row, built on the first row() call (a batch looks up every row by name)
    _by_name: dict[bytes, LeaseRow] | None = field(default=None, init=False, repr=False, compare=False)

    def row(self, name: bytes) -> LeaseRow:
        index = self._by_name
        if index is None:
            index = {r.name: r for r in reversed(self.rows)}  # the first row of a name wins
            object.__setattr__(self, "_by_name", index)
        return index[name]

    @property
    def names(self) -> tuple[bytes, ...]:
        return tuple(r.name for r in self.rows)

    def checksums(self) -> dict[bytes, int]:
        """``sums`` by row name (rows without one left out)."""
        return {r.name: int(v, 16) for r, v in zip(self.rows, self.sums, strict=False) if v is not None}

    def with_sums(self, checksums: dict[bytes, int]) -> Lease:
        """This READ HOST lease as a node serves it (``POST /v1/leases``, the local
        channel's LEND): with ``sums`` from ``checksums`` (``Bank.checksums``), null for a
        row with none (no bytes in the lease, or none recorded)."""
        return dataclasses.replace(self, sums=tuple(
            None if (v := checksums.get(r.name)) is None or not isinstance(r.location, HostSlot)
            else f"{v:016x}" for r in self.rows))


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a WRITE lease's commit did, row by row."""

    lease_id: str
    committed: tuple[bytes, ...]  # arrived whole and now visible
    discarded: tuple[bytes, ...]  # did not arrive: their reserved slots went back
    already_present: tuple[bytes, ...]  # stored by someone else meanwhile: slot returned


class LockOps(Protocol):
    """The store's page locks (``store.locks``)."""

    def lock(self, names: Sequence[bytes], holder: str) -> None: ...
    def unlock(self, names: Sequence[bytes], holder: str) -> None: ...
    def unlock_all(self, holder: str) -> None: ...
    def is_locked(self, name: bytes) -> bool: ...


class HostSlots(Protocol):
    """The store's host slots (``store.host``)."""

    def reserve(self, size: int, holder: str, *, timeout_s: float | None = None) -> HostSlot: ...
    def reserve_many(self, sizes: Sequence[int], holder: str, *,
                     timeout_s: float | None = None) -> list[HostSlot]: ...
    def commit(self, name: bytes, slot: HostSlot, *, dtype: str = "uint8",
               parent: bytes | None = None) -> None: ...
    def commit_many(self, rows: Sequence[tuple[bytes, HostSlot, str, bytes | None]],
                    published: list[bytes], sums: Mapping[bytes, int] | None = None) -> None: ...
    def abort(self, slot: HostSlot) -> None: ...
    def stage_many(self, names: Sequence[bytes], *,
                   timeout_s: float | None = None) -> list[HostSlot | None]: ...
    def view(self, slot: HostSlot) -> memoryview: ...
    def checksums(self, names: Sequence[bytes]) -> list[int | None]: ...
    def verify(self, name: bytes, view: memoryview) -> bool: ...
    def quarantine(self, names: Sequence[bytes]) -> list[bytes]: ...
    @property
    def segment(self) -> HostSlot | None: ...


class DeviceSlots(Protocol):
    """The store's device slots (``store.device``)."""

    def reserve(self, size: int, holder: str, *, timeout_s: float | None = None) -> DeviceSlot: ...
    def reserve_many(self, sizes: Sequence[int], holder: str, *,
                     timeout_s: float | None = None) -> list[DeviceSlot]: ...
    def commit(self, name: bytes, slot: DeviceSlot, *, dtype: str = "uint8",
               parent: bytes | None = None) -> None: ...
    def commit_many(self, rows: Sequence[tuple[bytes, DeviceSlot, str, bytes | None]],
                    published: list[bytes]) -> None: ...
    def abort(self, slot: DeviceSlot) -> None: ...
    def stage(self, name: bytes, *, timeout_s: float | None = None) -> DeviceSlot | None: ...
    def view(self, slot: DeviceSlot) -> torch.Tensor: ...


class LendingStore(Protocol):
    """What the lender needs of the tiered store: presence, page locks, host/device slots.

    :class:`kvbank.tiers.store.store.TieredStore` satisfies it; the lender is typed against this
    protocol so that its dependency on the store is exactly this list.
    """

    def locate(self, names: Sequence[bytes]) -> list[TierKind | None]: ...
    @property
    def locks(self) -> LockOps: ...
    @property
    def host(self) -> HostSlots: ...
    @property
    def device(self) -> DeviceSlots: ...
