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
:func:`gather_group` / :func:`scatter_group` copy between them and canonical pages here,
one slice copy per run of consecutive block ids, into and out of reused buffers
(:class:`PagePool`). An order or a tensor whose strides disagree with the declared order
is refused (:class:`~kvbank.integrations.vllm.layout.UnsupportedCache`) when the caches
are registered, naming it.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvbank.integrations.vllm.layout import UnsupportedCache, VllmLayout
from kvbank.layout import Role

__all__ = ["KNOWN_ORDERS", "BlockAdapter", "Interior", "PagePool", "gather_group", "pool_views",
           "scatter_group"]

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


def _spans(rows: Sequence[int], block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first row, first block, length)`` of the runs where both rows and block ids count
    up by one: each run is one slice copy, with no index tensor and no temporary (a fresh
    temporary of a few MiB costs its page faults on every step)."""
    out: list[tuple[int, int, int]] = []
    for r, b in zip(rows, block_ids, strict=True):
        if out and out[-1][0] + out[-1][2] == r and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((r, b, 1))
    return out


def gather_group(vl: VllmLayout, adapters: Adapters, group: int, block_ids: Sequence[int],
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Canonical pages ``uint8 [len(block_ids), page bytes]`` of ``group``'s blocks (CPU),
    written into ``out[:n]`` when given (a reused buffer: see :class:`PagePool`)."""
    layout = vl.layout
    n = len(block_ids)
    pages = (torch.zeros((n, layout.group_page_bytes[group]), dtype=torch.uint8) if out is None
             else out[:n])
    if not block_ids:
        return pages
    views = layout.views(pages, group)
    spans = _spans(range(n), block_ids)
    for name in vl.group_layers[group]:
        ad = adapters[name]
        i = vl.layer_index[name]
        kv, vv = views[(i, Role.KEY)], views[(i, Role.VALUE)]
        for r, b, k in spans:
            kv[r : r + k].copy_(ad.key[b : b + k])
            vv[r : r + k].copy_(ad.value[b : b + k])
    return pages


def scatter_group(vl: VllmLayout, adapters: Adapters, group: int, pages: torch.Tensor,
                  block_ids: Sequence[int], rows: Sequence[int] | None = None) -> None:
    """Write canonical ``pages`` into ``group``'s blocks of the cache: row ``rows[j]``
    (default ``j``) into block ``block_ids[j]``."""
    if not block_ids:
        return
    picked = list(range(len(block_ids))) if rows is None else list(rows)
    views = vl.layout.views(pages, group)
    spans = _spans(picked, block_ids)
    for name in vl.group_layers[group]:
        ad = adapters[name]
        i = vl.layer_index[name]
        kv, vv = views[(i, Role.KEY)], views[(i, Role.VALUE)]
        for r, b, k in spans:
            ad.key[b : b + k].copy_(kv[r : r + k])
            ad.value[b : b + k].copy_(vv[r : r + k])


class PagePool:
    """Reused page buffers (``uint8 [capacity, page bytes]``), a few per page size.

    A fresh tensor pays its page faults at first touch on every use: measured on a loaded
    2-core host, a 128-page (64 MiB) fetch into new buffers took 820 ms and into reused
    ones 32 ms. Buffers grow to the largest request seen (in steps of 64 pages) and at
    most ``keep`` idle ones are kept a size.
    """

    STEP = 64

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, rows: int, size: int) -> torch.Tensor:
        """A buffer of at least ``rows`` pages of ``size`` bytes (give it back when done)."""
        with self._lock:
            free = self._free.get(size, [])
            for k, buf in enumerate(free):
                if buf.shape[0] >= rows:
                    return free.pop(k)
        cap = max(self.STEP, -(-rows // self.STEP) * self.STEP)
        return torch.zeros((cap, size), dtype=torch.uint8)  # zeroed: padding never leaks

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            free = self._free.setdefault(int(buf.shape[1]), [])
            free.append(buf)
            free.sort(key=lambda t: -int(t.shape[0]))
            del free[self._keep :]
