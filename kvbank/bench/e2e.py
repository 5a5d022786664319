"""``kvbank bench e2e``: time to first token of a real transformers model through kvbank.

The model is :func:`~kvbank.integrations.scenario.tiny_llama` (4 layers, GQA, float32,
random weights) on 4,096-token prompts of 16-token pages. Every case goes through a
``kvbank serve`` node started for the run (its own data dir, no Redis) and a
:class:`~kvbank.Client` in the bench's process, which is on the node's host, so pages come
through the node's shared memory the way a worker on that node gets them. Cases:

- ``ttft-hit-4k`` — seconds to the first token of a prompt whose first 4,032 tokens
  another process stored (a spawned worker with its own ``Client``): match, fetch, a fresh
  ``DynamicCache`` built from the pages, and the last 64 tokens computed. The bench's
  client maps the node's segment before anything is timed (``Client.map_host``), as a
  worker does once at start.
  Baseline: the same model reusing a cache of those 4,032 tokens in process (cropped back
  after each run), the floor any cache reuse can reach.
- ``ttft-miss-4k`` — seconds to the first token when nothing is stored (the match misses,
  the whole prompt is computed). Baseline: the plain prefill.
- ``store-overhead-4k`` — seconds for a prefill that stores every page (a new scope per
  run, so every row is really written). Baseline: the same prefill without kvbank.

Runs are interleaved with their baseline and the medians reported.
"""

from __future__ import annotations

import multiprocessing
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from kvbank.bench.common import BenchRow, paired_seconds, row
from kvbank.keys import Scope

SUITE = "e2e"
PROMPT = 4096
STORED = 4032
PAGE = 16
NODE_ARGS = ("--host-bytes", "512M", "--disk-bytes", "1G", "--device-bytes", "0")


def _prompts() -> tuple[list[int], list[int]]:
    """Worker A's prompt and the bench's: the same first 4,032 tokens."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 1024, (STORED,), generator=g).tolist()
    a = shared + torch.randint(0, 1024, (PROMPT - STORED,), generator=g).tolist()
    b = shared + torch.randint(0, 1024, (PROMPT - STORED,), generator=g).tolist()
    return a, b


def _store_worker(url: str) -> None:
    """Worker A, in its own process: store prompt A on the node."""
    from kvbank.client.client import Client
    from kvbank.integrations import transformers as kt
    from kvbank.integrations.scenario import tiny_llama

    model = tiny_llama()
    a, _ = _prompts()
    with Client(url) as node:
        kt.store(node, kt.layout_for(model, tokens_per_page=PAGE), model, a)


def _first_token(model: Any, ids: torch.Tensor, cache: Any) -> int:
    with torch.inference_mode():
        return int(model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].argmax())


def run(quick: bool = False) -> Iterator[BenchRow]:
    try:
        import transformers  # noqa: F401  (only to say what is missing)
    except ImportError as exc:
        raise ImportError("bench e2e needs transformers: pip install 'kvbank[transformers]'") from exc
    from kvbank.client.client import Client
    from kvbank.integrations import transformers as kt
    from kvbank.integrations.scenario import tiny_llama
    from kvbank.service.launch import NodeProcess

    repeat = 3 if quick else 7
    model = tiny_llama()
    hl = kt.layout_for(model, tokens_per_page=PAGE)
    _, b = _prompts()
    ids = torch.tensor([b])
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-e2e-") as tmp:
        node = NodeProcess.start(["--data-dir", tmp, *NODE_ARGS])
        try:
            worker = multiprocessing.get_context("spawn").Process(target=_store_worker, args=(node.url,))
            worker.start()
            worker.join()
            if worker.exitcode != 0:
                raise RuntimeError(f"e2e: the storing worker exited with {worker.exitcode}")
            with Client(node.url) as client:
                # a worker maps the node's segment once at start (and builds its page
                # tables), as the service bench's clients do, before anything is timed
                client.map_host(wait_s=120.0)
                yield from _cases(client, hl, model, b, ids, repeat)
        finally:
            node.stop()


def _cases(bank: Any, hl: Any, model: Any, b: list[int], ids: torch.Tensor,
           repeat: int) -> Iterator[BenchRow]:
    from kvbank.integrations import transformers as kt

    reused = kt.fresh_cache(model)
    with torch.inference_mode():
        model(input_ids=ids[:, :STORED], cache=reused, use_cache=True)

    def hit() -> None:
        got = kt.load(bank, hl, model, b)
        if got.tokens != STORED:
            raise RuntimeError(f"ttft-hit-4k: resumed at {got.tokens}, expected {STORED}")
        _first_token(model, got.rest, got.cache)

    def in_process() -> None:
        _first_token(model, ids[:, STORED:], reused)
        reused.crop(-(PROMPT - STORED))

    ours, base = paired_seconds(hit, in_process, repeat)
    yield row(SUITE, "ttft-hit-4k", "s", ours, "the same model reusing a cache in process", base)

    cold = Scope(tenant="bench-e2e-cold")  # nothing is ever stored under it

    def miss() -> None:
        got = kt.load(bank, hl, model, b, scope=cold)
        _first_token(model, got.rest, got.cache)

    def plain() -> None:
        _first_token(model, ids, kt.fresh_cache(model))

    ours, base = paired_seconds(miss, plain, repeat)
    yield row(SUITE, "ttft-miss-4k", "s", ours, "plain recompute", base)

    runs = iter(range(1 << 30))

    def stores() -> None:
        kt.store(bank, hl, model, b, scope=Scope(tenant=f"bench-e2e-store-{next(runs)}"))

    ours, base = paired_seconds(stores, plain, repeat)
    yield row(SUITE, "store-overhead-4k", "s", ours, "the same prefill without kvbank", base)
