"""Gather and scatter pages between a worker's pool layout and canonical pages.

The worker's KV pool holds one tensor per ``(layer, role)`` buffer of a layout group:
``[num_blocks, tokens_per_page, *shape]`` for an ``ATTENTION`` group, ``[num_slots,
*shape]`` for a ``STATE`` group, of the buffer's dtype. A canonical page (DESIGN.md,
"How data moves", steps 2 and 5) concatenates, per page, each transferred buffer's block
at the offset ``layout.regions[group]`` gives it; padding bytes are zero.

Primitives:

- :func:`gather_pages` — pool blocks -> ``out`` (``uint8 [n, group_page_bytes]``), the
  store path: a worker gathers its pages straight into host slots.
- :func:`scatter_pages` — canonical pages -> pool blocks, the fetch path.

Both validate everything first (pool keys, dtypes, shapes, devices, block ids in range,
no duplicate targets for a scatter, pages sharing no memory with the pool, rows of a
gather's ``out`` sharing none with each other) and raise
:class:`~kvbank.errors.InvalidInput` or :class:`~kvbank.errors.PageSizeMismatch` naming
the field; nothing is moved unless all checks pass. A torch failure during the move
(:data:`~kvbank.tiers.device.TORCH_ERRORS`: a CUDA fault, a tensor with no data) leaves
as the :func:`~kvbank.tiers.device.torch_fault` of it, ``TierFull`` for out of device
memory, else ``TierUnavailable``.

Pool and pages may be on different devices (a CUDA pool, host pages): the bytes then go
through a device-side staging buffer of at most ``STAGING_BYTES`` so the cross-device
copy is one contiguous transfer per chunk.

Why word views: every region is moved as a ``[n, nbytes / w]`` tensor of the widest
integer ``w`` in (8, 4, 2, 1) bytes that divides its offsets, strides and size.
``index_select(out=)`` runs at copy speed whatever the width, but ``index_copy_`` on
``uint8`` takes a slow path (1.9 GB/s here) and 12-13 GB/s on an ``int64`` view.

Why neighbouring regions are fused: in a pool whose block holds several buffers side by
side (FlashInfer's ``[blocks, 2, P, heads, dim]``: K then V of a layer), the regions of
those buffers are neighbours in the page too, so they move as one row of twice the width
(one indexed copy instead of two strided ones).

Why a CPU scatter is a numpy fancy assignment: ``dst[ids] = src`` on word views copies
each row with one contiguous memcpy (15 GB/s measured, near a plain copy), while torch's
``index_copy_`` runs 5-13 GB/s on the same words and worse when its intra-op threads
share the cores with other work.

Why the CPU moves run on lanes of ours: a move of ``PARALLEL_BYTES`` or more is split by
rows over ``torch.get_num_threads()`` threads of this module (the lanes; the caller
waits), each lane's torch ops serial, slices taken by whichever lane is free. Two
effects of torch's OpenMP threads decide this. An indexed copy that forks torch's own
team per span (4 spans for a split pool) waits at every fork for a thread whose core
another process holds; a lane that forked a team of its own on each call put 4 threads
on 2 cores and paid a wake-up per call (``kvbank bench kernels``, medians of ten runs:
gather-split 0.75x memcpy, gather-fused 0.82x, against 0.87x and 0.93x with serial lanes).
And libgomp's workers spin after each
parallel region (``GOMP_SPINCOUNT``, 300,000 by default: about 6 ms of a core here after
a ``copy_``) unless it manages more threads than there are CPUs, when they spin 1,000
times (the libgomp manual); serial lanes started right after a torch op of the caller
would share the cores with those spinning workers. So the first lane runs one parallel
region before it turns serial and keeps that OpenMP team, idle, for its life: after it
the spin that follows a ``copy_`` here costs ~0.1 ms of CPU instead of ~6 ms.
``torch.set_num_threads`` in a lane also sets the count that threads started later begin
with; the caller gives that back once the lanes have started.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvbank import checks
from kvbank.errors import InvalidInput, PageSizeMismatch
from kvbank.kernels.faults import TORCH_ERRORS, torch_fault
from kvbank.layout import BufferRegion, GroupKind, PageLayout, Role

logger = logging.getLogger(__name__)

Pool = Mapping[tuple[int, Role], torch.Tensor]  # (layer, role) -> the pool tensor
Span = tuple[int, int, torch.Tensor]  # (page offset, bytes, pool rows as uint8 [blocks, bytes])
STAGING_BYTES = 64 << 20
# A CPU gather or scatter of at least this many bytes is split by rows over
# ``torch.get_num_threads()`` lanes (module docstring): one indexed copy per core
# reaches the memory bandwidth a 2-thread memcpy does, one alone about half of it.
PARALLEL_BYTES = 8 << 20
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
_INT64 = range(-(1 << 63), 1 << 63)


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidInput(f"dtype: torch {torch.__version__} has no dtype {name!r}")
    return dtype


def _block_ids(block_ids: Sequence[int] | torch.Tensor, what: str) -> torch.Tensor:
    """The block ids as a CPU ``int64`` tensor, where they are checked."""
    if isinstance(block_ids, torch.Tensor):
        dtype = block_ids.dtype
        if block_ids.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise InvalidInput(f"{what}: expected a 1-D integer tensor, got {block_ids.dtype} "
                               f"{tuple(block_ids.shape)}")
        try:
            return block_ids.to(device="cpu", dtype=torch.long)
        except TORCH_ERRORS as exc:
            raise torch_fault(f"reading {what} from {block_ids.device}", exc) from exc
    for b in block_ids:
        if isinstance(b, bool) or not isinstance(b, int):
            raise InvalidInput(f"{what}: expected integers, got {b!r}")
        if b not in _INT64:  # torch.tensor would raise a bare overflow error
            raise InvalidInput(f"{what}: block id {b} is outside int64")
    return torch.tensor(list(block_ids), dtype=torch.long)


def _byte_rows(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` as ``uint8 [dim0, bytes per row]`` without a copy (rows may be strided)."""
    try:
        return t.view(torch.uint8).view(t.shape[0], -1)
    except RuntimeError as exc:
        raise InvalidInput(
            f"{what}: each block must be contiguous in memory (stride {t.stride()})"
        ) from exc


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The ``[start, end)`` addresses of the bytes ``t`` (non-empty) may touch."""
    last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share bytes (their address ranges meet)."""
    if a.device != b.device or a.device.type == "meta" or a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = _extent(a), _extent(b)
    return a0 < b1 and b0 < a1


