"""kvbank for Hugging Face transformers: store a prefill, resume another prompt from it.

Install with ``pip install 'kvbank[transformers]'`` (transformers 5.24 or newer; the core
never imports transformers). User code::

    from kvbank import Bank
    from kvbank.integrations import transformers as kt

    hl = kt.layout_for(model)                       # the PageLayout + the cache-layer map
    kt.store(bank, hl, model, prompt_a)             # worker A: one prefill, pages stored
    got = kt.load(bank, hl, model, prompt_b)        # worker B: a DynamicCache of r tokens
    out = model.generate(got.generate_ids, cache=got.cache)  # computes prompt_b[r:]

``bank`` is a :class:`~kvbank.api.WorkerAPI`: a :class:`~kvbank.Bank`, or a
:class:`~kvbank.Client` of a served node (the adapter calls ``register``, ``put``,
``put_states``, ``fetch_prefix``).

Primitives:

- :func:`model_fingerprint` — the layout's ``model`` field: the config minus keys that
  change with how a model was saved or loaded, the attention implementation, and every
  parameter and buffer with its dtype and bytes (or, with ``revision=``, its name, dtype
  and shape only: the model's name and revision name the weights). Equal across processes and load paths
  that compute the same K/V; a fingerprint that differs makes every match a miss.
- :func:`layout_for` — a :class:`ModelLayout`: groups from what each ``cache.layers``
  entry is (full attention; sliding attention per ``sliding_window``; recurrent state;
  both; nothing), shapes and dtypes probed with a two-token forward, not hard-coded per
  family. A layer kvbank cannot map is :class:`UnmappableLayer` naming it.
- :func:`store` — one prefill that records the sliding layers' past and takes recurrent
  snapshots at the chosen page boundaries (the prefill is chunked at those boundaries
  only), then puts every group's pages and snapshots under one hashed key chain.
- :func:`fetch_pages` then :func:`build_cache` (together :func:`load`) — match, fetch
  into buffers sized from the layout, and a fresh ``DynamicCache`` holding exactly the
  tokens before the resume bound; a partial fetch lowers the bound to what arrived whole.

Lifecycle of a resume: match (never leases) → fetch (rows that arrive whole) → bound
recomputed from them → every page checked → cache written → the model computes
``tokens[r:]``. Batch size is 1; a model whose recurrent layers drop their state on a
multi-token forward (transformers' Jamba mixer in 5.24) cannot be chunked or resumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvbank.api import WorkerAPI
from kvbank.errors import InvalidInput, UnknownLayout
from kvbank.integrations._hf_cache import (
    CacheLayerMap,
    LayerKind,
    UnmappableLayer,
    attention_pages,
    check_cache,
    restore,
    state_page,
)
from kvbank.integrations._hf_layout import ModelLayout, fresh_cache, layout_for, model_fingerprint
from kvbank.keys import DEFAULT_SCOPE, RowName, Scope, page_keys
from kvbank.layout import GroupKind
from kvbank.results import Fetched, FetchResult, Match

__all__ = [
    "DEFAULT_SNAPSHOT_PAGES",
    "CacheLayerMap",
    "Fetched",
    "LayerKind",
    "Loaded",
    "ModelLayout",
    "Stored",
    "UnmappableLayer",
    "build_cache",
    "fetch_pages",
    "fresh_cache",
    "layout_for",
    "load",
    "model_fingerprint",
    "store",
]

HfModel = Any  # a transformers PreTrainedModel (transformers is untyped)
Tokens = Sequence[int] | torch.Tensor  # 1-D, or [1, T]

# Recurrent snapshots every 16 pages (256 tokens at 16 a page). A 1,000-token prefill cut
# into 256-token chunks was measured 2.2x slower than one forward, into 16-token chunks
# 10x: a snapshot at every page would cost more than it saves.
DEFAULT_SNAPSHOT_PAGES = 16


@dataclass(frozen=True, slots=True)
class Stored:
    """What :func:`store` put, and the storing worker's own cache to go on with."""

    cache: Any  # the prefilled DynamicCache (sliding layers trimmed back to their window)
    logits: torch.Tensor  # [1, vocab] at the prompt's last token
    pages: tuple[int, ...]  # per group: pages put (attention) or snapshots put (state)
    snapshots: tuple[int, ...]  # token boundaries with a recurrent snapshot
    nbytes: int  # page bytes handed to the bank


