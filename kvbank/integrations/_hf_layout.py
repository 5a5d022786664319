"""The model side of the transformers adapter: fingerprint and layout.

Primitives:

- :func:`model_fingerprint` — what determines a model's K/V, as the layout's ``model``.
- :func:`layout_for` — a :class:`ModelLayout`: the :class:`~kvbank.layout.PageLayout` and
  one :class:`~kvbank.integrations._hf_cache.CacheLayerMap` per ``cache.layers`` entry.
  Groups come from what each cache layer *is* (its transformers class): full-attention
  layers form one group, sliding layers one group per ``sliding_window`` (declared as
  ``window = sliding_window - 1``), recurrent layers one ``STATE`` group; a layer that is
  both sits in an attention group and the state group. Shapes and dtypes are probed with
  a two-token forward, never hard-coded per family. A Mamba-2 conv state declares its
  x, B and C channel sections (from the config's group and state sizes, checked against
  the probed width), so it reshards across tensor-parallel sizes section by section.

See :mod:`kvbank.integrations.transformers` for the user-facing lifecycle.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from kvbank.errors import InvalidInput
from kvbank.integrations._hf_cache import CacheLayerMap, UnmappableLayer, classify
from kvbank.layout import BufferSpec, GroupKind, LayerGroup, PageLayout, Role, dtype_name

HfModel = Any  # a transformers PreTrainedModel (transformers is untyped)

# Config keys that change with how a model was saved or loaded, never with its K/V.
# The dtype is not lost: every parameter's dtype is hashed.
_VOLATILE_KEYS = frozenset({
    "_name_or_path", "_commit_hash", "transformers_version", "architectures", "dtype",
    "torch_dtype", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
    "_attn_implementation_autoset", "_attn_implementation_internal",
    "_experts_implementation_internal", "id2label", "label2id",
})


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
        # "main" names other weights in every repository: the revision counts only with
        # the model's name.
        name = getattr(config, "_name_or_path", "") or ""
        h.update(f"name={name}\0revision={revision}\0".encode())
    tensors = [*model.named_parameters(remove_duplicate=False),
               *model.named_buffers(remove_duplicate=False)]
    for name, t in sorted(tensors, key=lambda item: item[0]):
        h.update(f"{name}:{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)}\0".encode())
        if revision is None:
            h.update(memoryview(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()))
    model_type = getattr(config, "model_type", "model") or "model"
    return f"{model_type}:{'rev' if revision else 'weights'}:{h.hexdigest()}"


def fresh_cache(model: HfModel) -> Any:
    """An empty ``DynamicCache`` with the layer classes ``model``'s config asks for."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _layer_types(model: HfModel) -> list[str | None]:
    text = model.config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None)
    n = getattr(text, "num_hidden_layers", 0)
    return list(types) if types is not None else [None] * n


def _probe(model: HfModel) -> Any:
    """A cache after a two-token forward: every layer's tensors exist, with real shapes."""
    cache = fresh_cache(model)
    ids = torch.zeros((1, 2), dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def _first_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _conv_sections(model: HfModel, layer: int, channels: int, shard_count: int) -> tuple[int, ...]:
    """One shard's x, B and C channel counts of a Mamba-2 conv state; ``()`` for a conv
    state of one kind of channel (Mamba-1).

    A Mamba-2 mixer convolves x (the inner width) beside B and C (``n_groups * d_state``
    each) in one tensor. Split evenly over ranks as one axis, rank 0 would get all of x and
    none of C, so each section is declared and split on its own. ``channels`` is what the
    probe's conv state holds (one shard's when the model itself is a shard)."""
    text = model.config.get_text_config(decoder=True)
    groups = _first_int(text, "mamba_n_groups", "n_groups")
    d_state = _first_int(text, "mamba_d_state", "state_size", "ssm_state_size")
    if groups is None or d_state is None:
        return ()  # no B/C sections: one kind of channel, split as one axis
    if (groups * d_state) % shard_count:
        raise UnmappableLayer(
            f"layer {layer}: a Mamba-2 conv state with n_groups * d_state = {groups * d_state} "
            f"cannot be split over {shard_count} shards"
        )
    bc = groups * d_state // shard_count
    inner = channels - 2 * bc
    heads = _first_int(text, "mamba_n_heads", "num_heads")
    head_dim = _first_int(text, "mamba_d_head", "head_dim")
    expected = None if heads is None or head_dim is None else heads * head_dim // shard_count
    if inner <= 0 or (expected is not None and inner != expected):
        raise UnmappableLayer(
            f"layer {layer}: a Mamba-2 conv state of {channels} channels is not x "
            f"({expected if expected is not None else '?'}) + B + C ({bc} each) as its config says"
        )
    return (inner, bc, bc)


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
                                          (*conv.shape[1:-1], kernel), head_axis=0,
                                          sections=_conv_sections(model, i, int(conv.shape[1]),
                                                                  shard_count)))
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
