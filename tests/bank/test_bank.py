"""The embedded Bank end to end: put → match → fetch, partial fetches resumed through the
ledger, Mamba state restored with the attention KV, scopes, and refused input."""

from __future__ import annotations

import inspect
import threading

import numpy as np
import pytest
import torch

from kvbank import (
    Bank,
    BankConfig,
    LeaseMode,
    Scope,
    full_attention,
    hybrid_mamba,
    mla,
    sliding_window,
    wire,
)
from kvbank.errors import (
    Busy,
    ConfigError,
    InvalidInput,
    InvalidTokens,
    LeaseNotFound,
    PageSizeMismatch,
    TierUnavailable,
    UnknownLayout,
)
from kvbank.lender.resume import Obstacle
from kvbank.tiers.base import TierKind

FA = full_attention("bank@1", num_layers=2, num_kv_heads=4, head_dim=64)  # 16 tokens a page
P = FA.tokens_per_page
PAGE = FA.group_page_bytes[0]
MAMBA = hybrid_mamba("bank-mamba@1", [0, 2], [1], 2, 32, conv_shape=(64, 3), ssm_shape=(4, 16))
SWA = sliding_window("bank-swa@1", 2, 2, 32, window=32, sink_tokens=16)


def rand(n: int, size: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8))


@pytest.fixture
def bank():
    with Bank.open(BankConfig(), host_bytes="64M", device_bytes=0) as b:
        yield b


def test_put_match_fetch_round_trip(bank: Bank) -> None:
    lid = bank.register(FA)
    assert bank.register(FA) == lid == FA.layout_id  # idempotent
    tokens = list(range(100))  # 6 full pages; the partial 7th is never stored
    pages = rand(6, PAGE, 1)
    bank.put(lid, tokens, group=0, pages=pages)
    m = bank.match(lid, [*tokens, 7, 8, 9])
    assert m.resume.tokens == 96 and m.resume.reason is None
    assert m.resume.pages == (tuple(range(6)),)
    assert m.prompt_tokens == 103 and len(m.names[0]) == 6
    buf = torch.zeros(8, PAGE, dtype=torch.uint8)
    got = bank.fetch(m, out={0: buf})
    assert got.complete and got.resume.tokens == 96 and got.nbytes == 6 * PAGE
    assert torch.equal(buf[:6], pages) and not buf[6:].any()
    assert bank.stats().open_fetches == 0
    bank.check_invariants()


def test_partial_fetch_resumes_from_first_undelivered_row(bank: Bank) -> None:
    lid = bank.register(FA)
    tokens = list(range(97))
    pages = rand(6, PAGE, 2)
    names = bank.put(lid, tokens, group=0, pages=pages)
    m = bank.match(lid, tokens)
    buf = torch.zeros(6, PAGE, dtype=torch.uint8)

    first = bank.fetch(m, out={0: buf}, max_rows=3)  # the transfer breaks after 3 rows
    assert not first.complete and first.resume.tokens == 48
    assert first.delivered == ((0, 1, 2),) and first.missing == ((3, 4, 5),)

    assert bank.admin.evict([names[4]]).evicted == (names[4],)  # a row vanishes before the resumed call reaches it
    second = bank.fetch(m, out={0: buf}, fetch_id=first.fetch_id)
    assert second.fetch_id == first.fetch_id and second.nbytes == 2 * PAGE
    assert second.missing == ((4,),) and second.resume.tokens == 64  # a miss, never "loaded"
    assert second.resume.reason is Obstacle.MISSING_PAGE

    bank.put(lid, tokens, group=0, pages=pages[4:5], first_page=4)
    third = bank.fetch(m, out={0: buf}, fetch_id=first.fetch_id)
    assert third.complete and third.nbytes == PAGE and third.resume.tokens == 96
    assert torch.equal(buf, pages)
    with pytest.raises(InvalidInput, match="fetch_id"):
        other = bank.match(lid, tokens[:40])
        opened = bank.fetch(other, out={0: buf}, max_rows=0)
        bank.fetch(m, out={0: buf}, fetch_id=opened.fetch_id)


