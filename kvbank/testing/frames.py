"""The conformance suite every :class:`~kvbank.tiers.base.FrameStore` passes.

Subclass :class:`FrameStoreTests`, name it ``Test…`` and implement :meth:`make_frames`
(a fresh store with this budget) and :meth:`reopen` (close, open the same storage)::

    class TestDiskFrames(FrameStoreTests):
        def make_frames(self, budget): return DiskTier(self.dir, budget, sync=False)
        def reopen(self, fs): fs.close(); return DiskTier(self.dir, self.budget, sync=False)

Checked: a frame written is read back as stored and decodes to the page; a miss is
``None``; ``expect`` guards sizes; a batch write (``write_frames``: every row, write
clocks upward from ``seq``, ``replace``); a lookup of many rows (``contains_many``);
``health``; delete, scan by prefix (with metadata), budget (``TierFull``, exact
``used_bytes``), restart, ``check``, close.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

import pytest

from kvbank.codec import decode_into
from kvbank.errors import PageSizeMismatch, TierFull, TierUnavailable
from kvbank.tiers.base import FrameHealth, FrameStore, FrameWrite

from .tiers import name_of, page_of


class FrameStoreTests(abc.ABC):
    budget = 256 * 1024
    page_size = 4096

    @abc.abstractmethod
    def make_frames(self, budget: int) -> FrameStore:
        """A fresh, empty frame store with this byte budget."""

    @abc.abstractmethod
    def reopen(self, fs: FrameStore) -> FrameStore:
        """Close ``fs`` and open the same storage again."""

    @pytest.fixture
    def fs(self) -> Iterator[FrameStore]:
        f = self.make_frames(self.budget)
        try:
            yield f
        finally:
            f.close()

    def _write(self, fs: FrameStore, i: int, parent: bytes | None = None) -> bytes:
        frame = fs.frame(page_of(i, self.page_size), "uint8")
        fs.write_frame(name_of(i), frame, raw_len=self.page_size, dtype="uint8", parent=parent)
        return frame

    def test_frames_write_then_read_frame_and_decode(self, fs: FrameStore) -> None:
        frame = self._write(fs, 1)
        assert fs.read_frame(name_of(1)) == frame
        out = bytearray(self.page_size)
        assert decode_into(frame, out) == self.page_size and bytes(out) == page_of(1, self.page_size)
        out2 = bytearray(self.page_size)
        assert fs.read_into(name_of(1), out2) == self.page_size
        assert bytes(out2) == page_of(1, self.page_size)

    def test_frames_miss_is_none(self, fs: FrameStore) -> None:
        assert fs.read_frame(name_of(9)) is None
        assert fs.read_into(name_of(9), bytearray(self.page_size)) is None
        self._write(fs, 1)
        assert fs.read_into(name_of(1), bytearray(self.page_size), expect=5) is None

    def test_frames_delete_and_used_bytes_are_exact(self, fs: FrameStore) -> None:
        frames = [self._write(fs, i) for i in range(3)]
        assert fs.used_bytes == sum(map(len, frames))
        assert fs.delete_many([name_of(0), name_of(7)]) == [True, False]
        assert fs.used_bytes == sum(map(len, frames[1:]))
        assert fs.read_frame(name_of(0)) is None
        fs.check()

    def test_frames_scan_by_prefix_lists_metadata(self, fs: FrameStore) -> None:
        self._write(fs, 1)
        self._write(fs, 2, parent=name_of(1))
        other = (b"z" + (5).to_bytes(8, "big")).rjust(54, b"\x01")
        fs.write_frame(other, fs.frame(b"abc", "uint8"), raw_len=3, dtype="uint8")
        rows = {r.name: r for r in fs.scan()}
        assert set(rows) == {name_of(1), name_of(2), other}
        assert rows[name_of(2)].parent == name_of(1) and rows[name_of(2)].raw_len == self.page_size
        assert rows[name_of(1)].seq < rows[name_of(2)].seq
        assert {r.name for r in fs.scan(b"\x01")} == {other}
        assert fs.names() and set(fs.names()) == set(rows)

    def test_frames_write_frames_writes_every_row_with_its_clock(self, fs: FrameStore) -> None:
        pages = [page_of(i, self.page_size) for i in range(3)]
        rows = [FrameWrite(name_of(i), fs.frame(p, "uint8"), self.page_size, "uint8",
                           name_of(i - 1) if i else None) for i, p in enumerate(pages)]
        fs.write_frames(rows, seq=100)
        for i, r in enumerate(rows):
            assert fs.read_frame(name_of(i)) == r.frame
        assert [(r.name, r.seq, r.parent) for r in fs.scan()] == [
            (name_of(0), 100, None), (name_of(1), 101, name_of(0)), (name_of(2), 102, name_of(1))]
        assert fs.used_bytes == sum(len(r.frame) for r in rows)
        fs.write_frames([])
        fs.check()

    def test_frames_write_frames_replace_allows_another_size(self, fs: FrameStore) -> None:
        self._write(fs, 1)
        small = fs.frame(b"abc", "uint8")
        with pytest.raises(PageSizeMismatch):
            fs.write_frames([FrameWrite(name_of(1), small, 3, "uint8")])
        fs.write_frames([FrameWrite(name_of(1), small, 3, "uint8")], replace=True)
        assert fs.read_frame(name_of(1)) == small and fs.used_bytes == len(small)
        fs.check()

    def test_frames_contains_many_is_a_lookup(self, fs: FrameStore) -> None:
        self._write(fs, 1)
        self._write(fs, 2)
        used = fs.used_bytes
        assert fs.contains_many([name_of(1), name_of(9), name_of(2)]) == [True, False, True]
        assert fs.contains_many([]) == []
        fs.delete_many([name_of(1)])
        assert fs.contains_many([name_of(1), name_of(2)]) == [False, True]
        assert fs.used_bytes < used

    def test_frames_health_says_bytes_and_faults(self, fs: FrameStore) -> None:
        frame = self._write(fs, 1)
        health = fs.health()
        assert isinstance(health, FrameHealth)
        assert (health.used_bytes, health.budget_bytes) == (len(frame), fs.budget_bytes)
        assert (health.corrupt_rows, health.failed_writes, health.last_error) == (0, 0, None)

    def test_frames_budget_is_typed(self, fs: FrameStore) -> None:
        with pytest.raises(TierFull):
            for i in range(self.budget // self.page_size + 2):
                self._write(fs, i)
        assert fs.used_bytes <= fs.budget_bytes
        fs.check()

    def test_frames_survive_a_restart(self, fs: FrameStore) -> None:
        frame = self._write(fs, 1)
        again = self.reopen(fs)
        try:
            assert again.read_frame(name_of(1)) == frame
            assert [r.name for r in again.scan()] == [name_of(1)]
        finally:
            again.close()

    def test_frames_closed_is_unavailable(self) -> None:
        f = self.make_frames(self.budget)
        f.close()
        f.close()
        with pytest.raises(TierUnavailable):
            f.read_frame(name_of(1))
        with pytest.raises(TierUnavailable):
            f.contains_many([name_of(1)])
