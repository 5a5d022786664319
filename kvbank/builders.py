"""Layout builders: the :class:`~kvbank.layout.PageLayout` of common model families.

- :func:`full_attention` — every layer full attention (MHA or GQA), K and V per layer,
  plus scale buffers for a quantized cache;
- :func:`mla` — multi-head latent attention: one replicated latent (and rope) buffer per
  layer;
- :func:`sliding_window` — full and sliding-window layers in separate groups;
- :func:`hybrid_mamba` — attention layers beside recurrent (Mamba) layers whose conv and
  SSM state are ``STATE`` snapshots.

Each takes the model fingerprint, the shapes, ``dtype`` (a name or a ``torch.dtype``),
``quant`` (a :class:`~kvbank.layout.QuantMode` or its name) and ``shard_count`` /
``shard_index``; heads divide over ranks, or duplicate when ranks outnumber them. They are
plain functions over :mod:`kvbank.layout`'s declarations: a layout built by hand with the
same buffers has the same id.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbank import checks
from kvbank.errors import LayoutError
from kvbank.layout import (
    BufferSpec,
    GroupKind,
    LayerGroup,
    PageLayout,
    QuantMode,
    Role,
    _shard_heads,
    dtype_name,
)

if TYPE_CHECKING:
    import torch


def _quant(quant: object) -> QuantMode:
    """A builder's ``quant``: a :class:`QuantMode` or its name as the docs spell it ("FP8")."""
    return quant if isinstance(quant, QuantMode) else QuantMode.parse(quant)


@dataclass(frozen=True, slots=True)
class _Heads:
    local: int  # heads one rank holds
    total: int  # heads over all ranks


def _heads_per_shard(num_kv_heads: int, shard_count: int) -> _Heads:
    return _Heads(_shard_heads(num_kv_heads, shard_count, "num_kv_heads"), num_kv_heads)