def test_state_snapshots_are_restored_with_the_attention_kv(bank: Bank) -> None:
    lid = bank.register(MAMBA)
    kv, st = MAMBA.group_page_bytes
    tokens = list(range(100))
    pages = rand(6, kv, 3)
    bank.put(lid, tokens, group=0, pages=pages)
    snap48, snap96 = rand(2, st, 4)
    bank.put_state(lid, tokens, group=1, state=snap48, at=48)
    bank.put_state(lid, tokens[:96], group=1, state=snap96.numpy().tobytes())  # at = 96

    m = bank.match(lid, tokens)
    assert m.resume.tokens == 96 and m.resume.pages == (tuple(range(6)), (5,))
    kv_out = torch.zeros(6, kv, dtype=torch.uint8)
    st_out = torch.zeros(1, st, dtype=torch.uint8)
    got = bank.fetch(m, out={0: kv_out, 1: st_out})
    assert got.complete and got.resume.tokens == 96
    assert torch.equal(kv_out, pages) and torch.equal(st_out[0], snap96)
    lease = bank.lend(m)  # snapshots are leased like pages
    assert lease.names[-1] == m.names[1][5]
    assert [r.layer for r in lease.rows[-1].regions] == [1, 1]  # conv + SSM state of layer 1
    assert bank.read(lease.id, m.names[1][5]) == snap96.numpy().tobytes()
    bank.release(lease.id)

    # the snapshot at 96 is gone: resume where one exists
    assert bank.admin.evict([m.names[1][5]]).evicted == (m.names[1][5],)
    m2 = bank.match(lid, tokens)
    assert m2.resume.tokens == 48 and m2.resume.pages == ((0, 1, 2), (2,))
    assert m2.resume.reason is Obstacle.NO_SNAPSHOT
    got2 = bank.fetch(m2, out={0: kv_out, 1: st_out})
    assert got2.resume.tokens == 48 and torch.equal(st_out[0], snap48)


def test_state_snapshot_without_its_kv_is_useless_after_a_partial_fetch(bank: Bank) -> None:
    lid = bank.register(MAMBA)
    kv, st = MAMBA.group_page_bytes
    tokens = list(range(65))
    bank.put(lid, tokens, group=0, pages=rand(4, kv, 5))
    bank.put_state(lid, tokens, group=1, state=rand(1, st, 6)[0])
    m = bank.match(lid, tokens)
    assert m.resume.tokens == 64
    got = bank.fetch(m, out={0: torch.zeros(4, kv, dtype=torch.uint8),
                              1: torch.zeros(1, st, dtype=torch.uint8)}, max_rows=3)
    assert got.resume.tokens == 0 and got.resume.reason is Obstacle.NO_SNAPSHOT


def test_sliding_window_fetches_only_sinks_and_window(bank: Bank) -> None:
    lid = bank.register(SWA)
    size = SWA.group_page_bytes[0]
    tokens = list(range(129))  # 8 pages; r = 128 needs the sink page and pages 6, 7
    pages = rand(8, size, 7)
    bank.put(lid, tokens, group=0, pages=pages[:1])
    bank.put(lid, tokens, group=0, pages=pages[6:], first_page=6)
    m = bank.match(lid, tokens)
    assert m.resume.tokens == 128 and m.resume.pages == ((0, 6, 7),)
    outs = [bytearray(size) for _ in range(3)]
    got = bank.fetch(m, out={0: [memoryview(o) for o in outs]})
    assert got.complete
    assert [bytes(o) for o in outs] == [pages[i].numpy().tobytes() for i in (0, 6, 7)]


def test_mla_untransferred_index_key_never_blocks(bank: Bank) -> None:
    layout = mla("bank-mla@1", 2, 64, tokens_per_page=16, index_key_dim=32)
    lid = bank.register(layout)
    tokens = list(range(40))
    bank.put(lid, tokens, group=0, pages=rand(2, layout.group_page_bytes[0], 8))
    assert bank.match(lid, tokens).resume.tokens == 32


