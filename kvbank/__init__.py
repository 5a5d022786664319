"""kvbank: storage-tier KV-cache offload and sharing for LLM serving fleets."""

from __future__ import annotations

__version__ = "0.1.0"

# The embedded API: what a worker needs to store, match, fetch and lend pages.
from kvbank.bank import Bank, BankStats, FetchResult, Match
from kvbank.config import BankConfig
from kvbank.keys import Scope
from kvbank.layout import PageLayout, full_attention, hybrid_mamba, mla, sliding_window
from kvbank.lender import CommitResult, Lease, LeaseMode, LeaseRow, MemoryKind, ResumeBound

__all__ = [
    "Bank",
    "BankConfig",
    "BankStats",
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
