"""The disk tier: conformance on real LMDB, corruption, restart, error mapping."""

from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvbank.codec import frame_info
from kvbank.errors import InvalidInput, TierFull
from kvbank.testing.tiers import TierTests, name_of, page_of
from kvbank.tiers.base import Tier
from kvbank.tiers.disk import DiskTier


class TestDiskTier(TierTests):
    @pytest.fixture(autouse=True)
    def _data_dir(self, tmp_path: Path) -> None:
        self.data_dir = tmp_path

    def make_tier(self, budget: int) -> Tier:
        return DiskTier(self.data_dir, budget, sync=False)

    def reopen(self, tier: Tier) -> Tier:
        tier.close()
        return DiskTier(self.data_dir, self.budget_pages * self.page_size, sync=False)


def _flip_frame_byte(data_dir: Path, name: bytes, at: int) -> None:
    """Corrupt one byte of a stored frame through a raw LMDB handle."""
    env = lmdb.open(str(data_dir / "lmdb"), max_dbs=2, subdir=True)
    try:
        frames = env.open_db(b"frames")
        with env.begin(write=True, db=frames) as txn:
            raw = bytearray(txn.get(name))
            raw[at] ^= 0x5A
            txn.put(name, bytes(raw))
    finally:
        env.close()


@pytest.mark.parametrize("where", ["payload", "header"])
def test_disk_corrupt_frame_is_a_counted_miss_and_is_deleted(tmp_path: Path, where: str) -> None:
    """A frame whose bytes changed on disk is never returned: miss, row gone, counted."""
    rng = np.random.default_rng(1)
    page = rng.standard_normal(4096, dtype=np.float32).astype(np.float16).tobytes()
    tier = DiskTier(tmp_path, 1 << 20, sync=False)
    tier.put(name_of(1), page, dtype="float16")
    tier.put(name_of(2), page, dtype="float16")
    tier.close()
    _flip_frame_byte(tmp_path, name_of(1), 60 if where == "payload" else 5)
    tier = DiskTier(tmp_path, 1 << 20, sync=False)
    try:
        out = bytearray(len(page))
        assert tier.get_into(name_of(1), out) is None
        assert tier.corrupt_rows == 1
        assert tier.contains([name_of(1), name_of(2)]) == [False, True]
        assert tier.get_into(name_of(2), out) == len(page)
        assert bytes(out) == page
        tier.check()
    finally:
        tier.close()


def test_disk_rows_are_compressed_frames(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    page = rng.standard_normal(32768, dtype=np.float32).astype(np.float16).tobytes()
    tier = DiskTier(tmp_path, 1 << 22, sync=False)
    try:
        tier.put(name_of(1), page, dtype="float16")
        assert tier.used_bytes < len(page)
        frame = tier.frame(page, "float16")
        assert frame_info(frame).raw_len == len(page)
    finally:
        tier.close()


def test_disk_budget_is_exact_and_map_never_fills_first(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 64 * 1024, sync=False)
    try:
        with pytest.raises(TierFull):
            for i in range(100):
                tier.put(name_of(i), page_of(i, 4096))
        assert tier.used_bytes <= 64 * 1024
        tier.check()
    finally:
        tier.close()


def test_disk_map_full_is_tier_full(tmp_path: Path) -> None:
    """LMDB's own MapFullError (a tiny map) maps to TierFull, never escapes as lmdb.Error."""
    tier = DiskTier(tmp_path, 1 << 30, sync=False, map_size=256 * 1024)
    try:
        with pytest.raises(TierFull, match="map"):
            for i in range(200):
                tier.put(name_of(i), page_of(i, 4096), dtype="uint8")
        out = bytearray(4096)
        assert tier.get_into(name_of(0), out) == 4096  # still serving
    finally:
        tier.close()


def test_disk_unknown_dtype_is_refused(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, sync=False)
    try:
        with pytest.raises(InvalidInput):
            tier.put(name_of(1), b"x" * 100, dtype="complex64")
        assert tier.contains([name_of(1)]) == [False]
    finally:
        tier.close()


def test_disk_scan_recovers_sizes_order_and_parents(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, sync=True)
    for i in range(3):
        frame = tier.frame(page_of(i, 1000), "uint8")
        tier.write_frame(name_of(i), frame, raw_len=1000, dtype="uint8",
                         parent=name_of(i - 1) if i else None, seq=10 - i)
    tier.close()
    tier = DiskTier(tmp_path, 1 << 20)
    try:
        rows = {r.name: r for r in tier.scan()}
        assert set(rows) == {name_of(i) for i in range(3)}
        assert rows[name_of(2)].parent == name_of(1) and rows[name_of(0)].parent is None
        assert [rows[name_of(i)].seq for i in range(3)] == [10, 9, 8]
        assert all(r.raw_len == 1000 and r.dtype == "uint8" for r in rows.values())
        assert tier.seq == 10
    finally:
        tier.close()
