"""Crash safety: a writer killed with SIGKILL mid-stream loses nothing it acknowledged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvbank.config import BankConfig
from kvbank.testing.tiers import name_of, stored
from kvbank.tiers.base import TierKind
from kvbank.tiers.host import SHM_DIR, cleanup_stale
from kvbank.tiers.store.store import TieredStore

PAGE = 16 * 1024
ACKED = 120  # puts acknowledged before the SIGKILL

WRITER = r"""
import random, sys
from kvbank.config import BankConfig
from kvbank.testing.tiers import name_of, stored
from kvbank.tiers.store.store import TieredStore

data_dir, policy, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = TieredStore(BankConfig(data_dir=data_dir, host_bytes=256 * 1024, disk_bytes=64 << 20,
                               device_bytes=0, write_policy=policy, disk_sync=True))
print("segment", store.host.reserve(1, "probe").segment, flush=True)
i = 0
while True:
    page = random.Random(i).randbytes(size)
    store.put(name_of(i, b"c"), page, parent=name_of(i - 1, b"c") if i else None)
    print(i, flush=True)  # acknowledged: put returned
    i += 1
"""


def _page(i: int) -> bytes:
    import random

    return random.Random(i).randbytes(PAGE)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["write-through", "write-back"])
def test_store_kill_9_loses_no_acknowledged_row(tmp_path: Path, policy: str) -> None:
    """Every row acknowledged before SIGKILL is there after reopening (write-through), and
    whatever is there reads back whole with a valid checksum: no half-written row."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), policy, str(PAGE)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    acked: list[int] = []
    segment = ""
    try:
        for line in proc.stdout:  # a count of acknowledged puts, however long they take
            word = line.split()
            if word[0] == "segment":
                segment = word[1]
                continue
            acked.append(int(word[0]))
            if len(acked) >= ACKED:
                break
        os.kill(proc.pid, signal.SIGKILL)
        for line in proc.stdout:  # acknowledgements already in the pipe count too
            acked.append(int(line.split()[0]))
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert len(acked) >= ACKED, "the writer died before it was killed"
    assert (SHM_DIR / segment).exists()  # killed: nobody unlinked it
    assert segment in cleanup_stale("kvbank")
    store = TieredStore(BankConfig(data_dir=tmp_path, host_bytes=256 * 1024,
                                   disk_bytes=64 << 20, device_bytes=0, disk_sync=False))
    try:
        store.check_invariants()
        last = max(acked)
        names = [name_of(i, b"c") for i in range(last + 2)]
        present = stored(store, names)
        out = bytearray(PAGE)
        for i, here in enumerate(present):
            if here:
                assert store.get_into(names[i], out) == PAGE
                assert bytes(out) == _page(i), f"row {i} came back with other bytes"
        assert not any(stored(store, [name_of(i, b"c") for i in range(last + 2, last + 50)]))
        if policy == "write-through":
            missing = [i for i in acked if not present[i]]
            assert not missing, f"acknowledged rows lost: {missing[:10]}"
        else:
            assert any(present), "write-back demotes: some rows should have reached disk"
        assert store.stats().tier(TierKind.DISK).corrupt_rows == 0
    finally:
        store.close()



