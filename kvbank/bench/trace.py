"""``kvbank bench trace``: eviction rules replayed on a request trace through a real Bank.

A trace is Mooncake JSONL (one request a line: ``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids``: the prompt's 512-token blocks as prefix hashes). Each
replay opens a :class:`~kvbank.bank.bank.Bank` whose clock is the trace's (injected, so a
rule that weighs time sees trace time), registers a one-group layout of 512 tokens a page
and small pages, and for every request in timestamp order:

1. ``match`` its full blocks (each block one row, its key from the block id);
2. ``fetch`` the rows the resume bound needs: the hit is the bound the delivered rows
   allow (a row that did not arrive whole is a miss), and the reads are the uses an
   eviction rule sees;
3. ``put`` its full blocks (the bank skips the ones it holds). A partial last block is
   never keyed (the bank's rule), so it is neither matched nor stored.

The host budget holds a share (``--budgets``, percent) of the trace's distinct blocks;
with ``--tiers host+disk`` a disk tier of four times as many rows sits below it
(write-back: host victims are written down, disk hits are read back up). The
watermarks are set so a full tier evicts one row for one row, as the offline rule does.

Rows (``suite`` ``trace``), for every budget:

- ``trace-<stem>-<pct>pct-<policy>``: ``hit_token_share`` (the resume bounds' tokens over
  all prompt tokens), baseline the ``lru`` replay of the same run;
- ``trace-<stem>-<pct>pct-oracle``: Belady's rule (evict the block whose next use lies
  farthest ahead) replayed offline with the whole trace known, over the same rows
  (host and disk together as one cache), baseline ``lru``;
- ``trace-<stem>-<pct>pct-<policy>-prefill-saved``: seconds of prefill the hits save
  over the whole trace under :class:`CostModel` (docs/tiers.md), less the time to load
  the rows from the tier each was in; baseline the ``lru`` replay's.

Without ``--trace`` (``kvbank bench all``) the suite replays a generated chat trace
(:mod:`kvbank.bench.tracegen`). Progress goes to stderr unless the caller says quiet.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbank import progress
from kvbank.bank.bank import Bank
from kvbank.bench import tracegen
from kvbank.bench.common import BenchRow, row
from kvbank.builders import full_attention
from kvbank.config import BankConfig, EvictionPolicy
from kvbank.errors import InvalidInput
from kvbank.tiers.base import TierKind

SUITE = "trace"
BLOCK = 512  # tokens a block in the Mooncake format, and a page of the replay's layout
HEAD_DIM = 1  # one layer, one KV head of one byte: a 1 KiB page (K and V, 512 tokens)
DISK_TIMES = 4  # the disk tier holds this many times the host tier's rows
BUDGETS = (2, 5, 10, 20)
TIERS = ("host", "host+disk")


@dataclass(frozen=True, slots=True)
class Request:
    t_ms: int  # arrival, milliseconds from the trace's start
    tokens: int  # prompt tokens
    blocks: tuple[int, ...]  # prefix-hash block ids, 512 tokens each (the last may be partial)

    @property
    def full(self) -> tuple[int, ...]:
        """The blocks that are whole pages (the ones a bank keys and stores)."""
        return self.blocks[: self.tokens // BLOCK]


def load(path: Path) -> list[Request]:
    """A Mooncake JSONL trace, sorted by arrival; ``InvalidInput`` naming the line that
    is not a request (a bad trace loses nothing: nothing has been replayed yet)."""
    out: list[Request] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                t, tokens, ids = d["timestamp"], d["input_length"], d["hash_ids"]
                ok = (isinstance(t, int) and isinstance(tokens, int) and tokens >= 1
                      and isinstance(ids, list) and all(type(i) is int for i in ids)
                      and len(ids) == -(-tokens // BLOCK))
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                raise InvalidInput(f"trace: {path}:{n}: not a request (timestamp ms, input_length, "
                                   f"hash_ids of one id per {BLOCK} tokens): {line[:120]!r}",
                                   field="trace")
            out.append(Request(t, tokens, tuple(ids)))
    out.sort(key=lambda r: r.t_ms)
    return out


def distinct_blocks(reqs: Sequence[Request]) -> int:
    return len({b for r in reqs for b in r.blocks})


def budget_rows(reqs: Sequence[Request], pct: float) -> int:
    """Rows a budget of ``pct`` percent of the trace's distinct blocks holds."""
    return max(1, int(distinct_blocks(reqs) * pct / 100))


