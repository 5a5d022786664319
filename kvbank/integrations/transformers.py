"""kvbank for Hugging Face transformers: store a prefill, resume another prompt from it.

Install with ``pip install 'kvbank[transformers]'`` (transformers 5.24 or newer; the core
never imports transformers). User code::

    from kvbank import Bank
    from kvbank.integrations import transformers as kt

    hl = kt.layout_for(model)                       # the PageLayout + the cache-layer map
    kt.store(bank, hl, model, prompt_a)             # worker A: one prefill, pages stored
    got = kt.load(bank, hl, model, prompt_b)        # worker B: a DynamicCache of r tokens
    out = model.generate(got.generate_ids, cache=got.cache)  # computes prompt_b[r:]

``bank`` is anything with :class:`~kvbank.Bank`'s API (``register``, ``put``,
``put_state``, ``match``, ``fetch``); the node service's client has the same one.

Primitives:

- :func:`model_fingerprint` — the layout's ``model`` field: the config minus keys that
  change with how a model was saved or loaded, the attention implementation, and every
  parameter and buffer with its dtype and bytes (or, with ``revision=``, its name, dtype
  and shape only: the revision names the weights). Equal across processes and load paths
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

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvbank.bank import FetchResult, Match
from kvbank.errors import InvalidInput
from kvbank.integrations._hf_cache import (
    CacheLayerMap,
    LayerKind,
    UnmappableLayer,
    attention_pages,
    check_cache,
    classify,
    restore,
    state_page,
)
from kvbank.keys import DEFAULT_SCOPE, Scope, page_keys
from kvbank.layout import (
    BufferSpec,
    GroupKind,
    LayerGroup,
    PageLayout,
    Role,
    dtype_name,
)

__all__ = [
    "DEFAULT_SNAPSHOT_PAGES",
    "BankLike",
    "CacheLayerMap",
    "Fetched",
    "LayerKind",
    "Loaded",
    "ModelLayout",
    "Stored",
    "UnmappableLayer",
    "build_cache",
    "fetch_pages",
    "layout_for",
    "load",
    "model_fingerprint",
    "store",
]

HfModel = Any  # a transformers PreTrainedModel (transformers is untyped)
Tokens = Sequence[int] | torch.Tensor  # 1-D, or [1, T]

# Recurrent snapshots every 16 pages (256 tokens at 16 a page): chunking a prefill costs
# ~2.2x at 256-token chunks here and ~10x at 16, so every page would be too dear.
DEFAULT_SNAPSHOT_PAGES = 16

# Config keys that change with how a model was saved or loaded, never with its K/V.
# The dtype is not lost: every parameter's dtype is hashed.
_VOLATILE_KEYS = frozenset({
    "_name_or_path", "_commit_hash", "transformers_version", "architectures", "dtype",
    "torch_dtype", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
    "_attn_implementation_autoset", "_attn_implementation_internal",
    "_experts_implementation_internal", "id2label", "label2id",
})


class BankLike(Protocol):
    """What the adapter needs of a bank: :class:`~kvbank.Bank` and its service client."""

    def register(self, layout: PageLayout) -> bytes: ...

    def put(self, layout_id: bytes, tokens: Any = None, *, group: int, pages: Any,
            scope: Scope = ..., keys: Sequence[bytes] | None = None, first_page: int = 0,
            shard: int | None = None) -> list[bytes]: ...

    def put_state(self, layout_id: bytes, tokens: Any = None, *, group: int, state: Any,
                  at: int | None = None, scope: Scope = ...,
                  keys: Sequence[bytes] | None = None, shard: int | None = None) -> bytes: ...

    def match(self, layout_id: bytes, tokens: Any, *, scope: Scope = ...,
              shard: int | None = None) -> Match: ...

    def fetch(self, match: Match, *, out: Any, fetch_id: str | None = None,
              max_rows: int | None = None) -> FetchResult: ...


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """A model's page layout and where each of its cache layers sits in it."""

    layout: PageLayout
    layers: tuple[CacheLayerMap, ...]  # one per cache.layers entry, in order

    @property
    def layout_id(self) -> bytes:
        return self.layout.layout_id

    @property
    def state_group(self) -> int | None:
        return next((g for g, grp in enumerate(self.layout.groups)
                     if grp.kind is GroupKind.STATE), None)


@dataclass(frozen=True, slots=True)
class Stored:
    """What :func:`store` put, and the storing worker's own cache to go on with."""

    cache: Any  # the prefilled DynamicCache (sliding layers trimmed back to their window)
    logits: torch.Tensor  # [1, vocab] at the prompt's last token
    pages: tuple[int, ...]  # per group: pages put (attention) or snapshots put (state)
    snapshots: tuple[int, ...]  # token boundaries with a recurrent snapshot
    nbytes: int  # page bytes handed to the bank


@dataclass(frozen=True, slots=True)
class Fetched:
    """The rows of a match that arrived, as page tensors (before any cache is built)."""

    match: Match
    result: FetchResult | None  # None when the match's bound was 0 (nothing fetched)
    pages: Mapping[int, torch.Tensor]  # group -> uint8 [len(match.resume.pages[g]), bytes]

    @property
    def tokens(self) -> int:
        """The bound the delivered rows allow (0 = recompute everything)."""
        return 0 if self.result is None else self.result.resume.tokens


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


