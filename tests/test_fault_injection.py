"""Raw library errors injected under the public surface: only KvbankError escapes.

LMDB is wrapped at the one place the disk tier opens it (``lmdb.open`` in
:mod:`kvbank.tiers.disk`): once armed, every transaction raises a raw ``lmdb.Error`` or
``OSError`` (EIO), as a failing disk would. Each public entry point of the disk tier, of
the store and of the bank that reaches the disk is called, and the error must be a
:class:`KvbankError` subclass (or a miss), never the library's own.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
import zstandard

from kvbank import Bank, BankConfig, Match, full_attention, hybrid_mamba
from kvbank.bank.admin import BankAdmin
from kvbank.bank.fleet import BankFleet
from kvbank.codec import entropy
from kvbank.config import WritePolicy
from kvbank.errors import KvbankError
from kvbank.keys import Scope
from kvbank.layout import GroupKind
from kvbank.lender.base import LeaseMode, MemoryKind
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.device import DevicePool
from kvbank.tiers.disk import DiskTier, FrameWrite
from kvbank.tiers.host import HostSlab
from kvbank.tiers.store.store import TieredStore

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
    monkeypatch.setattr(lmdb, "open", lambda *a, **k: _Env(real_open(*a, **k)))
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
    "contains_many": lambda t: t.contains_many([name_of(0)]),
    "health": lambda t: t.health(),
    "names": lambda t: t.names(),
    "scan": lambda t: list(t.scan()),
    "drop_corrupt": lambda t: t.drop_corrupt(name_of(0)),
    "frame": lambda t: t.frame(page_of(3, P), "uint8"),
    "write_frames": lambda t: t.write_frames([FrameWrite(name_of(4), t.frame(page_of(4, P), "uint8"),
                                                         P, "uint8")]),
    "put_many": lambda t: t.put_many([(name_of(5), page_of(5, P))]),
    "get_many_into": lambda t: t.get_many_into([name_of(0)], [bytearray(P)]),
    "check": lambda t: t.check(),
    "compact": lambda t: t.compact(),
    "close": lambda t: t.close(),
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


@pytest.mark.parametrize("library", ["zstd", "os"])
def test_disk_tier_entry_points_under_a_failing_codec_or_file_system(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, armed: type[_Armed],
        library: str) -> None:
    tier = DiskTier(tmp_path, 1 << 22, sync=False)
    faults = _Faults(monkeypatch, armed)
    try:
        tier.put(name_of(0), page_of(0, P))
        list(tier.scan())
        faults.arm(library)
        raised, leaked = _leaks({n: functools.partial(f, tier) for n, f in DISK_CALLS.items()})
    finally:
        faults.disarm()
        tier.close()
    assert not leaked, leaked
    assert "put" in raised, raised


def test_disk_tier_table_covers_every_public_method() -> None:
    assert set(DISK_CALLS) == _public(DiskTier)


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
                     disk_sync=False, write_policy=WritePolicy.WRITE_THROUGH, dirty_expire_s=0)
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


# -- every public entry point, four libraries ---------------------------------------------
#
# One bank with every tier (a device pool on the CPU, a host slab, a disk tier written
# through) is filled unarmed, then one library is made to fail and every public method of
# the Bank (bank.admin's and bank.fleet's too), of its TieredStore and of each tier is
# called. The method lists come from introspection: a public method added without an
# entry here fails the coverage checks.

MAMBA = hybrid_mamba("inject-state@1", [0], [1], 2, 32, conv_shape=(64, 3), ssm_shape=(4, 16))
STATE_PAGE = MAMBA.group_page_bytes[1]
OTHER = [t + 7000 for t in TOKENS]


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")
            and inspect.isfunction(inspect.getattr_static(cls, n))}


class _Faults:
    """Arms one library's failure: raw ``lmdb.Error`` or ``OSError(EIO)`` from every LMDB
    transaction (the latter from ``posix_fallocate`` and the segment files' ``pwritev``,
    ``preadv`` and ``fdatasync`` too), ``zstandard.ZstdError`` from
    every compress and decompress, a CUDA-style ``RuntimeError`` from every tensor copy."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, armed: type[_Armed]) -> None:
        self.mp = monkeypatch
        self.armed = armed

    def arm(self, library: str) -> None:
        if library == "lmdb":
            self.armed.exc = lmdb.Error("injected")
        elif library == "os":
            self.armed.exc = OSError(errno.EIO, "injected")

            def fallocate(*_: object) -> None:
                raise OSError(errno.EIO, "injected")
            self.mp.setattr(os, "posix_fallocate", fallocate)
            for io in ("pwritev", "preadv", "fdatasync"):  # the disk tier's segment files
                self.mp.setattr(os, io, fallocate)
        elif library == "zstd":
            def zstd_fails(*_: object, **__: object) -> Any:
                raise zstandard.ZstdError("injected")

            class _Compressor:
                compress = staticmethod(zstd_fails)
            self.mp.setattr(entropy, "compressor", lambda *a, **k: _Compressor())
            self.mp.setattr(zstandard, "frame_content_size", zstd_fails)
        elif library == "torch":
            def copy_fails(self: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
                raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
            self.mp.setattr(torch.Tensor, "copy_", copy_fails)
        else:  # pragma: no cover - a typo in the parameter list
            raise AssertionError(library)

    def disarm(self) -> None:
        self.armed.exc = None
        self.mp.undo()


@dataclass
class _Ctx:
    bank: Bank
    lid: bytes
    mid: bytes
    names: list[bytes]
    state_names: list[bytes]
    read_lease: str
    dev_lease: str
    write_lease: str
    fresh: list[bytes]
    match: Match


def _filled_bank(tmp_path: Path) -> _Ctx:
    cfg = BankConfig(data_dir=tmp_path, host_bytes=64 * 1024, device="cpu",
                     device_bytes=32 * 1024, disk_sync=False, write_policy=WritePolicy.WRITE_THROUGH,
                     dirty_expire_s=0, copy_threads=1)
    bank = Bank(cfg, reaper=False)
    lid, mid = bank.register(FA), bank.register(MAMBA)
    pages = torch.ones((4, PAGE), dtype=torch.uint8)
    names = bank.put(lid, TOKENS, group=0, pages=pages)
    for k in range(1, 4):  # pushes the first rows out of memory, onto the disk
        bank.put(lid, [t + 1000 * k for t in TOKENS], group=0, pages=pages)
    state_names = bank.put_states(mid, TOKENS, group=1, at=[MAMBA.tokens_per_page],
                                  states=torch.zeros((1, STATE_PAGE), dtype=torch.uint8))
    bank.flush()
    fresh = bank.row_names(lid, [t + 9000 for t in TOKENS], group=0)
    return _Ctx(bank, lid, mid, names, state_names,
                read_lease=bank.lend(names[2:4]).id,
                dev_lease=bank.lend(names[2:3], kind=MemoryKind.DEVICE).id,
                write_lease=bank.lend(fresh[:2], mode=LeaseMode.WRITE).id,
                fresh=fresh, match=bank.match(lid, TOKENS))


def _bank_entry_points(c: _Ctx) -> dict[str, Callable[[], object]]:
    """Every public method of the Bank, of ``bank.admin`` (keys ``admin.*``) and of
    ``bank.fleet`` (``fleet.*``) with real arguments, destructive ones last."""
    b, n = c.bank, c.names
    pages = torch.full((4, PAGE), 3, dtype=torch.uint8)
    pool = FA.views(torch.full((8, PAGE), 5, dtype=torch.uint8), 0)
    keys = [bytes([7, i]) * 8 for i in range(2)]  # an engine's 16-byte page keys
    return {
        "register": lambda: b.register(FA),
        "register_scope": lambda: b.register_scope(c.lid, Scope(tenant="t")),
        "layout": lambda: b.layout(c.lid),
        "admin.layouts": b.admin.layouts,
        "row_names": lambda: b.row_names(c.lid, TOKENS, group=0),
        "admin.prefixes": lambda: b.admin.prefixes(c.lid),
        "match": lambda: b.match(c.lid, TOKENS),
        "resume_at": lambda: b.resume_at(c.match, 0),
        "presence": lambda: b.presence(c.lid, TOKENS),
        "locate": lambda: b.locate(n),
        "out_buffers": lambda: b.out_buffers(c.match),
        "fetch": lambda: b.fetch(c.match, out=b.out_buffers(c.match)),
        "fetch_prefix": lambda: b.fetch_prefix(c.lid, TOKENS),
        "reshard_rows": lambda: b.reshard_rows(c.match),
        "fleet.as_if_held": lambda: b.fleet.as_if_held(c.match),
        "fleet.recall_remote": lambda: b.fleet.recall_remote(c.match),
        "fleet.count_served": lambda: b.fleet.count_served(b.locate(n)),
        "fleet.layout_ids": b.fleet.layout_ids,
        "fleet.held_names": lambda: list(b.fleet.held_names()),
        "fleet.put_rows": lambda: b.fleet.put_rows(c.lid, [(n[0], bytes(PAGE))]),
        "fetches": b.fetches,
        "get_into": lambda: b.get_into(n[0], bytearray(PAGE)),
        "admin.read_frame": lambda: b.admin.read_frame(n[0]),
        "admin.compact_disk": lambda: b.admin.compact_disk(),
        "admin.rows": lambda: b.admin.rows(c.lid),
        "admin.count": lambda: b.admin.count(n[0][:8]),
        "leases": b.leases,
        "lend": lambda: b.lend(n[:2]),
        "lend_all": lambda: b.lend_all(),
        "view": lambda: b.view(c.read_lease, n[2]).tobytes(),
        "checksums": lambda: b.checksums(c.read_lease),
        "device_view": lambda: b.device_view(c.dev_lease, n[2]).sum(),
        "read": lambda: b.read(c.read_lease, n[2]),
        "read_into": lambda: b.read_into(c.dev_lease, n[2], bytearray(PAGE)),
        "check_live": lambda: b.check_live(c.read_lease),
        "renew": lambda: b.renew(c.read_lease, 5),
        "write": lambda: b.write(c.write_lease, c.fresh[0], bytes(PAGE)),
        "commit": lambda: b.commit(c.write_lease, c.fresh[:2]),
        "commit_summed": lambda: b.commit_summed(b.lend(c.fresh[2:4], mode=LeaseMode.WRITE).id, c.fresh[2:4],
                                                 {c.fresh[2]: 1}),  # a lease of its own
        "release": lambda: b.release(c.read_lease),
        "put": lambda: b.put(c.lid, OTHER, group=0, pages=pages),
        "put_state": lambda: b.put_state(c.mid, OTHER, group=1,
                                         state=torch.ones(STATE_PAGE, dtype=torch.uint8)),
        "put_states": lambda: b.put_states(c.mid, [t + 1 for t in OTHER], group=1,
                                           at=[MAMBA.tokens_per_page],
                                           states=torch.ones((1, STATE_PAGE), dtype=torch.uint8)),
        "lend_put": lambda: b.lend_put(c.lid, [t + 2 for t in OTHER], group=0,
                                       group_kind=GroupKind.ATTENTION, count=1),
        "admin.touch": lambda: b.admin.touch(n),
        "admin.pin": lambda: b.admin.pin(n[:1]),
        "admin.unpin": lambda: b.admin.unpin(n[:1]),
        "admin.take_events": b.admin.take_events,
        "stats": b.stats,
        "health": b.health,
        "flush": lambda: b.flush(timeout_s=2),  # a hang bound: a failing mover gives up
        "check_invariants": b.check_invariants,
        # the engine calls (kvbank.bank.engine): a pool of 8 blocks viewed as the layout's
        "put_from": lambda: b.put_from(c.lid, pool=pool, block_ids={0: [0, 1]}, keys=keys),
        "lend_put_groups": lambda: b.lend_put_groups(c.lid, pages={0: [0, 1]}, keys=keys[::-1]),
        "match_with": lambda: b.match_with(None),
        "match_many": lambda: b.match_many(c.lid, [keys], hold=True),
        "held": lambda: b.held("no-such-handle"),
        "release_match": lambda: b.release_match("no-such-handle"),
        "load_match": lambda: b.load_match(c.match),
        "lend_load": lambda: b.lend_load(c.match),
        "fetch_into": lambda: b.fetch_into(c.match, pool=pool, block_ids={0: [4, 5, 6, 7]}),
        "admin.evict": lambda: b.admin.evict(n[:1]),
        "admin.evict_rows": lambda: b.admin.evict_rows(c.lid),
        "admin.unregister": lambda: b.admin.unregister(c.lid),
        "close": b.close,
    }


def _store_entry_points(s: TieredStore, names: list[bytes]) -> dict[str, Callable[[], object]]:
    page = bytes(PAGE)
    return {
        "locate": lambda: s.locate(names),
        "remote_has": lambda: s.remote_has(names),
        "residency": lambda: s.residency(names),
        "get_into": lambda: s.get_into(names[0], bytearray(PAGE)),
        "recall_into": lambda: s.recall_into(names[0], bytearray(PAGE)),
        "count_reads": lambda: s.count_reads(s.locate(names)),
        "get_many_into": lambda: s.get_many_into(names, [bytearray(PAGE) for _ in names]),
        "read_frame": lambda: s.read_frame(names[0]),
        "compact_disk": lambda: s.compact_disk(),
        "count": lambda: s.count(names[0][:8]),
        "scan": lambda: s.scan(b"", limit=10),
        "put": lambda: s.put(name_of(901), page),
        "put_many": lambda: s.put_many([(name_of(902), memoryview(page), None)]),
        "refuses": lambda: s.refuses(PAGE),
        "touch": lambda: s.touch(names),
        "pin": lambda: s.pin(names[:1]),
        "unpin": lambda: s.unpin(names[:1]),
        "take_events": s.take_events,
        "stats": s.stats,
        "health": s.health,
        "note": lambda: s.note("disk tier: a note"),
        "flush": lambda: s.flush(2),
        "check_invariants": s.check_invariants,
        "delete": lambda: s.delete(names[1]),
        "evict": lambda: s.evict(names[:1]),
        "close": s.close,
    }


LIBRARIES = ["lmdb", "os", "zstd", "torch"]


def _leaks(calls: dict[str, Callable[[], object]]) -> tuple[list[str], list[str]]:
    """(calls that raised a KvbankError, calls that leaked anything else)."""
    raised, leaked = [], []
    for name, call in calls.items():
        try:
            call()
        except KvbankError:
            raised.append(name)
        except Exception as exc:  # the leak these tests exist to catch
            leaked.append(f"{name}: {type(exc).__module__}.{type(exc).__name__}: {exc}")
    return raised, leaked


def test_fault_injection_bank_table_covers_every_public_method(tmp_path: Path) -> None:
    c = _filled_bank(tmp_path)
    try:
        assert set(_bank_entry_points(c)) == (_public(Bank) - {"open"}
                                              | {f"admin.{n}" for n in _public(BankAdmin)}
                                              | {f"fleet.{n}" for n in _public(BankFleet)})
        assert set(_store_entry_points(TieredStore.__new__(TieredStore), c.names)) \
            == _public(TieredStore)
    finally:
        c.bank.close()


@pytest.mark.parametrize("library", LIBRARIES)
def test_fault_injection_every_bank_entry_point_raises_only_kvbank_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, armed: type[_Armed],
        library: str) -> None:
    """A failing LMDB, file system, zstd or torch under every public Bank method: each
    call answers, misses or raises a KvbankError; no raw library error escapes."""
    faults = _Faults(monkeypatch, armed)
    c = _filled_bank(tmp_path)
    try:
        faults.arm(library)
        raised, leaked = _leaks(_bank_entry_points(c))
    finally:
        faults.disarm()
        c.bank.close()
    assert not leaked, leaked
    reached = {"lmdb": "put", "os": "put", "zstd": "put", "torch": "read_into"}[library]
    assert reached in raised, raised  # the injection reached the library