def _kv_buffers(
    layers: Iterable[int], kv_heads: _Heads, head_dim: int, dtype: str, quant: QuantMode
) -> list[BufferSpec]:
    """K and V per layer, plus the scale buffers the quant mode needs."""
    out: list[BufferSpec] = []
    heads, total = kv_heads.local, kv_heads.total
    for layer in layers:
        if quant is QuantMode.NONE:
            kv = ((dtype, (heads, head_dim)),)
            scale: tuple[str, tuple[int, ...]] | None = None
        elif quant is QuantMode.FP8:
            kv = (("float8_e4m3fn", (heads, head_dim)),)
            scale = ("float32", (heads, 1))  # one scale per token per head
        elif quant is QuantMode.INT8:
            kv = (("int8", (heads, head_dim)),)
            scale = ("float32", (heads, 1))
        elif quant in (QuantMode.NVFP4, QuantMode.MXFP4):
            block = 16 if quant is QuantMode.NVFP4 else 32
            if head_dim % block:
                raise LayoutError(
                    f"head_dim: {head_dim} is not a multiple of the {quant.name} block {block}"
                )
            kv = (("float4_e2m1fn_x2", (heads, head_dim // 2)),)
            sdt = "float8_e4m3fn" if quant is QuantMode.NVFP4 else "float8_e8m0fnu"
            scale = (sdt, (heads, head_dim // block))
        else:  # pragma: no cover - enum is closed
            raise LayoutError(f"quant: unsupported {quant}")
        (kv_dtype, kv_shape), = kv
        out.append(BufferSpec(layer, Role.KEY, kv_dtype, kv_shape, head_axis=0, heads=total))
        out.append(BufferSpec(layer, Role.VALUE, kv_dtype, kv_shape, head_axis=0, heads=total))
        if scale is not None:
            for role in (Role.KEY_SCALE, Role.VALUE_SCALE):
                out.append(BufferSpec(layer, role, scale[0], scale[1], head_axis=0, heads=total))
    return out


def full_attention(
    model: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    tokens_per_page: int = 16,
    dtype: str | torch.dtype = "bfloat16",
    quant: QuantMode | str = QuantMode.NONE,
    shard_count: int = 1,
    shard_index: int = 0,
) -> PageLayout:
    """MHA or GQA: one ATTENTION group, K and V per layer split by KV head."""
    dt, qm = dtype_name(dtype), _quant(quant)
    checks.count(num_layers, "num_layers", 1, error=LayoutError)
    heads = _heads_per_shard(num_kv_heads, shard_count)
    layers = tuple(range(num_layers))
    return PageLayout(
        model=model,
        tokens_per_page=tokens_per_page,
        groups=(LayerGroup(GroupKind.ATTENTION, layers),),
        buffers=tuple(_kv_buffers(layers, heads, head_dim, dt, qm)),
        quant=qm,
        shard_count=shard_count,
        shard_index=shard_index,
    )


def mla(
    model: str,
    num_layers: int,
    latent_dim: int,
    *,
    tokens_per_page: int = 64,
    dtype: str | torch.dtype = "bfloat16",
    index_key_dim: int | None = None,
    shard_count: int = 1,
    shard_index: int = 0,
) -> PageLayout:
    """Multi-head latent attention: one replicated latent buffer per layer (role KEY).

    ``index_key_dim`` adds a replicated ``INDEX_KEY`` buffer (sparse-attention indexers),
    declared not transferred: the receiver rebuilds it from the latent.
    """
    dt = dtype_name(dtype)
    checks.count(num_layers, "num_layers", 1, error=LayoutError)
    layers = tuple(range(num_layers))
    buffers: list[BufferSpec] = []
    for layer in layers:
        buffers.append(BufferSpec(layer, Role.KEY, dt, (latent_dim,)))
        if index_key_dim is not None:
            buffers.append(
                BufferSpec(layer, Role.INDEX_KEY, dt, (index_key_dim,), transferred=False)
            )
    return PageLayout(
        model=model,
        tokens_per_page=tokens_per_page,
        groups=(LayerGroup(GroupKind.ATTENTION, layers),),
        buffers=tuple(buffers),
        shard_count=shard_count,
        shard_index=shard_index,
    )


def sliding_window(
    model: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    window: int,
    sink_tokens: int = 0,
    full_layers: Sequence[int] = (),
    tokens_per_page: int = 16,
    dtype: str | torch.dtype = "bfloat16",
    quant: QuantMode | str = QuantMode.NONE,
    shard_count: int = 1,
    shard_index: int = 0,
) -> PageLayout:
    """Sliding-window attention; with ``full_layers`` the hybrid SWA + full pattern.

    Group 0 holds the windowed layers, group 1 (when ``full_layers`` is given) the
    full-attention ones.
    """
    dt, qm = dtype_name(dtype), _quant(quant)
    checks.count(num_layers, "num_layers", 1, error=LayoutError)
    heads = _heads_per_shard(num_kv_heads, shard_count)
    full = tuple(sorted(set(full_layers)))
    for layer in full:
        if not 0 <= layer < num_layers:
            raise LayoutError(f"full_layers: layer {layer} is outside 0..{num_layers - 1}")
    windowed = tuple(i for i in range(num_layers) if i not in full)
    if not windowed:
        raise LayoutError("full_layers: every layer is full attention; use full_attention()")
    groups = [LayerGroup(GroupKind.ATTENTION, windowed, window=window, sink_tokens=sink_tokens)]
    if full:
        groups.append(LayerGroup(GroupKind.ATTENTION, full))
    return PageLayout(
        model=model,
        tokens_per_page=tokens_per_page,
        groups=tuple(groups),
        buffers=tuple(_kv_buffers(range(num_layers), heads, head_dim, dt, qm)),
        quant=qm,
        shard_count=shard_count,
        shard_index=shard_index,
    )


def hybrid_mamba(
    model: str,
    attention_layers: Sequence[int],
    mamba_layers: Sequence[int],
    num_kv_heads: int,
    head_dim: int,
    *,
    conv_shape: tuple[int, ...],
    ssm_shape: tuple[int, ...],
    tokens_per_page: int = 16,
    dtype: str | torch.dtype = "bfloat16",
    state_dtype: str | torch.dtype = "float32",
    quant: QuantMode | str = QuantMode.NONE,
    shard_count: int = 1,
    shard_index: int = 0,
    conv_sections: Sequence[int] = (),
) -> PageLayout:
    """Attention layers (group 0) plus Mamba layers (group 1, STATE).

    ``conv_shape`` and ``ssm_shape`` are per shard; the conv state is split on its channel
    axis 0 and the SSM state by head (axis 0). ``conv_sections`` (one shard's channel
    counts of x, B and C, Mamba-2) splits each section of the conv channels on its own.
    """
    dt, qm = dtype_name(dtype), _quant(quant)
    state_dt = dtype_name(state_dtype, "state_dtype")
    heads = _heads_per_shard(num_kv_heads, shard_count)
    attn = tuple(attention_layers)
    mamba = tuple(mamba_layers)
    if not mamba:
        raise LayoutError("mamba_layers: a hybrid Mamba layout needs at least one Mamba layer")
    buffers = _kv_buffers(attn, heads, head_dim, dt, qm)
    for layer in mamba:
        buffers.append(BufferSpec(layer, Role.CONV_STATE, dt, conv_shape, head_axis=0,
                                  sections=tuple(conv_sections)))
        buffers.append(BufferSpec(layer, Role.SSM_STATE, state_dt, ssm_shape, head_axis=0))
    groups = []
    if attn:
        groups.append(LayerGroup(GroupKind.ATTENTION, attn))
    groups.append(LayerGroup(GroupKind.STATE, mamba))
    return PageLayout(
        model=model,
        tokens_per_page=tokens_per_page,
        groups=tuple(groups),
        buffers=tuple(buffers),
        quant=qm,
        shard_count=shard_count,
        shard_index=shard_index,
    )
