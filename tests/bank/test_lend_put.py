"""Bank.lend_put: a put planned and its WRITE lease taken in one call, the names looked
up once there and once at commit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvbank import Bank, LeaseMode, full_attention, hybrid_mamba
from kvbank.errors import InvalidInput
from kvbank.layout import GroupKind
from kvbank.lender.base import Delivery

FA = full_attention("lend-put@1", num_layers=1, num_kv_heads=2, head_dim=16)
PAGE = FA.group_page_bytes[0]
TOKENS = list(range(100, 164))  # 4 full pages of 16


@pytest.fixture
def bank(tmp_path: Path) -> Iterator[Bank]:
    with Bank.open(host_bytes="16M", data_dir=tmp_path, device_bytes=0) as b:
        yield b


def _count_locates(bank: Bank) -> list[int]:
    calls: list[int] = []
    store = bank._store
    real = store.locate

    def counting(names):
        calls.append(len(names))
        return real(names)

    store.locate = counting  # type: ignore[method-assign]
    return calls


def test_lend_put_reserves_the_absent_rows_and_commit_publishes_them(bank: Bank) -> None:
    lid = bank.register(FA)
    stored = bank.put(lid, TOKENS, group=0, pages=torch.full((2, PAGE), 1, dtype=torch.uint8))
    calls = _count_locates(bank)
    names, lease = bank.lend_put(lid, TOKENS, group=0, group_kind=GroupKind.ATTENTION, count=4,
                                 page_bytes=PAGE)
    assert names == bank.row_names(lid, TOKENS, group=0)
    assert names[:2] == stored
    assert lease is not None and lease.mode is LeaseMode.WRITE
    assert [r.name for r in lease.rows] == names[2:]  # only the absent rows are leased
    assert all(r.delivery is Delivery.RESERVED for r in lease.rows)
    for n in lease.names:
        bank.write(lease.id, n, bytes([7]) * PAGE)
    done = bank.commit(lease.id, list(lease.names))
    assert set(done.committed) == set(names[2:])
    assert calls == [4, 2], "a put looks its names up once to plan and once at commit"
    assert bank.match(lid, [*TOKENS, 1]).resume.tokens == 64


def test_lend_put_of_stored_rows_takes_no_lease(bank: Bank) -> None:
    lid = bank.register(FA)
    bank.put(lid, TOKENS, group=0, pages=torch.zeros((4, PAGE), dtype=torch.uint8))
    names, lease = bank.lend_put(lid, TOKENS, group=0, group_kind=GroupKind.ATTENTION, count=4)
    assert lease is None and len(names) == 4
    assert bank.leases() == ()


def test_lend_put_keeps_a_row_stored_between_the_lease_and_the_commit(bank: Bank) -> None:
    """The lease trusts the lookup it made; a row another put stored meanwhile is found at
    commit and kept (equal names are equal bytes), never stored twice."""
    lid = bank.register(FA)
    names, lease = bank.lend_put(lid, TOKENS, group=0, group_kind=GroupKind.ATTENTION, count=1)
    assert lease is not None
    bank.put(lid, TOKENS, group=0, pages=torch.full((1, PAGE), 3, dtype=torch.uint8))
    bank.write(lease.id, names[0], bytes([9]) * PAGE)
    done = bank.commit(lease.id, [names[0]])
    assert done.committed == () and done.already_present == (names[0],)
    out = torch.empty((1, PAGE), dtype=torch.uint8)
    got = bank.fetch(bank.match(lid, [*TOKENS[:16], 1]), out={0: out})
    assert got.complete and int(out[0, 0]) == 3


def test_lend_put_refuses_what_put_refuses_naming_the_field(bank: Bank) -> None:
    lid = bank.register(FA)
    with pytest.raises(InvalidInput, match=r"header\.pages"):
        bank.lend_put(lid, TOKENS, group=0, group_kind=GroupKind.ATTENTION, count=5, fields="header.")
    with pytest.raises(InvalidInput, match=r"header\.first_page"):
        bank.lend_put(lid, TOKENS, group=0, group_kind=GroupKind.ATTENTION, first_page=-1,
                      fields="header.")
    with pytest.raises(InvalidInput, match="page_bytes"):
        bank.lend_put(lid, TOKENS, group=0, group_kind=GroupKind.ATTENTION, page_bytes=PAGE + 1)
    with pytest.raises(InvalidInput, match="STATE"):
        bank.lend_put(lid, TOKENS, group=0, group_kind=GroupKind.STATE)
    assert bank.leases() == ()


def test_lend_put_of_a_snapshot_leases_its_boundary_row(bank: Bank) -> None:
    lay = hybrid_mamba("lend-put-mamba@1", [0], [1], 2, 16, conv_shape=(8, 3), ssm_shape=(2, 8))
    lid = bank.register(lay)
    state_group = next(i for i, g in enumerate(lay.groups) if g.kind is GroupKind.STATE)
    names, lease = bank.lend_put(lid, TOKENS, group=state_group, group_kind=GroupKind.STATE, at=32)
    assert lease is not None and list(lease.names) == names
    assert names == [bank.row_names(lid, TOKENS, group=state_group)[1]]
    bank.release(lease.id)


def test_absent_is_for_write_leases_only(bank: Bank) -> None:
    lid = bank.register(FA)
    names = bank.row_names(lid, TOKENS, group=0)
    with pytest.raises(InvalidInput, match="absent"):
        bank._lender.lend(names, mode=LeaseMode.READ, absent=True)