@dataclass(frozen=True, slots=True)
class Loaded:
    """A cache holding the first ``tokens`` tokens of the prompt, and what to compute."""

    cache: Any  # a fresh DynamicCache
    tokens: int  # r: the cache holds tokens [0, r)
    prompt: torch.Tensor  # [1, T] long: the whole prompt
    match: Match
    fetch: FetchResult | None

    @property
    def rest(self) -> torch.Tensor:
        """``[1, T - r]``: the prompt from ``r`` on, what a forward with the cache computes."""
        return self.prompt[:, self.tokens :]

    @property
    def generate_ids(self) -> torch.Tensor:
        """What to hand ``model.generate(…, cache=cache)``: transformers cuts the cached
        tokens off the whole prompt when the cache has attention layers, and takes the
        input as new tokens when every layer is recurrent."""
        return self.rest if all(self.cache.is_linear) else self.prompt


# ---- store -----------------------------------------------------------------------------------


def _ids(tokens: Tokens, device: torch.device) -> torch.Tensor:
    """``tokens`` as a 1-D long tensor on ``device`` (numpy does the checking in bulk)."""
    if isinstance(tokens, torch.Tensor):
        t = tokens[0] if tokens.dim() == 2 and tokens.shape[0] == 1 else tokens
    elif isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise InvalidInput(f"tokens: expected a sequence of token ids, got {type(tokens).__name__}")
    else:
        arr = np.asarray(tokens) if len(tokens) else np.zeros(0, dtype=np.int64)
        if arr.dtype.kind not in "iu":
            raise InvalidInput(f"tokens: expected integer token ids, got {arr.dtype} values")
        t = torch.from_numpy(arr.astype(np.int64, copy=False))
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InvalidInput(f"tokens: expected 1-D or [1, T] integer ids, got {t.dtype} "
                           f"{tuple(t.shape)}")
    return t.to(device=device, dtype=torch.long)