def test_scopes_never_share_pages(bank: Bank) -> None:
    lid = bank.register(FA)
    tokens = list(range(64))
    bank.put(lid, tokens, group=0, pages=rand(4, PAGE, 9), scope=Scope(tenant="a"))
    assert bank.match(lid, tokens, scope=Scope(tenant="a")).resume.tokens == 48
    assert bank.match(lid, tokens, scope=Scope(tenant="b")).resume.tokens == 0
    assert bank.match(lid, tokens).resume.tokens == 0
    assert bank.match(lid, tokens, scope=Scope(tenant="a", lora="x")).resume.tokens == 0


def test_wrong_page_size_is_refused_and_nothing_is_stored(bank: Bank) -> None:
    lid = bank.register(FA)
    tokens = list(range(64))
    with pytest.raises(PageSizeMismatch, match="pages"):
        bank.put(lid, tokens, group=0, pages=rand(4, PAGE + 1, 1))
    good = [bytes(PAGE)] * 3
    with pytest.raises(PageSizeMismatch, match=r"pages\[3\]"):
        bank.put(lid, tokens, group=0, pages=[*good, bytes(PAGE - 1)])
    assert bank.stats().store.rows == 0
    lid2 = bank.register(MAMBA)
    with pytest.raises(PageSizeMismatch, match="state"):
        bank.put_state(lid2, tokens, group=1, state=b"\0" * 3)


def test_unknown_layout_is_refused(bank: Bank) -> None:
    bank.register(FA)
    other = full_attention("never-registered@1", 1, 1, 8)
    for call in (
        lambda: bank.match(other.layout_id, [1, 2, 3]),
        lambda: bank.put(other.layout_id, list(range(16)), group=0, pages=[bytes(8)]),
        lambda: bank.row_names(other.layout_id, [1], group=0),
        lambda: bank.layout(b"nope"),
    ):
        with pytest.raises(UnknownLayout, match="layout_id"):
            call()


def test_bad_input_names_the_field(bank: Bank) -> None:
    lid = bank.register(FA)
    mid = bank.register(MAMBA)
    tokens = list(range(64))
    cases = [
        (lambda: bank.register("layout"), InvalidInput, "layout"),  # type: ignore[arg-type]
        (lambda: bank.put(lid, tokens, group=1, pages=[bytes(PAGE)]), InvalidInput, "group"),
        (lambda: bank.put(mid, tokens, group=1, pages=[b""]), InvalidInput, "put_state"),
        (lambda: bank.put_state(mid, tokens, group=0, state=b""), InvalidInput, "group"),
        (lambda: bank.put_state(mid, tokens, group=1, state=bytes(MAMBA.group_page_bytes[1]),
                                at=20), InvalidInput, "at"),
        (lambda: bank.put(lid, [-1] * 16, group=0, pages=[bytes(PAGE)]), InvalidTokens, "tokens"),
        (lambda: bank.put(lid, tokens, keys=[b"k" * 32], group=0, pages=[]), InvalidInput, "tokens"),
        (lambda: bank.put(lid, tokens, group=0, pages=[bytes(PAGE)] * 5), InvalidInput, "pages"),
        (lambda: bank.put(lid, tokens, group=0, pages=b"x"), InvalidInput, "pages"),  # type: ignore[arg-type]
        (lambda: bank.put(lid, tokens, group=0, pages=[bytes(PAGE)], first_page=-1),
         InvalidInput, "first_page"),
        (lambda: bank.match(lid, tokens, scope="a"), InvalidInput, "scope"),  # type: ignore[arg-type]
        (lambda: bank.fetch("match", out={}), InvalidInput, "match"),  # type: ignore[arg-type]
    ]
    for call, exc, field in cases:
        with pytest.raises(exc, match=field):
            call()
    bank.put(lid, tokens, group=0, pages=rand(4, PAGE, 1))
    m = bank.match(lid, tokens)
    for out, field in (
        ({}, r"out\[0\]"),
        ({0: torch.zeros(2, PAGE, dtype=torch.uint8)}, r"out\[0\]"),
        ({0: torch.zeros(4, PAGE, dtype=torch.int8)}, r"out\[0\]"),
        ({0: [bytes(PAGE)] * 3}, r"out\[0\]\[0\]"),
    ):
        with pytest.raises(InvalidInput, match=field):
            bank.fetch(m, out=out)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="max_rows"):
        bank.fetch(m, out={0: torch.zeros(4, PAGE, dtype=torch.uint8)}, max_rows=-1)
    assert bank.stats().store.rows == 4



