"""Block adapters: vLLM's paged cache tensors <-> kvbank canonical pages.

vLLM 0.32 hands the connector one tensor per layer, a *logical* ``[B, H, N, C]`` view
(blocks, KV heads, tokens of a block, content) whose physical order is the engine's
:class:`vllm.v1.kv_cache_layout.KVCacheLayout` (a stride permutation of
``[L, B, H, N, C]``; ``kv_cache_config.kv_cache_layout`` names it). How K and V share
the content axis depends on the backend:

- ``SPLIT_N`` (the CPU backend, ``cpu_attn.py``): each head's ``[N, C]`` interior is read
  as ``[2N, D]`` — all tokens' K, then all tokens' V. Needs ``N`` and ``C`` innermost
  and contiguous (``LBHNC``, ``BLHNC``, ``BHLNC``).
- ``SPLIT_C`` (FlashAttention-style GPU backends): ``C = D_k + D_v``, K first.

A kvbank page region is token-major: ``[P, H, D]`` per layer and role. An adapter gives
K and V of every block as ``[B, N, H, D]`` views sharing the cache's memory:
:func:`pool_views` hands them to kvbank's paged-pool calls (``fetch_into``,
``put_from``), which copy between the node's slots and those views once; and
:func:`gather_group` / :func:`scatter_group` copy between them and canonical pages here.
An order or a tensor whose strides disagree with the declared order is refused
(:class:`~kvbank.integrations.vllm.layout.UnsupportedCache`) when the caches are
registered, naming it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvbank.integrations.vllm.layout import UnsupportedCache, VllmLayout
from kvbank.layout import Role

__all__ = ["KNOWN_ORDERS", "BlockAdapter", "Interior", "gather_group", "pool_views", "scatter_group"]

# vLLM's KVCacheLayout members (v1/kv_cache_layout.py): stride permutations of
# [L, B, H, N, C]. Kept here so adapters can be checked without importing vLLM.
KNOWN_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


class Interior(enum.Enum):
    SPLIT_N = "SPLIT_N"  # [N, 2D] read as [2N, D]: K rows then V rows (CPU backend)
    SPLIT_C = "SPLIT_C"  # C = D_k ‖ D_v per (head, token) cell (GPU backends)


def layer_view_order(order: str) -> tuple[int, ...]:
    """Physical order of the per-layer ``[B, H, N, C]`` axes under ``order``."""
    perm = KNOWN_ORDERS.get(order)
    if perm is None:
        raise UnsupportedCache(f"kv_cache_layout {order!r} is not supported by the kvbank "
                               f"connector (known: {', '.join(KNOWN_ORDERS)})")
    return tuple(i - 1 for i in perm if i != 0)


def _check_strides(name: str, t: torch.Tensor, order: str) -> None:
    """The tensor's axes, outermost first by stride, follow ``order`` (size-1 axes aside)."""
    want = [a for a in layer_view_order(order) if t.shape[a] > 1]
    strides = t.stride()
    have = sorted(want, key=lambda a: -strides[a])
    if have != want or (want and strides[want[-1]] != 1):
        raise UnsupportedCache(f"kv cache of {name}: strides {tuple(strides)} for shape "
                               f"{tuple(t.shape)} are not the declared layout {order}")


@dataclass(frozen=True, slots=True)
class BlockAdapter:
    """K and V of one layer's paged cache as ``[B, N, H, D]`` views of its memory."""

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def of(cls, name: str, cache: torch.Tensor, order: str, interior: Interior,
           head_size: int, head_size_v: int) -> BlockAdapter:
        if cache.dim() != 4:
            raise UnsupportedCache(f"kv cache of {name}: expected a [blocks, heads, tokens, "
                                   f"content] tensor, got shape {tuple(cache.shape)}")
        _check_strides(name, cache, order)
        b, h, n, c = cache.shape
        if c != head_size + head_size_v:
            raise UnsupportedCache(f"kv cache of {name}: content axis {c}, expected "
                                   f"{head_size} + {head_size_v}")
        if interior is Interior.SPLIT_C:
            key = cache[..., :head_size].transpose(1, 2)
            value = cache[..., head_size:].transpose(1, 2)
            return cls(key, value)
        if head_size != head_size_v:
            raise UnsupportedCache(f"kv cache of {name}: the CPU layout needs equal K and V "
                                   f"head sizes, got {head_size} and {head_size_v}")
        if cache.stride(3) != 1 or cache.stride(2) != c:
            raise UnsupportedCache(f"kv cache of {name}: the CPU layout needs each head's "
                                   f"[tokens, content] contiguous; declared {order}")
        sb, sh = cache.stride(0), cache.stride(1)
        d = head_size
        kv = cache.as_strided((b, h, 2, n, d), (sb, sh, n * d, d, 1))  # [B, H, K|V, N, D]
        return cls(kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2))


Adapters = Mapping[str, BlockAdapter]  # vLLM layer name -> its adapter


def pool_views(vl: VllmLayout, adapters: Adapters) -> dict[tuple[int, Role], torch.Tensor]:
    """The engine's paged pool as kvbank's calls take it: ``(layer, role)`` → the
    ``[B, N, H, D]`` view of that layer's K or V (strided, the cache's own memory)."""
    out: dict[tuple[int, Role], torch.Tensor] = {}
    for names in vl.group_layers:
        for name in names:
            ad = adapters[name]
            i = vl.layer_index[name]
            out[(i, Role.KEY)] = ad.key
            out[(i, Role.VALUE)] = ad.value
    return out


def _ids(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(block_ids), dtype=torch.long, device=device)


def gather_group(vl: VllmLayout, adapters: Adapters, group: int,
                 block_ids: Sequence[int]) -> torch.Tensor:
    """Canonical pages ``uint8 [len(block_ids), page bytes]`` of ``group``'s blocks (CPU)."""
    layout = vl.layout
    pages = torch.zeros((len(block_ids), layout.group_page_bytes[group]), dtype=torch.uint8)
    if not block_ids:
        return pages
    views = layout.views(pages, group)
    for name in vl.group_layers[group]:
        ad = adapters[name]
        idx = _ids(block_ids, ad.key.device)
        i = vl.layer_index[name]
        views[(i, Role.KEY)].copy_(ad.key.index_select(0, idx))
        views[(i, Role.VALUE)].copy_(ad.value.index_select(0, idx))
    return pages


def scatter_group(vl: VllmLayout, adapters: Adapters, group: int, pages: torch.Tensor,
                  block_ids: Sequence[int]) -> None:
    """Write canonical ``pages`` (one a block id) into ``group``'s blocks of the cache."""
    if not block_ids:
        return
    views = vl.layout.views(pages[: len(block_ids)], group)
    for name in vl.group_layers[group]:
        ad = adapters[name]
        idx = _ids(block_ids, ad.key.device)
        i = vl.layer_index[name]
        ad.key.index_put_((idx,), views[(i, Role.KEY)].to(ad.key.device))
        ad.value.index_put_((idx,), views[(i, Role.VALUE)].to(ad.value.device))