def _boundaries(hl: ModelLayout, t: int, snapshot_every: int) -> list[int]:
    """Token positions with a recurrent snapshot: every ``snapshot_every`` pages and the
    last full page (where a prompt that extends this one resumes)."""
    if hl.state_group is None:
        return []
    if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every <= 0:
        raise InvalidInput(f"snapshot_every: must be a positive number of pages, got {snapshot_every!r}")
    p = hl.layout.tokens_per_page
    last = (t // p) * p
    step = snapshot_every * p
    return sorted({*range(step, last + 1, step), *([last] if last else [])})


def store(
    bank: WorkerAPI,
    hl: ModelLayout,
    model: HfModel,
    tokens: Tokens,
    *,
    snapshot_every: int = DEFAULT_SNAPSHOT_PAGES,
    scope: Scope = DEFAULT_SCOPE,
    shard: int | None = None,
) -> Stored:
    """Prefill ``tokens`` once and store every full page of every group (see module doc)."""
    if not isinstance(hl, ModelLayout):
        raise InvalidInput(f"hl: expected a ModelLayout, got {type(hl).__name__}")
    ids = _ids(tokens, model.device)
    t = int(ids.numel())
    if t == 0:
        raise InvalidInput("tokens: an empty prompt has nothing to store")
    layout = hl.layout
    p = layout.tokens_per_page
    keyed = t // p
    keys = page_keys(ids.cpu().numpy(), p, scope)  # hashed once for every group
    cache = fresh_cache(model)
    check_cache(hl.layers, cache)
    recording = [m.index for m in hl.layers if m.kind.sliding]
    for i in recording:  # keep each sliding layer's whole past until it is paged
        cache.layers[i].activate_past_recording()
    cuts = _boundaries(hl, t, snapshot_every)
    sg = hl.state_group if hl.state_group is not None else -1  # cuts is empty without one
    snapshots: list[tuple[int, torch.Tensor]] = []
    start = 0
    logits = None
    # no_grad, not inference_mode: the cache handed back is updated in place by later
    # forwards (recurrent layers copy_ into their state), which inference tensors refuse.
    with torch.no_grad():
        for end in [*(c for c in cuts if c < t), t]:
            out = model(input_ids=ids[None, start:end], cache=cache, use_cache=True)
            logits = out.logits[:, -1]
            if end in cuts:
                snapshots.append((end, state_page(layout, hl.layers, cache, sg)))
            start = end
    assert logits is not None  # t > 0, so the loop ran
    lid = bank.register(layout)
    counts = [0] * len(layout.groups)
    nbytes = 0
    for g, grp in enumerate(layout.groups):
        if grp.kind is GroupKind.ATTENTION and keyed and layout.group_bytes(g):
            pages = attention_pages(layout, hl.layers, cache, g, keyed)
            bank.put(lid, group=g, pages=pages, scope=scope, keys=keys, shard=shard)
            counts[g], nbytes = keyed, nbytes + pages.numel()
    if hl.state_group is not None and snapshots:
        bank.put_states(lid, group=sg, states=torch.stack([page for _, page in snapshots]),
                        at=[at for at, _ in snapshots], scope=scope, keys=keys, shard=shard)
        counts[hl.state_group] = len(snapshots)
        nbytes += sum(page.numel() for _, page in snapshots)
    for i in recording:  # back to transformers' own bookkeeping: the last S - 1 tokens
        layer = cache.layers[i]
        layer.crop(0)
        layer.record_past = False
    return Stored(cache, logits, tuple(counts), tuple(at for at, _ in snapshots), nbytes)


# ---- load ------------------------------------------------------------------------------------


def fetch_pages(
    bank: WorkerAPI,
    hl: ModelLayout,
    tokens: Tokens,
    *,
    scope: Scope = DEFAULT_SCOPE,
    shard: int | None = None,
) -> Fetched:
    """Match ``tokens`` and fetch the rows its bound needs into buffers of the right size."""
    if not isinstance(hl, ModelLayout):
        raise InvalidInput(f"hl: expected a ModelLayout, got {type(hl).__name__}")
    ids = _ids(tokens, torch.device("cpu")).numpy()
    # Match and fetch in one call (a node on this host: one round trip), into new buffers.
    try:  # the id is the layout's own hash: register only when the bank does not know it
        return bank.fetch_prefix(hl.layout_id, ids, scope=scope, shard=shard)
    except UnknownLayout:
        return bank.fetch_prefix(bank.register(hl.layout), ids, scope=scope, shard=shard)


def build_cache(hl: ModelLayout, model: HfModel, tokens: Tokens, fetched: Fetched) -> Loaded:
    """A fresh ``DynamicCache`` holding tokens ``[0, r)`` from ``fetched`` (checked first)."""
    return _build_cache(hl, model, tokens, fetched, check_tokens=True)


def _build_cache(hl: ModelLayout, model: HfModel, tokens: Tokens, fetched: Fetched, *,
                 check_tokens: bool) -> Loaded:
    if not isinstance(hl, ModelLayout):
        raise InvalidInput(f"hl: expected a ModelLayout, got {type(hl).__name__}")
    if not isinstance(fetched, Fetched):
        raise InvalidInput(f"fetched: expected a Fetched, got {type(fetched).__name__}")
    m = fetched.match
    if m.layout_id != hl.layout_id:
        raise InvalidInput(
            f"fetched: pages of layout {m.layout_id.hex()[:16]}…, this model's "
            f"layout is {hl.layout_id.hex()[:16]}…"
        )
    ids = _ids(tokens, model.device)
    # The pages belong to the matched prompt: the same length and the same key chain.
    # (load() matched these very tokens: it skips re-hashing the chain.)
    keyed = next((g for g in m.names if g), ()) if check_tokens else ()
    if int(ids.numel()) != m.prompt_tokens or [RowName.parse(n).page_key for n in keyed] != (
        page_keys(ids.cpu().numpy(), hl.layout.tokens_per_page, m.scope)[: len(keyed)] if keyed else []
    ):
        raise InvalidInput(f"tokens: not the {m.prompt_tokens}-token prompt the pages were matched for")
    cache = fresh_cache(model)
    r = fetched.tokens
    if r and fetched.result is not None:
        bound = fetched.result.resume
        restore(hl.layout, hl.layers, cache, fetched.pages, fetched.match.resume.pages,
                bound.pages, r, model.device)
    return Loaded(cache, r, ids[None], fetched.match, fetched.result)


def load(
    bank: WorkerAPI,
    hl: ModelLayout,
    model: HfModel,
    tokens: Tokens,
    *,
    scope: Scope = DEFAULT_SCOPE,
    shard: int | None = None,
) -> Loaded:
    """:func:`fetch_pages` then :func:`build_cache`."""
    fetched = fetch_pages(bank, hl, tokens, scope=scope, shard=shard)
    return _build_cache(hl, model, tokens, fetched, check_tokens=False)
