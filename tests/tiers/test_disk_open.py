"""Opening a data dir: one bank per dir, truncated and empty files, salvage, damaged keys.

Regression tests for issue 9's open-time faults. Each was run against the landed code
(5ba5ecc's disk tier, which had no lock, no size check and no salvage) and failed there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from kvbank.config import BankConfig
from kvbank.errors import TierUnavailable
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.base import TierKind
from kvbank.tiers.disk import DiskTier
from kvbank.tiers.diskseg import SEGMENT_DIR
from kvbank.tiers.store.store import TieredStore

PAGE = 4096


def _fill(data_dir: Path, n: int, *, page: int = PAGE, segments: bool = True) -> None:
    tier = DiskTier(data_dir, 64 << 20, sync=False, segments=segments)
    try:
        for i in range(n):
            tier.put(name_of(i), page_of(i, page))
    finally:
        tier.close()


def _readable(tier: DiskTier, n: int, *, page: int = PAGE) -> list[int]:
    """The indexes of rows that read back, each checked byte for byte."""
    out = bytearray(page)
    got = []
    for i in range(n):
        if tier.read_into(name_of(i), out) is not None:
            assert bytes(out) == page_of(i, page), f"row {i} read back wrong bytes"
            got.append(i)
    return got


def test_second_opener_of_a_data_dir_is_refused_naming_the_holders_pid(tmp_path: Path) -> None:
    """Two tiers on one dir each enforced the budget over their own rows only."""
    first = DiskTier(tmp_path, 1 << 20, sync=False)
    try:
        with pytest.raises(TierUnavailable, match=f"pid {os.getpid()}") as err:
            DiskTier(tmp_path, 1 << 20, sync=False)
        assert err.value.field == "data_dir"
    finally:
        first.close()
    DiskTier(tmp_path, 1 << 20, sync=False).close()  # closed: the dir is free again


def test_second_bank_process_on_a_data_dir_is_refused(tmp_path: Path) -> None:
    first = TieredStore(BankConfig(data_dir=tmp_path, device_bytes=0, host_bytes=1 << 20,
                                   disk_sync=False))
    try:
        code = ("import sys\nfrom kvbank.config import BankConfig\n"
                "from kvbank.errors import TierUnavailable\n"
                "from kvbank.tiers.store.store import TieredStore\n"
                "try:\n"
                f"    TieredStore(BankConfig(data_dir={str(tmp_path)!r}, device_bytes=0,"
                " host_bytes=1 << 20))\n"
                "except TierUnavailable as exc:\n    print(exc); sys.exit(3)\n")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=False)
        assert done.returncode == 3, done.stderr
        assert f"pid {os.getpid()}" in done.stdout
    finally:
        first.close()


_OPEN_TRUNCATED = """
import sys
from kvbank.errors import TierUnavailable
from kvbank.tiers.disk import DiskTier
try:
    DiskTier(sys.argv[1], 64 << 20, sync=False)
except TierUnavailable as exc:
    print(exc)
    sys.exit(3)