def test_malformed_state_out_and_fetch_id_are_typed_errors_and_change_nothing(bank: Bank) -> None:
    """Every malformed argument is an InvalidInput naming its field, never an IndexError
    or TypeError from deep inside: a 0-d state tensor, out buffers that are not
    writable contiguous bytes-likes, an unhashable fetch id. Nothing is stored or opened."""
    lid = bank.register(FA)
    mid = bank.register(MAMBA)
    tokens = list(range(64))
    with pytest.raises(InvalidInput, match="state"):
        bank.put_state(mid, tokens, group=1, state=torch.tensor(3, dtype=torch.uint8))
    bank.put(lid, tokens, group=0, pages=rand(4, PAGE, 1))
    m = bank.match(lid, tokens)
    strided = np.zeros((PAGE, 2), np.uint8)[:, 0]
    for out in ({0: [1] * 4}, {0: [strided] * 4}, {0: [torch.zeros(PAGE, dtype=torch.uint8)] * 4}):
        with pytest.raises(InvalidInput, match=r"out\[0\]\[0\]"):
            bank.fetch(m, out=out)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="fetch_id"):
        bank.fetch(m, out={0: torch.zeros(4, PAGE, dtype=torch.uint8)}, fetch_id=["x"])  # type: ignore[arg-type]
    assert bank.stats().store.rows == 4 and bank.stats().open_fetches == 0

def test_keys_instead_of_tokens_and_lending_a_match(bank: Bank) -> None:
    from kvbank.keys import page_keys

    lid = bank.register(FA)
    tokens = list(range(50))
    keys = page_keys(tokens, P)
    pages = rand(3, PAGE, 11)
    assert bank.put(lid, keys=keys, group=0, pages=pages) == bank.row_names(lid, tokens, group=0)
    m = bank.match(lid, tokens)
    lease = bank.lend(m)  # the rows the resume bound needs
    assert lease.names == tuple(m.needed) and len(lease.rows) == 3
    assert bank.read(lease.id, m.needed[2]) == pages[2].numpy().tobytes()
    assert bank.release(lease.id)


def test_concurrent_workers_keep_the_bank_consistent(bank: Bank) -> None:
    lid = bank.register(FA)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(15):
                tokens = list(range(w * 10_000 + i * 100, w * 10_000 + i * 100 + 48))
                pages = rand(3, PAGE, w * 100 + i)
                bank.put(lid, tokens, group=0, pages=pages)
                m = bank.match(lid, [*tokens, 1])
                lease = bank.lend(m)
                assert bank.read(lease.id, m.needed[0]) == pages[0].numpy().tobytes()
                bank.release(lease.id)
                w_lease = bank.lend(bank.row_names(lid, [*tokens, *range(16)], group=0)[3:],
                                    mode=LeaseMode.WRITE)
                bank.commit(w_lease.id, [])
        except BaseException as exc:  # collected and re-raised by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert bank.stats().live_leases == 0
    bank.check_invariants()


