"""In-place access to one memory kind: ``store.host`` and ``store.device``.

One set of operations per memory kind (:class:`HostOps`, :class:`DeviceOps`), over the
same plan → copy → publish rules:

- ``reserve(size, holder)`` — a private slot for a write lease: counts against the
  budget, invisible to readers, never evicted; ``TierFull`` (or ``Busy`` at the deadline)
  when there is no room after eviction;
- ``commit(name, slot)`` — publish a reserved slot's bytes as row ``name`` (an unlocked
  older copy, or one locked only by the reserving holder, is replaced); refused commits
  keep the reservation;
- ``abort(slot)`` — give a reserved slot back;
- ``stage(name)`` / ``stage_many(names)`` — bring rows into this kind of memory and
  answer their slots (the caller locks them first so that they stay);
- ``view(slot)`` — the owner-side bytes of a slot (a memoryview for host, a uint8 tensor
  for device); ``segment`` — the whole host segment as one location;
- host only: ``checksums(names)`` — the checksum each row's host copy was committed with
  (what a reader verifies its copy against); ``verify(name, view)`` — whether bytes read
  from a row's host slot still match it; ``quarantine(names)`` — drop the host copies whose
  bytes no longer match (another process of the segment's uid wrote them).

A commit takes the checksum of a host slot's bytes before it claims the slot (no lock
held; a batch's rows on the copy lanes); a device commit records none (device memory is not mapped by other processes;
the row gets one when its bytes reach a host slot).

Every call on a kind whose tier is off raises ``TierUnavailable``.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Generic, TypeVar

import numpy as np
import torch

from kvbank import checks
from kvbank.codec import checksum
from kvbank.config import WritePolicy
from kvbank.errors import InvalidInput
from kvbank.tiers.base import DeviceSlot, HostSlot, check_name, check_names
from kvbank.tiers.device import DevicePool
from kvbank.tiers.host import HostSlab
from kvbank.tiers.index import DEV, HOST, SUMMED
from kvbank.tiers.store import staging
from kvbank.tiers.store.copier import Lanes
from kvbank.tiers.store.mover import Mover
from kvbank.tiers.store.placement import alloc_for_stage
from kvbank.tiers.store.reads import quarantine_host
from kvbank.tiers.store.state import MAX_PAGE, StoreState, deadline_after
from kvbank.tiers.store.writes import Claimed, commit_locked, commit_through, publish

SlotT = TypeVar("SlotT", HostSlot, DeviceSlot)

logger = logging.getLogger("kvbank.tiers.store.store")


class MemoryOps(Generic[SlotT], abc.ABC):
    bit: int
    records_sums = False  # whether a commit records its rows' checksums (host memory does)

    def __init__(self, st: StoreState, mover: Mover, lanes: Lanes) -> None:
        self._st = st
        self._mover = mover
        self._lanes = lanes

    @property
    def enabled(self) -> bool:
        return self.bit in self._st.pools

    def _deadline(self, timeout_s: float | None) -> float:
        return deadline_after(timeout_s, self._st.config.wait_timeout_s)

    @abc.abstractmethod
    def _offset(self, slot: SlotT) -> int:
        """Implemented per memory kind."""

    @abc.abstractmethod
    def _slot(self, off: int, size: int) -> SlotT:
        """Implemented per memory kind."""

    def reserve(self, size: int, holder: str, *, timeout_s: float | None = None) -> SlotT:
        return self.reserve_many([size], holder, timeout_s=timeout_s)[0]

    def reserve_many(self, sizes: Sequence[int], holder: str, *,
                     timeout_s: float | None = None) -> list[SlotT]:
        """:meth:`reserve` of each size, in order, under one hold of the store lock (a
        WRITE lease's rows: a reservation each took the lock, the deadline and the pool
        check once per row). All or none: on a refusal the slots reserved so far go back."""
        for size in sizes:
            checks.count(size, "size", 1, MAX_PAGE)
        if not isinstance(holder, str) or not holder:
            raise InvalidInput(f"holder: expected a non-empty string, got {holder!r}")
        st, bit = self._st, self.bit
        st.pool(bit, "reserve")
        deadline = self._deadline(timeout_s)
        offs: list[int] = []
        with st.lock:
            st.check_open()
            try:
                for size in sizes:
                    off = alloc_for_stage(st, bit, size, deadline, "reserve")
                    st.res.reserved[(bit, off)] = (holder, size)
                    offs.append(off)
            except BaseException:
                for off in offs:
                    del st.res.reserved[(bit, off)]
                    st.res.free_slot(bit, off)
                st.notify()
                raise
            return [self._slot(off, size) for off, size in zip(offs, sizes, strict=True)]

    def _reserved(self, slot: SlotT) -> tuple[int, str]:
        off = self._offset(slot)
        hit = self._st.res.reserved.get((self.bit, off))
        if hit is None:
            raise InvalidInput(f"slot: offset {off} is not a reserved slot (committed, "
                               "aborted or never reserved)")
        if hit[1] != slot.size:
            raise InvalidInput(f"slot.size: {slot.size}, reserved {hit[1]}")
        return off, hit[0]

    @abc.abstractmethod
    def _source(self, off: int, size: int) -> memoryview:
        """Implemented per memory kind."""

    def _checksum(self, slot: SlotT) -> int | None:
        """The checksum of a reserved slot's bytes (None: this kind records none)."""
        return None

    def _sum_of(self, job: tuple[SlotT, int | None]) -> int | None:
        """A committed slot's checksum: its writer's where it sent one (and this kind
        records any), else the slot's bytes hashed."""
        slot, given = job
        return given if given is not None and self.records_sums else self._checksum(slot)

    def _claim_locked(self, name: bytes, slot: SlotT, dtype: str) -> tuple[int, str, int, int]:
        """Take a reserved slot out of its reservation to publish it as ``name``: its
        offset, holder, size and dtype code. A refusal here keeps the reservation."""
        st = self._st
        off, holder = self._reserved(slot)
        code = st.dtype_code(dtype)
        st.check_writable(name, slot.size, holder)
        del st.res.reserved[(self.bit, off)]
        return off, holder, slot.size, code

    def commit(self, name: bytes, slot: SlotT, *, dtype: str = "uint8",
               parent: bytes | None = None) -> None:
        check_name(name)
        if parent is not None:
            check_name(parent)
        st, bit = self._st, self.bit
        st.pool(bit, "commit")
        sum_ = self._checksum(slot)
        with st.lock:
            st.check_open()
            off, holder, size, code = self._claim_locked(name, slot, dtype)
            st.res.hold(bit, off)
        src = self._source(off, size)
        try:
            publish(st, self._mover, name, size, code, parent, bit, off, src, holder=holder,
                    reserve=(holder, size), sum_=sum_)
        finally:
            src.release()
            with st.lock:
                st.release(bit, off)

    def commit_many(self, rows: Sequence[tuple[bytes, SlotT, str, bytes | None]],
                    published: list[bytes], sums: Mapping[bytes, int] | None = None) -> None:
        """:meth:`commit` of each ``(name, slot, dtype, parent)``, in order, appending each
        name to ``published`` once it is. A write lease's batch, all or nothing: every
        row's slot is claimed first (a refusal raises with every row still reserved);
        under write-back they are then published under that one hold of the store lock;
        with write-through their frames are encoded on the copy lanes and written in ONE
        disk transaction, then published together, so a crash leaves all of them on disk
        or none (docs/reliability.md). ``sums``: each row's checksum as its writer hashed
        the bytes it copied into the slot (a same-host client, while they were in its
        cache), recorded instead of hashing the slot again; a wrong one makes the row fail
        its readers' checks (a miss), never serves other bytes."""
        check_names([name for name, _, _, _ in rows])
        check_names([parent for _, _, _, parent in rows if parent is not None])
        st, bit = self._st, self.bit
        st.pool(bit, "commit")
        through = st.config.write_policy is WritePolicy.WRITE_THROUGH and st.has_disk
        # before the claims, no lock held; on the copy lanes, as a put hashes its rows
        # (xxhash frees the GIL): a 64-row commit of 2 MiB rows hashed 128 MiB on one core
        given = sums or {}
        sums_ = self._lanes.map(self._sum_of, [(slot, given.get(name)) for name, slot, _, _ in rows])
        claimed: list[Claimed] = []
        with st.lock:
            st.check_open()
            try:
                for (name, slot, dtype, parent), sum_ in zip(rows, sums_, strict=True):
                    off, holder, size, code = self._claim_locked(name, slot, dtype)
                    claimed.append(Claimed(name, bit, off, size, code, parent, holder, checksum=sum_))
            except BaseException:
                for c in claimed:  # a refusal keeps every reservation
                    st.res.reserved[(bit, c.off)] = (c.holder, c.size)
                raise
            if not through:
                for c in claimed:  # checked above, under this same hold: no refusal
                    commit_locked(st, c.name, c.size, c.code, c.parent, bit, c.off, c.holder,
                                  on_disk=False, reserve=(c.holder, c.size), checksum=c.checksum)
                    published.append(c.name)
                return
            for c in claimed:
                st.res.hold(bit, c.off)
        try:
            for c in claimed:
                c.src = self._source(c.off, c.size)
            commit_through(st, self._mover, self._lanes, claimed, published)
        finally:
            for c in claimed:
                if c.src is not None:
                    c.src.release()
            with st.lock:
                for c in claimed:
                    st.release(bit, c.off)

    def abort(self, slot: SlotT) -> None:
        st = self._st
        st.pool(self.bit, "abort")
        with st.lock:
            st.check_open()
            off, _ = self._reserved(slot)
            del st.res.reserved[(self.bit, off)]
            st.res.free_slot(self.bit, off)
            st.notify()

    def stage(self, name: bytes, *, timeout_s: float | None = None) -> SlotT | None:
        got = staging.stage(self._st, name, self.bit, self._deadline(timeout_s))
        return None if got is None else self._typed(got)

    def stage_many(self, names: Sequence[bytes], *,
                   timeout_s: float | None = None) -> list[SlotT | None]:
        deadline = self._deadline(timeout_s)
        return [None if (s := staging.stage(self._st, n, self.bit, deadline)) is None
                else self._typed(s) for n in names]

    @abc.abstractmethod
    def _typed(self, slot: HostSlot | DeviceSlot) -> SlotT:
        """Implemented per memory kind."""


