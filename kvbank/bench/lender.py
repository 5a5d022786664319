"""``kvbank bench lender``: reads through leases from another process, and lease overhead.

Case ``lease-read-xproc``: a second process (a fresh interpreter, see
:mod:`kvbank.bench.borrower`) reads 1 GiB of 2 MiB pages (128 MiB with
``quick``) through HOST leases of 64 rows each: it maps the host segment once from the
leases' JSON and copies every leased page into one preallocated buffer, checking each
lease's deadline when its copies complete. Baseline: ``np.copyto`` of the same number of
bytes between two preallocated buffers in that same process, timed in the same
repetitions (the memcpy ceiling). Target: >= 0.7x.

Case ``lend-release-ops``: 64-row READ leases lent and released per second (validation,
conflict table, ``locate``, page locks, one ``stage_host_many``, the lease snapshot).
Baseline: a store's own ``lock`` + ``unlock_all`` of the same 64 names, stored there too —
the page-lock floor a lease sits on. A lease also needs ``locate`` and ``stage_host_many`` of the same
names and 64 ``LeaseRow`` objects, so it cannot reach 1.0x; docs/lender.md gives the split.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator

import numpy as np
import torch

from kvbank import wire
from kvbank.bank.bank import Bank
from kvbank.bench.borrower import BorrowerProcess
from kvbank.bench.common import BenchRow, paired_rates, row
from kvbank.builders import full_attention
from kvbank.tiers.store.store import TieredStore

SUITE = "lender"
ROWS_PER_LEASE = 64


def _read_xproc(quick: bool) -> BenchRow:
    # 32 layers x (K + V) x 16 tokens x 8 heads x 128 x bf16 = 2 MiB pages
    layout = full_attention("bench-lender@1", 32, 8, 128, tokens_per_page=16)
    page = layout.group_page_bytes[0]
    total = (128 << 20) if quick else (1 << 30)
    n_pages = total // page
    batch = ROWS_PER_LEASE
    with Bank.open(host_bytes=total + (64 << 20), device_bytes=0, max_lease_ttl_s=600) as bank:
        lid = bank.register(layout)
        src = torch.from_numpy((np.arange(batch * page, dtype=np.uint64) % 251).astype(np.uint8))
        src = src.view(batch, page)
        leases = []
        for b in range(n_pages // batch):
            tokens = list(range(b * 1_000_000, b * 1_000_000 + batch * 16))
            names = bank.put(lid, tokens, group=0, pages=src)
            leases.append(bank.lend(names, ttl_s=600))
        with BorrowerProcess() as borrower:
            reply = borrower.call(
                "bench", leases=[wire.to_dict(lease) for lease in leases], repeat=3 if quick else 7
            )
        for lease in leases:
            bank.release(lease.id)
    if not reply.get("ok"):
        raise RuntimeError(f"borrower failed: {reply}")
    nbytes = float(reply["bytes"])
    ours = nbytes / statistics.median(reply["ours"]) / 1e9
    base = nbytes / statistics.median(reply["base"]) / 1e9
    return row(SUITE, "lease-read-xproc", "GB/s", ours,
               "memcpy of the same bytes (np.copyto, preallocated, same process)", base)


def _lend_release(quick: bool) -> BenchRow:
    layout = full_attention("bench-lender-ops@1", 1, 1, 64, tokens_per_page=16)
    with contextlib.ExitStack() as stack:
        bank = stack.enter_context(Bank.open(host_bytes="64M", device_bytes=0))
        lid = bank.register(layout)
        tokens = list(range(ROWS_PER_LEASE * 16))
        pages = torch.zeros(ROWS_PER_LEASE, layout.group_page_bytes[0], dtype=torch.uint8)
        names = bank.put(lid, tokens, group=0, pages=pages)
        # The floor runs on a store of its own with the same rows: the bank's store is not
        # part of its API.
        store = stack.enter_context(TieredStore(bank.config.replace(data_dir=None)))
        for name, page in zip(names, pages.numpy(), strict=True):
            store.put(name, memoryview(page))
        n = 200 if quick else 1000

        def ours() -> None:
            for _ in range(n):
                bank.release(bank.lend(names).id)

        def floor() -> None:
            for i in range(n):
                holder = f"bench-{i}"
                store.locks.lock(names, holder)
                store.locks.unlock_all(holder)

        value, base = paired_rates(n, ours, floor, repeat=3 if quick else 7)
    return row(SUITE, "lend-release-ops", "leases/s", value,
               "store.lock + store.unlock_all of the same 64 names", base)


def run(quick: bool = False) -> Iterator[BenchRow]:
    yield _read_xproc(quick)
    yield _lend_release(quick)
