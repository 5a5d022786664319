"""Write-back's dirty-age sweep commits its rows in groups, not one transaction each."""

from __future__ import annotations

import time

from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.base import TierKind
from kvbank.tiers.store.dirty import SWEEP_GROUP

from .conftest import MakeStore

P = 4096


def test_dirty_sweep_writes_its_rows_in_group_commits(make_store: MakeStore) -> None:
    """Regression: the sweep committed (and fsync'd) each dirty row on its own, so under
    a steady put rate it fell behind and a write-back node killed by
    ``kvbank bench reliability`` lost puts 6 s old with ``dirty_expire_s`` = 2. Counted
    in LMDB write transactions, not in time: 150 rows take at most a few groups."""
    store = make_store(host_bytes=1 << 20, disk_bytes=1 << 22, dirty_expire_s=0.2)
    env = store._st.disk()._env  # type: ignore[attr-defined]  # the disk tier's LMDB environment
    names = [name_of(i) for i in range(150)]
    first = env.info()["last_txnid"]
    for i, n in enumerate(names):
        store.put(n, page_of(i, P))
    give_up = time.monotonic() + 120  # a hang detector only
    while not all(TierKind.DISK in r for r in store.residency(names)):
        assert time.monotonic() < give_up, "dirty rows never reached disk"
        time.sleep(0.05)
    txns = env.info()["last_txnid"] - first
    assert txns <= 4 * (len(names) // SWEEP_GROUP + 1), f"{txns} transactions for {len(names)} rows"
    out = bytearray(P)
    for i, n in enumerate(names):
        assert store.get_into(n, out) == P and bytes(out) == page_of(i, P)
    store.check_invariants()
