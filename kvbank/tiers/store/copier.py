"""Every byte copy the store makes between its tiers, in one place.

A :class:`Copier` runs with no store lock held, on slots the caller keeps busy (see
:mod:`.residency`). It is where torch/CUDA ``RuntimeError`` from a copy is mapped to
:class:`~kvbank.errors.TierUnavailable`, and the seam tests inject to hold or fail a copy
(``TieredStore(config, copier=...)``) instead of patching the store's privates.

- :meth:`~Copier.fill` — caller bytes into a memory slot (a put);
- :meth:`~Copier.read` — a memory slot into caller bytes (a get);
- :meth:`~Copier.between` — device ↔ host (demotion to host, staging either way);
  :meth:`~Copier.between_many` — a batch of them, queued together and waited for once;
- :meth:`~Copier.from_frames` — decode a frame-store row into a memory slot;
- :meth:`~Copier.encode` — a memory slot's bytes as a codec frame (demotion, close).

:class:`Lanes` spreads a batch's copies and codec work over ``copy_threads`` threads: the
caller's own thread runs one lane and a pool of ``copy_threads - 1`` workers the others,
so one batch never runs on more threads than configured, and a single item never leaves
the caller's thread. zstd, the plane kernels and numpy's copies release the GIL, so the
lanes run in parallel; a memoryview slice assignment does not (CPython copies under the
GIL), which is why every host copy here is a numpy loop between array views
(:func:`~kvbank.codec.planes.copy_bytes`, see it for when it calls ``memmove``) and never
``slot[...] = data``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from kvbank.codec.planes import copy_bytes
from kvbank.errors import TierUnavailable
from kvbank.tiers.base import FrameStore, SlotPool
from kvbank.tiers.device import DevicePool
from kvbank.tiers.host import HostSlab

U8Array = npt.NDArray[np.uint8]
T = TypeVar("T")
R = TypeVar("R")


def default_copy_threads() -> int:
    """The core count this process may use (``copy_threads`` unset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class Lanes:
    """Run a function over a batch on at most ``threads`` threads (the caller's included).

    ``map(fn, items)`` returns the results in item order. Lanes take the next item as
    they become free (not a fixed share each): a worker that wakes late, or a core taken
    by another process, costs only the items that lane ran. Every lane finishes its item
    before ``map`` returns (the items name slots the caller keeps busy until then); after
    an exception no lane starts another item, and the first exception is raised.
    ``start(fn, items)`` begins a batch on the workers alone and returns it; the caller
    does other work (a disk commit) and then ``join()`` s it, running what is left on its
    own thread too — so a pipeline never runs more than ``threads`` threads either.
    ``close()`` stops the workers (idempotent)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pool = (ThreadPoolExecutor(threads - 1, thread_name_prefix="kvbank-copy")
                      if threads > 1 else None)

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        if min(self.threads, len(items)) <= 1 or self._pool is None:
            return [fn(x) for x in items]  # a single item stays on the caller's thread
        return self._begin(fn, items, min(self.threads, len(items)) - 1).join()

    def start(self, fn: Callable[[T], R], items: Sequence[T]) -> Batch[T, R]:
        """Begin ``fn`` over ``items`` on the workers; ``join()`` for the results."""
        workers = 0 if self._pool is None else min(self.threads - 1, len(items))
        return self._begin(fn, items, workers)

    def _begin(self, fn: Callable[[T], R], items: Sequence[T], workers: int) -> Batch[T, R]:
        batch = Batch(fn, items)
        if self._pool is not None:
            batch.futs = [self._pool.submit(batch.lane) for _ in range(workers)]
        return batch

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class Batch(Generic[T, R]):
    """A batch begun by :meth:`Lanes.start` (or :meth:`Lanes.map`)."""

    def __init__(self, fn: Callable[[T], R], items: Sequence[T]) -> None:
        self._fn = fn
        self._items = items
        self._out: list[R | None] = [None] * len(items)
        self._todo = iter(range(len(items)))  # shared: next() on a range iterator is atomic under the GIL
        self._failed = False
        self.futs: list[Future[None]] = []

    def lane(self) -> None:
        for i in self._todo:
            if self._failed:
                return
            try:
                self._out[i] = self._fn(self._items[i])
            except BaseException:
                self._failed = True
                raise

    def abandon(self) -> None:
        """Stop starting items and wait for the lanes; their results and errors are
        dropped (the caller is already raising)."""
        self._failed = True
        wait(self.futs)

    def join(self) -> list[R]:
        """Run what is left on this thread too, wait for every lane, and return the results
        in item order (or raise the first exception once every lane has stopped)."""
        try:
            self.lane()
        finally:
            wait(self.futs)
        for f in self.futs:
            f.result()
        return self._out  # type: ignore[return-value]  # every slot was filled by a lane


class Copier:
    """The default copier: plain memory copies, torch for device memory."""

    def fill(self, pool: SlotPool, off: int, src: memoryview) -> None:
        if isinstance(pool, HostSlab):
            _copy(pool.numpy()[off : off + src.nbytes], _u8(src))
            return
        try:
            pool.write(off, src)
        except RuntimeError as exc:
            raise TierUnavailable(f"copy into a memory slot failed: {exc}") from exc

    def read(self, pool: SlotPool, off: int, size: int, dst: memoryview) -> None:
        if isinstance(pool, HostSlab):
            _copy(_u8(dst)[:size], pool.numpy()[off : off + size])
            return
        try:
            pool.read_into(off, size, dst)
        except RuntimeError as exc:
            raise TierUnavailable(f"copy out of a memory slot failed: {exc}") from exc

    def between(self, host: HostSlab, host_off: int, dev: DevicePool, dev_off: int,
                size: int, *, to_host: bool) -> None:
        self.between_many(host, dev, [(host_off, dev_off, size)], to_host=to_host)

    def between_many(self, host: HostSlab, dev: DevicePool,
                     copies: Sequence[tuple[int, int, int]], *, to_host: bool) -> None:
        """``(host offset, device offset, size)`` copies one way, all queued before one
        wait: on CUDA each is an asynchronous DMA from or to the pinned slab (a
        synchronous copy per row would wait for each in turn), then one stream sync."""
        arr = host.numpy()
        cuda = False
        try:
            for host_off, dev_off, size in copies:
                h = torch.from_numpy(arr[host_off : host_off + size])
                d = dev.tensor(dev_off, size)
                cuda = cuda or d.device.type == "cuda"
                if to_host:
                    h.copy_(d, non_blocking=d.device.type == "cuda")
                else:
                    d.copy_(h, non_blocking=d.device.type == "cuda")
            if cuda:
                torch.cuda.current_stream(torch.device(dev.device)).synchronize()
        except RuntimeError as exc:
            total = sum(c[2] for c in copies)
            raise TierUnavailable(f"device/host copy of {len(copies)} rows ({total} bytes) "
                                  f"failed: {exc}") from exc

    def from_frames(self, frames: FrameStore, name: bytes, pool: SlotPool, off: int,
                    size: int) -> int | None:
        """Decode the row into the slot; its size, or None if the store has no such row
        of that size. ``CorruptPage`` passes through (the caller drops the row)."""
        if isinstance(pool, HostSlab):
            view = pool.view(off, size)
            try:
                return frames.read_into(name, view, expect=size)
            finally:
                view.release()
        buf = memoryview(bytearray(size))
        n = frames.read_into(name, buf, expect=size)
        if n is not None:
            self.fill(pool, off, buf)
        return n

    def encode(self, frames: FrameStore, pool: SlotPool, off: int, size: int,
               dtype: str) -> bytes:
        if isinstance(pool, HostSlab):
            view = pool.view(off, size)
            try:
                return frames.frame(view, dtype)
            finally:
                view.release()
        assert isinstance(pool, DevicePool)  # the two memory pools
        try:
            data = pool.tensor(off, size).cpu().numpy().data
        except RuntimeError as exc:
            raise TierUnavailable(f"device copy-out of {size} bytes failed: {exc}") from exc
        return frames.frame(data, dtype)


def _u8(buf: memoryview) -> U8Array:
    """A flat uint8 array over a contiguous byte view (no copy)."""
    return np.frombuffer(buf, np.uint8)


def _copy(dst: U8Array, src: U8Array) -> None:
    """``dst[:] = src`` with the GIL released (same length, checked)."""
    if dst.size != src.size:
        raise ValueError(f"copy of {src.size} bytes into a {dst.size}-byte slot")
    copy_bytes(dst, src)
