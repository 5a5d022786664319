"""The tier contracts: what every storage tier of a node offers, and the values it hands out.

Primitives:

- :class:`SlotPool` — a memory pool of fixed-size slots named by offset (the host slab and
  the device pool are one). The tiered store keeps an ordered list of them, fastest first.
- :class:`FrameStore` — rows as codec frames by name: write a frame (or a batch of them,
  :class:`FrameWrite`), read a frame as stored, read and decode into a buffer, look many
  up, delete, scan by prefix, check, health (the disk tier is one; the remote tiers,
  chosen by URL scheme in :mod:`kvbank.tiers.remote`, are the next). The store keeps an
  ordered list of them below its memory pools. :class:`FrameStoreBase` gives a new one
  the batch members (``write_frames``, ``contains_many``) and ``health`` as loops over
  its single-row calls; a store overrides them when it can do better (one transaction,
  one round trip).

- :class:`TierKind` — ``DEVICE`` (a torch tensor pool), ``HOST`` (a POSIX shared-memory
  slab), ``DISK`` (one LMDB environment). Declared fastest first; the tiered store places a
  row in the fastest tier with room and moves it down under pressure.
- :class:`Tier` — five methods (:meth:`~Tier.get_into`, :meth:`~Tier.put`,
  :meth:`~Tier.delete`, :meth:`~Tier.contains`, :meth:`~Tier.close`), capability
  properties (``persistent``, ``in_place``, ``compressed``), the byte budget and the bytes
  in use, and batch helpers with default implementations a tier may override.
- :class:`HostSlot` / :class:`DeviceSlot` — where a row's bytes lie in memory, so that the
  lender can hand a worker the location to read or fill in place.

Rules every tier keeps (the conformance suite :mod:`kvbank.testing.tiers` checks them):

- Rows are keyed by the raw 54-byte row name; values are page bytes. A tier refuses a
  row whose size differs from what the same name already holds
  (:class:`~kvbank.errors.PageSizeMismatch`) and leaves the old row in place.
- A miss is ``None`` (``get_into``) or ``False`` (``delete``, ``contains``), never an
  exception. Failures are typed: :class:`~kvbank.errors.TierFull` when the budget has no
  room (a tier never evicts on its own; eviction is the store's policy),
  :class:`~kvbank.errors.TierUnavailable` after close or when the lower library fails,
  with the library's error chained (``raise TierUnavailable(...) from exc``).
- ``contains`` is a lookup: it never touches recency, locks or leases.

Lifecycle: construct → put/get/delete from any thread → ``close()`` (idempotent); every
call after close raises :class:`~kvbank.errors.TierUnavailable`.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvbank.errors import CorruptPage, InvalidInput, InvalidRowName
from kvbank.keys import ROW_NAME_BYTES, sized_bytes

Buffer = bytes | bytearray | memoryview  # page bytes accepted by put


# The one table of what the operating system raises under a tier (files, flock, mmap,
# madvise, fallocate, shared-memory segments): the host tier and the disk tier's files
# catch exactly these and map them to TierFull (no room) or TierUnavailable (anything
# else). ``mmap.error`` is OSError.
OS_ERRORS: tuple[type[Exception], ...] = (OSError,)


class TierKind(enum.Enum):
    """A tier's kind, fastest first (the store's demotion order follows this order)."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"

    @property
    def rank(self) -> int:
        """0 for the fastest tier; a row moves to higher ranks under pressure."""
        return _RANK[self]


_RANK = {TierKind.DEVICE: 0, TierKind.HOST: 1, TierKind.DISK: 2}


@dataclass(frozen=True, slots=True)
class HostSlot:
    """A row's bytes in a host shared-memory segment.

    Another process maps ``/dev/shm/<segment>`` (see :func:`kvbank.tiers.host.attach`)
    and reads or writes ``size`` bytes at ``offset``. The slot's capacity may be larger
    than ``size``; ``size`` is what the row holds.
    """

    segment: str  # POSIX shared-memory name, without the leading "/"
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class DeviceSlot:
    """A row's bytes in a device pool tensor: ``size`` bytes at byte ``offset``."""

    pool: str  # pool id, unique per store instance and chunk
    device: str  # torch device string, e.g. "cuda:0" or "cpu"
    offset: int  # byte offset in the pool tensor
    size: int


def check_name(name: object) -> bytes:
    """Return ``name`` if it is a raw row name (54 bytes), else raise InvalidRowName."""
    if type(name) is not bytes or len(name) != ROW_NAME_BYTES:
        got = len(name) if isinstance(name, (bytes, bytearray, memoryview)) else type(name).__name__
        raise InvalidRowName(f"row name: expected {ROW_NAME_BYTES} raw bytes, got {got}")
    return name


