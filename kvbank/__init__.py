"""kvbank: storage-tier KV-cache offload and sharing for LLM serving fleets.

The names below are imported on first use, so ``import kvbank.codec`` (or
``kvbank.wire.forms``'s callers that need only frames) does not pull in torch and the tiered
store through this package's ``__init__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvbank import _moved
from kvbank._version import __version__

_moved.install()

# The embedded API: what a worker needs to store, match, fetch and lend pages; and the
# node service's client, which makes the same calls over HTTP.
_EXPORTS = {
    "Bank": "kvbank.bank.bank",
    "Client": "kvbank.client.client",
    "BankConfig": "kvbank.config",
    "BankStats": "kvbank.results",
    "CommitResult": "kvbank.lender.base",
    "FetchResult": "kvbank.results",
    "Fetched": "kvbank.results",
    "GroupKind": "kvbank.layout",
    "Lease": "kvbank.lender.base",
    "LeaseMode": "kvbank.lender.base",
    "LeaseRow": "kvbank.lender.base",
    "Match": "kvbank.results",
    "MemoryKind": "kvbank.lender.base",
    "Obstacle": "kvbank.lender.resume",
    "PageLayout": "kvbank.layout",
    "Presence": "kvbank.results",
    "QuantMode": "kvbank.layout",
    "ResumeBound": "kvbank.lender.resume",
    "Role": "kvbank.layout",
    "Scope": "kvbank.keys",
    "TierKind": "kvbank.tiers.base",
    "full_attention": "kvbank.builders",
    "hybrid_mamba": "kvbank.builders",
    "mla": "kvbank.builders",
    "page_keys": "kvbank.keys",
    "sliding_window": "kvbank.builders",
}

if TYPE_CHECKING:
    from kvbank.bank.bank import Bank
    from kvbank.builders import full_attention, hybrid_mamba, mla, sliding_window
    from kvbank.client.client import Client
    from kvbank.config import BankConfig
    from kvbank.keys import Scope, page_keys
    from kvbank.layout import GroupKind, PageLayout, QuantMode, Role
    from kvbank.lender.base import CommitResult, Lease, LeaseMode, LeaseRow, MemoryKind
    from kvbank.lender.resume import Obstacle, ResumeBound
    from kvbank.results import BankStats, Fetched, FetchResult, Match, Presence
    from kvbank.tiers.base import TierKind

__all__ = [
    "Bank",
    "BankConfig",
    "BankStats",
    "Client",
    "CommitResult",
    "FetchResult",
    "Fetched",
    "GroupKind",
    "Lease",
    "LeaseMode",
    "LeaseRow",
    "Match",
    "MemoryKind",
    "Obstacle",
    "PageLayout",
    "Presence",
    "QuantMode",
    "ResumeBound",
    "Role",
    "Scope",
    "TierKind",
    "__version__",
    "full_attention",
    "hybrid_mamba",
    "mla",
    "page_keys",
    "sliding_window",
]


if not TYPE_CHECKING:  # mypy sees the imports above, so a name not exported is an error

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module 'kvbank' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this hook
        return value


def __dir__() -> list[str]:
    return sorted(__all__)
