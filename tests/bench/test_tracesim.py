"""The trace simulator (kvbank.bench.tracesim) answers what the replay through a real
Bank does, so a rule can be tried on it in seconds."""

from __future__ import annotations

import pytest

from kvbank.bench import trace, tracegen, tracesim
from kvbank.bench.trace import BLOCK, Request
from kvbank.config import EvictionPolicy

T = 2 * BLOCK + 1
TINY = [Request(0, T, (1, 2)), Request(10, T, (3, 4)), Request(20, T, (1, 2)),
        Request(30, T, (1, 5))]


def test_simulator_on_the_hand_worked_trace() -> None:
    """Two rows: r1 pushes [1, 2] out under both rules, r3 resumes from block 1 (as the
    Bank's replay does)."""
    for cls in tracesim.RULES.values():
        assert tracesim.simulate(TINY, 2, cls(2)) == pytest.approx(BLOCK / (4 * T))


@pytest.mark.parametrize(("shape", "requests", "pct"), [("chat", 400, 5), ("docqa", 150, 20)])
def test_simulator_matches_the_bank_replay(shape: str, requests: int, pct: int) -> None:
    """On generated traces the simulator's share is the Bank's within 0.015 under both
    rules. (It is a model: on a cache of a few dozen rows the Bank holds a row or two
    fewer at the moment of a put, and its value rule counts uses in a sketch.)"""
    reqs = [Request(int(d["timestamp"]), int(d["input_length"]), tuple(d["hash_ids"]))  # type: ignore[call-overload,arg-type]
            for d in tracegen.generate(shape, requests, seed=5)]
    rows = trace.budget_rows(reqs, pct)
    for name, cls in tracesim.RULES.items():
        got = tracesim.simulate(reqs, rows, cls(rows))
        bank = trace.replay(reqs, rows, EvictionPolicy(name), disk=False).share
        assert got == pytest.approx(bank, abs=0.015), (name, got, bank)
        assert got <= trace.oracle(reqs, rows) + 1e-9


def test_reuse_table_splits_uses_by_class() -> None:
    got = tracesim.reuse_table(TINY, 1)
    assert got["new-prompt"] == (4, 0.0)  # 1, 2, 3, 4: 1 and 2 come back two requests later
    assert got["reused"][0] == 3 and got["reused"][1] == pytest.approx(1 / 3)  # 1 in r2, again in r3
    assert got["new-tail"] == (1, 0.0)  # 5: r3 extends block 1
