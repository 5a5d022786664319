"""Rotten bytes and damaged files under a closed data dir, seen through ``kvbank serve``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbank.bench.reliability_procs import disk_rot, disk_startup_faults

pytestmark = pytest.mark.slow


def test_flipped_bytes_in_one_percent_of_frames_are_all_detected_and_served_as_misses(
        tmp_path: Path) -> None:
    """Bytes flipped inside 1 % of the LMDB values (found with the lmdb package, patched
    in data.mdb): each damaged row is counted corrupt and served as a miss, every other
    row reads back bit-exactly, and no wrong byte is served."""
    res = disk_rot(tmp_path, rows=400, fraction=0.01, seed=7)
    assert res.damaged >= 3
    assert res.missed == res.damaged, res
    assert res.counted == res.damaged, res
    assert res.wrong == 0 and res.healthy_lost == 0, res


def test_deleted_lock_files_and_a_truncated_data_file_start_clean_or_fail_clearly(
        tmp_path: Path) -> None:
    """Lock files deleted: a clean start with every row. data.mdb cut in half: kvbank
    serve exits once with an error naming the file (no SIGBUS, no empty cache); with
    salvage on it starts with the readable rows and says so in its health notes."""
    faults = disk_startup_faults(tmp_path, rows=100)
    assert [f.fault for f in faults] == ["lock files deleted", "data.mdb truncated",
                                         "data.mdb truncated, salvage on"]
    for f in faults:
        assert f.ok, f"{f.fault}: {f.detail}"
