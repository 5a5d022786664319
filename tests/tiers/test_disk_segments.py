"""The disk tier's segment files: write-ahead order, whole-segment frees, compaction, the
older layout (frames as LMDB values) served and compacted, RAW frames read in place."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kvbank.testing.diskrot import flip_frame_byte
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers import disk as disk_module
from kvbank.tiers import disklog
from kvbank.tiers.disk import DiskTier
from kvbank.tiers.diskmeta import unpack_record
from kvbank.tiers.diskseg import SEGMENT_DIR, Segments, segment_file

from .conftest import MakeStore

P = 4096
SEG = 4 * P + 1000  # four entries of a RAW 4 KiB page (frame + name + record) a segment


def _segments(data_dir: Path) -> list[Path]:
    return sorted((data_dir / SEGMENT_DIR).glob("*.seg"))


def _legacy_frames(data_dir: Path) -> int:
    env = lmdb.open(str(data_dir / "lmdb"), readonly=True, lock=False, max_dbs=2, subdir=True)
    try:
        with env.begin() as txn:
            return int(txn.stat(env.open_db(b"frames", txn=txn, create=False))["entries"])
    finally:
        env.close()


def _bf16(i: int, n: int = P) -> bytes:
    """Page bytes that compress (a coded frame): bfloat16 of normal values."""
    vals = np.random.default_rng(i).standard_normal(n // 2).astype(np.float32)
    return (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _reads_back(tier: DiskTier, rows: dict[int, bytes]) -> bool:
    out = bytearray(P)
    for i, page in rows.items():
        if tier.get_into(name_of(i), out) != len(page) or bytes(out[: len(page)]) != page:
            return False
    return True


def test_disk_frames_live_in_private_segment_files_not_in_lmdb(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 22, sync=True)
    try:
        rows = {i: _bf16(i) for i in range(6)}
        for i, page in rows.items():
            tier.put(name_of(i), page, dtype="bfloat16")
        assert tier.used_bytes < 6 * P  # coded frames
        assert _reads_back(tier, rows)
        tier.check()
    finally:
        tier.close()
    assert _legacy_frames(tmp_path) == 0
    segs = _segments(tmp_path)
    assert segs
    assert stat.S_IMODE(os.stat(tmp_path / SEGMENT_DIR).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(s).st_mode) == 0o600 for s in segs)


def test_disk_unindexed_bytes_after_a_crash_are_dead_space_never_rows(tmp_path: Path) -> None:
    """What a crash between the segment append and the index commit leaves (bytes no
    entry names, at a segment's end or a whole segment) is never served and never fails
    the open; a segment with no indexed row is unlinked at open."""
    tier = DiskTier(tmp_path, 1 << 22, sync=False)
    rows = {i: page_of(i, P) for i in range(4)}
    for i, page in rows.items():
        tier.put(name_of(i), page)
    used = tier.used_bytes
    tier.close()
    (seg,) = _segments(tmp_path)
    with open(seg, "ab") as f:
        f.write(os.urandom(3000))  # a torn append
    orphan = tmp_path / SEGMENT_DIR / "000000ff.seg"
    orphan.write_bytes(os.urandom(5000))
    orphan.chmod(0o600)
    again = DiskTier(tmp_path, 1 << 22, sync=False)
    try:
        assert again.corrupt_rows == 0 and again.used_bytes == used
        assert _reads_back(again, rows)
        assert not orphan.exists()
        again.put(name_of(9), page_of(9, P))  # appends go to a new segment, never the torn one
        assert _reads_back(again, rows | {9: page_of(9, P)})
        again.check()
    finally:
        again.close()


def _entries(data_dir: Path) -> dict[bytes, tuple[Path, int, int]]:
    """Every entry the segment files hold: row name -> (file, frame offset, length)."""
    segs = Segments(data_dir, sync=False)
    try:
        found = {}
        for seg in segs.ids():
            path = data_dir / SEGMENT_DIR / segment_file(seg)
            for name, _record, off, n in segs.entries(
                    seg, lambda name, rec: unpack_record(name, rec)[0].frame_len):
                found[name] = (path, off, n)
        return found
    finally:
        segs.close()


def test_disk_index_commits_a_machine_crash_undid_are_replayed_from_the_segments(
        tmp_path: Path) -> None:
    """The index's meta page is not synced per commit (the segments are its write-ahead
    log): an index that lost its last commits (LMDB's file as it was before them) gets
    their rows back from the segment entries past its mark, byte for byte, a rewrite's
    later entry winning; an entry there that is torn or fails its checksum is never
    indexed, and nothing is counted corrupt."""
    tier = DiskTier(tmp_path, 1 << 22, sync=True)
    first = {i: _bf16(i) for i in range(3)}
    for i, page in first.items():
        tier.put(name_of(i), page, dtype="bfloat16")
    tier.close()
    data = tmp_path / "lmdb" / "data.mdb"
    before = data.read_bytes()
    tier = DiskTier(tmp_path, 1 << 22, sync=True)
    later = {i: _bf16(i) for i in range(3, 7)}
    for i, page in later.items():
        tier.put(name_of(i), page, dtype="bfloat16")
    tier.put(name_of(0), _bf16(100), dtype="bfloat16")  # a rewrite: its later entry wins
    tier.close()
    data.write_bytes(before)  # the index as it was before those commits
    path, off, n = _entries(tmp_path)[name_of(5)]
    with open(path, "r+b") as f:  # rot in one replayed frame
        f.seek(off + n // 2)
        byte = f.read(1)[0]
        f.seek(off + n // 2)
        f.write(bytes([byte ^ 0x5A]))
    with open(_segments(tmp_path)[-1], "ab") as f:
        f.write(os.urandom(3000))  # and a torn append after them
    again = DiskTier(tmp_path, 1 << 22, sync=True)
    try:
        want = first | {i: p for i, p in later.items() if i != 5} | {0: _bf16(100)}
        assert _reads_back(again, want)
        assert again.get_into(name_of(5), bytearray(P)) is None
        assert again.corrupt_rows == 0
        again.check()
    finally:
        again.close()
    third = DiskTier(tmp_path, 1 << 22, sync=True)  # replayed once: the mark moved past them
    try:
        assert _reads_back(third, want) and third.corrupt_rows == 0
    finally:
        third.close()


def test_disk_a_segment_is_unlinked_only_once_the_index_commit_is_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine crash may undo the last index commit; the rows it deleted then come
    back and must find their bytes, so the segment goes only after an index sync."""
    events: list[str] = []
    real_sync, real_retire = disklog.sync_index, Segments.retire

    def sync(tier: DiskTier) -> None:
        events.append("sync")
        real_sync(tier)

    def retire(self: Segments, seg: int) -> None:
        events.append("unlink")
        real_retire(self, seg)

    monkeypatch.setattr(disk_module, "sync_index", sync)
    monkeypatch.setattr(Segments, "retire", retire)
    tier = DiskTier(tmp_path, 1 << 22, sync=True, segment_bytes=SEG, compact_bytes=0)
    try:
        for i in range(8):
            tier.put(name_of(i), page_of(i, P))
        events.clear()
        tier.delete_many([name_of(i) for i in range(4)])
        assert events == ["sync", "unlink"]
        assert _reads_back(tier, {i: page_of(i, P) for i in range(4, 8)})
    finally:
        tier.close()


def test_disk_a_frame_cut_short_in_its_segment_is_dropped_and_counted(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 22, sync=False)
    rows = {i: page_of(i, P) for i in range(3)}
    for i, page in rows.items():
        tier.put(name_of(i), page)
    tier.close()
    (seg,) = _segments(tmp_path)
    os.truncate(seg, seg.stat().st_size - 100)  # row 2's frame loses its tail
    again = DiskTier(tmp_path, 1 << 22, sync=False)
    try:
        assert again.corrupt_rows == 1
        assert again.contains([name_of(i) for i in range(3)]) == [True, True, False]
        assert _reads_back(again, {0: rows[0], 1: rows[1]})
        again.check()
    finally:
        again.close()


def test_disk_a_raw_frame_is_read_into_place_and_its_rot_detected(tmp_path: Path) -> None:
    """Incompressible bytes are a RAW frame, read straight into the caller's buffer and
    checked there: a flipped payload byte is a counted miss, never returned."""
    page = os.urandom(P)
    tier = DiskTier(tmp_path, 1 << 22, sync=False)
    tier.put(name_of(1), page)
    tier.put(name_of(2), page)
    assert tier.used_bytes == 2 * (P + 40)  # RAW: header + the bytes
    tier.close()
    flip_frame_byte(tmp_path, name_of(1), -7)
    again = DiskTier(tmp_path, 1 << 22, sync=False)
    try:
        out = bytearray(P)
        assert again.get_into(name_of(1), out) is None and again.corrupt_rows == 1
        assert again.get_into(name_of(2), out) == P and bytes(out) == page
        again.check()
    finally:
        again.close()


def test_disk_a_segment_whose_rows_are_all_deleted_is_unlinked(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 22, sync=False, segment_bytes=SEG, compact_bytes=0)
    try:
        for i in range(12):
            tier.put(name_of(i), page_of(i, P))
        first = _segments(tmp_path)
        assert len(first) == 3
        tier.delete_many([name_of(i) for i in range(3)])
        assert first[0].exists()  # row 3 still lives there
        tier.delete(name_of(3))
        assert not first[0].exists() and first[1].exists()
        assert _reads_back(tier, {i: page_of(i, P) for i in range(4, 12)})
        tier.check()
    finally:
        tier.close()


def test_disk_compaction_moves_live_rows_out_of_sparse_segments_within_its_budget(
        tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 22, sync=False, segment_bytes=SEG, compact_bytes=0)
    try:
        for i in range(16):
            tier.put(name_of(i), page_of(i, P))
        segs = _segments(tmp_path)
        assert len(segs) == 4
        # Rows 0..3 are the first segment, 4..7 the second: keep one of each.
        tier.delete_many([name_of(i) for i in (1, 2, 3, 5, 6, 7)])
        live = {i: page_of(i, P) for i in (0, 4, *range(8, 16))}
        step = tier.compact(budget=1)  # the budget stops it after the first batch
        assert step.moved == 1 and step.segments_freed == 1
        assert not segs[0].exists() and segs[1].exists()
        rest = tier.compact()
        assert rest.moved == 1 and rest.segments_freed == 1 and not segs[1].exists()
        assert tier.compact().moved == 0  # nothing sparse left
        assert _reads_back(tier, live)
        tier.check()
    finally:
        tier.close()
    again = DiskTier(tmp_path, 1 << 22, sync=False)
    try:
        assert again.corrupt_rows == 0 and _reads_back(again, live)
        again.check()
    finally:
        again.close()


def test_disk_background_compaction_frees_a_sparse_segment(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 22, sync=False, segment_bytes=SEG)
    try:
        for i in range(12):
            tier.put(name_of(i), page_of(i, P))
        first = _segments(tmp_path)[0]
        tier.delete_many([name_of(i) for i in (0, 1, 2)])  # row 3 alone keeps it
        give_up = time.monotonic() + 60  # the compactor thread runs on its own: a hang bound only
        while first.exists():
            assert time.monotonic() < give_up, "the compactor never removed the emptied segment"
            time.sleep(0.01)
        assert _reads_back(tier, {i: page_of(i, P) for i in range(3, 12)})
        tier.check()
    finally:
        tier.close()


def test_disk_reads_racing_compaction_return_only_whole_rows(tmp_path: Path) -> None:
    """A reader that looked a row up just before compaction moved it and unlinked its
    segment reads it at its new place: never a miss, never a corrupt row."""
    tier = DiskTier(tmp_path, 1 << 23, sync=False, segment_bytes=SEG, compact_bytes=0)
    rows = {i: _bf16(i) for i in range(64)}
    for i, page in rows.items():
        tier.put(name_of(i), page, dtype="bfloat16")
    keep = {i: p for i, p in rows.items() if i % 4 == 0}
    tier.delete_many([name_of(i) for i in rows if i not in keep])
    failures: list[str] = []

    def reader() -> None:
        out = bytearray(P)
        for _ in range(20):
            for i, page in keep.items():
                if tier.get_into(name_of(i), out) != P or bytes(out) != page:
                    failures.append(f"row {i}")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        moved = tier.compact().moved
        for t in threads:
            t.join()
        assert moved >= len(keep) - 4  # all but those in the active segment
        assert failures == [] and tier.corrupt_rows == 0
        tier.check()
    finally:
        tier.close()


def test_disk_older_layout_data_dir_is_served_then_compacted_into_segments(
        tmp_path: Path) -> None:
    """A data dir as the previous release wrote it (frames as LMDB values) opens and is
    served: records, parents and write clocks as written; a new write of one of its rows
    goes to a segment; ``compact`` moves the rest, after which no LMDB value holds a frame."""
    old = DiskTier(tmp_path, 1 << 22, sync=True, segments=False)
    rows = {i: _bf16(i) for i in range(8)}
    for i, page in rows.items():
        old.write_frame(name_of(i), old.frame(page, "bfloat16"), raw_len=P, dtype="bfloat16",
                        parent=name_of(i - 1) if i else None, seq=100 + i)
    old.close()
    assert _legacy_frames(tmp_path) == 8 and not _segments(tmp_path)
    tier = DiskTier(tmp_path, 1 << 22, sync=True)
    try:
        assert _reads_back(tier, rows)
        got = {r.name: r for r in tier.scan()}
        assert [got[name_of(i)].seq for i in range(8)] == list(range(100, 108))
        assert got[name_of(3)].parent == name_of(2)
        rows[0] = _bf16(50)
        tier.put(name_of(0), rows[0], dtype="bfloat16")  # rewritten: now in a segment
        rows[20] = _bf16(20)
        tier.put(name_of(20), rows[20], dtype="bfloat16")
        tier.check()
        report = tier.compact()
        assert report.legacy_moved == 7 and report.moved == 7
        assert _reads_back(tier, rows)
        assert {r.name: r.seq for r in tier.scan()}[name_of(5)] == 105  # clocks kept
        tier.check()
    finally:
        tier.close()
    assert _legacy_frames(tmp_path) == 0
    again = DiskTier(tmp_path, 1 << 22)
    try:
        assert again.corrupt_rows == 0 and _reads_back(again, rows)
        again.check()
    finally:
        again.close()


@pytest.mark.parametrize("segments", [True, False], ids=["segments", "older-layout"])
def test_disk_rot_is_detected_in_either_layout(tmp_path: Path, segments: bool) -> None:
    tier = DiskTier(tmp_path, 1 << 22, sync=False, segments=segments)
    rows = {i: _bf16(i) for i in range(4)}
    for i, page in rows.items():
        tier.put(name_of(i), page, dtype="bfloat16")
    tier.close()
    flip_frame_byte(tmp_path, name_of(2), -3)
    again = DiskTier(tmp_path, 1 << 22, sync=False)
    try:
        out = bytearray(P)
        assert again.get_into(name_of(2), out) is None and again.corrupt_rows == 1
        assert _reads_back(again, {i: rows[i] for i in (0, 1, 3)})
        again.check()
    finally:
        again.close()


def test_store_serves_an_older_layout_data_dir_and_compacts_it(make_store: MakeStore,
                                                               tmp_path: Path) -> None:
    """Through the tiered store: rows of a data dir written as frames in LMDB values
    are found at open and read back; ``compact_disk`` (what ``kvbank admin compact``
    calls) moves them into segments while the store stays open."""
    old = DiskTier(tmp_path / "data", 1 << 20, sync=True, segments=False)
    for i in range(6):
        old.put(name_of(i), page_of(i, P))
    old.close()
    s = make_store(host_bytes=64 * 1024, disk_bytes=1 << 20)
    out = bytearray(P)
    for i in range(6):
        assert s.get_into(name_of(i), out) == P and bytes(out) == page_of(i, P)
    report = s.compact_disk()
    assert report is not None and report.legacy_moved == 6
    s.check_invariants()
    s.close()
    assert _legacy_frames(tmp_path / "data") == 0
    again = make_store(host_bytes=64 * 1024, disk_bytes=1 << 20)
    for i in range(6):
        assert again.get_into(name_of(i), out) == P and bytes(out) == page_of(i, P)
    again.check_invariants()
