"""Storage tiers of a node and the tiered store over them.

:mod:`.base` holds the contracts: :class:`SlotPool` (memory: :mod:`.host`'s shared-memory
slab, :mod:`.device`'s torch pool, both over :mod:`.allocator`), :class:`FrameStore`
(frames: :mod:`.disk` on LMDB, :mod:`.remote` on Redis), :class:`TierKind` and the slot
values. :mod:`.store` places, moves, locks and evicts rows across them
(:class:`~kvbank.tiers.store.store.TieredStore`). This face loads only the contracts:
``import kvbank.tiers.base`` runs no store and opens no LMDB. See docs/tiers.md.
"""

from __future__ import annotations

from kvbank.tiers.base import DeviceSlot, FrameStore, HostSlot, SlotPool, Tier, TierKind

__all__ = ["DeviceSlot", "FrameStore", "HostSlot", "SlotPool", "Tier", "TierKind"]