def test_open_applies_overrides_and_close_is_final() -> None:
    bank = Bank.open(host_bytes="8M", device_bytes=0, lease_ttl_s=3)
    assert bank.config.host_bytes == 8 << 20 and bank.config.lease_ttl_s == 3
    lid = bank.register(FA)
    bank.close()
    bank.close()  # idempotent
    with pytest.raises(TierUnavailable):
        bank.match(lid, list(range(32)))
    with pytest.raises(TierUnavailable):
        bank.register(FA)
    with pytest.raises(InvalidInput, match="config"):
        Bank({"host_bytes": 1})  # type: ignore[arg-type]


def _public_methods(cls: type) -> list[str]:
    return sorted(n for n in dir(cls) if not n.startswith("_")
                  and inspect.isfunction(inspect.getattr_static(cls, n)))


def test_bank_every_public_method_after_close_is_tier_unavailable() -> None:
    """Regression: ``stats``, ``layout``, ``row_names``, ``lend``… answered (or leaked
    another error) after ``close``. Every public method of the bank, of ``bank.admin``
    and of ``bank.fleet``, found by introspection so a new one is covered, raises
    TierUnavailable naming the bank; only ``close`` (idempotent) and the ``open``
    constructor are exempt."""
    bank = Bank.open(host_bytes="1M", device_bytes=0)
    lid = bank.register(FA)
    bank.close()
    calls = {f"bank.{n}": getattr(bank, n) for n in _public_methods(Bank) if n not in ("close", "open")}
    for part in ("admin", "fleet"):
        obj = getattr(bank, part)
        calls |= {f"bank.{part}.{n}": getattr(obj, n) for n in _public_methods(type(obj))}
    assert {"bank.stats", "bank.register", "bank.put", "bank.fetch", "bank.lend", "bank.health",
            "bank.admin.rows", "bank.admin.evict", "bank.fleet.put_rows"} <= set(calls)
    for name, call in calls.items():
        with pytest.raises(TierUnavailable, match="closed") as err:
            call(lid)  # the state is checked before any argument
        assert err.value.field == "bank", name
        assert name in str(err.value), (name, err.value)
    bank.close()
    assert bank.clock() > 0 and bank.reservation is None  # values stay readable
    assert bank.fleet.has_remote is False


def test_bank_tensor_parallel_shards_never_share_rows(bank: Bank) -> None:
    """Regression: the layout id leaves the shard index out, so a bank serving several
    ranks must never answer one rank with another rank's rows."""
    tp = full_attention("bank-tp@1", num_layers=2, num_kv_heads=4, head_dim=64, shard_count=2)
    lid = bank.register(tp)
    assert bank.register(tp.with_shard(1)) == lid
    tokens = list(range(64))
    size = tp.group_page_bytes[0]
    bank.put(lid, tokens, group=0, pages=rand(4, size, 7), shard=0)
    assert bank.match(lid, tokens, shard=0).resume.tokens == 48
    other = bank.match(lid, tokens, shard=1)
    assert other.resume.tokens == 0 and not any(other.tiers[0])
    with pytest.raises(InvalidInput, match="shard"):
        bank.match(lid, tokens)  # two shards registered: the call must say which
    with pytest.raises(UnknownLayout, match="shard"):
        bank.put(lid, tokens, group=0, pages=rand(4, size, 8), shard=5)


def test_bank_single_shard_needs_no_shard_argument(bank: Bank) -> None:
    tp = full_attention("bank-tp@2", num_layers=2, num_kv_heads=4, head_dim=64, shard_count=2,
                        shard_index=1)
    lid = bank.register(tp)
    tokens = list(range(32))
    names = bank.put(lid, tokens, group=0, pages=rand(2, tp.group_page_bytes[0], 9))
    assert all(n[-2:] == b"\x00\x01" for n in names)  # shard index 1 in every row name
    assert bank.match(lid, tokens).resume.tokens == 16


