"""The bank across shard counts: a match finds rows stored under another TP size, a fetch
reshards them into the caller's buffers, and keeps them under the caller's shard."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvbank import wire
from kvbank.bank.bank import Bank
from kvbank.builders import full_attention, hybrid_mamba
from kvbank.config import BankConfig
from kvbank.kernels.reshard import reshard_pages
from kvbank.layout import PageLayout
from kvbank.reshard.plan import plan_reshard, shard_layout

P = 16


def _gqa(n: int, r: int = 0) -> PageLayout:
    return full_attention("cross@1", 2, 8, 32, shard_count=n, shard_index=r)


def _cut(full: PageLayout, group: int, pages: torch.Tensor, n: int) -> list[torch.Tensor]:
    """TP 1 pages cut into each of n ranks' pages."""
    out = []
    for r in range(n):
        dst = shard_layout(full, n, r)
        shard = torch.empty((pages.shape[0], dst.group_page_bytes[group]), dtype=torch.uint8)
        reshard_pages(plan_reshard(full, dst), group, {0: pages}, shard)
        out.append(shard)
    return out


def _pages(layout: PageLayout, group: int, count: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    full = torch.randint(0, 256, (count, layout.group_page_bytes[group]), dtype=torch.uint8,
                         generator=gen)
    # canonical pages: zero padding (the kernel writes it so; keep the source honest too)
    return _cut(layout, group, full, 1)[0]


@pytest.fixture
def bank() -> Iterator[Bank]:
    with Bank(BankConfig(host_bytes=64 << 20, device_bytes=0)) as b:
        yield b


def _store_tp4(bank: Bank, pages: int, seed: int = 0) -> tuple[list[int], torch.Tensor, bytes]:
    """Rows of ``pages`` pages stored by a TP 4 worker (all four ranks); the tokens, the
    TP 1 pages they came from, and the TP 4 layout id."""
    full = _gqa(1)
    tp1 = _pages(full, 0, pages, seed)
    tokens = [(seed * 7919 + i) % 32_000 for i in range(pages * P)]
    lid = b""
    for r, shard in enumerate(_cut(full, 0, tp1, 4)):
        lid = bank.register(_gqa(4, r))
        bank.put(lid, tokens, group=0, pages=shard, shard=r)
    return tokens, tp1, lid


def test_match_finds_rows_of_another_shard_count_and_fetch_reshards_them(bank: Bank) -> None:
    tokens, tp1, _ = _store_tp4(bank, 4)
    want = _cut(_gqa(1), 0, tp1, 2)
    for j in range(2):
        lid = bank.register(_gqa(2, j))
        m = bank.match(lid, [*tokens, 1], shard=j)
        assert m.resume.tokens == 4 * P
        assert m.via == ((4, 4, 4, 4),)
        out = torch.full((4, _gqa(2).group_page_bytes[0]), 0xEE, dtype=torch.uint8)
        got = bank.fetch(m, out={0: out})
        assert got.complete and got.resume.tokens == 4 * P and got.delivered == ((0, 1, 2, 3),)
        assert torch.equal(out, want[j])
        # stored under the caller's own shard: the next match is direct, the bytes equal
        again = bank.match(lid, [*tokens, 1], shard=j)
        assert again.via in ((), ((0, 0, 0, 0),)) and again.resume.tokens == 4 * P
        out2 = torch.zeros_like(out)
        assert bank.fetch(again, out={0: out2}).complete
        assert torch.equal(out2, want[j])
    bank.check_invariants()


def test_resharded_rows_are_not_stored_when_the_switch_is_off() -> None:
    with Bank(BankConfig(host_bytes=64 << 20, device_bytes=0, reshard_store=False)) as bank:
        tokens, tp1, _ = _store_tp4(bank, 2)
        lid = bank.register(_gqa(2, 1))
        m = bank.match(lid, [*tokens, 1])
        out = torch.zeros((2, _gqa(2).group_page_bytes[0]), dtype=torch.uint8)
        assert bank.fetch(m, out={0: out}).complete
        assert torch.equal(out, _cut(_gqa(1), 0, tp1, 2)[1])
        assert bank.locate(m.names[0]) == [None, None]
        assert bank.match(lid, [*tokens, 1]).via == ((4, 4),)


def test_a_row_counts_only_when_every_source_row_is_present(bank: Bank) -> None:
    """TP 4 -> TP 2 needs two source rows a page: with one of page 2's gone the bound
    stops at page 2, and the other rank (whose sources are whole) still resumes at 4."""
    tokens, _, lid4 = _store_tp4(bank, 4)
    gone = bank.row_names(lid4, tokens, group=0, shard=1)[2]
    bank._store.delete(gone)  # the store's own delete: rows are evicted one by one
    lid = bank.register(_gqa(2, 0))
    m = bank.match(lid, [*tokens, 1], shard=0)
    assert m.via == ((4, 4, 0, 4),) and m.resume.tokens == 2 * P
    lid_other = bank.register(_gqa(2, 1))
    assert bank.match(lid_other, [*tokens, 1], shard=1).resume.tokens == 4 * P


def test_a_source_gone_before_the_fetch_is_a_miss_and_nothing_half_built(bank: Bank) -> None:
    tokens, tp1, lid4 = _store_tp4(bank, 3)
    lid = bank.register(_gqa(2, 0))
    m = bank.match(lid, [*tokens, 1], shard=0)
    assert m.resume.tokens == 3 * P
    bank._store.delete(bank.row_names(lid4, tokens, group=0, shard=1)[1])
    out = torch.full((3, _gqa(2).group_page_bytes[0]), 0xEE, dtype=torch.uint8)
    got = bank.fetch(m, out={0: out})
    assert not got.complete and got.delivered == ((0, 2),) and got.missing == ((1,),)
    assert got.resume.tokens == P  # resume after the rows that arrived whole
    want = _cut(_gqa(1), 0, tp1, 2)[0]
    assert torch.equal(out[0], want[0]) and torch.equal(out[2], want[2])
    assert bool((out[1] == 0xEE).all())  # the row whose source was gone was not touched
    assert bank.locate([m.names[0][1]]) == [None]  # and nothing was stored for it


def test_unregistered_shard_counts_are_not_searched(bank: Bank) -> None:
    tokens, _, _ = _store_tp4(bank, 2)
    lid = bank.register(full_attention("another@1", 2, 8, 32, shard_count=2))
    m = bank.match(lid, [*tokens, 1], shard=0)
    assert m.resume.tokens == 0 and m.via == ()


def test_hybrid_mamba_reshards_pages_and_sectioned_state(bank: Bank) -> None:
    """A STATE group's snapshot (sectioned conv state, by-head SSM state) reshards like a
    page: TP 2 rows, fetched by a TP 4 rank."""
    def hybrid(n: int, r: int = 0) -> PageLayout:
        return hybrid_mamba("cross-mamba@1", attention_layers=[1], mamba_layers=[0, 2],
                            num_kv_heads=4, head_dim=16, conv_shape=(32 // n, 3),
                            conv_sections=(16 // n, 8 // n, 8 // n), ssm_shape=(8 // n, 4, 4),
                            shard_count=n, shard_index=r)
    full = hybrid(1)
    attn, state = _pages(full, 0, 2, 1), _pages(full, 1, 1, 2)
    tokens = list(range(2 * P))
    for r, (a, s) in enumerate(zip(_cut(full, 0, attn, 2), _cut(full, 1, state, 2), strict=True)):
        lid2 = bank.register(hybrid(2, r))
        bank.put(lid2, tokens, group=0, pages=a, shard=r)
        bank.put_state(lid2, tokens, group=1, state=s[0], shard=r)
    lid = bank.register(hybrid(4, 3))
    m = bank.match(lid, [*tokens, 1], shard=3)
    assert m.resume.tokens == 2 * P and m.via[0] == (2, 2) and m.via[1][1] == 2
    out_a = torch.zeros((2, hybrid(4).group_page_bytes[0]), dtype=torch.uint8)
    out_s = torch.zeros((1, hybrid(4).group_page_bytes[1]), dtype=torch.uint8)
    assert bank.fetch(m, out={0: out_a, 1: out_s}).complete
    assert torch.equal(out_a, _cut(full, 0, attn, 4)[3])
    assert torch.equal(out_s, _cut(full, 1, state, 4)[3])


def test_match_with_resharded_rows_crosses_the_wire(bank: Bank) -> None:
    tokens, _, _ = _store_tp4(bank, 2)
    lid = bank.register(_gqa(2, 0))
    m = bank.match(lid, [*tokens, 1])
    assert wire.from_dict(type(m), wire.to_dict(m)) == m


def test_cross_locate_answers_the_slowest_source_tier_and_only_when_all_are_there() -> None:
    """CrossLocate over a table of where rows are (the store's locate answers exactly
    this): a row is the slowest tier of its sources, and a miss if any source is."""
    from kvbank.bank.cross_shard import CrossLocate
    from kvbank.keys import DEFAULT_SCOPE, namespace, page_keys, row_names
    from kvbank.tiers.base import TierKind

    keys = page_keys(list(range(3 * P)), P)
    src, dst = _gqa(4), _gqa(2)
    ns4 = namespace(src.layout_id, DEFAULT_SCOPE)
    table = {}
    tiers = {0: (TierKind.HOST, TierKind.HOST), 1: (TierKind.HOST, TierKind.DISK),
             2: (TierKind.DEVICE, None)}
    for s in (0, 1):  # TP 2 rank 0 is built from TP 4 ranks 0 and 1
        for i, name in enumerate(row_names(ns4, keys, 0, 4, s)):
            if tiers[i][s] is not None:
                table[name] = tiers[i][s]
    own = row_names(namespace(dst.layout_id, DEFAULT_SCOPE), keys, 0, 2, 0)
    locate = CrossLocate(lambda names: [table.get(n) for n in names], dst, 0, DEFAULT_SCOPE, (src,))
    assert locate(own) == [TierKind.HOST, TierKind.DISK, None]


def test_own_and_resharded_rows_mix_in_one_fetch(bank: Bank) -> None:
    tokens, tp1, _ = _store_tp4(bank, 3)
    want = _cut(_gqa(1), 0, tp1, 2)[1]
    lid = bank.register(_gqa(2, 1))
    bank.put(lid, tokens[:P], group=0, pages=want[:1], shard=1)  # page 0 is its own already
    m = bank.match(lid, [*tokens, 1], shard=1)
    assert m.via == ((0, 4, 4),) and m.resume.tokens == 3 * P
    out = torch.zeros((3, _gqa(2).group_page_bytes[0]), dtype=torch.uint8)
    got = bank.fetch(m, out={0: out}, max_rows=2)
    assert got.delivered == ((0, 1),) and not got.complete
    got = bank.fetch(m, out={0: out}, fetch_id=got.fetch_id)  # resumes at the third row
    assert got.complete and torch.equal(out, want)


@pytest.mark.parametrize("size", [100, 9000])
def test_a_source_row_of_the_wrong_size_is_refused_naming_it(bank: Bank, size: int) -> None:
    from kvbank.errors import PageSizeMismatch

    tokens, _, lid4 = _store_tp4(bank, 2)
    lid = bank.register(_gqa(2, 0))
    m = bank.match(lid, [*tokens, 1], shard=0)
    bad = bank.row_names(lid4, tokens, group=0, shard=1)[1]
    bank._store.delete(bad)
    bank._store.put(bad, memoryview(bytes(size)))  # bytes no TP 4 page has
    out = torch.full((2, _gqa(2).group_page_bytes[0]), 0xEE, dtype=torch.uint8)
    with pytest.raises(PageSizeMismatch, match=f"source row {bad.hex()[:16]}"):
        bank.fetch(m, out={0: out})
    assert bool((out[1] == 0xEE).all())
    assert bank.locate([m.names[0][1]]) == [None]


def test_reshard_rows_builds_and_stores_the_bound_rows_a_served_fetch_streams(bank: Bank) -> None:
    """What a served fetch does first: every resharded row of the bound is built and
    stored under the caller's name (bit-exact), so a fetch by name finds it; a match with
    no resharded rows builds nothing."""
    tokens, tp1, _ = _store_tp4(bank, 3, seed=5)
    lid = bank.register(_gqa(2, 1))
    m = bank.match(lid, [*tokens, 1], shard=1)
    assert m.via == ((4, 4, 4),)
    assert bank.reshard_rows(m) == 3
    direct = bank.match(lid, [*tokens, 1], shard=1)
    assert not any(any(v) for v in direct.via) and bank.reshard_rows(direct) == 0
    out = torch.zeros((3, _gqa(2).group_page_bytes[0]), dtype=torch.uint8)
    assert bank.fetch(direct, out={0: out}).complete
    assert torch.equal(out, _cut(_gqa(1), 0, tp1, 2)[1])
    bank.check_invariants()