class HostOps(MemoryOps[HostSlot]):
    """Host (shared-memory) slots."""

    bit = HOST

    def _pool(self) -> HostSlab:
        self._st.pool(HOST, "host")
        assert self._st.host is not None
        return self._st.host

    def _typed(self, slot: HostSlot | DeviceSlot) -> HostSlot:
        assert isinstance(slot, HostSlot)
        return slot

    def _offset(self, slot: HostSlot) -> int:
        if not isinstance(slot, HostSlot):
            raise InvalidInput(f"slot: expected a HostSlot, got {type(slot).__name__}")
        pool = self._pool()
        if slot.segment != pool.segment:
            raise InvalidInput(f"slot.segment: {slot.segment!r} is not this store's")
        return slot.offset

    def _slot(self, off: int, size: int) -> HostSlot:
        return self._pool().slot(off, size)

    def _source(self, off: int, size: int) -> memoryview:
        return self._pool().view(off, size)

    records_sums = True

    def _checksum(self, slot: HostSlot) -> int | None:
        view = self.view(slot)  # refused unless it is a slot of this segment
        try:
            return checksum(view)
        finally:
            view.release()

    def checksums(self, names: Sequence[bytes]) -> list[int | None]:
        """The checksum each row's host copy was committed with (None: the row has no
        host copy, or none was recorded)."""
        st = self._st
        with st.lock:
            ix = st.ix
            # in arrays: a lease of 252 rows took 0.13 ms row by row (numpy scalar reads)
            rids = np.fromiter(map(ix.ids.get, names, repeat(-1)), dtype=np.int64, count=len(names))
            safe = np.maximum(rids, 0)
            known = (rids >= 0) & ((ix.where[safe] & HOST) != 0) & ((ix.flags[safe] & SUMMED) != 0)
            sums = ix.checksum[safe].tolist()
            return [v if k else None for v, k in zip(sums, known.tolist(), strict=True)]

    def verify(self, name: bytes, view: memoryview) -> bool:
        """Whether ``view`` (bytes just read from row ``name``'s host slot) matches the
        checksum the row was committed with. A row with none recorded (its bytes came
        from a device commit) records this one: it is verified from then on."""
        got = checksum(view)
        st = self._st
        with st.lock:
            rid = st.ix.ids.get(name)
            if rid is None:
                return True  # gone meanwhile: nothing to compare with, the lease decides
            want = st.ix.get_checksum(rid)
            if want is None:
                st.ix.set_checksum(rid, got)
                return True
        if got != want:
            logger.warning("store: row %s…: host bytes changed since commit (xxh3 %#018x, "
                           "committed %#018x)", name.hex()[:16], got, want)
        return got == want

    def quarantine(self, names: Sequence[bytes]) -> list[bytes]:
        """Check the host copies of ``names`` against their checksums and drop those that
        no longer match and no lease or pin holds (the next read is a miss, or reads the
        disk copy, whose frame has its own checksum); the names dropped. A row held now
        is checked again at its next read."""
        self._pool()
        return quarantine_host(self._st, names)

    def stage_many(self, names: Sequence[bytes], *,
                   timeout_s: float | None = None) -> list[HostSlot | None]:
        """One planning pass for a lease's rows (see :func:`.staging.stage_host_many`)."""
        return staging.stage_host_many(self._st, names, self._mover.encoder,
                                       self._deadline(timeout_s))

    @property
    def segment(self) -> HostSlot | None:
        """The whole host segment as one location (name, 0, mapped size), for leases
        that map it once; ``None`` when the host tier is off."""
        pool = self._st.host
        if pool is None or pool.allocator.space_bytes == 0:
            return None
        return HostSlot(pool.segment, 0, pool.allocator.space_bytes)

    def view(self, slot: HostSlot) -> memoryview:
        """The owner-side view of a host slot's bytes (release it when done)."""
        pool = self._pool()
        if not isinstance(slot, HostSlot) or slot.segment != pool.segment:
            raise InvalidInput(f"slot: not a slot of segment {pool.segment}")
        with self._st.lock:
            self._st.check_open()
            if not pool.allocator.is_slot(slot.offset) or slot.size > pool.capacity(slot.offset):
                raise InvalidInput(f"slot: offset {slot.offset} size {slot.size} is not a slot")
            return pool.view(slot.offset, slot.size)