def test_bank_put_skips_rows_already_stored_and_never_overwrites_a_leased_row(bank: Bank) -> None:
    """Re-storing a shared prefix must not fail while a lease reads it, nor change the
    leased bytes: equal names mean equal bytes, so stored pages are skipped. A WRITE lease
    racing a put of the same row: the first to store wins, the other is discarded."""
    lid = bank.register(FA)
    tokens = list(range(48))
    first = rand(3, PAGE, 21)
    names = bank.put(lid, tokens, group=0, pages=first)
    reader = bank.lend(names[:2])
    assert bank.put(lid, tokens, group=0, pages=rand(3, PAGE, 22)) == names  # no RowLocked
    assert bank.read(reader.id, names[0]) == first[0].numpy().tobytes()
    bank.release(reader.id)

    more = list(range(48, 64))
    (absent,) = bank.row_names(lid, tokens + more, group=0)[3:]
    writer = bank.lend([absent], mode=LeaseMode.WRITE)
    stored = rand(1, PAGE, 23)
    bank.put(lid, tokens + more, group=0, pages=stored, first_page=3)
    bank.write(writer.id, absent, rand(1, PAGE, 24)[0].numpy().tobytes())
    result = bank.commit(writer.id, [absent])
    assert result.already_present == (absent,) and not result.committed
    buf = torch.zeros(4, PAGE, dtype=torch.uint8)
    m = bank.match(lid, [*tokens, *more, 0])
    assert bank.fetch(m, out={0: buf}).complete
    assert torch.equal(buf[:3], first) and torch.equal(buf[3], stored[0])
    bank.check_invariants()


def test_bank_namespace_table_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache salt per request must not grow the bank's tables without bound."""
    import kvbank.bank.catalog as catalog_module

    monkeypatch.setattr(catalog_module, "MAX_NAMESPACES", 8)
    with Bank.open(BankConfig(), host_bytes="64M", device_bytes=0) as bank:
        lid = bank.register(FA)
        for i in range(50):
            bank.put(lid, list(range(16)), group=0, pages=rand(1, PAGE, i),
                     scope=Scope(cache_salt=f"req-{i}"))
        assert bank._catalog.namespaces == 8
        names = bank.put(lid, list(range(16)), group=0, pages=rand(1, PAGE, 5),
                         scope=Scope(cache_salt="req-0"))  # fell out long ago: learnt again
        lease = bank.lend(names)
        assert lease.rows[0].regions  # described, so the borrower knows the buffer regions
        bank.release(lease.id)


# ---- the service-facing surface --------------------------------------------------------------


class TickClock:
    """A fake monotonic clock that moves ``step`` seconds every time it is read."""

    def __init__(self, step: float = 0.0) -> None:
        self.now = 1000.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_bank_queries_write_nothing(bank: Bank) -> None:
    """match, row_names, presence, resume_at and locate learn no namespace, take no lock or
    lease, and open no fetch; a command (put, lend of a match, register_scope) learns."""
    lid = bank.register(FA)
    tokens = list(range(64))
    bank.put(lid, tokens, group=0, pages=rand(4, PAGE, 1))
    before = (bank._catalog.namespaces, bank.stats())
    salt = Scope(cache_salt="q")
    m = bank.match(lid, [*tokens, 1], scope=salt)
    bank.row_names(lid, tokens, group=0, scope=salt)
    bank.presence(lid, tokens, scope=salt)
    bank.resume_at(bank.match(lid, [*tokens, 1]), 16)
    bank.locate(m.names[0])
    assert (bank._catalog.namespaces, bank.stats()) == before
    fresh = bank.row_names(lid, tokens, group=0, scope=salt)
    with pytest.raises(InvalidInput, match="describes"):  # a scope the bank never learnt
        bank.lend(fresh[:1], mode=LeaseMode.WRITE)
    bank.register_scope(lid, salt)
    w = bank.lend(fresh[:1], mode=LeaseMode.WRITE)
    assert w.rows[0].regions  # now it can
    bank.release(w.id)


def test_bank_open_refuses_a_misspelled_setting() -> None:
    with pytest.raises(ConfigError) as info:
        Bank.open(host_byte="1M")
    assert info.value.field == "host_byte" and "host_bytes" in str(info.value)