# ---- fingerprint and layout ----------------------------------------------------------------


def _config_doc(config: Any) -> object:
    doc = config.to_dict()

    def strip(value: object) -> object:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _VOLATILE_KEYS}
        if isinstance(value, list | tuple):
            return [strip(v) for v in value]
        return value

    return strip(doc)


def model_fingerprint(model: HfModel, *, revision: str | None = None) -> str:
    """A string naming what determines ``model``'s K/V (see the module docstring)."""
    h = hashlib.sha256(b"kvbank/transformers-fingerprint\0v1\0")
    config = model.config
    h.update(json.dumps(_config_doc(config), sort_keys=True, default=str).encode())
    h.update(f"\0attn={getattr(config, '_attn_implementation', None)}\0".encode())
    if revision is not None:
        if not isinstance(revision, str) or not revision:
            raise InvalidInput(f"revision: must be a non-empty string, got {revision!r}")
        h.update(f"revision={revision}\0".encode())
    tensors = [*model.named_parameters(remove_duplicate=False),
               *model.named_buffers(remove_duplicate=False)]
    for name, t in sorted(tensors, key=lambda item: item[0]):
        h.update(f"{name}:{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)}\0".encode())
        if revision is None:
            h.update(memoryview(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()))
    model_type = getattr(config, "model_type", "model") or "model"
    return f"{model_type}:{'rev' if revision else 'weights'}:{h.hexdigest()}"


def _fresh_cache(model: HfModel) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _layer_types(model: HfModel) -> list[str | None]:
    text = model.config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None)
    n = getattr(text, "num_hidden_layers", 0)
    return list(types) if types is not None else [None] * n


def _probe(model: HfModel) -> Any:
    """A cache after a two-token forward: every layer's tensors exist, with real shapes."""
    cache = _fresh_cache(model)
    ids = torch.zeros((1, 2), dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def layout_for(
    model: HfModel,
    *,
    tokens_per_page: int = 16,
    dtype: str | torch.dtype | None = None,
    shard_count: int = 1,
    shard_index: int = 0,
    revision: str | None = None,
) -> ModelLayout:
    """The layout of ``model``'s cache. ``dtype`` stores attention K/V in another dtype
    than the cache computes in (lossy when narrower); states keep their own dtype."""
    kv_override = None if dtype is None else dtype_name(dtype)
    probe = _probe(model)
    types = _layer_types(model)
    kinds = [classify(layer, i, types[i] if i < len(types) else None)
             for i, layer in enumerate(probe.layers)]
    windows = sorted({probe.layers[i].sliding_window for i, k in enumerate(kinds) if k.sliding})
    groups: list[LayerGroup] = []
    full = tuple(i for i, k in enumerate(kinds) if k.attention and not k.sliding)
    group_of: dict[int | None, int] = {}  # sliding_window (None = full) -> group index
    if full:
        group_of[None] = len(groups)
        groups.append(LayerGroup(GroupKind.ATTENTION, full))
    for s in windows:
        group_of[s] = len(groups)
        layers = tuple(i for i, k in enumerate(kinds)
                       if k.sliding and probe.layers[i].sliding_window == s)
        # transformers' S counts the query's own token; kvbank's window does not.
        groups.append(LayerGroup(GroupKind.ATTENTION, layers, window=max(1, s - 1)))
    recurrent = tuple(i for i, k in enumerate(kinds) if k.state)
    state_group = len(groups) if recurrent else None
    if recurrent:
        groups.append(LayerGroup(GroupKind.STATE, recurrent))

    buffers: list[BufferSpec] = []
    maps: list[CacheLayerMap] = []
    for i, (layer, kind) in enumerate(zip(probe.layers, kinds, strict=True)):
        s = layer.sliding_window if kind.sliding else None
        kv_dtype = None
        if kind.attention:
            kv_dtype = dtype_name(layer.keys.dtype)
            for role, t in ((Role.KEY, layer.keys), (Role.VALUE, layer.values)):
                buffers.append(BufferSpec(i, role, kv_override or dtype_name(t.dtype),
                                          (t.shape[1], t.shape[3]), head_axis=0))
        kernel = None
        if kind.state:
            conv, ssm = layer.conv_states[0], layer.recurrent_states[0]
            if conv is None and ssm is None:
                raise UnmappableLayer(f"layer {i}: a recurrent layer with no state after a forward")
            if conv is not None:
                kernel = int(layer.conv_kernel_size[0] or conv.shape[-1])
                buffers.append(BufferSpec(i, Role.CONV_STATE, dtype_name(conv.dtype),
                                          (*conv.shape[1:-1], kernel), head_axis=0))
            if ssm is not None:
                buffers.append(BufferSpec(i, Role.SSM_STATE, dtype_name(ssm.dtype),
                                          tuple(ssm.shape[1:]), head_axis=0))
        maps.append(CacheLayerMap(
            index=i, kind=kind,
            attention_group=group_of[s] if kind.attention else None,
            state_group=state_group if kind.state else None,
            sliding_window=s, conv_kernel=kernel, kv_dtype=kv_dtype,
        ))
    if not buffers:
        raise UnmappableLayer("model: no layer holds a cache kvbank could store")
    layout = PageLayout(
        model=model_fingerprint(model, revision=revision),
        tokens_per_page=tokens_per_page,
        groups=tuple(groups),
        buffers=tuple(buffers),
        shard_count=shard_count,
        shard_index=shard_index,
    )
    return ModelLayout(layout, tuple(maps))


# ---- store -----------------------------------------------------------------------------------


def _ids(tokens: Tokens, device: torch.device) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        t = tokens[0] if tokens.dim() == 2 and tokens.shape[0] == 1 else tokens
        if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise InvalidInput(f"tokens: expected 1-D or [1, T] integer ids, got "
                               f"{t.dtype} {tuple(tokens.shape)}")
        return t.to(device=device, dtype=torch.long)
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise InvalidInput(f"tokens: expected a sequence of token ids, got {type(tokens).__name__}")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in tokens):
        raise InvalidInput("tokens: every token id must be an int")
    return torch.tensor(list(tokens), dtype=torch.long, device=device)


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
    bank: BankLike,
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
    keys = page_keys(ids.tolist(), p, scope)  # the chain is hashed once for every group
    cache = _fresh_cache(model)
    check_cache(hl.layers, cache)
    recording = [m.index for m in hl.layers if m.kind.sliding]
    for i in recording:  # keep each sliding layer's whole past until it is paged
        cache.layers[i].activate_past_recording()
    cuts = _boundaries(hl, t, snapshot_every)
    sg = hl.state_group if hl.state_group is not None else -1  # cuts is empty without one
    snapshots: list[tuple[int, torch.Tensor]] = []
    start = 0
    logits = None
    with torch.inference_mode():
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
    if hl.state_group is not None:
        for at, page in snapshots:  # no batch put_state yet: one call a snapshot
            bank.put_state(lid, group=hl.state_group, state=page, at=at, scope=scope,
                           keys=keys, shard=shard)
        counts[hl.state_group] = len(snapshots)
        nbytes += sum(page.numel() for _, page in snapshots)
    for i in recording:  # back to transformers' own bookkeeping: the last S - 1 tokens
        layer = cache.layers[i]
        layer.crop(0)
        layer.record_past = False
    return Stored(cache, logits, tuple(counts), tuple(at for at, _ in snapshots), nbytes)


