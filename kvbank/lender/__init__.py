"""Leases, page locks and expiry; resume bounds; the fetch ledger.

- :mod:`kvbank.lender.base` — the contract: :class:`Lease`, :class:`LeaseRow`, locations,
  enums, and :class:`LendingStore` (what the lender needs of the tiered store).
- :mod:`kvbank.lender.lender` — :class:`Lender`: lend → read/fill → commit/release;
  renew; expiry checked at completion; a reaper thread.
- :mod:`kvbank.lender.resume` — :func:`resume_bound`, a pure function.
- :mod:`kvbank.lender.ledger` — :class:`FetchLedger`: delivered rows of a fetch.
- :mod:`kvbank.lender.borrow` — the borrower's side in another process: map a HOST
  lease's segments by name from the lease's JSON.
"""

from __future__ import annotations

from kvbank.lender.base import (
    CommitResult,
    Delivery,
    DeviceLocation,
    HostLocation,
    Lease,
    LeaseMode,
    LeaseRow,
    LendingStore,
    Location,
    MemoryKind,
    PageShape,
    Region,
    Selection,
)
from kvbank.lender.ledger import FetchLedger, PlannedRow
from kvbank.lender.lender import Lender
from kvbank.lender.resume import Obstacle, ResumeBound, required_pages, resume_bound

__all__ = [
    "CommitResult",
    "Delivery",
    "DeviceLocation",
    "FetchLedger",
    "HostLocation",
    "Lease",
    "LeaseMode",
    "LeaseRow",
    "Lender",
    "LendingStore",
    "Location",
    "MemoryKind",
    "Obstacle",
    "PageShape",
    "PlannedRow",
    "Region",
    "ResumeBound",
    "Selection",
    "required_pages",
    "resume_bound",
]
