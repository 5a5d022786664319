"""The bank's admin calls (``bank.admin``): rows by layout / scope / prefix with a cursor, evict by
name and by listing (locked and pinned rows reported, left in place), pin under the
budget, touch, the change feed and a row's encoded frame."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbank import Bank, BankConfig, LeaseMode, Scope, full_attention
from kvbank.codec import decode
from kvbank.errors import InvalidInput, PinBudgetExceeded, UnknownLayout
from kvbank.keys import namespace
from kvbank.results import EventKind

FA = full_attention("admin@1", num_layers=1, num_kv_heads=2, head_dim=64)  # 16 tokens a page
OTHER = full_attention("admin-other@1", num_layers=1, num_kv_heads=2, head_dim=64)
P = FA.tokens_per_page
PAGE = FA.group_page_bytes[0]
A, B = Scope("tenant-a"), Scope("tenant-b")


def pages(n: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, PAGE), dtype=np.uint8))


@pytest.fixture
def bank():
    with Bank.open(BankConfig(), host_bytes="16M", device_bytes=0, pin_bytes=4 * PAGE) as b:
        b.register(FA)
        b.register(OTHER)
        yield b


def fill(bank: Bank, lid: bytes, scope: Scope, n: int, seed: int) -> list[bytes]:
    tokens = list(range(seed * 1000, seed * 1000 + n * P))
    return bank.put(lid, tokens, group=0, pages=pages(n, seed), scope=scope)


def test_rows_by_layout_scope_and_prefix_page_by_page(bank: Bank) -> None:
    a = fill(bank, FA.layout_id, A, 5, 1)
    b = fill(bank, FA.layout_id, B, 3, 2)
    o = fill(bank, OTHER.layout_id, A, 2, 3)
    assert [r.name for r in bank.admin.rows(FA.layout_id, scope=A, limit=100)] == sorted(a)
    assert {r.name for r in bank.admin.rows(FA.layout_id, limit=100)} == set(a) | set(b)
    assert {r.name for r in bank.admin.rows(scope=A, limit=100)} == set(a) | set(o)
    assert len(bank.admin.rows(limit=100)) == 10
    # pages of 2 after the cursor: every row once, in name order
    seen, after = [], None
    while True:
        page = bank.admin.rows(FA.layout_id, limit=2, after=after)
        seen += [r.name for r in page]
        if len(page) < 2:
            break
        after = page[-1].name
    assert seen == sorted(a + b)
    ns = namespace(FA.layout_id, B)
    assert [r.name for r in bank.admin.rows(prefix=ns[:3], limit=100)] == sorted(
        n for n in a + b + o if n.startswith(ns[:3]))
    info = bank.admin.rows(FA.layout_id, scope=B, limit=1)[0]
    assert info.size == PAGE and info.pinned is False and info.holders == frozenset() and info.tiers


def test_rows_refuses_bad_input_naming_the_field(bank: Bank) -> None:
    for kwargs, field in (({"limit": 0}, "limit"), ({"limit": 10_001}, "limit"),
                          ({"after": b"short"}, "after"), ({"prefix": b"x" * 60}, "prefix")):
        with pytest.raises(InvalidInput) as e:
            bank.admin.rows(**kwargs)
        assert str(e.value).startswith(field), e.value
    with pytest.raises(UnknownLayout):
        bank.admin.rows(b"\0" * 32)


def test_evict_by_name_and_by_listing_reports_locked_and_pinned(bank: Bank) -> None:
    a = fill(bank, FA.layout_id, A, 4, 1)
    b = fill(bank, FA.layout_id, B, 2, 2)
    lease = bank.lend([a[0]], mode=LeaseMode.READ)
    assert bank.admin.pin([a[1]]) == ()  # every row named is stored: none left unpinned
    done = bank.admin.evict_rows(FA.layout_id, scope=A)
    assert set(done.evicted) == set(a[2:]) and done.locked == (a[0],) and done.pinned == (a[1],)
    assert bank.locate(a) == [bank.locate([a[0]])[0], bank.locate([a[1]])[0], None, None]
    assert all(t is not None for t in bank.locate(b))  # another scope untouched
    bank.release(lease.id)
    bank.admin.unpin([a[1]])
    one = bank.admin.evict([a[0], a[3]])
    assert one.evicted == (a[0],) and one.missing == (a[3],)
    with pytest.raises(InvalidInput):
        bank.admin.evict_rows()  # everything needs naming a layout, scope or prefix


def test_pin_budget_is_refused_not_ignored(bank: Bank) -> None:
    a = fill(bank, FA.layout_id, A, 6, 1)
    assert bank.admin.pin(a[:4]) == ()
    with pytest.raises(PinBudgetExceeded):
        bank.admin.pin(a[4:])
    assert [r.pinned for r in bank.admin.rows(FA.layout_id, scope=A, limit=10)].count(True) == 4
    bank.admin.unpin(a[:4])
    assert bank.admin.pin([a[5], b"\1" * 54]) == (b"\1" * 54,)


def test_touch_events_and_frames(bank: Bank) -> None:
    assert bank.admin.take_events() == []  # the feed records from the first call on
    a = fill(bank, FA.layout_id, A, 2, 1)
    assert bank.admin.touch([a[0], b"\2" * 54]) == 1
    events = bank.admin.take_events()
    assert [(e.kind, e.name) for e in events] == [(EventKind.PUBLISHED, n) for n in a]
    frame = bank.admin.read_frame(a[1])
    assert frame is not None
    assert decode(frame) == pages(2, 1)[1].numpy().tobytes()
    assert bank.admin.read_frame(b"\3" * 54) is None
    assert bank.admin.evict([a[0]]).evicted == (a[0],)
    assert [(e.kind, e.name) for e in bank.admin.take_events()] == [(EventKind.WITHDRAWN, a[0])]
    bank.flush(timeout_s=5.0)
