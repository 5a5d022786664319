"""The fetch ledger: delivered rows, recomputed bounds, resume order, expiry."""

from __future__ import annotations

import pytest

from kvbank.builders import hybrid_mamba
from kvbank.errors import FetchNotFound, InvalidInput
from kvbank.lender.ledger import FetchLedger
from kvbank.lender.resume import Obstacle, resume_bound

P = 4
MAMBA = hybrid_mamba("m@1", [0], [1], 4, 8, conv_shape=(4, 3), ssm_shape=(2, 8), tokens_per_page=P)
T = 33  # 8 keyed pages; best boundary 32
NAMES = [[bytes([g, j]) * 27 for j in range(8)] for g in range(2)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def plan_all():
    # the store holds every attention page and snapshots at 16 and 32
    return resume_bound(MAMBA, T, lambda g, j: g == 0 or j in (3, 7), NAMES)


def test_ledger_bound_counts_only_rows_delivered_whole() -> None:
    ledger = FetchLedger(10.0, FakeClock())
    plan = plan_all()
    assert plan.tokens == 32 and plan.pages == (tuple(range(8)), (7,))
    fid = ledger.open(MAMBA, T, NAMES, plan)
    assert ledger.bound(fid).tokens == 0  # nothing arrived yet: recompute
    ledger.record(fid, NAMES[0][:8])
    b = ledger.bound(fid)
    assert b.tokens == 0 and b.reason is Obstacle.NO_SNAPSHOT  # KV without its state is useless
    ledger.record(fid, [NAMES[1][7]])
    assert ledger.bound(fid).tokens == 32
    assert ledger.pending(fid) == ()
    ledger.check_invariants()


def test_ledger_broken_fetch_resumes_from_first_undelivered_row() -> None:
    ledger = FetchLedger(10.0, FakeClock())
    fid = ledger.open(MAMBA, T, NAMES, plan_all(), fetch_id="f-1")
    assert fid == "f-1"
    ledger.record(fid, [NAMES[0][0], NAMES[0][1], NAMES[0][3]])  # page 2 broke mid-transfer
    pending = ledger.pending(fid)
    assert [(r.group, r.index) for r in pending][:3] == [(0, 2), (0, 4), (0, 5)]
    assert pending[-1].group == 1 and pending[-1].out_index == 0
    assert [r.out_index for r in pending if r.group == 0] == [2, 4, 5, 6, 7]


def test_ledger_refuses_rows_outside_the_plan_and_duplicate_ids() -> None:
    ledger = FetchLedger(10.0, FakeClock())
    fid = ledger.open(MAMBA, T, NAMES, plan_all())
    with pytest.raises(InvalidInput, match=r"names\[0\]"):
        ledger.record(fid, [NAMES[1][0]])  # a snapshot the plan does not use
    with pytest.raises(InvalidInput, match="fetch_id"):
        ledger.open(MAMBA, T, NAMES, plan_all(), fetch_id=fid)
    with pytest.raises(InvalidInput, match="plan"):
        ledger.open(MAMBA, T, NAMES, resume_bound(MAMBA, T, lambda g, j: True))  # no names


def test_ledger_entries_expire_after_ttl_unless_touched() -> None:
    clock = FakeClock()
    ledger = FetchLedger(10.0, clock)
    a = ledger.open(MAMBA, T, NAMES, plan_all())
    b = ledger.open(MAMBA, T, NAMES, plan_all())
    clock.now += 8
    ledger.record(b, [NAMES[0][0]])  # activity keeps b alive
    clock.now += 3
    with pytest.raises(FetchNotFound):
        ledger.bound(a)
    assert a not in ledger and b in ledger
    clock.now += 10
    assert ledger.expire() == 2  # a was past its deadline, but lookups never drop an entry
    assert len(ledger) == 0
    with pytest.raises(FetchNotFound, match="fetch_id"):
        ledger.close(b)


def test_ledger_lookups_neither_renew_nor_expire() -> None:
    """plan, pending, delivered, bound, in, len and entries change nothing: an entry lives
    ttl_s from its last open, record or renew however often it is looked at."""
    clock = FakeClock()
    ledger = FetchLedger(10.0, clock)
    a = ledger.open(MAMBA, T, NAMES, plan_all())
    for _ in range(3):
        clock.now += 3
        ledger.plan(a), ledger.pending(a), ledger.delivered(a), ledger.bound(a)
        assert a in ledger and len(ledger) == 1
        (info,) = ledger.entries()
        assert info.fetch_id == a and info.planned_rows == len(ledger.plan(a))
        assert info.delivered_rows == 0 and info.layout_id == MAMBA.layout_id
    assert ledger.entries()[0].ttl_s == pytest.approx(1.0)
    clock.now += 1  # 10 s after open: gone, although looked at every 3 s
    assert a not in ledger and len(ledger) == 0 and ledger.entries() == ()
    with pytest.raises(FetchNotFound):
        ledger.pending(a)


def test_ledger_renew_and_record_keep_a_fetch_open() -> None:
    clock = FakeClock()
    ledger = FetchLedger(10.0, clock)
    a = ledger.open(MAMBA, T, NAMES, plan_all())
    clock.now += 9
    ledger.renew(a)
    clock.now += 9
    ledger.record(a, [NAMES[0][0]])
    clock.now += 9
    assert a in ledger and ledger.delivered(a) == {NAMES[0][0]}
    clock.now += 1
    assert a not in ledger
    with pytest.raises(FetchNotFound):
        ledger.renew(a)
    assert ledger.expire() == 1


def test_ledger_record_row_by_row_over_a_long_plan_is_all_or_nothing_per_call() -> None:
    """Recording a long plan one row per call (as a streamed fetch does) delivers exactly
    those rows; a call naming a row outside the plan records none of its names. The plan's
    name set is built once at open (so record is linear in the fetch), and the checker
    compares it with the plan."""
    layout = hybrid_mamba("long@1", [0], [1], 4, 8, conv_shape=(4, 3), ssm_shape=(2, 8),
                          tokens_per_page=1)
    t = 1001
    names = [[bytes([g]) + j.to_bytes(4, "big") * 13 + b"\x00" for j in range(t)] for g in range(2)]
    plan = resume_bound(layout, t, lambda g, j: g == 0 or j == t - 2, names)
    assert plan.tokens == t - 1
    ledger = FetchLedger(10.0, FakeClock())
    fid = ledger.open(layout, t, names, plan)
    rows = ledger.plan(fid)
    assert len(rows) == t  # 1,000 KV pages and one snapshot
    with pytest.raises(InvalidInput, match=r"names\[1\]"):
        ledger.record(fid, [rows[0].name, names[1][0]])  # the snapshot at 1 is not planned
    assert ledger.delivered(fid) == frozenset()  # nothing of the refused call was recorded
    for r in rows[:-1]:
        ledger.record(fid, [r.name])
    assert ledger.delivered(fid) == frozenset(r.name for r in rows[:-1])
    assert ledger.pending(fid) == (rows[-1],)
    ledger.record(fid, [rows[-1].name, rows[-1].name])  # a repeat is harmless
    assert ledger.bound(fid).tokens == t - 1 and ledger.pending(fid) == ()
    ledger.check_invariants()
