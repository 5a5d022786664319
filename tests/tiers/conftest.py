"""Fixtures for the tier tests: a store factory that always closes what it opened."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbank.config import BankConfig
from kvbank.tiers import lockorder
from kvbank.tiers.store.store import TieredStore

# Every lock made by the tier tests checks the node's lock order on acquire.
lockorder.enable()

MakeStore = Callable[..., TieredStore]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[MakeStore]:
    """``make_store(**config)``: a TieredStore on ``tmp_path`` (device off unless asked;
    ``encode_workers=`` and ``copier=`` go to the store, the rest to its BankConfig),
    checked and closed at the end of the test."""
    opened: list[TieredStore] = []

    def make(**overrides: Any) -> TieredStore:
        fields: dict[str, Any] = {"data_dir": tmp_path / "data", "device_bytes": 0,
                                  "disk_sync": False}
        fields.update(overrides)
        workers = fields.pop("encode_workers", None)
        copier = fields.pop("copier", None)
        store = TieredStore(BankConfig(**fields), encode_workers=workers, copier=copier)
        opened.append(store)
        return store

    yield make
    for store in opened:
        if not store.closed:  # the test may have closed it to reopen the data dir
            store.flush()
            store.check_invariants()
        store.close()
