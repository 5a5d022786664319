"""The disk tier: conformance on real LMDB, corruption, restart, error mapping."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import pytest
import xxhash

from kvbank.codec import frame_info
from kvbank.errors import InvalidInput, TierFull
from kvbank.testing.frames import FrameStoreTests
from kvbank.testing.tiers import TierTests, name_of, page_of, stored
from kvbank.tiers.base import FrameStore, Tier, TierKind
from kvbank.tiers.disk import DiskTier
from kvbank.tiers.diskmeta import unpack_record
from kvbank.tiers.diskseg import SEGMENT_DIR, segment_file

from .conftest import MakeStore


class TestDiskFrames(FrameStoreTests):
    @pytest.fixture(autouse=True)
    def _data_dir(self, tmp_path: Path) -> None:
        self.data_dir = tmp_path

    def make_frames(self, budget: int) -> FrameStore:
        return DiskTier(self.data_dir, budget, sync=False)

    def reopen(self, fs: FrameStore) -> FrameStore:
        fs.close()
        return DiskTier(self.data_dir, self.budget, sync=False)


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
    """Corrupt one byte of a stored frame: in its segment file (found through the
    row's record), or through a raw LMDB handle for a row of the older layout."""
    env = lmdb.open(str(data_dir / "lmdb"), max_dbs=2, subdir=True)
    try:
        frames, meta = env.open_db(b"frames"), env.open_db(b"meta")
        with env.begin(write=True) as txn:
            rec = txn.get(name, db=meta)
            assert rec is not None
            _, where = unpack_record(name, rec)
            if where is not None:
                seg = data_dir / SEGMENT_DIR / segment_file(where.seg)
                with open(seg, "r+b") as f:
                    f.seek(where.offset + at)
                    byte = f.read(1)[0]
                    f.seek(where.offset + at)
                    f.write(bytes([byte ^ 0x5A]))
                return
            frame = txn.get(name, db=frames)
            assert frame is not None
            raw = bytearray(frame)
            raw[at] ^= 0x5A
            txn.put(name, bytes(raw), db=frames)
    finally:
        env.close()


@pytest.mark.parametrize("segments", [True, False], ids=["segments", "older-layout"])
@pytest.mark.parametrize("where", ["payload", "header"])
def test_disk_corrupt_frame_is_a_counted_miss_and_is_deleted(tmp_path: Path, where: str,
                                                             segments: bool) -> None:
    """A frame whose bytes changed on disk is never returned: miss, row gone, counted."""
    rng = np.random.default_rng(1)
    page = rng.standard_normal(4096, dtype=np.float32).astype(np.float16).tobytes()
    tier = DiskTier(tmp_path, 1 << 20, sync=False, segments=segments)
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
    """LMDB's own MapFullError (a tiny map: the index's records fill it) maps to
    TierFull, never escapes as lmdb.Error."""
    tier = DiskTier(tmp_path, 1 << 30, sync=False, map_size=64 * 1024)
    try:
        with pytest.raises(TierFull, match="map"):
            for i in range(2000):
                tier.put(name_of(i), page_of(i, 64), dtype="uint8")
        out = bytearray(64)
        assert tier.get_into(name_of(0), out) == 64  # still serving
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


# -- meta records: checked like frames -----------------------------------------------------

_BODY = struct.Struct("<QQQB")  # raw_len, frame_len, seq, len(dtype); then dtype, parent


def _seal(name: bytes, body: bytes) -> bytes:
    """A meta record as the disk tier writes it: body + xxh3-64 of (name + body)."""
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(name + body))


def _forge(**fields: int) -> Callable[[bytes, bytes], bytes]:
    """Rewrite fields of a record's body and seal it again: a record that passes its
    checksum but lies (what a bug or a crafted file could leave)."""
    def edit(name: bytes, rec: bytes) -> bytes:
        body = bytearray(rec[:-8])
        raw_len, frame_len, seq, dlen = _BODY.unpack_from(body)
        vals = {"raw_len": raw_len, "frame_len": frame_len, "seq": seq} | fields
        _BODY.pack_into(body, 0, vals["raw_len"], vals["frame_len"], vals["seq"], dlen)
        return _seal(name, bytes(body))
    return edit


def _in_place(at: int, value: int) -> Callable[[bytes, bytes], bytes]:
    """Overwrite one 8-byte field of the record, checksum left as it was."""
    def edit(name: bytes, rec: bytes) -> bytes:
        out = bytearray(rec)
        struct.pack_into("<Q", out, at, value)
        return bytes(out)
    return edit