def resume_tokens(held_prefix: int, tokens: int) -> int:
    """The resume bound of a prompt of ``tokens`` whose first ``held_prefix`` pages are
    held: a page boundary, at most ``tokens - 1`` (one token is computed for logits)."""
    return min(held_prefix, (tokens - 1) // BLOCK) * BLOCK


# ---- the cost model ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CostModel:
    """Prefill time a cache hit saves, and what loading the hit costs (docs/tiers.md).

    Defaults: a Llama-3-8B-class model (8.0 B parameters, 32 layers, model width 4,096,
    8 KV heads of 128, bf16: 128 KiB of KV a token) on one H100-class GPU at 400 TFLOP/s
    of useful bf16 work in prefill (about 40 % of the dense peak), host to GPU at 25 GB/s
    (PCIe 5 x16 at half its peak, pinned copies), disk to host at 3 GB/s (an NVMe read)."""

    params: float = 8.0e9
    layers: int = 32
    width: int = 4096
    kv_bytes_per_token: int = 2 * 32 * 8 * 128 * 2
    flops: float = 400e12
    host_to_gpu: float = 25e9  # bytes/s
    disk_to_host: float = 3e9  # bytes/s

    def prefill_s(self, start: int, end: int) -> float:
        """Seconds to prefill tokens ``[start, end)``: 2 FLOPs a parameter a token, plus
        attention over the context before each token (4 x layers x width FLOPs a pair)."""
        if end <= start:
            return 0.0
        n = end - start
        pairs = (start + end - 1) * n / 2  # sum of positions start..end-1
        return (2 * self.params * n + 4 * self.layers * self.width * pairs) / self.flops

    def load_s(self, tokens: int, tier: TierKind) -> float:
        """Seconds to bring ``tokens`` tokens of KV from ``tier`` to the GPU."""
        nbytes = tokens * self.kv_bytes_per_token
        s = nbytes / self.host_to_gpu
        if tier is TierKind.DISK:
            s += nbytes / self.disk_to_host
        return s

    def saved_s(self, hit: int, tokens: int, tiers: Sequence[TierKind | None]) -> float:
        """What a hit of ``hit`` tokens of a ``tokens``-token prompt saves: the prefill of
        ``[0, hit)`` less the loads of its pages from the tiers they were in."""
        if hit <= 0:
            return 0.0
        load = sum(self.load_s(BLOCK, t if t is not None else TierKind.HOST)
                   for t in tiers[: hit // BLOCK])
        return self.prefill_s(0, hit) - load


# ---- the offline reference -------------------------------------------------------------


def oracle(reqs: Sequence[Request], rows: int) -> float:
    """Belady's rule on a cache of ``rows`` blocks: after each request, while over
    budget, drop the block whose next use lies farthest ahead (never used again first).
    The reference optimum for equal-size blocks; under the prefix rule a parent's next
    use never lies after its child's, so it keeps chains whole. Answers the hit token
    share with the same accounting as the replay."""
    uses: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(reqs):
        for b in r.full:
            uses[b].append(i)
    seen: dict[int, int] = defaultdict(int)
    never = len(reqs)
    held: dict[int, int] = {}  # block -> its next use
    # (-next use, -depth, block), stale entries skipped: a parent's next use is never
    # after its child's, and on a tie the deeper block goes first, so chains stay whole.
    heap: list[tuple[int, int, int]] = []
    hit = total = 0
    for r in reqs:
        full = r.full
        k = 0
        while k < len(full) and full[k] in held:
            k += 1
        hit += resume_tokens(k, r.tokens)
        total += r.tokens
        for depth, b in enumerate(full):
            seen[b] += 1
            u = uses[b]
            nxt = u[seen[b]] if seen[b] < len(u) else never
            held[b] = nxt
            heapq.heappush(heap, (-nxt, -depth, b))
        while len(held) > rows:
            neg, _, b = heapq.heappop(heap)
            if held.get(b) == -neg:
                del held[b]
    return hit / total if total else 0.0


# ---- the replay through a Bank ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Replay:
    hit_tokens: int
    total_tokens: int
    saved_s: float  # prefill seconds saved under the cost model

    @property
    def share(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0


class _TraceClock:
    """The bank's clock: trace time in seconds, set before each request."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _key(block: int) -> bytes:
    return block.to_bytes(8, "big").rjust(32, b"\x6b")  # a 32-byte page key per block id


def replay(reqs: Sequence[Request], rows: int, policy: EvictionPolicy, *, disk: bool,
           cost: CostModel | None = None,
           progress: Callable[[int], None] | None = None) -> Replay:
    """Replay ``reqs`` through a Bank whose host tier holds ``rows`` pages (and a disk
    tier of ``DISK_TIMES`` as many with ``disk``) under ``policy``."""
    cost = cost or CostModel()
    layout = full_attention("kvbank-bench-trace", 1, 1, HEAD_DIM, tokens_per_page=BLOCK,
                            dtype="uint8")
    page = layout.group_page_bytes[0]
    tmp = Path(tempfile.mkdtemp(prefix="kvbank-bench-trace-")) if disk else None
    clock = _TraceClock()
    # One row for one row: evict when full, down to one slot below (no watermark band).
    settings: dict[str, object] = dict(
        host_bytes=rows * page, device_bytes=0, data_dir=tmp, eviction_policy=policy,
        high_watermark=1.0, low_watermark=1.0 - 1.0 / (rows + 1), dirty_expire_s=0.0,
        disk_sync=False, wait_timeout_s=600.0)  # a put waits for the mover on a busy machine
    if disk:
        settings["disk_bytes"] = DISK_TIMES * rows * _frame_bytes(page)
    hit = total = 0
    saved = 0.0
    data = torch.zeros((max((len(r.full) for r in reqs), default=1), page), dtype=torch.uint8)
    try:
        with Bank(BankConfig(**settings), clock=clock) as bank:  # type: ignore[arg-type]
            lid = bank.register(layout)
            for i, r in enumerate(reqs):
                clock.now = r.t_ms / 1000.0
                keys = [_key(b) for b in r.full]
                total += r.tokens
                if keys:
                    m = bank.match(lid, keys=keys, prompt_tokens=r.tokens)
                    got = 0
                    if m.resume.tokens:
                        got = bank.fetch(m, out=bank.out_buffers(m)).resume.tokens
                    hit += got
                    saved += cost.saved_s(got, r.tokens, m.tiers[0])
                    bank.put(lid, keys=keys, group=0, pages=data[: len(keys)])
                if progress is not None and i % 64 == 0:
                    progress(i)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return Replay(hit, total, saved)


def _frame_bytes(page: int) -> int:
    """Bytes a page's frame takes on the disk tier (its header and the page)."""
    from kvbank.codec import encode

    return len(encode(bytes(page), "uint8"))


# ---- the suite -----------------------------------------------------------------------------


def _progress(label: str, n: int, quiet: bool) -> Callable[[int], None] | None:
    """A replay's bar on a terminal (:mod:`kvbank.progress`); ``None`` when quiet."""
    if quiet:
        return None
    shown = progress.bar(n, label, unit="req")

    def show(i: int) -> None:
        shown.update(i - shown.n)
        if i >= n:
            shown.close()
    return show


def run(quick: bool = False, *, trace: Path | None = None, budgets: Sequence[float] = BUDGETS,
        policies: Sequence[str] = ("value",), tiers: str = "host",
        quiet: bool = False) -> Iterator[BenchRow]:
    """The suite's rows (see the module docstring)."""
    logging.getLogger("kvbank.tiers").setLevel(logging.ERROR)
    if tiers not in TIERS:
        raise InvalidInput(f"tiers: expected one of {list(TIERS)}, got {tiers!r}", field="tiers")
    chosen = [EvictionPolicy(p) if p in {e.value for e in EvictionPolicy} else _bad_policy(p)
              for p in policies]
    if trace is None:
        reqs = [Request(int(d["timestamp"]), int(d["input_length"]),  # type: ignore[call-overload]
                        tuple(d["hash_ids"]))  # type: ignore[arg-type]
                for d in tracegen.generate("chat", 400 if quick else 2_000)]
        stem = "gen-chat"
    else:
        reqs = load(trace)
        stem = trace.stem
    disk = tiers == "host+disk"
    cost = CostModel()
    for pct in budgets:
        rows = budget_rows(reqs, pct)
        name = f"trace-{stem}-{pct:g}pct"
        runs: dict[EvictionPolicy, Replay] = {}
        for p in [EvictionPolicy.LRU, *[c for c in chosen if c is not EvictionPolicy.LRU]]:
            show = _progress(f"{name}-{p.value}", len(reqs), quiet)
            runs[p] = replay(reqs, rows, p, disk=disk, cost=cost, progress=show)
            if show is not None:
                show(len(reqs))
        lru = runs[EvictionPolicy.LRU]
        for p in chosen:
            yield row(SUITE, f"{name}-{p.value}", "hit_token_share", runs[p].share, "lru", lru.share)
        best = oracle(reqs, rows * (1 + DISK_TIMES) if disk else rows)
        yield row(SUITE, f"{name}-oracle", "hit_token_share", best, "lru", lru.share)
        for p in chosen:
            yield row(SUITE, f"{name}-{p.value}-prefill-saved", "s", runs[p].saved_s, "lru",
                      lru.saved_s)


def _bad_policy(p: str) -> EvictionPolicy:
    raise InvalidInput(f"policies: expected names from {[e.value for e in EvictionPolicy]}, "
                       f"got {p!r}", field="policies")


if __name__ == "__main__":  # a quick look: python -m kvbank.bench.trace FILE
    for r in run(trace=Path(sys.argv[1]) if len(sys.argv) > 1 else None,
                 quiet=bool(os.environ.get("QUIET"))):
        print(r.to_json())
