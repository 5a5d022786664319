"""kvbank: storage-tier KV-cache offload and sharing for LLM serving fleets.

The names below load on first use (PEP 562): ``import kvbank`` costs nothing, so the
``kvbank`` command answers ``--help`` and ``--version`` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The embedded API: what a worker needs to store, match, fetch and lend pages; and the
# node service's client, which makes the same calls over HTTP.
_EXPORTS: dict[str, str] = {
    "Bank": "kvbank.bank", "BankStats": "kvbank.bank", "FetchResult": "kvbank.bank",
    "Match": "kvbank.bank", "BankConfig": "kvbank.config", "Scope": "kvbank.keys",
    "PageLayout": "kvbank.layout", "full_attention": "kvbank.layout",
    "hybrid_mamba": "kvbank.layout", "mla": "kvbank.layout", "sliding_window": "kvbank.layout",
    "CommitResult": "kvbank.lender", "Lease": "kvbank.lender", "LeaseMode": "kvbank.lender",
    "LeaseRow": "kvbank.lender", "MemoryKind": "kvbank.lender", "ResumeBound": "kvbank.lender",
    "Client": "kvbank.service.client",
}

if TYPE_CHECKING:
    from kvbank.bank import Bank, BankStats, FetchResult, Match
    from kvbank.config import BankConfig
    from kvbank.keys import Scope
    from kvbank.layout import PageLayout, full_attention, hybrid_mamba, mla, sliding_window
    from kvbank.lender import CommitResult, Lease, LeaseMode, LeaseRow, MemoryKind, ResumeBound
    from kvbank.service.client import Client


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvbank' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "Bank",
    "BankConfig",
    "BankStats",
    "Client",
    "CommitResult",
    "FetchResult",
    "Lease",
    "LeaseMode",
    "LeaseRow",
    "Match",
    "MemoryKind",
    "PageLayout",
    "ResumeBound",
    "Scope",
    "__version__",
    "full_attention",
    "hybrid_mamba",
    "mla",
    "sliding_window",
]