@pytest.mark.parametrize("library", LIBRARIES)
def test_fault_injection_every_store_entry_point_raises_only_kvbank_errors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, armed: type[_Armed],
        library: str) -> None:
    faults = _Faults(monkeypatch, armed)
    cfg = BankConfig(data_dir=tmp_path, host_bytes=32 * 1024, device="cpu",
                     device_bytes=16 * 1024, disk_sync=False, write_policy=WritePolicy.WRITE_THROUGH,
                     copy_threads=1)
    s = TieredStore(cfg)
    names = [name_of(i) for i in range(12)]
    try:
        for i, name in enumerate(names):
            s.put(name, page_of(i, PAGE))
        s.flush()
        faults.arm(library)
        raised, leaked = _leaks(_store_entry_points(s, names))
    finally:
        faults.disarm()
        s.close()
    assert not leaked, leaked
    assert raised, "the injection reached no store call"


@pytest.mark.parametrize("library", LIBRARIES)
def test_fault_injection_memory_pools_raise_only_kvbank_errors(
        monkeypatch: pytest.MonkeyPatch, armed: type[_Armed], library: str) -> None:
    """The host slab and the device pool: every public method under a failing OS / torch."""
    faults = _Faults(monkeypatch, armed)
    host, dev = HostSlab(1 << 20, pin=False), DevicePool(1 << 20, "cpu")
    try:
        hoff, doff = host.alloc(PAGE), dev.alloc(PAGE)
        assert hoff is not None and doff is not None
        faults.arm(library)
        def pool_calls(p: HostSlab | DevicePool, o: int) -> dict[str, Callable[[], object]]:
            kind = type(p).__name__
            return {
                f"{kind}.alloc": lambda: p.alloc(64 * 1024),  # a new chunk
                f"{kind}.write": lambda: p.write(o, memoryview(bytes(PAGE))),
                f"{kind}.read_into": lambda: p.read_into(o, PAGE, memoryview(bytearray(PAGE))),
                f"{kind}.slot": lambda: p.slot(o, PAGE),
                f"{kind}.capacity": lambda: p.capacity(o),
                f"{kind}.fits": lambda: p.fits(PAGE),
                f"{kind}.free": lambda: p.free(o),
            }

        calls = {**pool_calls(host, hoff), **pool_calls(dev, doff)}
        calls |= {
            "HostSlab.view": lambda: host.view(hoff, PAGE).release(),
            "HostSlab.numpy": lambda: host.numpy().sum(),
            "HostSlab.prefault": lambda: host.prefault(0, 128 * 1024),
            "DevicePool.tensor": lambda: dev.tensor(doff, PAGE).sum(),
            "DevicePool.offset_of": lambda: dev.offset_of(dev.slot(doff, PAGE)),
        }
        calls |= {"HostSlab.close": host.close, "DevicePool.close": dev.close}
        assert {c.partition(".")[2] for c in calls if c.startswith("HostSlab")} == _public(HostSlab)
        assert {c.partition(".")[2] for c in calls if c.startswith("DevicePool")} == _public(DevicePool)
        raised, leaked = _leaks(calls)
    finally:
        faults.disarm()
        host.close()
        dev.close()
    assert not leaked, leaked
    if library == "os":
        assert "HostSlab.alloc" in raised, raised
    if library == "torch":
        assert "DevicePool.read_into" in raised, raised


