"""The toy directory frame store: conformance, damaged and planted files, and a tiered
store that uses it as its remote tier by URL scheme alone."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvbank.config import BankConfig
from kvbank.errors import ConfigError, CorruptPage, TierUnavailable
from kvbank.testing.dirstore import DirFrameStore
from kvbank.testing.frames import FrameStoreTests
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.base import FrameStore, TierKind
from kvbank.tiers.schemes import open_remote, remote_schemes

from .conftest import MakeStore
from .store.test_stats import assert_counters_agree

P = 4096


class TestDirFrames(FrameStoreTests):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path / "rows"

    def make_frames(self, budget: int) -> FrameStore:
        return DirFrameStore(self.root, budget, sync=False)

    def reopen(self, fs: FrameStore) -> FrameStore:
        fs.close()
        return DirFrameStore(self.root, self.budget, sync=False)


def _write(fs: DirFrameStore, i: int) -> bytes:
    frame = fs.frame(page_of(i, P), "uint8")
    fs.write_frame(name_of(i), frame, raw_len=P, dtype="uint8")
    return frame


def test_dirstore_damaged_file_is_corrupt_never_bytes_and_dropped_at_open(
        tmp_path: Path) -> None:
    fs = DirFrameStore(tmp_path, 1 << 20, sync=False)
    _write(fs, 1)
    kept = _write(fs, 2)
    path = tmp_path / (name_of(1).hex() + ".row")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptPage):
        fs.read_into(name_of(1), bytearray(P))
    fs.close()
    again = DirFrameStore(tmp_path, 1 << 20, sync=False)
    try:
        assert again.corrupt_rows == 1 and again.names() == [name_of(2)]
        assert again.used_bytes == len(kept) and not path.exists()
        again.check()
    finally:
        again.close()


def test_dirstore_never_follows_a_planted_link(tmp_path: Path) -> None:
    """A link planted at a row's file is neither read through nor written through: the
    read is TierUnavailable, and a write replaces the link, leaving its target as it was."""
    root, target = tmp_path / "rows", tmp_path / "secret"
    target.write_bytes(b"not a row")
    fs = DirFrameStore(root, 1 << 20, sync=False)
    try:
        link = root / (name_of(1).hex() + ".row")
        os.symlink(target, link)
        with pytest.raises(TierUnavailable):
            fs.read_frame(name_of(1))
        frame = _write(fs, 1)
        assert target.read_bytes() == b"not a row" and not link.is_symlink()
        assert fs.read_frame(name_of(1)) == frame
    finally:
        fs.close()


def test_dirstore_open_removes_a_write_cut_short(tmp_path: Path) -> None:
    (tmp_path / ".tmp-0123").write_bytes(b"half a row")
    fs = DirFrameStore(tmp_path, 1 << 20, sync=False)
    try:
        assert not (tmp_path / ".tmp-0123").exists() and fs.names() == []
    finally:
        fs.close()


def test_remote_unknown_scheme_is_a_config_error_naming_the_known_ones() -> None:
    config = BankConfig(host_bytes=1 << 20, remote_url="nope://x", remote_bytes=1 << 20)
    with pytest.raises(ConfigError) as err:
        open_remote(config, [])
    assert "'nope'" in str(err.value) and "'dir'" in str(err.value)
    assert "'redis'" in str(err.value) and {"dir", "redis", "rediss"} <= set(remote_schemes())


def test_remote_dir_scheme_store_spills_disk_evictions_and_serves_them(
        make_store: MakeStore, tmp_path: Path) -> None:
    """A TieredStore configured with ``dir://`` as its remote tier (no change to the
    store): rows the disk evicts land there and a read of one answers its exact bytes;
    a row never stored is still a miss."""
    pages = [np.random.default_rng(i).bytes(P) for i in range(80)]  # incompressible
    s = make_store(host_bytes=32 * 1024, disk_bytes=96 * 1024,
                   remote_url=f"dir://{tmp_path / 'remote'}", remote_bytes=1 << 20)
    assert s.has_remote
    for i, page in enumerate(pages):
        s.put(name_of(i), page)
    s.flush()
    assert s.stats().tier(TierKind.DISK).evictions > 0
    assert s.remote_has([name_of(0), name_of(999)]) == [True, False]
    assert any(p.name.endswith(".row") for p in (tmp_path / "remote").iterdir())
    out = bytearray(P)
    assert s.get_into(name_of(0), out) == P and bytes(out) == pages[0]
    assert s.get_into(name_of(999), out) is None
    assert not [n for n in s.health().notes if n.startswith("remote")]
    st = s.stats()  # the remote answer is a hit of the store, a miss of every local tier
    assert (st.gets, st.hits, st.misses, st.remote_hits) == (2, 1, 1, 1)
    assert_counters_agree(st)
