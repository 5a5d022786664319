"""The shared-system-prompt scenario: two workers, one bank, a real (tiny) model.

What ``kvbank demo`` and ``kvbank bench e2e`` run. Worker A answers one question under a
long system prompt and stores its prefill; worker B gets another question under the same
system prompt, resumes from what it fetches and computes only its own question. Both
workers are written against anything with :class:`~kvbank.Bank`'s API, so the same code
runs embedded or against ``kvbank serve``.

Primitives:

- :func:`tiny_llama` — a random-weight Llama built from its config class (no download),
  deterministic per seed, big enough that a 4,096-token prefill is measurable on a CPU.
- :func:`store_system_prompt` (worker A) and :func:`resume_system_prompt` (worker B) —
  each worker alone, for running them in two processes against one node;
- :func:`shared_prompt_scenario` — runs both workers and measures B's time to first
  token with and without kvbank; a :class:`ScenarioResult`.
- :meth:`ScenarioResult.summary` — a one-screen, plot-free explanation of the numbers.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvbank.api import WorkerAPI
from kvbank.integrations import transformers as kt
from kvbank.keys import DEFAULT_SCOPE, Scope


def tiny_llama(*, seed: int = 0, dtype: torch.dtype = torch.float32, max_tokens: int = 8192) -> Any:
    """A 4-layer random-weight Llama (GQA: 8 query heads over 2 KV heads of 32)."""
    import transformers

    hf_logging: Any = transformers.utils.logging
    hf_logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_tokens,
    )
    torch.manual_seed(seed)
    model: Any = transformers.LlamaForCausalLM(config)
    return model.to(dtype).eval()


def prompts(system_tokens: int, question_tokens: int, *, seed: int = 0) -> tuple[list[int], list[int]]:
    """Two prompts: one system prompt, then two different questions (random token ids)."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 1024, (system_tokens,), generator=g).tolist()
    qa = torch.randint(0, 1024, (question_tokens,), generator=g).tolist()
    qb = torch.randint(0, 1024, (question_tokens,), generator=g).tolist()
    return system + qa, system + qb


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    prompt_tokens: int  # worker B's prompt
    shared_tokens: int  # the system prompt both share
    tokens_resumed: int  # r: tokens B did not compute
    bytes_fetched: int
    ttft_with_s: float  # B's time to first token: match + fetch + its own tokens (median, warm)
    ttft_without_s: float  # B's time to first token computing the whole prompt (median, warm)
    same_tokens: bool  # B's greedy continuation equals the recomputing worker's

    @property
    def hit_rate(self) -> float:
        """Share of B's prompt served from the bank."""
        return self.tokens_resumed / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> str:
        speedup = self.ttft_without_s / self.ttft_with_s if self.ttft_with_s else 0.0
        return "\n".join([
            "kvbank: two workers, one shared system prompt",
            f"  prompt (worker B)     {self.prompt_tokens:>9,} tokens, "
            f"{self.shared_tokens:,} of them the system prompt worker A stored",
            f"  hit rate              {self.hit_rate:>9.1%}   share of B's prompt it did not compute",
            f"  tokens resumed        {self.tokens_resumed:>9,}   B starts computing at this position",
            f"  bytes fetched         {self.bytes_fetched:>9,}   K/V pages copied out of the bank",
            f"  first token, kvbank   {self.ttft_with_s * 1e3:>9.1f} ms  match + fetch + B's own tokens",
            f"  first token, without  {self.ttft_without_s * 1e3:>9.1f} ms  B computes the whole prompt",
            f"  speed-up              {speedup:>9.1f}x",
            f"  same answer           {'yes' if self.same_tokens else 'NO':>9}   "
            "B's greedy tokens equal a worker that recomputed everything",
        ])


def _first_token(model: Any, ids: torch.Tensor, cache: Any) -> int:
    with torch.inference_mode():
        return int(model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].argmax())


def _generate(model: Any, ids: torch.Tensor, cache: Any, n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(ids, cache=cache, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return [int(x) for x in out[0, -n:]]


def store_system_prompt(
    bank: WorkerAPI,
    model: Any | None = None,
    *,
    system_tokens: int = 2048,
    question_tokens: int = 64,
    tokens_per_page: int = 16,
    scope: Scope = DEFAULT_SCOPE,
) -> int:
    """Worker A: answer its question under the system prompt, storing the prefill; the
    number of pages it stored."""
    model = tiny_llama() if model is None else model
    hl = kt.layout_for(model, tokens_per_page=tokens_per_page)
    a, _ = prompts(system_tokens, question_tokens)
    return sum(kt.store(bank, hl, model, a, scope=scope).pages)


def resume_system_prompt(
    bank: WorkerAPI,
    model: Any | None = None,
    *,
    system_tokens: int = 2048,
    question_tokens: int = 64,
    new_tokens: int = 8,
    tokens_per_page: int = 16,
    scope: Scope = DEFAULT_SCOPE,
    repeat: int = 3,
) -> ScenarioResult:
    """Worker B, after worker A stored: its time to first token with and without kvbank,
    and whether its greedy answer equals a worker that recomputed everything."""
    model = tiny_llama() if model is None else model
    hl = kt.layout_for(model, tokens_per_page=tokens_per_page)
    _, b = prompts(system_tokens, question_tokens)
    ids = torch.tensor([b])

    def without_kvbank() -> None:
        _first_token(model, ids, kt.fresh_cache(model))

    def with_kvbank() -> kt.Loaded:
        got = kt.load(bank, hl, model, b, scope=scope)
        _first_token(model, got.rest, got.cache)
        return got

    # A warm worker: the first call of each path (lazy inits, the first mapping of the
    # node's shared memory) is not timed; then the median of a few runs, interleaved.
    without_kvbank()
    got = with_kvbank()
    withouts: list[float] = []
    withs: list[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        without_kvbank()
        withouts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with_kvbank()
        withs.append(time.perf_counter() - t0)
    without, with_kv = statistics.median(withouts), statistics.median(withs)

    again = kt.load(bank, hl, model, b, scope=scope)
    resumed = _generate(model, again.generate_ids, again.cache, new_tokens)
    recomputed = _generate(model, ids, None, new_tokens)
    return ScenarioResult(
        prompt_tokens=len(b), shared_tokens=system_tokens, tokens_resumed=got.tokens,
        bytes_fetched=got.fetch.nbytes if got.fetch else 0, ttft_with_s=with_kv,
        ttft_without_s=without, same_tokens=resumed == recomputed,
    )


def shared_prompt_scenario(
    bank: WorkerAPI,
    model: Any | None = None,
    *,
    system_tokens: int = 2048,
    question_tokens: int = 64,
    new_tokens: int = 8,
    tokens_per_page: int = 16,
    scope: Scope = DEFAULT_SCOPE,
) -> ScenarioResult:
    """Worker A stores, worker B resumes (both here, on one bank); B's time to first token
    with and without."""
    model = tiny_llama() if model is None else model
    store_system_prompt(bank, model, system_tokens=system_tokens, question_tokens=question_tokens,
                        tokens_per_page=tokens_per_page, scope=scope)
    return resume_system_prompt(bank, model, system_tokens=system_tokens,
                                question_tokens=question_tokens, new_tokens=new_tokens,
                                tokens_per_page=tokens_per_page, scope=scope)