def test_bank_put_timeout_stops_between_pages() -> None:
    clock = TickClock(step=1.0)
    with Bank(BankConfig(host_bytes=64 << 20, device_bytes=0), clock=clock, reaper=False) as b:
        lid = b.register(FA)
        tokens = list(range(64))
        with pytest.raises(Busy) as info:
            b.put(lid, tokens, group=0, pages=rand(4, PAGE, 2), timeout=2.5)
        assert info.value.field == "timeout" and "stored 2 of 4" in str(info.value)
        names = b.row_names(lid, tokens, group=0)
        assert [t is not None for t in b.locate(names)] == [True, True, False, False]
        with pytest.raises(InvalidInput, match="timeout"):
            b.put(lid, tokens, group=0, pages=rand(4, PAGE, 2), timeout=-1)


def test_bank_fetch_timeout_answers_what_arrived_and_resumes() -> None:
    clock = TickClock()
    with Bank(BankConfig(host_bytes=64 << 20, device_bytes=0), clock=clock, reaper=False) as b:
        lid = b.register(FA)
        tokens = list(range(96))
        pages = rand(6, PAGE, 3)
        b.put(lid, tokens, group=0, pages=pages)
        m = b.match(lid, [*tokens, 1])
        buf = torch.zeros(6, PAGE, dtype=torch.uint8)
        clock.step = 1.0
        first = b.fetch(m, out={0: buf}, timeout=3.5)
        assert not first.complete and 0 < len(first.delivered[0]) < 6
        assert [f.fetch_id for f in b.fetches()] == [first.fetch_id]
        clock.step = 0.0
        rest = b.fetch(m, out={0: buf}, fetch_id=first.fetch_id, timeout=10)
        assert rest.complete and torch.equal(buf, pages) and b.fetches() == ()


def test_bank_lend_past_its_timeout_is_released() -> None:
    clock = TickClock()
    with Bank(BankConfig(host_bytes=64 << 20, device_bytes=0), clock=clock, reaper=False) as b:
        lid = b.register(FA)
        names = b.put(lid, list(range(32)), group=0, pages=rand(2, PAGE, 4))
        clock.step = 5.0  # every clock read inside lend moves past the deadline
        with pytest.raises(Busy, match="released"):
            b.lend(names, timeout=1.0, ttl_s=100)
        clock.step = 0.0
        assert b.leases() == () and b.stats().store.locked_names == 0
        lease = b.lend(names, timeout=1.0, ttl_s=30)
        assert [x.id for x in b.leases()] == [lease.id]
        assert wire.to_dict(lease, now=b.clock())["ttl_s"] == 30  # against the bank's clock
        b.release(lease.id)


def test_bank_lease_bytes_in_place_through_the_bank(bank: Bank) -> None:
    lid = bank.register(FA)
    tokens = list(range(48))
    pages = rand(3, PAGE, 5)
    names = bank.put(lid, tokens, group=0, pages=pages)
    lease = bank.lend(names)
    with bank.view(lease.id, names[1]) as mv:
        assert bytes(mv) == pages[1].numpy().tobytes()
    bank.check_live(lease.id)
    out = bytearray(PAGE)
    assert bank.read_into(lease.id, names[2], out) == PAGE and out == pages[2].numpy().tobytes()
    bank.release(lease.id)
    with pytest.raises(LeaseNotFound):
        bank.check_live("never-lent")
    (fresh,) = bank.row_names(lid, list(range(64)), group=0)[3:]
    w = bank.lend([fresh], mode=LeaseMode.WRITE)
    bank.write(w.id, fresh, b"\x07" * PAGE)
    assert bank.commit(w.id, [fresh]).committed == (fresh,)
    bank.flush()
    assert bank.health().ok
    bank.check_invariants()


