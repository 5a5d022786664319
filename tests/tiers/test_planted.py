"""Guarantees that planted bugs used to slip past (issue 9), each tested directly.

- a disk row is whole in both LMDB databases or in neither, even when the write fails
  between the frame and the meta record;
- at open, a frame with no meta record is dropped and counted, and ``used_bytes`` is
  exact;
- a row a lease locks while a put is copying into its new slot is never overwritten
  (the copy held at the Copier seam: deterministic, no timing).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import lmdb
import pytest

from kvbank.errors import RowLocked, TierUnavailable
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.base import TierKind
from kvbank.tiers.disk import DiskTier
from kvbank.tiers.store.store import Copier

from .conftest import MakeStore

P = 4096


class _FailingMetaTxn:
    """A write transaction that fails on the meta put, after the frame put went in."""

    def __init__(self, txn: Any, meta_db: Any) -> None:
        self._txn, self._meta = txn, meta_db

    def __enter__(self) -> _FailingMetaTxn:
        self._txn.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._txn.__exit__(*exc)

    def put(self, key: bytes, value: bytes, *, db: Any = None) -> bool:
        if db is self._meta:
            raise lmdb.DiskError("injected: the disk failed between frame and meta")
        return bool(self._txn.put(key, value, db=db))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)


class _Env:
    def __init__(self, env: lmdb.Environment, meta_db: Any) -> None:
        self._env, self._meta = env, meta_db

    def begin(self, *args: Any, **kw: Any) -> Any:
        txn = self._env.begin(*args, **kw)
        return _FailingMetaTxn(txn, self._meta) if kw.get("write") else txn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def test_a_disk_row_is_whole_in_both_databases_or_in_neither(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 22, sync=False)
    try:
        tier.put(name_of(0), page_of(0, P))
        used, on_disk = tier.used_bytes, tier.file_bytes
        real = tier._env  # the seam: LMDB's own handle, wrapped to fail mid-transaction
        tier._env = _Env(real, tier._meta)  # type: ignore[assignment]
        with pytest.raises(TierUnavailable, match="injected"):
            tier.put(name_of(1), page_of(1, P))
        tier._env = real
        assert tier.contains([name_of(0), name_of(1)]) == [True, False]
        assert tier.read_frame(name_of(1)) is None
        assert tier.used_bytes == used
        assert tier.file_bytes == on_disk  # the frame appended first is cut off again
        tier.check()  # frames and meta hold the same names
    finally:
        tier.close()


@pytest.mark.parametrize("segments", [True, False], ids=["segments", "older-layout"])
def test_a_frame_with_no_meta_record_is_dropped_at_open_and_used_bytes_stay_exact(
        tmp_path: Path, segments: bool) -> None:
    """A frame nothing in the index names is not a row: in a segment it is dead bytes
    (what a crash between append and index commit leaves); as an older-layout value it
    is dropped and counted."""
    tier = DiskTier(tmp_path, 1 << 22, sync=False, segments=segments)
    for i in range(4):
        tier.put(name_of(i), page_of(i, P))
    keep = sum(len(tier.read_frame(name_of(i)) or b"") for i in (0, 1, 3))
    tier.close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=2, subdir=True)
    with env.begin(write=True) as txn:
        assert txn.delete(name_of(2), db=env.open_db(b"meta", txn=txn))
    env.close()
    again = DiskTier(tmp_path, 1 << 22, sync=False)
    try:
        assert again.corrupt_rows == (0 if segments else 1)
        assert again.used_bytes == keep
        assert again.contains([name_of(i) for i in range(4)]) == [True, True, False, True]
        again.check()
    finally:
        again.close()


def test_a_row_locked_while_a_put_copies_is_never_overwritten(make_store: MakeStore) -> None:
    entered, gate = threading.Event(), threading.Event()

    class HeldFill(Copier):
        def fill(self, pool, off, src):
            if bytes(src[:8]) == page_of(1, P)[:8]:
                entered.set()
                assert gate.wait(60)
            super().fill(pool, off, src)

    store = make_store(host_bytes=1 << 20, disk_bytes=1 << 22, copier=HeldFill())
    name = name_of(0)
    store.put(name, page_of(0, P))
    errors: list[BaseException] = []

    def overwrite() -> None:
        try:
            store.put(name, page_of(1, P))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=overwrite)
    t.start()
    try:
        assert entered.wait(60), "the put never reached its copy"
        store.locks.lock([name], "lease-reader")
    finally:
        gate.set()
    t.join(60)
    assert len(errors) == 1 and isinstance(errors[0], RowLocked)
    out = bytearray(P)
    assert store.get_into(name, out) == P and bytes(out) == page_of(0, P)
    assert TierKind.HOST in store.residency([name])[0]
    store.locks.unlock([name], "lease-reader")
