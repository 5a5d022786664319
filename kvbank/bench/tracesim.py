"""A fast model of ``kvbank bench trace`` outside the Bank, for trying eviction rules.

:func:`simulate` replays a trace (:func:`kvbank.bench.trace.load`) on a cache of ``rows``
blocks the way the bench's replay does it through a real Bank, in pure Python, in
seconds: each request's held prefix is its hit (the same resume bound), the blocks of
the resume bound are read (a use), the blocks not held are put (a use); then, while
over budget, the evictable row with the smallest key goes, where a row is evictable
only while no child of it (the block after it in the request that first put the child)
is held: the store's prefix rule, so chains go from their tail. A :class:`Rule` gives a
row's key at each use (the store's rules key a row at its last use too).

On the Mooncake trace it answers what the bench measures within a few thousandths
(docs/tiers.md, "Eviction on request traces"); :func:`reuse_table` is the study that
chose the value rule: how likely a block is to be used again soon, by its uses so far.

``python -m kvbank.bench.tracesim [FILE]`` prints LRU, value and the oracle per budget.
"""

from __future__ import annotations

import heapq
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from kvbank.bench import trace
from kvbank.bench.trace import BLOCK, Request, resume_tokens
from kvbank.tiers.store.policy import REUSE_SPAN, REUSED


class Rule:
    """LRU: a row's key is the count of uses before it (a logical clock, as the store's)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.clock = 0
        self.held = 0  # blocks held at this use, this one included (the caller sets it)

    def use(self, block: int) -> float:
        """The key of ``block`` after this use; the smallest key is evicted first."""
        self.clock += 1
        return self.clock


class Value(Rule):
    """The store's value rule: the stamp, plus ``span`` times the blocks held at this use
    for a block used at least twice (counted across evictions, as the store's reuse
    history does)."""

    def __init__(self, rows: int, span: float = REUSE_SPAN) -> None:
        super().__init__(rows)
        self.uses: dict[int, int] = defaultdict(int)
        self.span = span

    def use(self, block: int) -> float:
        self.clock += 1
        self.uses[block] += 1
        return self.clock + (self.span * self.held if self.uses[block] >= REUSED else 0)


RULES = {"lru": Rule, "value": Value}


def simulate(reqs: Sequence[Request], rows: int, rule: Rule) -> float:
    """The hit token share of ``reqs`` on a cache of ``rows`` blocks under ``rule``."""
    key: dict[int, float] = {}
    kids: dict[int, int] = defaultdict(int)  # held children of a held block
    parent: dict[int, int | None] = {}
    heap: list[tuple[float, int]] = []  # (key, block) of leaves; stale entries skipped
    hit = total = 0
    for r in reqs:
        full = r.full
        k = 0
        while k < len(full) and full[k] in key:
            k += 1
        bound = resume_tokens(k, r.tokens) // BLOCK
        hit += bound * BLOCK
        total += r.tokens
        for b in full[:bound]:  # the reads of the resume bound
            rule.held = len(key)
            key[b] = kb = rule.use(b)
            if kids[b] == 0:
                heapq.heappush(heap, (kb, b))
        for d, b in enumerate(full):  # the puts (held blocks are skipped)
            if b in key:
                continue
            rule.held = len(key) + 1
            key[b] = kb = rule.use(b)
            p = parent.setdefault(b, full[d - 1] if d else None)
            if p is not None and p in key:
                kids[p] += 1
            heapq.heappush(heap, (kb, b))
        while len(key) > rows:
            kb, b = heapq.heappop(heap)
            if key.get(b) != kb or kids[b] > 0:
                continue
            del key[b]
            p = parent.get(b)
            if p is not None and p in key:
                kids[p] -= 1
                if kids[p] == 0:
                    heapq.heappush(heap, (key[p], p))
    return hit / total if total else 0.0


def reuse_table(reqs: Sequence[Request], horizon: int) -> dict[str, tuple[int, float]]:
    """For every block use: how many, and the share whose block is used again within
    ``horizon`` requests, split by whether the block was used before (``reused``) or is
    new, and then whether its request's first block was new too (``new-prompt``) or the
    request extends a prefix seen before (``new-tail``: a conversation's next turn)."""
    uses: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(reqs):
        for b in r.full:
            uses[b].append(i)
    seen: dict[int, int] = defaultdict(int)
    count: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for i, r in enumerate(reqs):
        known = seen[r.full[0]] > 0 if r.full else False
        for b in r.full:
            u, s = uses[b], seen[b]
            seen[b] += 1
            soon = s + 1 < len(u) and u[s + 1] - i <= horizon
            cls = "reused" if s else "new-tail" if known else "new-prompt"
            count[cls][0] += 1
            count[cls][1] += soon
    return {c: (n, k / n) for c, (n, k) in sorted(count.items())}


def main(path: Path) -> None:
    reqs = trace.load(path)
    for pct in trace.BUDGETS:
        rows = trace.budget_rows(reqs, pct)
        got = {name: simulate(reqs, rows, cls(rows)) for name, cls in RULES.items()}
        got["oracle"] = trace.oracle(reqs, rows)
        print(f"{pct:>3}% ({rows} rows): " + "  ".join(f"{k} {v:.3f}" for k, v in got.items()))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("../shared/traces/mooncake-synthetic.jsonl"))
