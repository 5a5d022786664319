"""Raw library errors injected under the public surface: only KvbankError escapes.

LMDB is wrapped at the one place the disk tier opens it (``lmdb.open`` in
:mod:`kvbank.tiers.disk`): once armed, every transaction raises a raw ``lmdb.Error`` or
``OSError`` (EIO), as a failing disk would. Each public entry point of the disk tier, of
the store and of the bank that reaches the disk is called, and the error must be a
:class:`KvbankError` subclass (or a miss), never the library's own.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch

from kvbank import Bank, BankConfig, full_attention
from kvbank.errors import KvbankError
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers import disk as disk_module
from kvbank.tiers.disk import DiskTier
from kvbank.tiers.store import TieredStore

P = 4096
RAW_ERRORS: list[BaseException] = [lmdb.Error("injected"), lmdb.CorruptedError("injected"),
                                   lmdb.MapFullError("injected"), OSError(errno.EIO, "injected")]


class _Armed:
    exc: BaseException | None = None


class _Env:
    """LMDB's environment, raising ``_Armed.exc`` from every transaction once armed."""

    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env

    def begin(self, *args: Any, **kw: Any) -> Any:
        if _Armed.exc is not None:
            raise _Armed.exc
        return self._env.begin(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


@pytest.fixture
def armed(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Armed]]:
    real_open = lmdb.open
    monkeypatch.setattr(disk_module.lmdb, "open", lambda *a, **k: _Env(real_open(*a, **k)))
    _Armed.exc = None
    yield _Armed
    _Armed.exc = None


def _only_kvbank_errors(call: Callable[[], object]) -> bool:
    """Whether ``call`` raised (a KvbankError; anything else fails the test)."""
    try:
        call()
    except KvbankError:
        return True
    except AssertionError:
        raise
    except Exception as exc:  # the leak this test exists to catch
        pytest.fail(f"{type(exc).__module__}.{type(exc).__name__} escaped: {exc}")
    return False


DISK_CALLS: dict[str, Callable[[DiskTier], object]] = {
    "read_into": lambda t: t.read_into(name_of(0), bytearray(P)),
    "read_frame": lambda t: t.read_frame(name_of(0)),
    "get_into": lambda t: t.get_into(name_of(0), bytearray(P)),
    "put": lambda t: t.put(name_of(1), page_of(1, P)),
    "write_frame": lambda t: t.write_frame(name_of(2), t.frame(page_of(2, P), "uint8"),
                                           raw_len=P, dtype="uint8"),
    "delete": lambda t: t.delete(name_of(0)),
    "delete_many": lambda t: t.delete_many([name_of(0)]),
    "contains": lambda t: t.contains([name_of(0)]),
    "names": lambda t: t.names(),
    "scan": lambda t: list(t.scan()),
    "drop_corrupt": lambda t: t.drop_corrupt(name_of(0)),
}


@pytest.mark.parametrize("exc", RAW_ERRORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("call", sorted(DISK_CALLS))
def test_disk_tier_entry_points_map_raw_lmdb_errors(
        tmp_path: Path, armed: type[_Armed], call: str, exc: BaseException) -> None:
    tier = DiskTier(tmp_path, 1 << 22, sync=False)
    try:
        tier.put(name_of(0), page_of(0, P))
        list(tier.scan())  # the open's scan is spent: the next scan reads LMDB
        armed.exc = exc
        _only_kvbank_errors(lambda: DISK_CALLS[call](tier))
    finally:
        armed.exc = None
        tier.close()


@pytest.mark.parametrize("exc", RAW_ERRORS, ids=lambda e: type(e).__name__)
def test_disk_tier_open_maps_raw_lmdb_errors(
        tmp_path: Path, armed: type[_Armed], exc: BaseException) -> None:
    armed.exc = exc
    _only_kvbank_errors(lambda: DiskTier(tmp_path, 1 << 22, sync=False).close())
    armed.exc = None
    DiskTier(tmp_path, 1 << 22, sync=False).close()  # the failed open released the dir lock


FA = full_attention("inject@1", num_layers=1, num_kv_heads=2, head_dim=64)  # 8 KiB pages
PAGE = FA.group_page_bytes[0]
TOKENS = list(range(4 * FA.tokens_per_page))


def _bank_calls(bank: Bank, lid: bytes) -> dict[str, Callable[[], object]]:
    names = bank.row_names(lid, TOKENS, group=0)
    pages = torch.zeros((4, PAGE), dtype=torch.uint8)
    return {
        "put": lambda: bank.put(lid, [t + 9999 for t in TOKENS], group=0, pages=pages),
        "match+fetch": lambda: bank.fetch(bank.match(lid, TOKENS),
                                          out={0: torch.zeros((4, PAGE), dtype=torch.uint8)}),
        "lend+read": lambda: bank.read(bank.lend(names).id, names[0]),
        "lend_all": lambda: bank.lend_all(),
        "put_again": lambda: bank.put(lid, TOKENS, group=0, pages=pages),
        "flush": lambda: bank.flush(),
        "stats+health": lambda: (bank.stats(), bank.health()),
    }


@pytest.mark.parametrize("exc", RAW_ERRORS, ids=lambda e: type(e).__name__)
def test_bank_and_store_entry_points_over_a_failing_disk(
        tmp_path: Path, armed: type[_Armed], exc: BaseException) -> None:
    cfg = BankConfig(data_dir=tmp_path, host_bytes=64 * 1024, device_bytes=0,
                     disk_sync=False, write_policy="write-through", dirty_expire_s=0)
    bank = Bank(cfg)
    try:
        lid = bank.register(FA)
        bank.put(lid, TOKENS, group=0, pages=torch.ones((4, PAGE), dtype=torch.uint8))
        bank.put(lid, [t + 5000 for t in TOKENS], group=0,  # pushes the first rows to disk
                 pages=torch.ones((4, PAGE), dtype=torch.uint8))
        bank.flush()
        armed.exc = exc
        raised = []
        for name, call in _bank_calls(bank, lid).items():
            try:
                if _only_kvbank_errors(call):
                    raised.append(name)
            except BaseException as err:
                raise AssertionError(f"Bank.{name}: {err}") from err
        assert "put" in raised, raised  # the injection reached the disk
    finally:
        armed.exc = None
        bank.close()


def test_store_opened_over_a_failing_disk_is_a_kvbank_error(
        tmp_path: Path, armed: type[_Armed]) -> None:
    armed.exc = lmdb.Error("injected")
    _only_kvbank_errors(lambda: TieredStore(BankConfig(data_dir=tmp_path, device_bytes=0,
                                                       host_bytes=1 << 20)).close())
