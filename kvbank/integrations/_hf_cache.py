"""transformers cache layers <-> kvbank pages: the byte-level half of the transformers adapter.

Primitives:

- :class:`LayerKind` and :func:`classify` — what one ``cache.layers`` entry holds (full or
  sliding attention, recurrent state, both, nothing), from its class, never from a model
  family's name. A class kvbank cannot map is :class:`UnmappableLayer`.
- :class:`CacheLayerMap` — one cache layer's place in a layout: its groups, transformers'
  ``sliding_window``, the conv kernel, the dtypes the cache computes in.
- :func:`attention_pages` / :func:`state_page` — a prefilled cache's K/V (token-major) and
  recurrent state written into canonical pages through :meth:`PageLayout.views`.
- :func:`restore` — fetched pages written into a fresh ``DynamicCache`` as transformers
  would hold them after a prefill of ``r`` tokens: full layers hold ``[0, r)``, sliding
  layers the last ``sliding_window - 1`` tokens with ``cumulative_length = r``, recurrent
  layers their snapshot with ``has_previous_state`` set (without it transformers silently
  treats the next forward as a fresh prefill).

Everything is checked before any cache tensor is written: page tensors of the wrong shape
are :class:`~kvbank.errors.PageSizeMismatch`, a cache whose layers do not match the map is
:class:`~kvbank.errors.InvalidInput`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvbank.errors import InvalidInput, LayoutError, PageSizeMismatch
from kvbank.layout import PageLayout, Role

HfCache = Any  # a transformers Cache (transformers is untyped)


class UnmappableLayer(LayoutError):
    """A model layer whose cache kvbank cannot declare (names the layer and its type)."""


class LayerKind(enum.Enum):
    NONE = "NONE"  # no cache of its own (MLP/MoE-only, or it reuses another layer's KV)
    FULL = "FULL"
    SLIDING = "SLIDING"
    STATE = "STATE"
    FULL_STATE = "FULL_STATE"  # FalconH1-style: attention and recurrent in one layer
    SLIDING_STATE = "SLIDING_STATE"

    @property
    def attention(self) -> bool:
        return self in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.FULL_STATE,
                        LayerKind.SLIDING_STATE)

    @property
    def sliding(self) -> bool:
        return self in (LayerKind.SLIDING, LayerKind.SLIDING_STATE)

    @property
    def state(self) -> bool:
        return self in (LayerKind.STATE, LayerKind.FULL_STATE, LayerKind.SLIDING_STATE)


@dataclass(frozen=True, slots=True)
class CacheLayerMap:
    """Where ``cache.layers[index]`` lives in the layout (kvbank layer = ``index``)."""

    index: int
    kind: LayerKind
    attention_group: int | None
    state_group: int | None
    sliding_window: int | None  # transformers' value S; the layout declares window S - 1
    conv_kernel: int | None
    kv_dtype: str | None  # what the cache computes K/V in (pages may hold another dtype)


def classify(layer: object, index: int, layer_type: str | None) -> LayerKind:
    """The kind of one cache layer, by its transformers class."""
    from transformers import cache_utils as cu

    if isinstance(layer, cu.DummyLayer):
        return LayerKind.NONE
    linear = isinstance(layer, cu.LinearAttentionCacheLayerMixin)
    attention = isinstance(layer, cu.CacheLayerMixin)
    # Only the two dynamic attention classes hold plain K/V kvbank can page; indexed,
    # quantized, static and compressed layers keep extra state we would drop silently.
    plain = type(layer) in (cu.DynamicLayer, cu.DynamicSlidingWindowLayer) or (
        linear and type(layer) in (cu.LinearAttentionLayer,
                                   cu.LinearAttentionAndFullAttentionLayer,
                                   cu.LinearAttentionAndSlidingWindowAttentionLayer)
    )
    if not plain or (linear and getattr(layer, "number_of_states", 1) != 1):
        raise UnmappableLayer(
            f"layer {index}: transformers layer type {layer_type!r} (cache class "
            f"{type(layer).__name__}) has no kvbank mapping"
        )
    sliding = isinstance(layer, cu.DynamicSlidingWindowLayer)
    if linear and attention:
        return LayerKind.SLIDING_STATE if sliding else LayerKind.FULL_STATE
    if linear:
        return LayerKind.STATE
    return LayerKind.SLIDING if sliding else LayerKind.FULL


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidInput(f"dtype: torch {torch.__version__} has no dtype {name!r}")
    return dtype


def check_cache(layers: Sequence[CacheLayerMap], cache: HfCache) -> None:
    """``cache`` has the layer classes ``layers`` were mapped from (same model, same layout)."""
    got = len(cache.layers)
    if got != len(layers):
        raise InvalidInput(f"cache: {got} layers, the layout maps {len(layers)}")
    for m in layers:
        kind = classify(cache.layers[m.index], m.index, None)
        if kind is not m.kind:
            raise InvalidInput(
                f"cache: layer {m.index} is {kind.name} here, {m.kind.name} in the layout"
            )


# ---- cache -> pages ----------------------------------------------------------------------


def _token_major(t: torch.Tensor, start: int, n: int, p: int) -> torch.Tensor:
    """``[1, heads, T, dim]`` tokens ``[start, start + n·p)`` as ``[n, p, heads, dim]``."""
    heads, dim = t.shape[1], t.shape[3]
    return t[0, :, start : start + n * p].reshape(heads, n, p, dim).permute(1, 2, 0, 3)


def attention_pages(
    layout: PageLayout, layers: Sequence[CacheLayerMap], cache: HfCache, group: int, n: int
) -> torch.Tensor:
    """Pages ``0..n-1`` of an attention group from a cache that holds every token's K/V
    (sliding layers recorded their past during the prefill)."""
    pages = torch.zeros((n, layout.group_bytes(group)), dtype=torch.uint8)
    views = layout.views(pages, group)
    p = layout.tokens_per_page
    for m in layers:
        if m.attention_group != group:
            continue
        layer = cache.layers[m.index]
        for role, t in ((Role.KEY, layer.keys), (Role.VALUE, layer.values)):
            if t is None or t.dim() != 4 or t.shape[0] != 1 or t.shape[2] < n * p:
                shape = None if t is None else tuple(t.shape)
                raise InvalidInput(
                    f"cache: layer {m.index} {role.name} holds {shape}, not the "
                    f"[1, heads, >= {n * p}, dim] a store needs (was its past recorded?)"
                )
            dst = views[(m.index, role)]
            got = (str(t.dtype).removeprefix("torch."), t.shape[1], t.shape[3])
            want = (m.kv_dtype, dst.shape[2], dst.shape[3])
            if got != want:  # another model's layout: its pages would be named wrongly
                raise InvalidInput(
                    f"cache: layer {m.index} {role.name} is (dtype, heads, dim) {got}, the "
                    f"layout was made for {want}"
                )
            dst.copy_(_token_major(t, 0, n, p))
    return pages


def state_page(
    layout: PageLayout, layers: Sequence[CacheLayerMap], cache: HfCache, group: int
) -> torch.Tensor:
    """The snapshot of a STATE group: every recurrent layer's conv and SSM state now."""
    page = torch.zeros(layout.group_bytes(group), dtype=torch.uint8)
    views = layout.views(page, group)
    for m in layers:
        if m.state_group != group:
            continue
        layer = cache.layers[m.index]
        conv = layer.conv_states[0]
        if conv is not None and (m.index, Role.CONV_STATE) in views:
            k = m.conv_kernel or conv.shape[-1]
            # A layer recording its past keeps the whole conv input; the state is its tail.
            # A prefill shorter than the kernel is left-padded, as transformers pads it.
            tail = conv[0, ..., -k:]
            dst = views[(m.index, Role.CONV_STATE)]
            dst.zero_()
            dst[..., k - tail.shape[-1] :].copy_(tail)
        ssm = layer.recurrent_states[0]
        if ssm is not None and (m.index, Role.SSM_STATE) in views:
            dst = views[(m.index, Role.SSM_STATE)]
            if ssm.dtype != dst.dtype or tuple(ssm.shape[1:]) != tuple(dst.shape):
                raise InvalidInput(
                    f"cache: layer {m.index} SSM_STATE is {ssm.dtype} {tuple(ssm.shape[1:])}, "
                    f"the layout was made for {dst.dtype} {tuple(dst.shape)}"
                )
            dst.copy_(ssm[0])
    return page