"""


@pytest.mark.parametrize("keep", ["half", "8KiB", "0"])
def test_truncated_data_file_is_tier_unavailable_naming_it_not_sigbus(
        tmp_path: Path, keep: str) -> None:
    """The open-time scan read mapped pages past the end of the file: exit 135 (SIGBUS).
    A 0-byte file opened as an empty tier, a silent loss. Run in a child process so that
    a SIGBUS fails this test instead of killing the suite."""
    _fill(tmp_path, 200)
    data = tmp_path / "lmdb" / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, {"half": size // 2, "8KiB": 8192, "0": 0}[keep])
    done = subprocess.run([sys.executable, "-c", _OPEN_TRUNCATED, str(tmp_path)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert str(data) in done.stdout
    assert ("truncated" if keep != "0" else "empty") in done.stdout


@pytest.mark.parametrize("keep", ["half", "8KiB", "0"])
def test_salvage_rebuilds_every_row_of_a_truncated_index_from_the_segments(
        tmp_path: Path, keep: str) -> None:
    """Each segment entry names its row and carries its record: a salvage of a damaged
    index (truncated to any length) gets every row back from the segment files, and a
    torn entry at a segment's end (a crash mid-append) is left out, not indexed."""
    _fill(tmp_path, 200)
    seg = next((tmp_path / SEGMENT_DIR).iterdir())
    with open(seg, "ab") as f:
        f.write(b"KVS1" + b"\xff" * 30)  # a torn entry: cut off mid-head
    data = tmp_path / "lmdb" / "data.mdb"
    os.truncate(data, {"half": data.stat().st_size // 2, "8KiB": 8192, "0": 0}[keep])
    tier = DiskTier(tmp_path, 64 << 20, sync=False, salvage=True)
    try:
        report = tier.salvaged
        assert report is not None and report.kept_at.is_dir()
        assert _readable(tier, 200) == list(range(200))
        assert report.copied == 200 and report.dropped == 0
        rows = {r.name: r for r in tier.scan()}
        assert all(rows[name_of(i)].seq == i + 1 for i in range(200))  # records kept
        tier.check()
    finally:
        tier.close()


@pytest.mark.parametrize("keep", ["half", "8KiB", "0"])
def test_salvage_copies_the_readable_rows_of_a_truncated_file_and_reports_the_rest(
        tmp_path: Path, keep: str) -> None:
    """The older layout (frames as LMDB values): what can be read is copied."""
    _fill(tmp_path, 200, segments=False)
    data = tmp_path / "lmdb" / "data.mdb"
    os.truncate(data, {"half": data.stat().st_size // 2, "8KiB": 8192, "0": 0}[keep])
    tier = DiskTier(tmp_path, 64 << 20, sync=False, salvage=True)
    try:
        report = tier.salvaged
        assert report is not None
        got = _readable(tier, 200)
        assert report.copied == len(got)
        if keep == "half":
            assert report.copied + report.dropped == 200
            assert report.copied > 0
        else:  # nothing left to read: said, not silent
            assert report.copied == 0
            assert report.first_error or "empty" in report.reason
        assert report.kept_at.is_dir() and report.kept_at != tier.path  # never wiped
        assert tier.used_bytes == sum(len(tier.read_frame(name_of(i)) or b"") for i in got)
        tier.check()
    finally:
        tier.close()
    again = DiskTier(tmp_path, 64 << 20, sync=False)  # the fresh environment stands alone
    try:
        assert again.salvaged is None
        assert _readable(again, 200) == got
    finally:
        again.close()


def _flip_in_file(path: Path, needle: bytes, delta: int) -> None:
    """Flip a byte at ``delta`` into every copy of ``needle`` (freed pages hold old ones)."""
    raw = bytearray(path.read_bytes())
    at = raw.find(needle)
    assert at >= 0, "the bytes to damage are not in the file"
    while at >= 0:
        raw[at + delta] ^= 0xFF
        at = raw.find(needle, at + 1)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("segments", [True, False], ids=["segments", "older-layout"])
def test_store_salvage_of_a_damaged_btree_page_is_said_in_health(tmp_path: Path,
                                                                 segments: bool) -> None:
    """One damaged byte in a B-tree page refused the start with no way back."""
    _fill(tmp_path, 200, page=512, segments=segments)
    data = tmp_path / "lmdb" / "data.mdb"
    page = os.sysconf("SC_PAGE_SIZE")
    raw = bytearray(data.read_bytes())
    # Damage the page header (flags) of the leaf page holding row 0's meta record (its
    # key then its record, inline): the B-tree cannot be walked through it.
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=2, subdir=True)
    with env.begin(db=env.open_db(b"meta")) as txn:
        record = txn.get(name_of(0))
        assert record is not None
        needle = name_of(0) + bytes(record)
    env.close()
    at = raw.rfind(needle)
    assert at > 0
    raw[at // page * page + 10] = 0x40  # mp_flags: no longer a leaf
    data.write_bytes(bytes(raw))
    cfg = BankConfig(data_dir=tmp_path, device_bytes=0, host_bytes=1 << 20, disk_sync=False,
                     disk_bytes=64 << 20)
    with pytest.raises(TierUnavailable, match=r"disk_salvage|MDB|corrupt|Corrupt"):
        TieredStore(cfg).close()
    store = TieredStore(cfg.replace(disk_salvage=True))
    try:
        disk = next(t for t in store.health().tiers if t.kind is TierKind.DISK)
        assert "salvaged" in disk.detail and "dropped" in disk.detail
        # The frames (the segments, or the frames database) are whole: every row comes
        # back, byte for byte.
        out = bytearray(512)
        for i in range(200):
            assert store.get_into(name_of(i), out) == 512
            assert bytes(out) == page_of(i, 512)
        store.check_invariants()
    finally:
        store.close()


def test_a_row_with_damaged_key_bytes_is_deleted_at_open_and_used_bytes_stay_exact(
        tmp_path: Path) -> None:
    """Found at open, never deletable by key lookup: recounted as corrupt at every open."""
    _fill(tmp_path, 8, page=512)
    name = name_of(3)
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=2, subdir=True)
    with env.begin(db=env.open_db(b"meta")) as txn:
        got = txn.get(name)
        assert got is not None
        rec = bytes(got)
    env.close()
    # The meta node holds the key then its record: damage the key's first byte there,
    # which also puts it out of B-tree order.
    _flip_in_file(tmp_path / "lmdb" / "data.mdb", name + rec, 0)
    first = DiskTier(tmp_path, 64 << 20, sync=False)
    try:
        assert first.corrupt_rows >= 1
        first.check()
        assert first.used_bytes == sum(len(first.read_frame(name_of(i)) or b"")
                                       for i in range(8))
    finally:
        first.close()
    second = DiskTier(tmp_path, 64 << 20, sync=False)
    try:
        assert second.corrupt_rows == 0  # deleted for good, not recounted
        second.check()
    finally:
        second.close()


def test_a_new_host_slab_reclaims_segments_of_dead_owners(tmp_path: Path) -> None:
    from kvbank.tiers.host import SHM_DIR, HostSlab

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead = int(child.stdout)
    stale = SHM_DIR / f"kvbank-{dead}-0123456789ab"
    live = SHM_DIR / f"kvbank-{os.getpid()}-ba9876543210"
    stale.write_bytes(b"x" * 4096)
    live.write_bytes(b"y")
    try:
        slab = HostSlab(1 << 20)
        try:
            assert not stale.exists()
            assert stale.name in slab.reclaimed
            assert live.exists()  # its owner is alive
        finally:
            slab.close()
    finally:
        for p in (stale, live):
            p.unlink(missing_ok=True)


def _wreck_btree(data_dir: Path) -> None:
    """Give every page after the two meta pages a page-type field of 0: each B-tree page
    LMDB then reaches is 'wrong type' (MDB_CORRUPTED), as a flipped header is."""
    path = data_dir / "lmdb" / "data.mdb"
    raw = bytearray(path.read_bytes())
    page = 4096
    for off in range(2 * page, len(raw), page):
        raw[off + 10 : off + 12] = b"\0\0"  # mp_flags, after mp_pgno (8) and mp_pad (2)
    path.write_bytes(raw)


def test_a_damaged_btree_refused_at_open_names_disk_salvage(tmp_path: Path) -> None:
    """Regression (served-node review D8): a corrupt B-tree page refused the open with
    LMDB's 'Located page was wrong type' alone, without the ``disk_salvage`` hint that
    the truncation refusal carries (a salvage then starts)."""
    _fill(tmp_path, 40)
    _wreck_btree(tmp_path)
    with pytest.raises(TierUnavailable, match="disk_salvage") as err:
        DiskTier(tmp_path, 64 << 20, sync=False)
    assert "MDB_CORRUPTED" in str(err.value) or "MDB_PAGE_NOTFOUND" in str(err.value)
    tier = DiskTier(tmp_path, 64 << 20, sync=False, salvage=True)
    try:
        assert tier.salvaged is not None
    finally:
        tier.close()


def test_a_deleted_data_file_beside_a_catalog_of_puts_is_a_health_note(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Regression (served-node review D8): ``lmdb/data.mdb`` deleted while the catalog
    (``namespaces.bin``) records puts started silently empty; it is a health note of the
    disk tier and a warning now (a new data dir, with no catalog, is neither)."""
    from kvbank import Bank
    from kvbank.builders import full_attention

    layout = full_attention("deleted@1", 1, 1, 64, tokens_per_page=16)
    cfg = BankConfig(host_bytes=4 << 20, device_bytes=0, data_dir=tmp_path, disk_sync=False)
    with Bank(cfg) as bank:
        assert not any("missing" in n for n in bank.health().notes)
        lid = bank.register(layout)
        bank.put(lid, list(range(32)), group=0, pages=[bytes(layout.group_page_bytes[0])] * 2)
    (tmp_path / "lmdb" / "data.mdb").unlink()
    with Bank(cfg) as bank:
        disk = bank.health().tiers[2]
        assert disk.kind is TierKind.DISK and "data.mdb was missing" in disk.detail, disk
        assert any("data.mdb was missing" in n for n in bank.health().notes)
    assert "data.mdb was missing" in caplog.text


def test_disk_budget_over_the_file_system_is_said_at_open(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """W5: ``--disk-bytes 2T`` opened without a word on a file system with 78 GB free;
    a budget over what the file system can hold is a warning naming both."""
    import logging

    from kvbank.tiers.disk import DiskTier

    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    with caplog.at_level(logging.WARNING, logger="kvbank.tiers.disk"):
        DiskTier(tmp_path / "big", 2 * free + (1 << 30), sync=False).close()
    assert any("more than the file system can hold" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbank.tiers.disk"):
        DiskTier(tmp_path / "small", 64 << 20, sync=False).close()
    assert not caplog.records


def test_disk_map_the_process_cannot_have_names_disk_bytes(tmp_path: Path) -> None:
    """W5: ``--disk-bytes 900T`` failed with "Cannot allocate memory" and no word about the
    budget: the refusal names ``disk_bytes`` and the map it sized."""
    from kvbank.tiers.disk import DiskTier

    with pytest.raises(TierUnavailable, match="disk_bytes") as e:
        DiskTier(tmp_path, 900 << 40, sync=False)  # 900 TiB: a 3.5 PiB map
    assert e.value.field == "disk_bytes" and "map" in str(e.value)
