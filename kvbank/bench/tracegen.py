"""Request traces of other shapes than the shipped one, in the Mooncake JSONL format.

``kvbank bench trace`` replays a trace; the eviction rule must not be tuned to one file,
so this module makes traces of the shapes a serving fleet sees, from a seed and a
request count (never a span of time):

- ``chat`` — multi-turn chat: sessions arrive at random; each starts from one of a few
  system prompts (popularity falls off as a power law) and every turn's prompt is the
  previous prompt, the model's answer and a new user message; users think for tens of
  seconds between turns, so turns of many sessions interleave.
- ``system`` — single-turn requests that share a long system prompt (a handful of them,
  power-law popular) followed by a question of their own: the prompts are the reuse.
- ``agent`` — agent tool loops: a session calls the model many times in quick succession,
  each call the previous context plus a tool's result; a few tool specs are shared.
- ``docqa`` — long documents asked several questions each, minutes apart (the shape of
  the Mooncake trace's long-context part).

:func:`generate` answers the requests as dicts (``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids``); :func:`write` writes them one a line. Block ids are
prefix hashes as in the Mooncake release: two prompts share their first k ids exactly
when they share their first k × 512 tokens. A prompt's last, partial block gets an id too.
"""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Iterator
from pathlib import Path

from kvbank.errors import InvalidInput

BLOCK = 512  # tokens a block (the Mooncake trace's)
SHAPES = ("chat", "system", "agent", "docqa")

Piece = tuple[int, int]  # (content id, tokens): a stretch of a prompt from one source


class _Blocks:
    """Prefix-hash block ids: a block's id is fixed by its parent's id and its content."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}

    def ids(self, pieces: list[Piece]) -> list[int]:
        out: list[int] = []
        block: list[tuple[int, int, int]] = []  # (content, start, end) within the block
        used = 0
        parent = -1
        for content, tokens in pieces:
            pos = 0
            while pos < tokens:
                take = min(tokens - pos, BLOCK - used)
                block.append((content, pos, pos + take))
                pos += take
                used += take
                if used == BLOCK:
                    parent = self._id(parent, block)
                    out.append(parent)
                    block, used = [], 0
        if block:
            out.append(self._id(parent, block))
        return out

    def _id(self, parent: int, block: list[tuple[int, int, int]]) -> int:
        key = (parent, tuple(block))
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._ids)
        return got


def _zipf(rng: random.Random, n: int, s: float = 1.1) -> int:
    """An index in [0, n) with probability proportional to 1 / (i + 1) ** s."""
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    return rng.choices(range(n), weights)[0]


def generate(shape: str, requests: int, seed: int = 0) -> list[dict[str, object]]:
    """``requests`` requests of ``shape`` (see the module docstring), in arrival order."""
    if shape not in SHAPES:
        raise InvalidInput(f"shape: expected one of {list(SHAPES)}, got {shape!r}", field="shape")
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise InvalidInput(f"requests: expected a count >= 1, got {requests!r}", field="requests")
    rng = random.Random(f"{shape}/{seed}")
    blocks = _Blocks()
    out: list[dict[str, object]] = []
    for t_ms, pieces, answer in _sessions(shape, rng, requests):
        tokens = sum(n for _, n in pieces)
        out.append({"timestamp": int(t_ms), "input_length": tokens, "output_length": answer,
                    "hash_ids": blocks.ids(pieces)})
    out.sort(key=lambda r: r["timestamp"])  # type: ignore[arg-type,return-value]
    return out


def _sessions(shape: str, rng: random.Random, requests: int) -> Iterator[tuple[float, list[Piece], int]]:
    """Interleave sessions by arrival time until ``requests`` requests are made."""
    content = iter(range(1_000_000, 1 << 62))  # fresh content ids (shared ones are small)
    # (next request time, tie, session state): a heap of live sessions
    live: list[tuple[float, int, list[Piece], int]] = []
    made = 0
    tie = 0
    next_session = 0.0
    gap_ms, turns_mean, think_ms = {"chat": (2_000, 5, 60_000), "system": (300, 1, 0),
                                    "agent": (4_000, 12, 3_000), "docqa": (6_000, 6, 150_000)}[shape]
    while made < requests:
        if not live or next_session <= live[0][0]:
            t = next_session
            next_session += rng.expovariate(1.0 / gap_ms)
            turns = max(1, round(rng.expovariate(1.0 / turns_mean))) if turns_mean > 1 else 1
            heapq.heappush(live, (t, tie, _opening(shape, rng, content), turns))
            tie += 1
            continue
        t, _, pieces, left = heapq.heappop(live)
        answer = max(1, int(rng.lognormvariate(5.0, 0.8)))
        yield t, list(pieces), answer
        made += 1
        if left > 1:
            more = _next_turn(shape, rng, content, answer)
            nxt = pieces + more if shape != "docqa" else pieces[:1] + more
            wait = rng.expovariate(1.0 / think_ms) if think_ms else 0.0
            heapq.heappush(live, (t + 1_000 + wait, tie, nxt, left - 1))
            tie += 1


def _opening(shape: str, rng: random.Random, content: Iterator[int]) -> list[Piece]:
    if shape == "chat":
        system = _zipf(rng, 8)
        return [(system, 600 + 400 * system), (next(content), int(rng.lognormvariate(5.5, 0.7)) + 1)]
    if shape == "system":
        system = _zipf(rng, 6, 0.9)
        return [(10 + system, 2_500 + 1_500 * system),
                (next(content), int(rng.lognormvariate(5.0, 0.9)) + 1)]
    if shape == "agent":
        spec = _zipf(rng, 4)
        return [(20 + spec, 3_000 + 2_000 * spec), (next(content), int(rng.lognormvariate(6.0, 0.6)) + 1)]
    doc = next(content)
    return [(doc, int(rng.uniform(4_000, 40_000))), (next(content), int(rng.lognormvariate(4.5, 0.5)) + 1)]


def _next_turn(shape: str, rng: random.Random, content: Iterator[int], answer: int) -> list[Piece]:
    if shape == "chat":
        return [(next(content), answer), (next(content), int(rng.lognormvariate(5.0, 0.8)) + 1)]
    if shape == "agent":  # the model's call, then the tool's result
        return [(next(content), answer), (next(content), int(rng.lognormvariate(6.5, 1.0)) + 1)]
    return [(next(content), int(rng.lognormvariate(4.5, 0.5)) + 1)]  # docqa: a new question


def write(path: Path, rows: list[dict[str, object]]) -> None:
    """One request a line, the Mooncake JSONL format."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
