"""Workers racing on the SAME prompt through the Bank: put vs put, put vs lend, WRITE
leases vs READ leases, fetch vs evict, all on one chain of rows, with a host budget small
enough that the mover demotes rows to disk meanwhile.

What must hold: a fetch delivers only whole rows with their exact bytes (equal names,
equal bytes: every worker stores the same pages for the same tokens); a READ lease's
bytes are exact whenever ``check_live`` passes; a conflict is ``LeaseConflict``, a locked
or busy row a typed refusal; at the end no lease is left and ``check_invariants`` is clean.
"""

from __future__ import annotations

import collections
import random
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvbank import Bank, BankConfig, full_attention
from kvbank.errors import Busy, LeaseConflict, LeaseExpired, LeaseNotFound, RowLocked, TierFull
from kvbank.lender.base import LeaseMode

FA = full_attention("races@1", num_layers=1, num_kv_heads=2, head_dim=64)  # 8 KiB pages
PAGE = FA.group_page_bytes[0]
P = FA.tokens_per_page
TOKENS = list(range(6 * P))  # six rows every worker shares
PAGES = torch.from_numpy(np.random.default_rng(5).integers(0, 256, (6, PAGE), dtype=np.uint8))
REFUSALS = (LeaseConflict, RowLocked, Busy, TierFull, LeaseExpired, LeaseNotFound)
OPS = 60


def _page(k: int) -> bytes:
    return PAGES[k].numpy().tobytes()


def test_bank_same_prompt_races_keep_bytes_exact_and_tables_clean(tmp_path: Path) -> None:
    cfg = BankConfig(data_dir=tmp_path, host_bytes=4 * PAGE, device_bytes=0, disk_sync=False,
                     dirty_expire_s=0, wait_timeout_s=5, copy_threads=1)
    bank = Bank(cfg)
    lid = bank.register(FA)
    names = bank.row_names(lid, TOKENS, group=0)
    index = {n: k for k, n in enumerate(names)}

    def put(rng: random.Random) -> None:
        first = rng.randrange(6)
        bank.put(lid, TOKENS, group=0, pages=PAGES[first:], first_page=first)

    def fetch(_: random.Random) -> None:
        m = bank.match(lid, [*TOKENS, 1])
        out = bank.out_buffers(m)
        got = bank.fetch(m, out=out)
        for k in range(got.resume.tokens // P):  # the delivered prefix, whole
            assert out[0][k].numpy().tobytes() == _page(k), f"fetched row {k}: wrong bytes"

    def read_lease(rng: random.Random) -> None:
        picked = rng.sample(names, 2)
        lease = bank.lend(picked)
        try:
            for row in lease.rows:
                if row.present:
                    data = bank.view(lease.id, row.name).tobytes()
                    bank.check_live(lease.id)  # bytes count only if the lease outlived the copy
                    assert data == _page(index[row.name]), "leased row: wrong bytes"
        finally:
            bank.release(lease.id)

    def write_lease(rng: random.Random) -> None:
        # Fill rows in place as a worker would; already stored rows are skipped by commit.
        picked = rng.sample(names, 2)
        lease = bank.lend(picked, mode=LeaseMode.WRITE)
        try:
            for row in lease.rows:
                if not row.present:
                    bank.write(lease.id, row.name, _page(index[row.name]))
            bank.commit(lease.id, [r.name for r in lease.rows])
        finally:
            bank.release(lease.id)

    def evict(rng: random.Random) -> None:
        bank.admin.evict([rng.choice(names)])

    def get(rng: random.Random) -> None:
        k = rng.randrange(6)
        out = bytearray(PAGE)
        if bank.get_into(names[k], out) is not None:
            assert bytes(out) == _page(k), f"row {k}: wrong bytes"

    ops: dict[str, Callable[[random.Random], None]] = {
        "put": put, "fetch": fetch, "read_lease": read_lease, "write_lease": write_lease,
        "evict": evict, "get": get}
    errors: list[BaseException] = []
    done: collections.Counter[str] = collections.Counter()
    start = threading.Barrier(4)

    def worker(w: int) -> None:
        rng = random.Random(w)
        start.wait()
        try:
            for _ in range(OPS):
                op = rng.choice(sorted(ops))
                try:
                    ops[op](rng)
                    done[op] += 1
                except REFUSALS:
                    pass
        except BaseException as exc:  # re-raised by the test thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)  # a hang bound, not a timing figure
        assert not any(t.is_alive() for t in threads), "a worker hung"
        assert not errors, errors
        assert set(done) == set(ops), done  # every kind of operation really ran
        assert bank.leases() == ()
        bank.flush()
        bank.check_invariants()
        fetch(random.Random(0))  # what is stored now is still exact
    finally:
        bank.close()
