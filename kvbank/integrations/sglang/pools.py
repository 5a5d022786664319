"""SGLang's host pools as kvbank layouts, and their slots as kvbank's paged-pool views.

Every pool SGLang registers with a storage backend (the KV anchor ``kv``, and the
sidecars of hybrid models: ``mamba``, ``swa``, ``indexer`` …) becomes a kvbank layout of
its own, so each pool's rows live in a namespace of their own and a pool's hit never
depends on another's presence (SGLang folds the pools' hits itself, ``batch_exists_v2``):

- **KV pages** (``MHATokenToKVPoolHost``: K and V, ``(heads, head_dim)`` a token and
  layer; ``MLATokenToKVPoolHost``: one latent ``(1, kv_cache_dim)``) — one ``ATTENTION``
  group, ``tokens_per_page`` = the pool's page size, and one buffer a role spanning the
  pool's layers, ``(layers, heads, dim)`` a token: kvbank's page is then SGLang's own
  ``page_first`` page byte for byte (K then V, token-major), and a page moves between the
  node's memory and the host pool as one contiguous copy a role (per-layer buffers cost
  one strided copy a layer and role: a 64-page load measured 2.3x slower on 512 KiB pages). MHA heads are
  split over TP ranks (``shard_count`` = TP size, ``shard_index`` = rank); MLA's latent is
  the same on every rank: one shard, written by SGLang's one storage writer.
- **State snapshots** (``MambaPoolHost``: one slot a snapshot) — one ``STATE`` group whose
  snapshot is the slot's bytes as SGLang's own flat page holds them (``get_data_page``),
  one ``uint8`` buffer. A snapshot is TP-sharded (each rank holds its own channels). Its
  ``tokens_per_page`` is the KV pool's: the snapshot after page ``i`` is named by page
  ``i``'s key, as SGLang keys it.

:func:`pool_map` gives a :class:`PoolMap`: the layout, and for an attention pool the views
kvbank's ``fetch_into`` and ``put_from`` copy through (``(layer, role)`` → ``[pages,
tokens, heads, dim]``, strided views of the pool's own memory: the one copy between the
node's shared memory and the host pool's slots). The same views over a batch of SGLang's
flat pages (``get_data_page(i, flat=True)``, the legacy calls') are :meth:`PoolMap.flat_views`.

The model name (SGLang suffixes the pool's ``storage_format_tag``), the dtype, the page
size, the layer range and the pipeline / context-parallel rank go into the layout: two
engines whose bytes differ never share a row. The host pool's own layout does not: its
pages are viewed in kvbank's one order, so a ``layer_first`` engine loads what a
``page_first`` one stored. A pool kvbank cannot map
(another layout, K and V of different widths, a DCP-sharded MLA pool, a pool of compressed
blocks) is :class:`UnsupportedPool`, naming it, when SGLang registers it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvbank.errors import InvalidInput
from kvbank.kernels.strided import PoolViews
from kvbank.layout import BufferSpec, GroupKind, LayerGroup, PageLayout, Role, dtype_name

__all__ = ["PoolMap", "UnsupportedPool", "pool_map"]

# the page-axis layouts of SGLang's MHA and MLA host pools whose slots kvbank can view
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class UnsupportedPool(InvalidInput):
    """An SGLang host pool this backend cannot map to a kvbank layout."""


Viewer = Callable[[torch.Tensor], dict[tuple[int, Role], torch.Tensor]]


@dataclass(frozen=True)
class PoolMap:
    """One SGLang host pool as kvbank sees it."""

    name: str
    host: Any  # SGLang's host pool
    layout: PageLayout
    shard: int  # this rank's shard index (the layout's)
    slot_pages: int  # slots a page takes in the host pool (page size; 1 for a state pool)
    views: PoolViews = field(default_factory=dict)  # the host pool's pages (attention pools)
    _flat: Viewer | None = None  # (n, flat page) -> views, for the legacy calls
    flat_shape: tuple[int, ...] = ()  # a batch of flat pages: (n, *flat_shape) of ``dtype``
    dtype: torch.dtype = torch.uint8

    @property
    def is_state(self) -> bool:
        return self.layout.groups[0].kind is GroupKind.STATE

    @property
    def layout_id(self) -> bytes:
        return self.layout.layout_id

    @property
    def tokens_per_page(self) -> int:
        return self.layout.tokens_per_page

    def flat_views(self, pages: torch.Tensor) -> dict[tuple[int, Role], torch.Tensor]:
        """``pages`` (``[n, flat page numel]`` of the pool's dtype) as ``put_from`` views."""
        if self._flat is None:
            raise UnsupportedPool(f"pool {self.name!r}: a state pool has no paged views")
        return self._flat(pages.view(pages.shape[0], *self.flat_shape))

    def blocks(self, host_indices: Any, count: int) -> list[int]:
        """The page (block) index of each of ``count`` pages at ``host_indices`` (token
        slots, ``slot_pages`` a page); a page whose slots are not one aligned page of the
        pool is :class:`UnsupportedPool` (kvbank moves whole pages)."""
        p = self.slot_pages
        idx = torch.as_tensor(host_indices).reshape(-1)
        if idx.numel() != count * p:
            raise InvalidInput(f"host_indices: {idx.numel()} slots for {count} pages of {p}")
        if p == 1:
            return [int(f) for f in idx.tolist()]
        pages = idx.cpu().numpy().reshape(count, p)  # numpy: a few µs an op, not torch's ~10
        firsts = pages[:, 0]
        if (pages != firsts[:, None] + np.arange(p)).any() or (firsts % p).any():
            raise UnsupportedPool(f"pool {self.name!r}: host slots are not whole aligned pages")
        out: list[int] = (firsts // p).tolist()
        return out


def _model(cfg: Any, pool: str, host: Any) -> str:
    """The layout's model field: the model name (with SGLang's storage format tag), the
    pool, and the pipeline / context-parallel rank. Not the host pool's layout: every
    layout's pages are viewed in the one canonical order, so engines whose host pools are
    laid out differently share rows."""
    parts = [f"sglang/{cfg.model_name or ''}", f"pool={pool}"]
    if int(cfg.pp_size) > 1:
        parts.append(f"pp={cfg.pp_rank}/{cfg.pp_size}")
    if int(getattr(cfg, "attn_cp_size", 1)) > 1:
        parts.append(f"cp={cfg.attn_cp_rank}/{cfg.attn_cp_size}")
    return "|".join(parts)


def _dtype(host: Any, pool: str) -> str:
    try:
        return dtype_name(host.dtype)
    except Exception as exc:
        raise UnsupportedPool(f"pool {pool!r}: dtype {host.dtype} has no kvbank name") from exc


def _mha_viewer(layout: str, p: int) -> tuple[Viewer, Viewer]:
    """(views of the pool's ``kv_buffer``, views of ``[n, *flat page]``) for an MHA pool:
    ``KEY`` and ``VALUE`` → ``[pages, p, layers, heads, dim]``."""

    def over(t: torch.Tensor, pick: Callable[[torch.Tensor, int], torch.Tensor]
             ) -> dict[tuple[int, Role], torch.Tensor]:
        return {(0, Role.KEY): pick(t, 0), (0, Role.VALUE): pick(t, 1)}

    if layout == "layer_first":  # kv [2, L, S, H, D]; flat page [2, L, p, H, D]
        return (lambda kv: over(kv.unflatten(2, (-1, p)), lambda t, r: t[r].permute(1, 2, 0, 3, 4)),
                lambda f: over(f, lambda t, r: t[:, r].transpose(1, 2)))
    if layout == "page_first":  # kv [2, S, L, H, D]; flat page [2, p, L, H, D]: kvbank's own order
        return (lambda kv: over(kv.unflatten(1, (-1, p)), lambda t, r: t[r]),
                lambda f: over(f, lambda t, r: t[:, r]))
    if layout == "page_first_direct":  # kv [2, pages, L, p, H, D]; flat page [2, 1, L, p, H, D]
        return (lambda kv: over(kv, lambda t, r: t[r].transpose(1, 2)),
                lambda f: over(f, lambda t, r: t[:, r, 0].transpose(1, 2)))
    # page_head: kv [2, pages, H, p, L, D]; flat page [2, 1, H, p, L, D]
    return (lambda kv: over(kv, lambda t, r: t[r].permute(0, 2, 3, 1, 4)),
            lambda f: over(f, lambda t, r: t[:, r, 0].permute(0, 2, 3, 1, 4)))


def _mla_viewer(layout: str, p: int) -> tuple[Viewer, Viewer]:
    """The same for an MLA pool: ``KEY`` → ``[pages, p, layers, 1, dim]``."""

    def one(v: torch.Tensor) -> dict[tuple[int, Role], torch.Tensor]:
        return {(0, Role.KEY): v}

    if layout == "layer_first":  # kv [L, S, 1, C]; flat page [L, p, 1, C]
        return (lambda kv: one(kv.unflatten(1, (-1, p)).permute(1, 2, 0, 3, 4)),
                lambda f: one(f.transpose(1, 2)))
    if layout == "page_first":  # kv [S, L, 1, C]; flat page [p, L, 1, C]
        return (lambda kv: one(kv.unflatten(0, (-1, p))), one)
    # page_first_direct: kv [pages, L, p, 1, C]; flat page [1, L, p, 1, C]
    return (lambda kv: one(kv.transpose(1, 2)), lambda f: one(f[:, 0].transpose(1, 2)))


def _flat_shape(host: Any) -> tuple[int, ...]:
    return tuple(host.get_data_page(0, flat=False).shape)


def pool_map(name: str, host: Any, cfg: Any, kv_page_size: int | None = None) -> PoolMap:
    """The :class:`PoolMap` of SGLang host pool ``host`` registered as ``name``, for the
    backend's ``HiCacheStorageConfig`` ``cfg``; ``kv_page_size``: the KV pool's page size
    (a state pool's snapshots sit at its page boundaries)."""
    kind = type(host).__name__
    tp, rank = int(cfg.tp_size), int(cfg.tp_rank)
    if kind == "MambaPoolHost":
        if kv_page_size is None:
            raise UnsupportedPool(f"pool {name!r}: a state pool needs the KV pool registered first")
        nbytes = int(host.get_dummy_flat_data_page().numel() * host.get_dummy_flat_data_page().element_size())
        layout = PageLayout(model=_model(cfg, name, host), tokens_per_page=kv_page_size,
                            groups=(LayerGroup(GroupKind.STATE, (0,)),),
                            buffers=(BufferSpec(0, Role.SSM_STATE, "uint8", (nbytes,)),),
                            shard_count=tp, shard_index=rank)
        return PoolMap(name, host, layout, rank, int(getattr(host, "page_size", 1) or 1))
    if kind in ("MHATokenToKVPoolHost", "MLATokenToKVPoolHost"):
        mla = kind.startswith("MLA")
        host_layout = str(host.layout)
        allowed = MLA_LAYOUTS if mla else MHA_LAYOUTS
        if host_layout not in allowed:
            raise UnsupportedPool(f"pool {name!r}: {kind} layout {host_layout!r} is not supported "
                                  f"(supported: {', '.join(allowed)})")
        p = int(host.page_size)
        layers = int(host.layer_num)
        start = int(getattr(host, "start_layer", 0) or 0)
        dt = _dtype(host, name)
        if mla:
            if int(getattr(cfg, "dcp_size", 1)) > 1:
                raise UnsupportedPool(f"pool {name!r}: MLA with decode context parallel is not supported")
            buffers: tuple[BufferSpec, ...] = (
                BufferSpec(start, Role.KEY, dt, (layers, 1, int(host.kv_cache_dim))),)
            shards, shard = 1, 0  # the latent is the same on every rank: stored once
            pool_view, flat_view = _mla_viewer(host_layout, p)
        else:
            heads, d, dv = int(host.head_num), int(host.head_dim), int(host.v_head_dim)
            if d != dv:
                raise UnsupportedPool(f"pool {name!r}: K and V widths differ ({d} and {dv})")
            buffers = tuple(BufferSpec(start, role, dt, (layers, heads, d), head_axis=1)
                            for role in (Role.KEY, Role.VALUE))
            shards, shard = tp, rank
            pool_view, flat_view = _mha_viewer(host_layout, p)
        layout = PageLayout(model=_model(cfg, name, host) + f"|layers={start}..{start + layers}",
                            tokens_per_page=p, groups=(LayerGroup(GroupKind.ATTENTION, (start,)),),
                            buffers=buffers, shard_count=shards, shard_index=shard)

        def renumber(views: dict[tuple[int, Role], torch.Tensor]) -> dict[tuple[int, Role], torch.Tensor]:
            return {(start, role): t for (_, role), t in views.items()}

        return PoolMap(name, host, layout, shard, p, views=renumber(pool_view(host.kv_buffer)),
                       _flat=lambda t: renumber(flat_view(t)), flat_shape=_flat_shape(host),
                       dtype=host.dtype)
    raise UnsupportedPool(f"pool {name!r}: {kind} is not supported by the kvbank backend "
                          "(supported: MHATokenToKVPoolHost, MLATokenToKVPoolHost, MambaPoolHost)")