def test_bank_match_by_engine_keys_of_any_length(bank: Bank) -> None:
    """vLLM-style 16-byte keys: put and match by the engine's chain, never by zero padding."""
    lid = bank.register(FA)
    vllm = [bytes([i + 1]) * 16 for i in range(4)]
    pages = rand(4, PAGE, 6)
    names = bank.put(lid, keys=vllm, group=0, pages=pages)
    m = bank.match(lid, keys=vllm, prompt_tokens=4 * P + 3)
    assert m.resume.tokens == 4 * P and m.needed == names
    assert bank.match(lid, keys=vllm).resume.tokens == 3 * P  # default T: the keyed pages
    padded = bank.match(lid, keys=[k + bytes(16) for k in vllm])
    assert not any(padded.tiers[0])
    with pytest.raises(InvalidInput, match="prompt_tokens"):
        bank.match(lid, keys=vllm, prompt_tokens=5 * P)
    with pytest.raises(InvalidInput, match="prompt_tokens"):
        bank.match(lid, list(range(64)), prompt_tokens=64)


def test_bank_every_boundary_and_resume_at(bank: Bank) -> None:
    """SGLang asks for every usable prefix length: a hole at page 2 leaves boundaries 16
    and 32; resuming at 16 needs exactly one row and fetches it."""
    lid = bank.register(FA)
    tokens = list(range(96))
    pages = rand(6, PAGE, 7)
    names = bank.put(lid, tokens, group=0, pages=pages)
    assert bank.admin.evict([names[2]]).evicted == (names[2],)
    m = bank.match(lid, [*tokens, 1])
    assert m.boundaries == (16, 32) and m.resume.tokens == 32
    low = bank.resume_at(m, 16)
    assert low.resume.tokens == 16 and low.needed == names[:1] and low.resume.reason is None
    buf = torch.zeros(1, PAGE, dtype=torch.uint8)
    assert bank.fetch(low, out={0: buf}).complete and torch.equal(buf[0], pages[0])
    with pytest.raises(InvalidInput, match="at:"):
        bank.resume_at(m, 48)


def test_bank_presence_of_every_shard_in_one_call(bank: Bank) -> None:
    tp = full_attention("bank-tp@3", num_layers=2, num_kv_heads=4, head_dim=64, shard_count=2)
    lid = bank.register(tp)
    bank.register(tp.with_shard(1))
    tokens = list(range(64))
    size = tp.group_page_bytes[0]
    bank.put(lid, tokens, group=0, pages=rand(4, size, 8), shard=0)
    bank.put(lid, tokens, group=0, pages=rand(2, size, 9), shard=1)
    p = bank.presence(lid, [*tokens, 1])
    assert p.shards == (0, 1) and p.shard_tokens == (64, 32) and p.tokens == 32
    assert p.held(0, 0, 3) and not p.held(1, 0, 2)
    assert bank.presence(lid, [*tokens, 1], shards=[0]).tokens == 64
    for bad in ([], [2], [True], "0"):
        with pytest.raises(InvalidInput, match="shards"):
            bank.presence(lid, tokens, shards=bad)  # type: ignore[arg-type]


def test_bank_workers_sharing_one_prefix_see_its_bytes(bank: Bank) -> None:
    """Workers racing to store, lend, read and fetch the same rows: equal names mean equal
    bytes, so every read answers the one page stored under a name and no call fails."""
    lid = bank.register(FA)
    tokens = list(range(64))
    pages = rand(4, PAGE, 99)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(20):
                names = bank.put(lid, tokens, group=0, pages=pages)
                m = bank.match(lid, [*tokens, 1])
                lease = bank.lend(m)
                for k, n in enumerate(m.needed):
                    assert bank.read(lease.id, n) == pages[k].numpy().tobytes()
                bank.release(lease.id)
                buf = torch.zeros(4, PAGE, dtype=torch.uint8)
                got = bank.fetch(m, out={0: buf})
                assert got.complete and torch.equal(buf, pages)
                assert bank.locate(names) == [TierKind.HOST] * 4
        except BaseException as exc:  # collected and re-raised by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert bank.stats().live_leases == 0 and bank.stats().store.rows == 4
    bank.check_invariants()