def check_names(names: Sequence[object]) -> None:
    """Raise InvalidRowName for the first of ``names`` that is not a raw row name. Two C
    passes when all are well (what a lookup of a whole prompt's rows pays)."""
    if sized_bytes(names, ROW_NAME_BYTES):
        return
    for name in names:
        check_name(name)


def as_bytes_view(data: object, field: str = "data") -> memoryview:
    """A flat unsigned-byte view of ``data`` (bytes, bytearray or a contiguous memoryview)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidInput(f"{field}: expected bytes, bytearray or memoryview, got {type(data).__name__}")
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise InvalidInput(f"{field}: the buffer must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def as_out_view(out: object) -> memoryview:
    """A flat writable byte view of a destination buffer."""
    mv = as_bytes_view(out, "out")
    if mv.readonly:
        raise InvalidInput("out: the buffer is read-only")
    return mv


class SlotAllocatorView(Protocol):
    """The part of a pool's allocator the store reads (capacity, slot checks)."""

    @property
    def space_bytes(self) -> int: ...
    def is_slot(self, offset: int) -> bool: ...
    def check(self) -> None: ...


class SlotPool(Protocol):
    """A memory pool: slots of a size class, named by offset, within a byte budget.

    Not thread-safe: the owner (the store, under its lock) serialises ``alloc``/``free``;
    ``write``/``read_into`` may run concurrently on slots the owner keeps from being freed.
    ``alloc`` answers ``None`` when the budget has no slot of that class left;
    ``TierFull`` only when the memory behind a new chunk cannot be had.
    """

    @property
    def budget(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def allocated_bytes(self) -> int: ...
    @property
    def allocator(self) -> SlotAllocatorView: ...
    def fits(self, size: int) -> bool: ...
    def alloc(self, size: int) -> int | None: ...
    def free(self, offset: int) -> None: ...
    def capacity(self, offset: int) -> int: ...
    def write(self, offset: int, data: memoryview) -> None: ...
    def read_into(self, offset: int, size: int, out: memoryview) -> None: ...
    def slot(self, offset: int, size: int) -> HostSlot | DeviceSlot: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class FrameRow:
    """One committed row of a frame store, as its metadata says."""

    name: bytes
    raw_len: int
    frame_len: int
    seq: int  # write clock: higher is newer
    dtype: str
    parent: bytes | None


@dataclass(frozen=True, slots=True)
class FrameWrite:
    """One frame of a batch write (:meth:`FrameStore.write_frames`)."""

    name: bytes
    frame: bytes
    raw_len: int
    dtype: str
    parent: bytes | None = None


@dataclass(frozen=True, slots=True)
class FrameHealth:
    """What a frame store's health says: its bytes, and the faults it counted."""

    used_bytes: int
    budget_bytes: int
    corrupt_rows: int  # rows whose frame or metadata failed a check (deleted)
    failed_writes: int  # writes that raised (counted, never dropped silently)
    last_error: str | None  # the last of them


class FrameStore(Protocol):
    """Rows as self-checking codec frames, keyed by row name (disk, remote).

    A miss is ``None``; a frame that fails its checks is ``CorruptPage`` from the reads
    (the caller drops it with :meth:`drop_corrupt`); a full budget is ``TierFull``; an
    unreachable or closed store is ``TierUnavailable``. Thread-safe.
    ``write_frames`` writes a batch (one transaction where the store has them: all or
    none); ``contains_many`` is a lookup (no read counted, no TTL refreshed).
    """

    @property
    def used_bytes(self) -> int: ...
    @property
    def budget_bytes(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def corrupt_rows(self) -> int: ...
    def frame(self, data: Buffer, dtype: str) -> bytes: ...
    def write_frame(self, name: bytes, frame: bytes, *, raw_len: int, dtype: str,
                    parent: bytes | None = None, seq: int | None = None,
                    replace: bool = False) -> None: ...
    def write_frames(self, rows: Sequence[FrameWrite], *, seq: int | None = None,
                     replace: bool = False) -> None: ...
    def read_frame(self, name: bytes) -> bytes | None: ...
    def read_into(self, name: bytes, out: memoryview | bytearray, *,
                  expect: int | None = None) -> int | None: ...
    def contains_many(self, names: Sequence[bytes]) -> list[bool]: ...
    def delete_many(self, names: Sequence[bytes]) -> list[bool]: ...
    def drop_corrupt(self, name: bytes) -> None: ...
    def scan(self, prefix: bytes = b"") -> Iterator[FrameRow]: ...
    def names(self) -> list[bytes]: ...
    def check(self) -> None: ...
    def health(self) -> FrameHealth: ...
    def close(self) -> None: ...


class FrameStoreBase(abc.ABC):
    """The :class:`FrameStore` members a store may leave to loops over its single-row
    calls: a new frame store subclasses this and writes the single-row ones."""

    corrupt_rows: int  # rows that failed a check and were deleted

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Frame bytes of the stored rows."""

    @property
    @abc.abstractmethod
    def budget_bytes(self) -> int:
        """The store's byte budget."""

    @abc.abstractmethod
    def write_frame(self, name: bytes, frame: bytes, *, raw_len: int, dtype: str,
                    parent: bytes | None = None, seq: int | None = None,
                    replace: bool = False) -> None:
        """Store one frame and its metadata (whole or not at all)."""

    @abc.abstractmethod
    def read_frame(self, name: bytes) -> bytes | None:
        """The frame as stored, checked; ``None`` if absent."""

    def write_frames(self, rows: Sequence[FrameWrite], *, seq: int | None = None,
                     replace: bool = False) -> None:
        """``write_frame`` for each row, write clocks upward from ``seq``. Not one
        transaction: a store that has them overrides this (the disk's group commit)."""
        for i, r in enumerate(rows):
            self.write_frame(r.name, r.frame, raw_len=r.raw_len, dtype=r.dtype,
                             parent=r.parent, seq=None if seq is None else seq + i,
                             replace=replace)

    def contains_many(self, names: Sequence[bytes]) -> list[bool]:
        """Whether each row is here, by reading its frame (a damaged one is not); a
        store with a cheaper lookup overrides this."""
        found: list[bool] = []
        for name in names:
            try:
                found.append(self.read_frame(name) is not None)
            except CorruptPage:
                found.append(False)
        return found

    def health(self) -> FrameHealth:
        """Bytes and corrupt rows; a store that counts failed writes overrides this."""
        return FrameHealth(self.used_bytes, self.budget_bytes, self.corrupt_rows, 0, None)


class Tier(abc.ABC):
    """One storage tier as a caller sees it: rows keyed by raw 54-byte names, values are
    page bytes. ``DiskTier`` and :class:`kvbank.testing.tiers.StoreTier` implement it for
    the conformance suite; the tiered store itself works through :class:`SlotPool` and
    :class:`FrameStore`."""

    kind: TierKind

    # -- capabilities ------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def persistent(self) -> bool:
        """True when committed rows survive a process restart (disk)."""

    @property
    @abc.abstractmethod
    def in_place(self) -> bool:
        """True when the tier can hand out its memory for in-place reads and fills."""

    @property
    @abc.abstractmethod
    def compressed(self) -> bool:
        """True when rows are stored as codec frames (sizes in ``used_bytes`` are frames)."""

    @property
    def evicts(self) -> bool:
        """True when a full tier makes room by evicting old rows instead of ``TierFull``
        (the tiered store does; a single tier never evicts on its own)."""
        return False

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes of the budget that rows (and reservations) occupy now."""

    @property
    @abc.abstractmethod
    def budget_bytes(self) -> int:
        """The tier's byte budget."""

    # -- the five methods --------------------------------------------------------------

    @abc.abstractmethod
    def get_into(self, name: bytes, out: memoryview | bytearray) -> int | None:
        """Copy the row into ``out``; the byte count, or ``None`` on a miss.

        Raises :class:`~kvbank.errors.InvalidInput` when ``out`` is too small.
        """

    @abc.abstractmethod
    def put(self, name: bytes, data: Buffer, *, dtype: str = "uint8") -> None:
        """Store (or replace, same size only) a row. ``TierFull`` when there is no room."""

    @abc.abstractmethod
    def delete(self, name: bytes) -> bool:
        """Remove a row; ``False`` if it was not there."""

    @abc.abstractmethod
    def contains(self, names: Sequence[bytes]) -> list[bool]:
        """Presence of many rows at once; touches nothing."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the tier's resources. Idempotent."""

    # -- batch helpers -----------------------------------------------------------------

    def get_many_into(
        self, names: Sequence[bytes], outs: Sequence[memoryview | bytearray]
    ) -> list[int | None]:
        """``get_into`` for each pair; a tier may override it with one round trip."""
        if len(names) != len(outs):
            raise InvalidInput(f"outs: {len(outs)} buffers for {len(names)} names")
        return [self.get_into(n, o) for n, o in zip(names, outs, strict=True)]

    def put_many(self, items: Iterable[tuple[bytes, Buffer]], *, dtype: str = "uint8") -> None:
        """``put`` for each ``(name, data)``; a tier may override it with one transaction."""
        for name, data in items:
            self.put(name, data, dtype=dtype)

    def delete_many(self, names: Sequence[bytes]) -> list[bool]:
        """``delete`` for each name."""
        return [self.delete(n) for n in names]

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
