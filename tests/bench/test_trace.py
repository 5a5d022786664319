"""``kvbank bench trace``: the offline oracle on a hand-worked trace, the replay through a
real Bank on small traces, the generator's prefix hashes, the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbank.bench import trace, tracegen
from kvbank.bench.trace import BLOCK, Request
from kvbank.cli.main import main
from kvbank.config import EvictionPolicy
from kvbank.errors import InvalidInput

T = 2 * BLOCK + 1  # two full blocks and one token more: both blocks can be resumed from

# Hand-worked: a cache of two blocks. r0 stores [1, 2]; r1's [3, 4] are never used again,
# so Belady drops them at once and r2 hits both blocks of [1, 2]; then only 1 has a
# next use (r3), and r3 = [1, 5] hits block 1 and misses 5 (prefix rule: one block).
TINY = [Request(0, T, (1, 2)), Request(10, T, (3, 4)), Request(20, T, (1, 2)),
        Request(30, T, (1, 5))]


def test_oracle_on_a_hand_worked_trace() -> None:
    assert trace.oracle(TINY, 2) == pytest.approx((2 * BLOCK + BLOCK) / (4 * T))
    assert trace.oracle(TINY, 4) == pytest.approx((2 * BLOCK + BLOCK) / (4 * T))  # nothing better
    # One block: block 1 is kept throughout (on a tie the deeper block 2 goes), so r2 and
    # r3 each resume from it.
    assert trace.oracle(TINY, 1) == pytest.approx((BLOCK + BLOCK) / (4 * T))


def test_resume_tokens_keeps_one_token_to_compute() -> None:
    assert trace.resume_tokens(3, 3 * BLOCK) == 2 * BLOCK
    assert trace.resume_tokens(3, 3 * BLOCK + 1) == 3 * BLOCK
    assert trace.resume_tokens(0, 10 * BLOCK) == 0


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_replay_through_a_bank_on_the_hand_worked_trace(policy: EvictionPolicy) -> None:
    """Two rows: r1 pushes [1, 2] out under both rules (each was used once), r2 misses and
    stores them again, r3 resumes from block 1."""
    got = trace.replay(TINY, 2, policy, disk=False)
    assert (got.hit_tokens, got.total_tokens) == (BLOCK, 4 * T)
    assert got.saved_s > 0


def test_replay_of_a_generated_slice_under_both_tiers() -> None:
    """A small generated chat trace: the replay is deterministic, every rule's share lies
    between nothing and the oracle's, and a disk below the host only adds hits."""
    reqs = [Request(int(d["timestamp"]), int(d["input_length"]), tuple(d["hash_ids"]))  # type: ignore[call-overload,arg-type]
            for d in tracegen.generate("chat", 120, seed=3)]
    rows = trace.budget_rows(reqs, 5)
    best = trace.oracle(reqs, rows)
    for policy in EvictionPolicy:
        host = trace.replay(reqs, rows, policy, disk=False)
        assert 0 < host.share <= best
        assert trace.replay(reqs, rows, policy, disk=False) == host
        both = trace.replay(reqs, rows, policy, disk=True)
        assert host.share <= both.share <= trace.oracle(reqs, rows * (1 + trace.DISK_TIMES))


def test_load_refuses_a_line_that_is_not_a_request(tmp_path: Path) -> None:
    good = {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [7, 8]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "hash_ids": [7]}) + "\n")
    with pytest.raises(InvalidInput, match=r"t.jsonl:2"):
        trace.load(path)
    path.write_text(json.dumps(good) + "\n\n")
    assert trace.load(path) == [Request(0, 600, (7, 8))]


def test_generator_ids_are_prefix_hashes() -> None:
    """Equal ids exactly when the prompts share the tokens up to that block; the same
    seed makes the same trace; a block count matches the prompt's length."""
    for shape in tracegen.SHAPES:
        rows = tracegen.generate(shape, 80, seed=1)
        assert rows == tracegen.generate(shape, 80, seed=1)
        parent: dict[int, int] = {}
        for r in rows:
            ids = r["hash_ids"]
            assert isinstance(ids, list) and len(ids) == -(-int(r["input_length"]) // BLOCK)  # type: ignore[call-overload]
            for i, b in enumerate(ids):
                assert parent.setdefault(b, ids[i - 1] if i else -1) == (ids[i - 1] if i else -1)
        reused = sum(len(r["hash_ids"]) for r in rows) - len(parent)  # type: ignore[arg-type,misc]
        assert reused > 0, shape
    with pytest.raises(InvalidInput, match="shape"):
        tracegen.generate("batch", 10)


def test_cli_prints_the_trace_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "small.jsonl"
    tracegen.write(path, tracegen.generate("system", 60, seed=2))
    assert main(["bench", "trace", "--trace", str(path), "--budgets", "10", "--json"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["case"] for r in rows] == ["trace-small-10pct-value", "trace-small-10pct-oracle",
                                         "trace-small-10pct-value-prefill-saved"]
    assert {r["baseline"] for r in rows} == {"lru"}
    assert rows[0]["metric"] == rows[1]["metric"] == "hit_token_share"
    assert err == ""  # quiet under --json
