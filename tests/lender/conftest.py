"""The lender tests run with the node's lock order checked on every acquire."""

from __future__ import annotations

from kvbank.tiers import lockorder

lockorder.enable()