def test_fault_injection_zstd_failing_under_the_mover_degrades_the_disk_not_the_mover(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, armed: type[_Armed]) -> None:
    """Write-back: demotions encode on the mover's workers. A compress that fails there is
    a CodecError (a TierError): the disk tier shows degraded, the mover keeps running, the
    rows stay readable from memory, and nothing leaks."""
    faults = _Faults(monkeypatch, armed)
    s = TieredStore(BankConfig(data_dir=tmp_path, host_bytes=32 * 1024, device_bytes=0,
                               disk_sync=False, write_policy=WritePolicy.WRITE_BACK, copy_threads=1,
                               wait_timeout_s=0.5))
    try:
        faults.arm("zstd")
        for i in range(6):  # more than the host holds: the mover must demote
            with contextlib.suppress(KvbankError):  # no room while demotions fail: typed
                s.put(name_of(i), page_of(i, PAGE))
        with contextlib.suppress(KvbankError):  # no watermark met while the codec fails
            s.flush(2)
        health = s.health()
        assert health.mover_running, health
        assert not health.ok, health
        out = bytearray(PAGE)
        assert s.get_into(name_of(0), out) in (None, PAGE)
        faults.disarm()
        s.flush(30)  # the codec works again: the mover catches up (a hang bound)
        s.check_invariants()
    finally:
        faults.disarm()
        s.close()