# ---- pages -> cache ----------------------------------------------------------------------


def check_pages(
    layout: PageLayout, pages: Mapping[int, torch.Tensor], plan: Sequence[Sequence[int]]
) -> None:
    """Every group the plan needs has ``uint8 [len(plan[g]), group_bytes]`` pages."""
    for g, wanted in enumerate(plan):
        if not wanted:
            continue
        t = pages.get(g)
        size = layout.group_bytes(g)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
            raise InvalidInput(f"pages[{g}]: expected a uint8 tensor [{len(wanted)}, {size}]")
        if t.shape[1] != size or t.shape[0] < len(wanted):
            raise PageSizeMismatch(
                f"pages[{g}]: {tuple(t.shape)}, group {g} needs [{len(wanted)}, {size}]"
            )


def restore(
    layout: PageLayout,
    layers: Sequence[CacheLayerMap],
    cache: HfCache,
    pages: Mapping[int, torch.Tensor],
    plan: Sequence[Sequence[int]],
    needed: Sequence[Sequence[int]],
    r: int,
    device: torch.device,
) -> None:
    """Fill a fresh ``cache`` with the first ``r`` tokens' state.

    ``pages[g][k]`` holds key index ``plan[g][k]`` of group ``g`` (what was fetched);
    ``needed[g]`` are the key indices resuming at ``r`` uses (a subset of the plan)."""
    check_pages(layout, pages, plan)
    check_cache(layers, cache)
    p = layout.tokens_per_page
    views: dict[int, dict[tuple[int, Role], torch.Tensor]] = {}
    for g, want in enumerate(needed):
        if not want:
            continue
        slot = {j: k for k, j in enumerate(plan[g])}
        missing = [j for j in want if j not in slot]
        if missing:
            raise InvalidInput(f"pages[{g}]: key indices {missing} were not fetched")
        slots = [slot[j] for j in want]
        # Usually every fetched row is used, in order: a view, not a gathered copy.
        run = slots == list(range(slots[0], slots[0] + len(slots)))
        rows = pages[g][slots[0] : slots[0] + len(slots)] if run else pages[g][slots]
        views[g] = layout.views(rows, g)
    for m in layers:
        layer = cache.layers[m.index]
        if m.kind.attention and m.attention_group is not None:
            g = m.attention_group
            keep = r - needed[g][0] * p  # tokens the fetched pages hold, up to r
            if m.sliding_window is not None:  # transformers keeps the last S - 1 of them
                keep = min(keep, m.sliding_window - 1)
            assert m.kv_dtype is not None  # every attention layer records its dtype
            kv = [_cache_tensor(views[g][(m.index, role)], keep, m.kv_dtype, device)
                  for role in (Role.KEY, Role.VALUE)]
            # Assigned, not update()d: update would concatenate, a second full copy.
            layer.lazy_initialization(kv[0], kv[1])
            layer.keys, layer.values = kv
            if m.sliding_window is not None:
                layer.cumulative_length = r
        if m.kind.state and m.state_group is not None:
            _restore_state(layer, views[m.state_group], m, device)


