"""Build canonical pages of one shard count from pages of another, on CPU or CUDA.

Primitive:

- :func:`reshard_pages` — run one group of a :class:`~kvbank.reshard.plan.ReshardPlan` over a
  batch of pages: for every page ``i``, destination page ``out[i]`` is built from
  ``sources[s][i]`` of each source shard ``s`` the group needs. Head slicing (a head range
  of every by-head buffer) and sectioned slicing (a range of each section) are both
  strided byte copies of the plan; padding bytes of the destination are zeroed.

Lifecycle: plan once per (source shard count, destination layout) with
:func:`kvbank.reshard.plan.plan_reshard`, then call this per batch; it allocates nothing.

Everything is validated before a byte moves (sources present, uint8 ``[n,
page_bytes]``, equal page counts, one device, rows contiguous, no source overlapping
``out``) and refused with :class:`~kvbank.errors.InvalidInput` or
:class:`~kvbank.errors.PageSizeMismatch` naming the field, so ``out`` is never half
built. Sources are only read.

Why strided views: a copy of the plan is ``count`` runs at fixed strides, so over a
batch it is one ``[pages, count, run]`` view on each side and one ``copy_`` — batched over
pages and (after the plan's merging) over every layer at once. The views use the widest
integer type that divides every offset, stride and length, as in
:mod:`kvbank.kernels.pages`: torch's strided copy is faster on wide words.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvbank import checks
from kvbank.errors import InvalidInput, PageSizeMismatch
from kvbank.reshard.plan import Copy, ReshardPlan

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _pages(t: object, what: str, rows: int | None, page_bytes: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidInput(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8 or t.dim() != 2:
        raise InvalidInput(
            f"{what}: expected a uint8 tensor [n, page_bytes], got {t.dtype} {tuple(t.shape)}"
        )
    if rows is not None and t.shape[0] != rows:
        raise InvalidInput(f"{what}: {t.shape[0]} pages, out has {rows}")
    if t.shape[1] != page_bytes:
        raise PageSizeMismatch(f"{what}: pages of {t.shape[1]} bytes, the plan's are {page_bytes}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise InvalidInput(f"{what}: each page must be contiguous (stride {t.stride()})")
    return t


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes of storage ``t`` can touch, as ``[start, end)`` data addresses."""
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    return start, start + (t.shape[0] - 1) * t.stride(0) + t.shape[1]


def _width(c: Copy, src: torch.Tensor, dst: torch.Tensor) -> tuple[int, torch.dtype]:
    for width, dtype in _WORDS:
        if all(v % width == 0 for v in (c.src_offset, c.src_stride, c.dst_offset,
                                        c.dst_stride, c.length, src.stride(0), dst.stride(0),
                                        src.data_ptr(), dst.data_ptr())):
            return width, dtype
    return 1, torch.uint8  # pragma: no cover - width 1 always divides


def _view(t: torch.Tensor, width: int, dtype: torch.dtype, offset: int, stride: int,
          count: int, length: int) -> torch.Tensor:
    """``[pages, count, length]`` bytes of ``t`` (in ``width``-byte words)."""
    words = t.view(dtype) if width > 1 else t
    return words.as_strided(
        (t.shape[0], count, length // width),
        (t.stride(0) // width, stride // width, 1),
        words.storage_offset() + offset // width,
    )


def reshard_pages(
    plan: ReshardPlan, group: int, sources: Mapping[int, torch.Tensor], out: torch.Tensor
) -> None:
    """Build ``out`` (``uint8 [n, dst page bytes]``) for group ``group`` of ``plan`` from
    ``sources`` (source shard index -> ``uint8 [n, src page bytes]``, page ``i`` of each
    the same logical page). Extra shards in ``sources`` are ignored."""
    if not isinstance(plan, ReshardPlan):
        raise InvalidInput(f"plan: expected a ReshardPlan, got {type(plan).__name__}")
    checks.count(group, "group", 0, len(plan.groups) - 1)
    gp = plan.groups[group]
    out = _pages(out, "out", None, gp.dst_page_bytes)
    if out.shape[0] > 1 and out.stride(0) < out.shape[1]:
        raise InvalidInput(f"out: rows overlap (row stride {out.stride(0)} < {out.shape[1]} bytes)")
    if not isinstance(sources, Mapping):
        raise InvalidInput(f"sources: expected a mapping of shard index to pages, got "
                           f"{type(sources).__name__}")
    rows = out.shape[0]
    lo, hi = _span(out)
    srcs: dict[int, torch.Tensor] = {}
    for s in gp.sources:
        if s not in sources:
            raise InvalidInput(f"sources[{s}]: group {group} needs source shard {s} "
                               f"(needs {list(gp.sources)}), it is missing")
        t = _pages(sources[s], f"sources[{s}]", rows, gp.src_page_bytes)
        if t.device != out.device:
            raise InvalidInput(f"sources[{s}]: on {t.device}, out is on {out.device}")
        a, b = _span(t)
        if a < hi and lo < b:
            raise InvalidInput(f"sources[{s}]: overlaps out; a reshard cannot run in place")
        srcs[s] = t
    if rows == 0:
        return
    for c in gp.copies:
        src = srcs[c.source]
        width, dtype = _width(c, src, out)
        _view(out, width, dtype, c.dst_offset, c.dst_stride, c.count, c.length).copy_(
            _view(src, width, dtype, c.src_offset, c.src_stride, c.count, c.length)
        )
    for start, end in gp.padding:
        out[:, start:end].zero_()