class DeviceOps(MemoryOps[DeviceSlot]):
    """Device (torch pool) slots."""

    bit = DEV

    def _pool(self) -> DevicePool:
        self._st.pool(DEV, "device")
        assert self._st.device is not None
        return self._st.device

    def _typed(self, slot: HostSlot | DeviceSlot) -> DeviceSlot:
        assert isinstance(slot, DeviceSlot)
        return slot

    def _offset(self, slot: DeviceSlot) -> int:
        if not isinstance(slot, DeviceSlot):
            raise InvalidInput(f"slot: expected a DeviceSlot, got {type(slot).__name__}")
        return self._pool().offset_of(slot)

    def _slot(self, off: int, size: int) -> DeviceSlot:
        return self._pool().slot(off, size)

    def _source(self, off: int, size: int) -> memoryview:
        # Only write-through needs the bytes on the host (to encode a frame).
        st = self._st
        if st.config.write_policy is WritePolicy.WRITE_THROUGH and st.has_disk:
            return memoryview(self._pool().tensor(off, size).cpu().numpy().data)
        return memoryview(b"")

    @property
    def segment(self) -> HostSlot | None:
        return None  # device pools are chunk tensors that come and go: not one location

    def view(self, slot: DeviceSlot) -> torch.Tensor:
        """A uint8 tensor view of a device slot."""
        pool = self._pool()
        with self._st.lock:
            self._st.check_open()
            off = pool.offset_of(slot)
            if not pool.allocator.is_slot(off) or slot.size > pool.capacity(off):
                raise InvalidInput(f"slot: offset {slot.offset} size {slot.size} is not a slot")
            return pool.tensor(off, slot.size)

