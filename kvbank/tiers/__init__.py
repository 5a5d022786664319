"""Storage tiers of a node and the tiered store over them.

:mod:`.base` holds the contract (:class:`Tier`, :class:`TierKind`, slot values);
:mod:`.host`, :mod:`.device` and :mod:`.disk` implement it; :mod:`.store` places, moves,
locks and evicts rows across them (:class:`TieredStore`). See docs/tiers.md.
"""

from __future__ import annotations

from kvbank.tiers.base import DeviceSlot, FrameStore, HostSlot, SlotPool, Tier, TierKind
from kvbank.tiers.store import StoreHealth, StoreStats, TieredStore, TierHealth, TierStats

__all__ = [
    "DeviceSlot",
    "FrameStore",
    "HostSlot",
    "SlotPool",
    "StoreHealth",
    "StoreStats",
    "Tier",
    "TierHealth",
    "TierKind",
    "TierStats",
    "TieredStore",
]
