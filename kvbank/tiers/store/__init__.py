"""The tiered store: :class:`~kvbank.tiers.store.store.TieredStore` (in :mod:`.store`,
whose docstring lists the parts and the lock order) and its public values (in
:mod:`.types`). ``TieredStore`` is imported on first use, so ``kvbank.tiers.store.types``
costs no LMDB."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbank.tiers.store.store import TieredStore

__all__ = ["TieredStore"]


def __getattr__(name: str) -> Any:
    if name == "TieredStore":
        from kvbank.tiers.store.store import TieredStore
        return TieredStore
    raise AttributeError(f"module 'kvbank.tiers.store' has no attribute {name!r}")
