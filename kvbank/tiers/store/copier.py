"""Every byte copy the store makes between its tiers, in one place.

A :class:`Copier` runs with no store lock held, on slots the caller keeps busy (see
:mod:`.residency`). It is where torch/CUDA ``RuntimeError`` from a copy is mapped to
:class:`~kvbank.errors.TierUnavailable`, and the seam tests inject to hold or fail a copy
(``TieredStore(config, copier=...)``) instead of patching the store's privates.

- :meth:`~Copier.fill` — caller bytes into a memory slot (a put);
- :meth:`~Copier.read` — a memory slot into caller bytes (a get);
- :meth:`~Copier.between` — device ↔ host (demotion to host, staging either way);
- :meth:`~Copier.from_frames` — decode a frame-store row into a memory slot;
- :meth:`~Copier.encode` — a memory slot's bytes as a codec frame (demotion, close).
"""

from __future__ import annotations

import torch

from kvbank.errors import TierUnavailable
from kvbank.tiers.base import FrameStore, SlotPool
from kvbank.tiers.device import DevicePool
from kvbank.tiers.host import HostSlab


class Copier:
    """The default copier: plain memory copies, torch for device memory."""

    def fill(self, pool: SlotPool, off: int, src: memoryview) -> None:
        try:
            pool.write(off, src)
        except RuntimeError as exc:
            raise TierUnavailable(f"copy into a memory slot failed: {exc}") from exc

    def read(self, pool: SlotPool, off: int, size: int, dst: memoryview) -> None:
        try:
            pool.read_into(off, size, dst)
        except RuntimeError as exc:
            raise TierUnavailable(f"copy out of a memory slot failed: {exc}") from exc

    def between(self, host: HostSlab, host_off: int, dev: DevicePool, dev_off: int,
                size: int, *, to_host: bool) -> None:
        h = torch.from_numpy(host.numpy()[host_off : host_off + size])
        d = dev.tensor(dev_off, size)
        try:
            if to_host:
                h.copy_(d)
            else:
                d.copy_(h)
        except RuntimeError as exc:
            raise TierUnavailable(f"device/host copy of {size} bytes failed: {exc}") from exc

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