def _flip(name: bytes, rec: bytes) -> bytes:
    out = bytearray(rec)
    out[0] ^= 0x01  # the low byte of raw_len: 4096 reads as 4097
    return bytes(out)


META_EDITS: dict[str, Callable[[bytes, bytes], bytes]] = {
    "flipped-size-byte": _flip,
    "truncated": lambda name, rec: rec[: len(rec) // 2],
    "one-byte-short": lambda name, rec: rec[:-1],
    "empty": lambda name, rec: b"",
    "absurd-size": _in_place(0, 1 << 62),
    "absurd-frame-len": _in_place(8, 1 << 62),
    "forged-absurd-size": _forge(raw_len=1 << 40),
    "forged-wrong-size": _forge(raw_len=4096 - 64),  # valid check, header disagrees
    "forged-wrong-frame-len": _forge(frame_len=1000),
}


def _edit_meta(env: lmdb.Environment, name: bytes, edit: Callable[[bytes, bytes], bytes]) -> None:
    meta = env.open_db(b"meta")
    with env.begin(write=True, db=meta) as txn:
        rec = txn.get(name)
        assert rec is not None
        txn.put(name, edit(name, bytes(rec)))


@pytest.mark.parametrize("how", sorted(META_EDITS))
def test_store_reopens_past_a_corrupt_meta_record_and_drops_that_row(
    make_store: MakeStore, tmp_path: Path, how: str
) -> None:
    """Regression: a meta record that parses but lies (a wrong or absurd size) used to make
    the read raise InvalidInput, or the reopen fail. Now the reopen drops and counts the
    row, answers a miss for it, and every other row reads back intact."""
    page_size = 4096
    s = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20, write_policy="write-through")
    for i in range(4):
        s.put(name_of(i), page_of(i, page_size), parent=name_of(i - 1) if i else None)
    s.close()
    env = lmdb.open(str(tmp_path / "data" / "lmdb"), max_dbs=2, subdir=True)
    try:
        _edit_meta(env, name_of(1), META_EDITS[how])
    finally:
        env.close()
    again = make_store(host_bytes=32 * 1024, disk_bytes=1 << 20)
    assert stored(again, [name_of(i) for i in range(4)]) == [True, False, True, True]
    out = bytearray(page_size)
    assert again.get_into(name_of(1), out) is None
    assert again.stats().tier(TierKind.DISK).corrupt_rows == 1
    for i in (0, 2, 3):
        assert again.get_into(name_of(i), out) == page_size
        assert bytes(out) == page_of(i, page_size)
    again.check_invariants()


@pytest.mark.parametrize("how", ["flipped-size-byte", "forged-wrong-size", "absurd-size"])
def test_disk_read_checks_the_meta_record_and_drops_a_row_that_disagrees(
    tmp_path: Path, how: str
) -> None:
    """Regression: a meta record damaged while the tier is open makes the read a counted
    miss (the frame header's raw length must equal the meta's); the row is deleted."""
    tier = DiskTier(tmp_path, 1 << 20, sync=False)
    try:
        for i in range(3):
            tier.put(name_of(i), page_of(i, 4096))
        _edit_meta(tier._env, name_of(1), META_EDITS[how])
        out = bytearray(4096)
        assert tier.get_into(name_of(1), out) is None
        assert tier.corrupt_rows == 1
        assert tier.contains([name_of(i) for i in range(3)]) == [True, False, True]
        for i in (0, 2):
            assert tier.get_into(name_of(i), out) == 4096 and bytes(out) == page_of(i, 4096)
        tier.check()
    finally:
        tier.close()


def test_disk_overwrite_of_a_row_with_a_corrupt_meta_record_succeeds(tmp_path: Path) -> None:
    """A write over a row whose meta fails its check replaces it (and counts the bad
    record) instead of raising CorruptPage or PageSizeMismatch; the budget stays exact."""
    tier = DiskTier(tmp_path, 1 << 20, sync=False)
    try:
        tier.put(name_of(1), page_of(1, 4096))
        _edit_meta(tier._env, name_of(1), META_EDITS["absurd-frame-len"])
        tier.put(name_of(1), page_of(2, 4096))
        assert tier.corrupt_rows == 1
        out = bytearray(4096)
        assert tier.get_into(name_of(1), out) == 4096 and bytes(out) == page_of(2, 4096)
        tier.check()
    finally:
        tier.close()
