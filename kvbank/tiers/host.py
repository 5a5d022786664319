"""The host tier: fixed-size slots in one POSIX shared-memory segment per store instance.

Primitives:

- :class:`HostSlab` — one ``/dev/shm/<prefix>-<pid>-<random>`` file mapped once, as a
  sparse address space of ``host_bytes``; :class:`~kvbank.tiers.allocator.SlotAllocator`
  carves it into chunks of equal slots per size class. A chunk's memory becomes real when
  the chunk is claimed (``posix_fallocate``: a full ``/dev/shm`` is a clean ``TierFull``
  instead of a SIGBUS later, then pre-faulted so the first copy into it runs at memcpy
  speed) and is given back with ``MADV_REMOVE`` when the chunk is released. Claimed
  chunks count fully against the budget. With CUDA present each chunk is registered as
  pinned host memory (``cudaHostRegister``) so device copies from it are DMA.
- :func:`map_segment` — the one way another process maps a host segment (by name, with
  the one name check: no path separator, no leading dot, no NUL; and only a regular
  file, never through a symbolic link, never blocking on a FIFO); :func:`attach` /
  :class:`SlotMapping` map just one slot given a
  :class:`~kvbank.tiers.base.HostSlot` (segment name, offset, size), and the borrower
  (:mod:`kvbank.client.shm`) maps whole segments through it.
- :func:`cleanup_stale` — unlinks segments left by dead processes (``kill -9``); every
  new slab calls it for its prefix, so a restarted bank reclaims its predecessor's memory.

Why not :class:`multiprocessing.shared_memory.SharedMemory`: on Python < 3.13 every
process that *attaches* registers the segment with its resource tracker, which unlinks
it (and warns) when that process exits, destroying the owner's memory. Plain ``os.open``
on ``/dev/shm`` plus :mod:`mmap` has no tracker, and the owner alone unlinks on close.

Lifecycle: ``HostSlab(budget)`` creates the segment (sparse: no memory yet) → ``alloc``
claims chunks as rows arrive → ``close()`` unmaps and unlinks it. A process that mapped
the segment keeps its mapping valid after the unlink (POSIX semantics); it reads zeros
from a released chunk, never another process's memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import mmap
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import numpy as np

from kvbank.errors import InvalidInput, TierFull, TierUnavailable
from kvbank.tiers.allocator import AllocatorBacked, SlotAllocator
from kvbank.tiers.base import OS_ERRORS, HostSlot

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
DEFAULT_PREFIX = "kvbank"
MADV_POPULATE_READ = 22  # Linux >= 5.14; not exported by the mmap module on 3.11
MADV_POPULATE_WRITE = 23


@functools.cache
def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def madvise(addr: int, nbytes: int, advice: int) -> None:
    """``madvise(2)`` on ``[addr, addr + nbytes)`` with the GIL released (OSError on
    failure). Not ``mmap.madvise``: it holds the GIL for the whole call, and populating
    64 MiB of a segment stopped every other thread of the process for ~30 ms (a 1 GiB
    populate, half a second)."""
    fn = _libc_madvise()
    if fn is None:
        raise OSError(errno.ENOSYS, "madvise: libc has none")
    if fn(addr, nbytes, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise: {os.strerror(err)}")


def _segment_path(name: str) -> Path:
    if not isinstance(name, str) or not name or "/" in name or name.startswith(".") \
            or "\x00" in name:
        raise InvalidInput(f"segment: not a shared-memory name: {name!r}")
    return SHM_DIR / name


def map_segment(name: str, *, writable: bool, offset: int = 0,
                length: int | None = None) -> mmap.mmap:
    """Map ``length`` bytes (default: all) of segment ``name`` from ``offset`` (a multiple
    of the allocation granularity). ``InvalidInput`` for a bad name or a range beyond the
    segment, ``TierUnavailable`` when it cannot be opened or mapped (owner gone?)."""
    path = _segment_path(name)
    # A segment name comes from a lease, i.e. from another process: never follow a link
    # planted in the shared directory, never block on a FIFO, map only a regular file.
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise TierUnavailable(f"segment {name}: not found (owner closed?)") from None
    except OS_ERRORS as exc:
        if getattr(exc, "errno", None) == errno.ELOOP:
            raise InvalidInput(f"segment: {name!r} is a symbolic link, not a segment") from None
        raise TierUnavailable(f"segment {name}: cannot open: {exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInput(f"segment: {name!r} is not a regular file")
        size = st.st_size
        if length is None:
            length = size - offset
        if offset + length > size or length <= 0:
            raise InvalidInput(f"slot: {offset}+{length} beyond segment {name} ({size} bytes)")
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        return mmap.mmap(fd, length, access=access, offset=offset)
    except OS_ERRORS as exc:
        raise TierUnavailable(f"segment {name}: mmap failed: {exc}") from exc
    finally:
        os.close(fd)


def _cuda_pinning() -> Callable[[int, int, bool], None] | None:
    """A function pinning (True) / unpinning (False) a host range, or None without CUDA."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    if not torch.cuda.is_available():
        return None
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]

    def pin(ptr: int, nbytes: int, on: bool) -> None:
        rc = cudart.cudaHostRegister(ptr, nbytes, 0) if on else cudart.cudaHostUnregister(ptr)
        if int(rc) != 0:
            raise OSError(f"cudaHost{'Register' if on else 'Unregister'} returned {int(rc)}")

    return pin