def _cache_tensor(v: torch.Tensor, keep: int, dtype: str, device: torch.device) -> torch.Tensor:
    """Page views ``[n, p, heads, dim]`` as the cache's ``[1, heads, keep, dim]`` (the last
    ``keep`` tokens), with one strided copy (pages interleave layers, so no view fits)."""
    n, p, heads, dim = v.shape
    out = torch.empty((1, heads, n * p, dim), dtype=_torch_dtype(dtype), device=device)
    out[0].view(heads, n, p, dim).copy_(v.permute(2, 0, 1, 3))
    return out[:, :, n * p - keep :] if keep < n * p else out


def _restore_state(
    layer: Any, views: Mapping[tuple[int, Role], torch.Tensor], m: CacheLayerMap,
    device: torch.device,
) -> None:
    from transformers.cache_utils import LinearAttentionLayer

    conv = views.get((m.index, Role.CONV_STATE))
    ssm = views.get((m.index, Role.SSM_STATE))
    conv_t = None if conv is None else conv[0].unsqueeze(0).to(device)
    ssm_t = None if ssm is None else ssm[0].unsqueeze(0).to(device)
    # Called on the class: the hybrid layers' own lazy_initialization dispatches on the
    # argument count and would ignore these keywords.
    LinearAttentionLayer.lazy_initialization(
        layer, conv_states=conv_t, recurrent_states=ssm_t, state_idx=0,
        conv_kernel_size=m.conv_kernel,
    )
    if conv_t is not None:
        layer.conv_states[0].copy_(conv_t)
    if ssm_t is not None:
        layer.recurrent_states[0].copy_(ssm_t)
    layer.has_previous_state[0] = True
