"""Leases, page locks and expiry; resume bounds; the fetch ledger.

- :mod:`kvbank.lender.base` — the contract: :class:`Lease`, :class:`LeaseRow`, locations,
  enums, and :class:`LendingStore` (what the lender needs of the tiered store).
- :mod:`kvbank.lender.lender` — :class:`Lender`: lend → read/fill → commit/release;
  renew; expiry checked at completion; a reaper thread.
  Beside it: :mod:`kvbank.lender.conflicts` (the readers/writer tables),
  :mod:`kvbank.lender.reads` and :mod:`kvbank.lender.writes` (what a READ or WRITE
  lease does in the store: stage and copy out; reserve, fill and publish).
- :mod:`kvbank.lender.resume` — :func:`resume_bound`, a pure function.
- :mod:`kvbank.lender.ledger` — :class:`FetchLedger`: delivered rows of a fetch.

The borrower's side in another process (map a HOST lease's slots) is
:mod:`kvbank.client.shm`. This face imports nothing: ``kvbank.lender.base`` (the lease
values a client needs) loads without the lender.
"""
