"""Move canonical pages straight between rows in memory and an engine's paged pool, whose
tensors may be any strided view (a backend's stride order).

An engine describes its cache per ``(layer, role)`` as a *logical* ``[blocks,
tokens_per_page, *shape]`` tensor of the buffer's dtype — for vLLM, the per-layer
``[B, N, H, D]`` K or V view of a ``[B, H, N, C]`` cache whose physical axis order its
backend chose (``LBHNC``, ``LBNHC``, ...). The strides are whatever that view has: no
axis needs to be contiguous, so the caller never makes a copy of its own to reach
canonical order. (:mod:`kvbank.kernels.pages` needs each block contiguous.)

Primitives:

- :func:`check_pool` — the pool's tensors for a group, checked against the layout
  (every transferred buffer present, dtype, logical shape), before anything moves.
- :func:`scatter_strided` — canonical rows ``uint8 [n, page bytes]`` (rows may be
  strided: slots of a segment lying back to back, or a staging buffer) into pool blocks:
  one indexed copy per buffer (``index_put_`` through the strided view), or, where the
  block ids mostly run consecutively, one slice copy per run and buffer.
- :func:`gather_strided` — pool blocks into canonical rows: one ``index_select(out=)``
  per buffer, written through the rows' region views (no intermediate tensor). Padding
  bytes between regions are zeroed, so equal pages are equal rows.

A pool on another device than the rows (a CUDA pool, host slots): each buffer's bytes
cross once as a contiguous tensor, then move by index on the pool's device. On the CPU a
large move is split by rows over :mod:`kvbank.kernels.pages`' lanes (serial torch ops on
threads of that module), as its own gathers and scatters are: one indexed copy per core.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvbank.codec.planes import copy_bytes
from kvbank.errors import InvalidInput, PageSizeMismatch
from kvbank.kernels.faults import TORCH_ERRORS, torch_fault
from kvbank.kernels.pages import _cpu_parts
from kvbank.layout import GroupKind, PageLayout, Role

__all__ = ["PoolViews", "check_pool", "gather_strided", "scatter_strided"]

PoolViews = Mapping[tuple[int, Role], torch.Tensor]  # (layer, role) -> [blocks, P, *shape], any strides


def check_pool(layout: PageLayout, group: int, pool: PoolViews,
               field: str = "pool") -> dict[tuple[int, Role], torch.Tensor]:
    """The pool tensors of ``group``'s transferred buffers, each checked: its dtype and a
    logical shape ``[blocks, tokens_per_page, *shape]``. Extra entries (other groups'
    layers) are ignored."""
    if not isinstance(pool, Mapping):
        raise InvalidInput(f"{field}: expected a mapping (layer, role) -> tensor, got {type(pool).__name__}")
    if layout.groups[group].kind is not GroupKind.ATTENTION:
        raise InvalidInput(f"group: {group} is a STATE group; a paged pool holds ATTENTION groups only")
    out: dict[tuple[int, Role], torch.Tensor] = {}
    blocks: int | None = None
    for r in layout.regions[group]:
        b = r.buffer
        key = (b.layer, b.role)
        t = pool.get(key)
        if t is None:
            raise InvalidInput(f"{field}: no tensor for layer {b.layer} {b.role.name} of group {group}")
        if not isinstance(t, torch.Tensor):
            raise InvalidInput(f"{field}[{b.layer}, {b.role.name}]: expected a tensor, got {type(t).__name__}")
        want = getattr(torch, b.dtype, None)
        if t.dtype != want:
            raise InvalidInput(f"{field}[{b.layer}, {b.role.name}]: dtype {t.dtype}, the layout "
                               f"declares {b.dtype}")
        shape = (layout.tokens_per_page, *b.shape)
        if t.dim() != 1 + len(shape) or tuple(t.shape[1:]) != shape:
            raise PageSizeMismatch(f"{field}[{b.layer}, {b.role.name}]: shape {tuple(t.shape)}, "
                                   f"expected [blocks, {', '.join(map(str, shape))}]")
        if blocks is not None and t.shape[0] != blocks:
            raise InvalidInput(f"{field}[{b.layer}, {b.role.name}]: {t.shape[0]} blocks, other "
                               f"buffers of group {group} have {blocks}")
        blocks = int(t.shape[0])
        out[key] = t
    return out


def _id_list(block_ids: Sequence[int], blocks: int, unique: bool, field: str) -> list[int]:
    """``block_ids`` checked: each an int in ``[0, blocks)`` (``unique``: each once)."""
    ids = list(block_ids)
    if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= blocks):
        for i, b in enumerate(ids):  # the one pass at C speed found something: name it
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < blocks:
                raise InvalidInput(f"{field}[{i}]: expected a block id in [0, {blocks}), got {b!r}")
    if unique and len(set(ids)) != len(ids):
        raise InvalidInput(f"{field}: a block id appears twice (two pages into one block)")
    return ids


def _ids(block_ids: Sequence[int], blocks: int, unique: bool, field: str) -> torch.Tensor:
    return torch.tensor(_id_list(block_ids, blocks, unique, field), dtype=torch.long)


BYTES_MIN = 64 << 10  # a region this long a page or longer moves as bytes (runs of pages)
HASHED_RUN_BYTES = 1 << 20  # a run handed to ``then`` after its copy is at most this many row bytes (or one row)
SPAN_PAGES = 8  # a run is cut in pieces this long (or longer, see _span_pages), so the lanes share a long one


def _span_pages(row_bytes: int) -> int:
    """How many pages a piece of a run holds: :data:`SPAN_PAGES`, or as many as fill
    :data:`HASHED_RUN_BYTES` where pages are small. Each piece costs a ``copy_`` per
    buffer: 252 pages of 32 KiB into 8 ``[1, H, T, D]`` views took 1.62 ms in pieces of 8
    pages (256 copies), 1.04 ms in pieces of 32 (1 MiB), against 0.70 ms for one copy per
    buffer, which would leave a reader's check no piece to hash while it is in cache."""
    return max(SPAN_PAGES, HASHED_RUN_BYTES // max(1, row_bytes))


def _spans(block_ids: Sequence[int], cap: int = SPAN_PAGES) -> list[tuple[int, int, int]]:
    """``(first row, first block, length)`` of the runs where the block ids count up by
    one, cut in pieces of at most ``cap`` pages: each moves as one slice copy (``copy_``
    of a strided view runs at memory speed, ``index_put_`` does not: a 64-page, 32 MiB
    scatter into consecutive blocks took 40 ms through it, 18 ms as slice copies, 16 ms
    a plain memcpy of the rows; a gather's ``index_select`` is as fast as slice copies
    and stays)."""
    out: list[tuple[int, int, int]] = []
    for r, b in enumerate(block_ids):
        if out and out[-1][1] + out[-1][2] == b and out[-1][2] < cap:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((r, int(b), 1))
    return out


def _page_bytes(t: torch.Tensor) -> np.ndarray[Any, Any] | None:
    """``t`` (``[pages, *inner]`` on the CPU) as a ``uint8 [pages, inner bytes]`` array
    over the same memory, where each page's part is contiguous and at least
    :data:`BYTES_MIN` long; else None."""
    if t.device.type != "cpu" or t.requires_grad or t.dim() < 2 or t.shape[0] == 0 or not t[0].is_contiguous():
        return None
    if t[0].numel() * t.element_size() < BYTES_MIN:
        return None
    return t.flatten(1).view(torch.uint8).numpy()


def _check_count(layout: PageLayout, group: int, rows: torch.Tensor, n: int) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[0] != n:
        raise InvalidInput(f"pages: expected uint8 [{n}, {layout.group_page_bytes[group]}], got "
                           f"{getattr(rows, 'dtype', type(rows).__name__)} {tuple(getattr(rows, 'shape', ()))}")


def _checked_rows(layout: PageLayout, group: int, rows: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` canonical rows, checked (``page_rows``'s checks), as bytes."""
    _check_count(layout, group, rows, n)
    return layout.page_rows(rows, group)


def _rows(layout: PageLayout, group: int, rows: torch.Tensor, n: int) -> dict[tuple[int, Role], torch.Tensor]:
    """``n`` canonical rows' typed views (``views`` makes ``page_rows``'s checks once)."""
    _check_count(layout, group, rows, n)
    return layout.views(rows, group)


def _region_bytes(layout: PageLayout, group: int, rows: torch.Tensor,
                  tensors: dict[tuple[int, Role], torch.Tensor]) -> list[tuple[Any, Any]] | None:
    """Each of ``group``'s regions as ``(its bytes in the checked canonical rows, its
    pool tensor as bytes)`` (numpy ``uint8 [n, region bytes]`` and ``[blocks, region
    bytes]``), where the rows are on the CPU and every pool tensor takes the byte path
    (:func:`_page_bytes`); else None. No typed view is built: a region of the rows is a
    slice of their bytes."""
    if rows.device.type != "cpu":
        return None
    out = []
    src = None
    for r in layout.regions[group]:
        d = _page_bytes(tensors[(r.buffer.layer, r.buffer.role)])
        if d is None or d.shape[1] != r.nbytes:
            return None
        if src is None:
            src = rows.numpy()
        out.append((src[:, r.offset : r.offset + r.nbytes], d))
    return out


def scatter_strided(layout: PageLayout, group: int, rows: torch.Tensor, pool: PoolViews,
                    block_ids: Sequence[int], then: Callable[[int, int], None] | None = None) -> None:
    """Write canonical ``rows`` (row ``k`` is the page for block ``block_ids[k]``) into
    ``group``'s blocks of ``pool``. Everything is checked before anything moves.
    ``then(first, end)``: called for each part of a CPU scatter right after rows
    ``first..end-1`` were copied, on the lane that copied them (while they are still in
    its cache: a reader's check hashes them there); the parts cover every row once."""
    tensors = check_pool(layout, group, pool)
    if not block_ids:
        return
    blocks = next(iter(tensors.values())).shape[0] if tensors else 0
    ids = _id_list(block_ids, blocks, True, "block_ids")
    checked = _checked_rows(layout, group, rows, len(ids))
    try:
        flat = _region_bytes(layout, group, checked, tensors)
        if flat is not None:  # long regions (a page-first pool): runs of pages as bytes
            # a run's rows are hashed by ``then`` right after its copy: at most
            # HASHED_RUN_BYTES of them, so they are still in the lane's cache (64 pages
            # of 2 x 256 KiB, copied and hashed in runs of 2: 3.15-3.31 ms a load against
            # 3.29-3.48 in runs of 8, alternated in one process)
            cap = len(ids) if then is None else max(1, HASHED_RUN_BYTES // max(1, rows.shape[1]))

            def pages(sl: slice) -> None:
                # no torch op: the caller's thread is a lane too. A run of consecutive
                # blocks moves as one copy per region, then goes to ``then``: 64 pages of
                # 2 x 256 KiB in runs of 8 took 1.5 ms against 1.9-2.1 page by page
                # (each page's two regions in turn)
                r = sl.start
                while r < sl.stop:
                    b, k = ids[r], 1
                    while r + k < sl.stop and ids[r + k] == b + k and k < cap:
                        k += 1
                    for src_b, dst_b in flat:
                        copy_bytes(dst_b[b : b + k], src_b[r : r + k])
                    if then is not None:
                        then(r, r + k)
                    r += k

            _cpu_parts(pages, len(ids), len(ids) * rows.shape[1], caller=True)
            return
        views = layout.views(checked, group)  # the rows are checked already
        pairs = [(views[key], dst) for key, dst in tensors.items()]
        if all(dst.device.type == "cpu" and src.device.type == "cpu" for src, dst in pairs):
            spans = _spans(ids, _span_pages(rows.shape[1]))
            if len(spans) * 2 <= len(block_ids):  # mostly consecutive blocks: slice copies
                def runs(sl: slice) -> None:
                    for r, b, k in spans[sl]:
                        for src, dst in pairs:
                            dst[b : b + k].copy_(src[r : r + k])
                        if then is not None:
                            then(r, r + k)

                _cpu_parts(runs, len(spans), len(block_ids) * rows.shape[1])
                return

            idx = torch.tensor(ids, dtype=torch.long)

            def part(sl: slice) -> None:
                for src, dst in pairs:
                    dst.index_put_((idx[sl],), src[sl])
                if then is not None:
                    then(sl.start, sl.stop)

            _cpu_parts(part, len(block_ids), len(block_ids) * rows.shape[1])
            return
        idx = torch.tensor(ids, dtype=torch.long)
        for src, dst in pairs:
            if src.device != dst.device:
                src = src.to(dst.device)
            dst.index_put_((idx.to(dst.device),), src)
        if then is not None:
            then(0, len(block_ids))
    except TORCH_ERRORS as exc:
        raise torch_fault("scattering pages into the pool", exc) from exc


def gather_strided(layout: PageLayout, group: int, pool: PoolViews, block_ids: Sequence[int],
                   rows: torch.Tensor, then: Callable[[int, int], None] | None = None) -> None:
    """Fill canonical ``rows`` (row ``k`` from block ``block_ids[k]``) from ``group``'s
    blocks of ``pool``; padding bytes between regions are zeroed. ``then(first, end)``:
    as :func:`scatter_strided`'s, called once rows ``first..end-1`` are filled, on the
    lane that filled them (a writer's checksums hash them there)."""
    tensors = check_pool(layout, group, pool)
    if not block_ids:
        return
    blocks = next(iter(tensors.values())).shape[0] if tensors else 0
    idx = _ids(block_ids, blocks, False, "block_ids")
    views = _rows(layout, group, rows, len(block_ids))
    try:
        for start, end in layout.padding(group):
            rows[:, start:end].zero_()
        pairs = [(src, views[key]) for key, src in tensors.items()]
        if all(src.device.type == "cpu" and dst.device.type == "cpu" for src, dst in pairs):
            def part(sl: slice) -> None:
                for src, dst in pairs:
                    torch.index_select(src, 0, idx[sl], out=dst[sl])
                if then is not None:
                    then(sl.start, sl.stop)

            _cpu_parts(part, len(block_ids), len(block_ids) * rows.shape[1])
            return
        for src, dst in pairs:
            if src.device != dst.device:
                dst.copy_(src.index_select(0, idx.to(src.device)))
            else:
                torch.index_select(src, 0, idx, out=dst)
        if then is not None:
            then(0, len(block_ids))
    except TORCH_ERRORS as exc:
        raise torch_fault("gathering pages from the pool", exc) from exc