class HostSlab(AllocatorBacked):
    """Slots in one shared-memory segment; offsets name slots. Not thread-safe: the owner
    (the store) serialises alloc/free; copies may run concurrently
    on slots the owner keeps from being freed."""

    def __init__(self, budget: int, *, prefix: str = DEFAULT_PREFIX, pin: bool = True) -> None:
        if "/" in prefix or not prefix:
            raise InvalidInput(f"prefix: not usable in a shared-memory name: {prefix!r}")
        # A bank killed with SIGKILL never unlinks its segment: reclaim those of dead
        # owners here, at the one moment a new owner starts (they hold memory forever).
        self.reclaimed = tuple(cleanup_stale(prefix))
        self.segment = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        self._alloc = SlotAllocator(budget, on_grow=self._grow, on_release=self._release)
        self._pin = _cuda_pinning() if pin else None
        self._pinned: dict[int, int] = {}  # chunk start -> bytes registered with CUDA
        self.keep_memory = False  # set by a reservation: released chunks keep their memory
        self.prefaulted = 0  # bytes from offset 0 a reservation has made resident
        self._closed = False
        self._fd = -1
        self._mm: mmap.mmap | None = None
        self._mv = memoryview(b"")
        self._arr: np.ndarray[tuple[int], np.dtype[np.uint8]] = np.empty(0, np.uint8)
        size = self._alloc.space_bytes
        if size == 0:
            return
        path = _segment_path(self.segment)
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(self._fd, size)  # sparse: tmpfs allocates on claim, not here
            self._mm = mmap.mmap(self._fd, size)
        except OS_ERRORS as exc:
            self._close_files()
            raise TierUnavailable(f"host tier: cannot create /dev/shm/{self.segment} "
                                  f"({size} bytes): {exc}") from exc
        self._mv = memoryview(self._mm)
        self._arr = np.frombuffer(self._mm, dtype=np.uint8)
        logger.debug("host slab %s: %d bytes in %d units of %d", self.segment, size,
                     self._alloc.n_units, self._alloc.unit)

    # -- chunk memory ------------------------------------------------------------------

    def _grow(self, start: int, nbytes: int) -> None:
        if start + nbytes <= self.prefaulted:
            self._pin_chunk(start, nbytes)  # reserved: allocated and faulted already
            return
        try:
            os.posix_fallocate(self._fd, start, nbytes)
        except OS_ERRORS as exc:
            if getattr(exc, "errno", None) in (errno.ENOSPC, errno.ENOMEM):
                raise TierFull(f"host tier: /dev/shm has no room for a {nbytes}-byte chunk "
                               f"(host_bytes budget {self._alloc.budget}): {exc}") from exc
            raise TierUnavailable(f"host tier: fallocate on {self.segment}: {exc}") from exc
        assert self._mm is not None  # space_bytes > 0 here
        try:
            # Pre-fault so that the first put into the chunk runs at memcpy speed, not
            # at page-fault speed (10x slower, machine-limits.md section 1).
            madvise(int(self._arr.ctypes.data) + start, nbytes, MADV_POPULATE_WRITE)
        except OS_ERRORS:  # no MADV_POPULATE_WRITE (Linux < 5.14): fault by writing
            self._arr[start : start + nbytes] = 0
        self._pin_chunk(start, nbytes)

    def _pin_chunk(self, start: int, nbytes: int) -> None:
        if self._pin is not None:
            try:
                self._pin(int(self._arr.ctypes.data) + start, nbytes, True)
                self._pinned[start] = nbytes
            except OS_ERRORS as exc:
                logger.warning("host tier: chunk at %d stays unpinned: %s", start, exc)
        logger.debug("host slab %s: claimed %d bytes at %d", self.segment, nbytes, start)

    def _release(self, start: int, nbytes: int) -> None:
        assert self._mm is not None
        try:
            if self._pinned.pop(start, None) is not None and self._pin is not None:
                self._pin(int(self._arr.ctypes.data) + start, nbytes, False)
            if self.keep_memory:
                return  # reserved up front: the memory stays claimed for the next chunk
            # Give the memory back to tmpfs. madvise needs page-aligned ranges; a tiny
            # budget has sub-page units, whose partial pages stay allocated (at most 2
            # per chunk).
            lo = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
            hi = (start + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
            if hi > lo:
                # GIL-free (a 64 MiB chunk took ~10 ms); the chunk is free and its
                # caller holds the store's lock, so nothing claims it meanwhile
                madvise(int(self._arr.ctypes.data) + lo, hi - lo, mmap.MADV_REMOVE)
        except OS_ERRORS as exc:
            raise TierUnavailable(f"host tier: releasing {nbytes} bytes at {start} of "
                                  f"{self.segment}: {exc}") from exc
        logger.debug("host slab %s: released %d bytes at %d", self.segment, nbytes, start)

    def prefault(self, start: int, nbytes: int) -> None:
        """Make ``[start, start + nbytes)`` of the segment resident now (tmpfs blocks and
        this mapping's page tables) without changing a byte, so it is safe beside copies
        into slots there; a reservation calls it from its own thread."""
        self._check_open()
        nbytes = min(nbytes, self._alloc.space_bytes - start)
        if nbytes <= 0:
            return
        try:
            os.posix_fallocate(self._fd, start, nbytes)
        except OS_ERRORS as exc:
            raise TierFull(f"host tier: /dev/shm has no room to reserve {nbytes} bytes: {exc}") from exc
        assert self._mm is not None
        try:
            madvise(int(self._arr.ctypes.data) + start, nbytes, MADV_POPULATE_WRITE)
        except OS_ERRORS:
            return  # no MADV_POPULATE_WRITE: allocated now, page tables filled on first use
        if start == self.prefaulted:
            self.prefaulted = start + nbytes

    @property
    def space_bytes(self) -> int:
        """Bytes of the segment (at most the budget)."""
        return self._alloc.space_bytes

    # -- slots -------------------------------------------------------------------------

    def write(self, offset: int, data: memoryview) -> None:
        self._check_open()
        self._mv[offset : offset + data.nbytes] = data

    def read_into(self, offset: int, size: int, out: memoryview) -> None:
        self._check_open()
        out[:size] = self._mv[offset : offset + size]

    def view(self, offset: int, size: int) -> memoryview:
        """The slot's bytes in place (the owner's mapping). Release it before close."""
        self._check_open()
        return self._mv[offset : offset + size]

    def numpy(self) -> np.ndarray[tuple[int], np.dtype[np.uint8]]:
        """The whole segment as a uint8 array (device copies read from it)."""
        self._check_open()
        return self._arr

    def slot(self, offset: int, size: int) -> HostSlot:
        return HostSlot(self.segment, offset, size)

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"host tier: segment {self.segment} is closed")

    def close(self) -> None:
        """Unpin, unmap and unlink the segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pin is not None:
            for start in list(self._pinned):
                try:
                    self._pin(int(self._arr.ctypes.data) + start, self._pinned.pop(start), False)
                except OS_ERRORS as exc:
                    logger.warning("host tier: unpinning chunk at %d: %s", start, exc)
        self._mv.release()
        self._arr = np.empty(0, np.uint8)
        self._close_files()
        logger.debug("host slab %s: closed and unlinked", self.segment)

    def _close_files(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                # A caller still holds a view from view()/host_view(); the mapping lives
                # until that view is released. The file is unlinked below regardless.
                logger.debug("host slab %s: mapping still exported, left to GC", self.segment)
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            _segment_path(self.segment).unlink()


# -- other processes ---------------------------------------------------------------------


class SlotMapping:
    """A slot of another process's host segment, mapped here for in-place access.

    ``with SlotMapping(slot) as mv: ...`` — ``mv`` is a writable memoryview of exactly
    ``slot.size`` bytes. Only the pages around the slot are mapped.
    """

    def __init__(self, slot: HostSlot, *, writable: bool = True) -> None:
        if slot.offset < 0 or slot.size <= 0:
            raise InvalidInput(f"slot: offset {slot.offset} / size {slot.size} out of range")
        gran = mmap.ALLOCATIONGRANULARITY
        base = slot.offset // gran * gran
        length = slot.offset + slot.size - base
        try:
            self._mm: mmap.mmap | None = map_segment(slot.segment, writable=writable,
                                                     offset=base, length=length)
        except InvalidInput:
            raise InvalidInput(f"slot: {slot.offset}+{slot.size} beyond segment "
                               f"{slot.segment}") from None
        self._view: memoryview | None = memoryview(self._mm)[slot.offset - base :]
        self.slot = slot

    @property
    def view(self) -> memoryview:
        if self._view is None:
            raise TierUnavailable("slot mapping: closed")
        return self._view

    def close(self) -> None:
        """Unmap. Idempotent; views taken from :attr:`view` must be released first."""
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def __enter__(self) -> memoryview:
        return self.view

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def attach(slot: HostSlot, *, writable: bool = True) -> tuple[memoryview, Callable[[], None]]:
    """Map ``slot`` in this process: ``(view, close)``; call ``close()`` when done."""
    m = SlotMapping(slot, writable=writable)
    return m.view, m.close


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Unlink ``/dev/shm/<prefix>-<pid>-*`` segments whose process is gone; their names."""
    removed: list[str] = []
    try:
        entries = list(SHM_DIR.iterdir()) if SHM_DIR.is_dir() else []
    except OS_ERRORS as exc:
        raise TierUnavailable(f"host tier: cannot list {SHM_DIR}: {exc}") from exc
    lead = prefix + "-"
    for entry in entries:
        rest = entry.name[len(lead):] if entry.name.startswith(lead) else ""
        pid_text, sep, tail = rest.partition("-")
        if not sep or not pid_text.isdigit() or "-" in tail:
            continue
        pid = int(pid_text)
        try:
            os.kill(pid, 0)
            continue  # alive (or another user's process): not ours to remove
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            entry.unlink()
            removed.append(entry.name)
            logger.warning("host tier: removed stale segment /dev/shm/%s of dead pid %d",
                           entry.name, pid)
        except FileNotFoundError:
            pass
        except OS_ERRORS as exc:  # not ours to remove (another user's): it stays, said once
            logger.warning("host tier: cannot remove stale segment /dev/shm/%s: %s",
                           entry.name, exc)
    return removed