def _word_views(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` (uint8, 2-D, rows contiguous, same row length) viewed as the widest
    integer both their sizes, strides and offsets allow."""
    for width, dtype in _WORDS:
        if all(
            t.shape[1] % width == 0 and t.stride(0) % width == 0 and t.storage_offset() % width == 0
            for t in (a, b)
        ):
            try:
                return a.view(dtype), b.view(dtype)
            except RuntimeError:  # pragma: no cover - e.g. a misaligned data pointer
                continue
    return a, b


def _resolve(
    pool: Pool, layout: PageLayout, group: int, count: int, pages: torch.Tensor, what: str,
    *, writes_pages: bool = False,
) -> tuple[list[tuple[BufferRegion, torch.Tensor]], int]:
    """Validate and return ``(region, pool rows as uint8 [blocks, nbytes])`` pairs and the
    number of blocks every buffer can address. ``writes_pages``: the move writes
    ``pages``, so its rows must not share bytes with each other either."""
    if not isinstance(layout, PageLayout):
        raise InvalidInput(f"layout: expected a PageLayout, got {type(layout).__name__}")
    checks.count(group, "group", 0, len(layout.groups) - 1)
    page_bytes = layout.group_page_bytes[group]
    if not isinstance(pages, torch.Tensor):
        raise InvalidInput(f"{what}: expected a torch.Tensor, got {type(pages).__name__}")
    if pages.dtype != torch.uint8 or pages.dim() != 2:
        raise InvalidInput(
            f"{what}: expected a uint8 tensor [n, page_bytes], got {pages.dtype} "
            f"{tuple(pages.shape)}"
        )
    if pages.shape[0] != count:
        raise InvalidInput(f"{what}: {pages.shape[0]} pages for {count} block ids")
    if pages.shape[1] != page_bytes:
        raise PageSizeMismatch(
            f"{what}: pages of {pages.shape[1]} bytes, layout group {group} pages are "
            f"{page_bytes}"
        )
    if pages.stride(1) != 1:
        raise InvalidInput(f"{what}: each page must be contiguous (stride {pages.stride()})")
    if writes_pages and count > 1 and pages.stride(0) < page_bytes:
        raise InvalidInput(f"{what}: rows overlap (row stride {pages.stride(0)} bytes, pages "
                           f"are {page_bytes})")
    kind = layout.groups[group].kind
    resolved: list[tuple[BufferRegion, torch.Tensor]] = []
    blocks: int | None = None
    device: torch.device | None = None
    for region in layout.regions[group]:
        buf = region.buffer
        key = (buf.layer, buf.role)
        name = f"pool[({buf.layer}, {buf.role.name})]"
        t = pool.get(key)
        if t is None:
            raise InvalidInput(f"pool: no tensor for buffer (layer {buf.layer}, {buf.role.name})")
        if not isinstance(t, torch.Tensor):
            raise InvalidInput(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != _torch_dtype(buf.dtype):
            raise InvalidInput(f"{name}: dtype {t.dtype}, the layout declares {buf.dtype}")
        per_block = (layout.tokens_per_page, *buf.shape) if kind is GroupKind.ATTENTION else buf.shape
        if t.dim() != 1 + len(per_block) or tuple(t.shape[1:]) != tuple(per_block):
            raise InvalidInput(
                f"{name}: shape {tuple(t.shape)}, expected [blocks, {', '.join(map(str, per_block))}]"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise InvalidInput(f"{name}: on {t.device}, other pool tensors on {device}")
        rows = _byte_rows(t, name)
        if _overlap(rows, pages):  # one side is written while the other is read
            raise InvalidInput(f"{what}: shares memory with {name}")
        if rows.shape[1] != region.nbytes:  # pragma: no cover - follows from the shape check
            raise PageSizeMismatch(f"{name}: {rows.shape[1]} bytes per block, region has {region.nbytes}")
        blocks = rows.shape[0] if blocks is None else min(blocks, rows.shape[0])
        resolved.append((region, rows))
    return resolved, blocks or 0


def _check_ids(ids: torch.Tensor, blocks: int, what: str, unique: bool) -> None:
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= blocks:
        bad = lo if lo < 0 else hi
        raise InvalidInput(f"{what}: block id {bad} is outside the pool's 0..{blocks - 1}")
    if unique and torch.unique(ids).numel() != ids.numel():
        raise InvalidInput(f"{what}: duplicate block ids; two pages cannot land in one block")


def _spans(resolved: list[tuple[BufferRegion, torch.Tensor]]) -> list[Span]:
    """The regions as page spans, neighbours fused where the pool holds them side by side
    too (same storage, the next region's rows start where the previous ones end, same
    row stride): one wider indexed copy instead of several."""
    spans: list[Span] = []
    for region, rows in resolved:
        if spans:
            off, nbytes, prev = spans[-1]
            if (off + nbytes == region.offset and prev.device == rows.device
                    and prev.shape[0] == rows.shape[0] and prev.stride(0) == rows.stride(0)
                    and prev.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
                    and prev.storage_offset() + nbytes == rows.storage_offset()
                    and nbytes + region.nbytes <= prev.stride(0)):
                wide = prev.as_strided((prev.shape[0], nbytes + region.nbytes), (prev.stride(0), 1))
                spans[-1] = (off, nbytes + region.nbytes, wide)
                continue
        spans.append((region.offset, region.nbytes, rows))
    return spans


def gather_pages(
    pool: Pool,
    block_ids: Sequence[int] | torch.Tensor,
    layout: PageLayout,
    group: int,
    out: torch.Tensor,
) -> None:
    """Write the canonical pages of ``block_ids`` (in order) into ``out``
    (``uint8 [len(block_ids), layout.group_page_bytes[group]]``). The pool is only read."""
    _gather(pool, block_ids, layout, group, out, staging=None)


def _plan(
    pool: Pool,
    block_ids: Sequence[int] | torch.Tensor,
    layout: PageLayout,
    group: int,
    pages: torch.Tensor,
    field: str,
    *,
    unique: bool,
) -> tuple[list[tuple[BufferRegion, torch.Tensor]], torch.Tensor, torch.device, int] | None:
    """Validate a gather (``unique=False``: it writes ``pages``) or a scatter and resolve its
    regions, its block ids (on the CPU) and the pool's device; None when there is nothing
    to move."""
    count = len(block_ids)
    resolved, blocks = _resolve(pool, layout, group, count, pages, field, writes_pages=not unique)
    if not resolved or count == 0:
        return None
    ids = _block_ids(block_ids, "block_ids")
    _check_ids(ids, blocks, "block_ids", unique=unique)
    return resolved, ids, resolved[0][1].device, count


def _gather(
    pool: Pool,
    block_ids: Sequence[int] | torch.Tensor,
    layout: PageLayout,
    group: int,
    out: torch.Tensor,
    staging: bool | None,
) -> None:
    plan = _plan(pool, block_ids, layout, group, out, "out", unique=False)
    if plan is None:
        return
    resolved, ids, device, count = plan
    if staging is None:
        staging = out.device != device
    try:
        _gather_checked(resolved, ids.to(device), layout, group, out, staging)
    except TORCH_ERRORS as exc:  # checked input: a fault of torch or of the device
        raise torch_fault(f"gather_pages: {count} pages from {device} into {out.device}",
                          exc) from exc


def _gather_checked(
    resolved: list[tuple[BufferRegion, torch.Tensor]],
    ids: torch.Tensor,
    layout: PageLayout,
    group: int,
    out: torch.Tensor,
    staging: bool,
) -> None:
    count = ids.numel()
    device = ids.device
    gaps = layout.padding(group)
    if not staging:
        _gather_rows(resolved, ids, out, gaps)
        return
    # Cross-device: gather on the pool's device, then one contiguous copy per chunk.
    page_bytes = out.shape[1]
    chunk = max(1, STAGING_BYTES // max(page_bytes, 1))
    buf = torch.empty((min(chunk, count), page_bytes), dtype=torch.uint8, device=device)
    for start in range(0, count, chunk):
        part = ids[start : start + chunk]
        stage = buf[: part.numel()]
        _gather_rows(resolved, part, stage, gaps)
        out[start : start + part.numel()].copy_(stage)


_lanes_lock = threading.Lock()
_lanes: ThreadPoolExecutor | None = None
_lanes_size = 0
_lanes_pid = 0


def _start_lane(starts: Iterator[int]) -> None:
    """Make a lane thread's torch ops serial (the lanes are the parallelism). The first
    lane runs one parallel region before that, so it keeps an OpenMP team of its own;
    see "Why the CPU moves run on lanes of ours" in the module docstring."""
    torch.get_num_threads()  # torch's lazy per-thread init, which would undo the next line
    if next(starts) == 0:
        torch.zeros(1 << 16, dtype=torch.uint8)  # > torch's 32,768-element grain: one region
    torch.set_num_threads(1)


def _lane_pool(k: int) -> ThreadPoolExecutor:
    """The executor of at least ``k`` started lanes (created again after a fork)."""
    global _lanes, _lanes_size, _lanes_pid
    with _lanes_lock:
        if _lanes is not None and _lanes_size >= k and _lanes_pid == os.getpid():
            return _lanes
        old = _lanes if _lanes_pid == os.getpid() else None
        threads = torch.get_num_threads()
        lanes = ThreadPoolExecutor(k, thread_name_prefix="kvbank-pages", initializer=_start_lane,
                                   initargs=(itertools.count(),))
        started = threading.Barrier(k)
        for f in [lanes.submit(started.wait) for _ in range(k)]:  # start all k now
            f.result()
        # torch.set_num_threads in a lane also set the count that threads started later
        # begin with: give that back (this thread's own count is unchanged).
        torch.set_num_threads(threads)
        _lanes, _lanes_size, _lanes_pid = lanes, k, os.getpid()
    if old is not None:
        old.shutdown(wait=False)
    return lanes


def _cpu_parts(fn: Callable[[slice], None], count: int, nbytes: int, *, caller: bool = False) -> None:
    """Run ``fn`` over row slices of ``0..count`` on up to ``torch.get_num_threads()``
    lanes while the caller waits; a small move stays on the caller's thread. Slices of
    about ``PARALLEL_BYTES / 2`` are taken by whichever lane is free (a lane whose core is
    busy elsewhere holds back only the slices it took). Raises the first failure after
    every lane stopped. ``caller``: the calling thread is one of the lanes (for an ``fn``
    of no torch op: a torch op on the caller's thread would start its intra-op threads
    beside the lanes, which is why the caller waits by default)."""
    k = max(1, min(torch.get_num_threads(), nbytes // PARALLEL_BYTES, count))
    if k == 1:
        fn(slice(0, count))
        return
    pool = _lane_pool(k - caller)
    step = max(1, min(count // k, count * (PARALLEL_BYTES // 2) // max(nbytes, 1)))
    todo = iter(range(0, count, step))  # shared: next() on a range iterator is atomic under the GIL
    failed = False

    def lane() -> None:
        nonlocal failed
        for start in todo:
            if failed:
                return
            try:
                fn(slice(start, min(start + step, count)))
            except BaseException:
                failed = True
                raise

    futs: list[Future[None]] = [pool.submit(lane) for _ in range(k - caller)]
    try:
        if caller:
            lane()
    finally:
        for f in futs:
            f.exception()  # waits for it, raising nothing (cheaper than futures.wait's waiter)
    for f in futs:
        f.result()


def _gather_rows(
    resolved: list[tuple[BufferRegion, torch.Tensor]],
    ids: torch.Tensor,
    out: torch.Tensor,
    gaps: tuple[tuple[int, int], ...],
) -> None:
    views = [_word_views(rows, out[:, off : off + nbytes]) for off, nbytes, rows in _spans(resolved)]
    if ids.device.type != "cpu" or out.device.type != "cpu":
        for src, dst in views:
            torch.index_select(src, 0, ids, out=dst)
    else:
        def part(rows: slice) -> None:
            for src, dst in views:
                torch.index_select(src, 0, ids[rows], out=dst[rows])

        _cpu_parts(part, ids.numel(), ids.numel() * out.shape[1])
    for start, end in gaps:
        out[:, start:end].zero_()


def scatter_pages(
    pages: torch.Tensor,
    pool: Pool,
    block_ids: Sequence[int] | torch.Tensor,
    layout: PageLayout,
    group: int,
) -> None:
    """Write canonical ``pages`` (``uint8 [n, group_page_bytes]``) into the pool blocks
    ``block_ids`` (distinct). ``pages`` is only read; padding bytes are ignored."""
    _scatter(pages, pool, block_ids, layout, group, staging=None)


def _scatter(
    pages: torch.Tensor,
    pool: Pool,
    block_ids: Sequence[int] | torch.Tensor,
    layout: PageLayout,
    group: int,
    staging: bool | None,
) -> None:
    plan = _plan(pool, block_ids, layout, group, pages, "pages", unique=True)
    if plan is None:
        return
    resolved, ids, device, count = plan
    if staging is None:
        staging = pages.device != device
    try:
        _scatter_checked(pages, resolved, ids.to(device), staging)
    except TORCH_ERRORS as exc:  # checked input: a fault of torch or of the device
        raise torch_fault(f"scatter_pages: {count} pages from {pages.device} into {device}",
                          exc) from exc


def _scatter_checked(
    pages: torch.Tensor,
    resolved: list[tuple[BufferRegion, torch.Tensor]],
    ids: torch.Tensor,
    staging: bool,
) -> None:
    count = ids.numel()
    device = ids.device
    if not staging:
        _scatter_rows(resolved, ids, pages)
        return
    page_bytes = pages.shape[1]
    chunk = max(1, STAGING_BYTES // max(page_bytes, 1))
    buf = torch.empty((min(chunk, count), page_bytes), dtype=torch.uint8, device=device)
    for start in range(0, count, chunk):
        part = ids[start : start + chunk]
        stage = buf[: part.numel()]
        stage.copy_(pages[start : start + part.numel()])
        _scatter_rows(resolved, part, stage)


def _scatter_rows(
    resolved: list[tuple[BufferRegion, torch.Tensor]], ids: torch.Tensor, pages: torch.Tensor
) -> None:
    views = [_word_views(rows, pages[:, off : off + nbytes]) for off, nbytes, rows in _spans(resolved)]
    if ids.device.type != "cpu" or pages.device.type != "cpu":
        for dst, src in views:
            dst.index_copy_(0, ids, src)
        return
    idn = ids.numpy()
    arrays = [(dst.detach().numpy(), src.detach().numpy()) for dst, src in views]

    def part(rows: slice) -> None:
        # Block ids were checked distinct and in range: a plain fancy assignment, and
        # the parts write disjoint blocks.
        for dst, src in arrays:
            dst[idn[rows]] = src[rows]

    _cpu_parts(part, ids.numel(), ids.numel() * pages.shape[1])
