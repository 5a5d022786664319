"""Bank calls an engine integration leans on: several STATE snapshots in one call, fetch
buffers sized by the bank, and the enums and page keys exported from ``kvbank``."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import kvbank
from kvbank import Bank, hybrid_mamba
from kvbank.errors import InvalidInput, PageSizeMismatch

MAMBA = hybrid_mamba("bank-states@1", [0, 2], [1], 2, 32, conv_shape=(64, 3), ssm_shape=(4, 16))
P = MAMBA.tokens_per_page
STATE = 1


def rand(n: int, size: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8))


@pytest.fixture
def bank() -> Iterator[Bank]:
    with Bank.open(host_bytes="32M", device_bytes=0) as b:
        yield b


def test_put_states_stores_every_snapshot_like_put_state(bank: Bank) -> None:
    lid = bank.register(MAMBA)
    tokens = list(range(6 * P + 3))
    size = MAMBA.group_bytes(STATE)
    states = rand(3, size, 1)
    names = bank.put_states(lid, tokens, group=STATE, states=states, at=[2 * P, 4 * P, 6 * P])
    one = [bank.row_names(lid, tokens, group=STATE)[k] for k in (1, 3, 5)]
    assert names == one
    m = bank.match(lid, tokens)
    assert [j for j, t in enumerate(m.tiers[STATE]) if t is not None] == [1, 3, 5]
    # Each snapshot is the row put_state would have written: fetch the one at 6P back.
    bank.put(lid, tokens, group=0, pages=rand(6, MAMBA.group_bytes(0), 2))
    m = bank.match(lid, tokens)
    assert m.resume.tokens == 6 * P
    out = bank.out_buffers(m)
    got = bank.fetch(m, out=out)
    assert got.complete
    assert torch.equal(out[STATE][0], states[2])


def test_put_states_checks_everything_before_storing_anything(bank: Bank) -> None:
    lid = bank.register(MAMBA)
    tokens = list(range(4 * P))
    size = MAMBA.group_bytes(STATE)
    with pytest.raises(InvalidInput, match=r"at\[1\]"):
        bank.put_states(lid, tokens, group=STATE, states=rand(2, size, 3), at=[P, P + 1])
    with pytest.raises(InvalidInput, match=r"at\[0\]"):
        bank.put_states(lid, tokens, group=STATE, states=rand(1, size, 3), at=[5 * P])
    with pytest.raises(InvalidInput, match="at"):
        bank.put_states(lid, tokens, group=STATE, states=rand(2, size, 3), at=[P])
    with pytest.raises(PageSizeMismatch, match="states"):
        bank.put_states(lid, tokens, group=STATE, states=rand(2, size - 64, 3), at=[P, 2 * P])
    with pytest.raises(InvalidInput, match="group"):
        bank.put_states(lid, tokens, group=0, states=rand(1, size, 3), at=[P])
    assert all(t is None for t in bank.match(lid, tokens).tiers[STATE])


def test_out_buffers_fit_the_bound(bank: Bank) -> None:
    lid = bank.register(MAMBA)
    tokens = list(range(5 * P + 1))
    bank.put(lid, tokens, group=0, pages=rand(5, MAMBA.group_bytes(0), 4))
    bank.put_states(lid, tokens, group=STATE, states=rand(1, MAMBA.group_bytes(STATE), 5),
                    at=[4 * P])
    m = bank.match(lid, tokens)
    assert m.resume.tokens == 4 * P
    out = bank.out_buffers(m)
    assert {g: tuple(t.shape) for g, t in out.items()} == {
        0: (4, MAMBA.group_bytes(0)), STATE: (1, MAMBA.group_bytes(STATE))}
    assert all(t.dtype == torch.uint8 for t in out.values())
    assert bank.out_buffers(bank.match(lid, list(range(7)))) == {}  # nothing to fetch
    with pytest.raises(InvalidInput, match="match"):
        bank.out_buffers("m")  # type: ignore[arg-type]


def test_enums_and_page_keys_are_exported() -> None:
    from kvbank.keys import page_keys
    from kvbank.layout import GroupKind, QuantMode, Role
    from kvbank.lender.resume import Obstacle
    from kvbank.tiers.base import TierKind

    assert (kvbank.Role, kvbank.GroupKind, kvbank.QuantMode) == (Role, GroupKind, QuantMode)
    assert (kvbank.TierKind, kvbank.Obstacle, kvbank.page_keys) == (TierKind, Obstacle, page_keys)
    assert {"Role", "GroupKind", "QuantMode", "TierKind", "Obstacle", "page_keys"} <= set(
        kvbank.__all__)
