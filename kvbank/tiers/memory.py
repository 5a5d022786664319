"""A memory tier on its own: a slot pool plus a ``name -> (offset, size)`` dict.

The host (shared-memory slab) and device (torch pool) tiers differ only in their pool;
the contract's methods — get into a caller's buffer, put, delete, contains, close — are
the same code, here. The tiered store does not use these classes (it keeps one compact
index over all tiers and drives the pools directly); they are the tiers as the
:class:`~kvbank.tiers.base.Tier` contract sees them, for embedding one tier alone and for
the conformance suite.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

from kvbank.errors import InvalidInput, PageSizeMismatch, TierFull, TierUnavailable
from kvbank.tiers.base import Buffer, Tier, as_bytes_view, as_out_view, check_name


class SlotPool(Protocol):
    """What a memory tier needs of its pool (HostSlab and DevicePool both are one)."""

    @property
    def budget(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    def fits(self, size: int) -> bool: ...
    def alloc(self, size: int) -> int | None: ...
    def free(self, offset: int) -> None: ...
    def write(self, offset: int, data: memoryview) -> None: ...
    def read_into(self, offset: int, size: int, out: memoryview) -> None: ...
    def close(self) -> None: ...


class MemoryTier(Tier):
    """A volatile, in-place tier over a slot pool. Thread-safe (one lock)."""

    def __init__(self, pool: SlotPool, label: str) -> None:
        self._pool = pool
        self._label = label  # "host tier", "device tier": names the tier in errors
        self._rows: dict[bytes, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def persistent(self) -> bool:
        return False

    @property
    def in_place(self) -> bool:
        return True

    @property
    def compressed(self) -> bool:
        return False

    @property
    def used_bytes(self) -> int:
        return self._pool.used_bytes

    @property
    def budget_bytes(self) -> int:
        return self._pool.budget

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"{self._label}: closed")

    def get_into(self, name: bytes, out: memoryview | bytearray) -> int | None:
        check_name(name)
        dst = as_out_view(out)
        with self._lock:
            self._check_open()
            hit = self._rows.get(name)
            if hit is None:
                return None
            offset, size = hit
            if dst.nbytes < size:
                raise InvalidInput(f"out: {dst.nbytes} bytes, the row holds {size}")
            # Copied under the lock: a concurrent delete must not free the slot mid-copy.
            self._pool.read_into(offset, size, dst)
            return size

    def put(self, name: bytes, data: Buffer, *, dtype: str = "uint8") -> None:
        check_name(name)
        src = as_bytes_view(data)
        size = src.nbytes
        if size == 0:
            raise InvalidInput("data: a page cannot be empty")
        with self._lock:
            self._check_open()
            old = self._rows.get(name)
            if old is not None:
                if old[1] != size:
                    raise PageSizeMismatch(
                        f"data: {size} bytes, but row already holds {old[1]} bytes")
                self._pool.write(old[0], src)
                return
            if not self._pool.fits(size):
                raise TierFull(f"{self._label}: a {size}-byte row exceeds the budget "
                               f"{self._pool.budget}")
            offset = self._pool.alloc(size)
            if offset is None:
                raise TierFull(f"{self._label}: no room for {size} bytes "
                               f"(used {self._pool.used_bytes} of {self._pool.budget})")
            self._pool.write(offset, src)
            self._rows[name] = (offset, size)

    def delete(self, name: bytes) -> bool:
        check_name(name)
        with self._lock:
            self._check_open()
            hit = self._rows.pop(name, None)
            if hit is None:
                return False
            self._pool.free(hit[0])
            return True

    def contains(self, names: Sequence[bytes]) -> list[bool]:
        with self._lock:
            self._check_open()
            rows = self._rows
            return [check_name(n) in rows for n in names]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._rows.clear()
            self._pool.close()