# ---- load ------------------------------------------------------------------------------------


def fetch_pages(
    bank: BankLike,
    hl: ModelLayout,
    tokens: Tokens,
    *,
    scope: Scope = DEFAULT_SCOPE,
    shard: int | None = None,
) -> Fetched:
    """Match ``tokens`` and fetch the rows its bound needs into buffers of the right size."""
    if not isinstance(hl, ModelLayout):
        raise InvalidInput(f"hl: expected a ModelLayout, got {type(hl).__name__}")
    ids = _ids(tokens, torch.device("cpu"))
    lid = bank.register(hl.layout)
    m = bank.match(lid, ids.tolist(), scope=scope, shard=shard)
    plan = m.resume.pages
    out = {g: torch.zeros((len(want), hl.layout.group_bytes(g)), dtype=torch.uint8)
           for g, want in enumerate(plan) if want}
    if m.resume.tokens == 0 or not out:
        return Fetched(m, None, out)
    return Fetched(m, bank.fetch(m, out=out), out)


def build_cache(hl: ModelLayout, model: HfModel, tokens: Tokens, fetched: Fetched) -> Loaded:
    """A fresh ``DynamicCache`` holding tokens ``[0, r)`` from ``fetched`` (checked first)."""
    if not isinstance(fetched, Fetched):
        raise InvalidInput(f"fetched: expected a Fetched, got {type(fetched).__name__}")
    if fetched.match.layout_id != hl.layout_id:
        raise InvalidInput(
            f"fetched: pages of layout {fetched.match.layout_id.hex()[:16]}…, this model's "
            f"layout is {hl.layout_id.hex()[:16]}…"
        )
    ids = _ids(tokens, model.device)
    if int(ids.numel()) != fetched.match.prompt_tokens:
        raise InvalidInput(
            f"tokens: {ids.numel()} tokens, the match was for {fetched.match.prompt_tokens}"
        )
    cache = _fresh_cache(model)
    r = fetched.tokens
    if r and fetched.result is not None:
        bound = fetched.result.resume
        restore(hl.layout, hl.layers, cache, fetched.pages, fetched.match.resume.pages,
                bound.pages, r, model.device)
    return Loaded(cache, r, ids[None], fetched.match, fetched.result)


def load(
    bank: BankLike,
    hl: ModelLayout,
    model: HfModel,
    tokens: Tokens,
    *,
    scope: Scope = DEFAULT_SCOPE,
    shard: int | None = None,
) -> Loaded:
    """:func:`fetch_pages` then :func:`build_cache`."""
    fetched = fetch_pages(bank, hl, tokens, scope=scope, shard=shard)
    return build_cache(hl, model, tokens, fetched)
