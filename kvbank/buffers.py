"""Caller buffers checked against a layout: the pages a put takes, the outputs a fetch fills.

- :func:`page_views` — flat byte views of pages (a ``uint8 [n, page_bytes]`` tensor or a
  sequence of bytes-likes), each checked against the page size
  (:class:`~kvbank.errors.PageSizeMismatch`), without copying host memory.
- :func:`snapshot_boundaries` — the ``at=`` of a ``put_states``: one page boundary per
  snapshot, each within the prompt's full pages.
- :func:`out_views` — writable views of a fetch's output buffers, one per planned row.
- :func:`out_buffers` — new output buffers sized for a match's bound.
- :func:`fetched` — ``fetch_prefix`` after its match: the rows the bound needs fetched into
  the caller's buffers or new ones (``Bank``, and ``Client`` off the lease path).

Every refusal is :class:`~kvbank.errors.InvalidInput` naming the argument and position.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from kvbank.errors import InvalidInput, PageSizeMismatch
from kvbank.layout import PageLayout
from kvbank.results import Fetched, FetchResult, Match

Pages = torch.Tensor | Sequence[bytes | bytearray | memoryview]  # uint8 [n, page_bytes] or n buffers
OutBuffers = Mapping[int, torch.Tensor | Sequence[bytearray | memoryview]]  # group -> rows


def out_buffers(layout: PageLayout, pages: tuple[tuple[int, ...], ...]) -> dict[int, torch.Tensor]:
    """``uint8 [len(pages[g]), page bytes of g]`` for every group with planned rows (not
    zeroed: a fetch writes each row that arrives whole, and only those may be read)."""
    return {g: torch.empty((len(want), layout.group_page_bytes[g]), dtype=torch.uint8)
            for g, want in enumerate(pages) if want}


def page_views(pages: Pages, size: int, field: str) -> list[memoryview]:
    """Flat byte views of the pages, each checked against the layout's page size."""
    if isinstance(pages, torch.Tensor):
        if pages.device.type not in ("cpu", "cuda"):  # a meta tensor has no storage to copy
            raise InvalidInput(f"{field}: a tensor on {pages.device} has no bytes to store; "
                               "give a CPU or CUDA tensor", field=field)
        if pages.dtype != torch.uint8 or pages.dim() != 2:
            raise InvalidInput(f"{field}: expected a uint8 tensor [n, page_bytes], got "
                               f"{pages.dtype} {tuple(pages.shape)}")
        if pages.shape[1] != size:
            raise PageSizeMismatch(f"{field}: pages of {pages.shape[1]} bytes, the layout's page is {size} bytes")
        arr = pages.detach().cpu().contiguous().numpy()
        return [memoryview(arr[i]) for i in range(arr.shape[0])]
    if isinstance(pages, (bytes, bytearray, memoryview, str)) or not isinstance(pages, Sequence):
        raise InvalidInput(f"{field}: expected a uint8 tensor or a sequence of bytes-likes, got {type(pages).__name__}")
    out: list[memoryview] = []
    for i, p in enumerate(pages):
        if not isinstance(p, (bytes, bytearray, memoryview, np.ndarray)):
            raise InvalidInput(f"{field}[{i}]: expected a bytes-like page, got {type(p).__name__}")
        mv = memoryview(p)
        if not mv.c_contiguous:
            raise InvalidInput(f"{field}[{i}]: the buffer must be C-contiguous")
        mv = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
        if len(mv) != size:
            raise PageSizeMismatch(f"{field}[{i}]: {len(mv)} bytes, the layout's page is {size} bytes")
        out.append(mv)
    return out


def snapshot_boundaries(at: Sequence[int], count: int, tokens_per_page: int, full_pages: int) -> list[int]:
    """``at`` of ``count`` snapshots, checked: each a positive multiple of ``tokens_per_page``
    within the ``full_pages`` keyed pages of the prompt."""
    if isinstance(at, (str, bytes)) or not isinstance(at, Sequence) or len(at) != count:
        raise InvalidInput(f"at: expected one boundary per snapshot ({count}), got {at!r}")
    p = tokens_per_page
    for i, b in enumerate(at):
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0 or b % p or b // p > full_pages:
            raise InvalidInput(f"at[{i}]: must be a positive multiple of tokens_per_page {p} "
                               f"within the {full_pages} full pages given, got {b!r}")
    return list(at)


def out_views(
    layout: PageLayout, pages: tuple[tuple[int, ...], ...], out: OutBuffers
) -> dict[int, list[memoryview]]:
    """Views of ``out[g][k]`` for every planned page ``k`` of every group ``g``."""
    if not isinstance(out, Mapping):
        raise InvalidInput(f"out: expected a mapping group -> buffers, got {type(out).__name__}")
    views: dict[int, list[memoryview]] = {}
    for g, planned in enumerate(pages):
        if not planned:
            continue
        size = layout.group_page_bytes[g]
        buf = out.get(g)
        if buf is None:
            raise InvalidInput(f"out[{g}]: missing; group {g} needs {len(planned)} rows of {size} bytes")
        if isinstance(buf, torch.Tensor):
            if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != size or buf.shape[0] < len(planned):
                raise InvalidInput(
                    f"out[{g}]: expected uint8 [>= {len(planned)}, {size}], got {buf.dtype} {tuple(buf.shape)}"
                )
            if buf.device.type != "cpu":
                raise InvalidInput(f"out[{g}]: expected a contiguous CPU tensor, got one on {buf.device}")
            if not buf.is_contiguous():
                raise InvalidInput(f"out[{g}]: expected a contiguous CPU tensor, got a non-contiguous "
                                   f"view (strides {tuple(buf.stride())}); pass .contiguous() or a new one")
            arr = buf.numpy()
            views[g] = [memoryview(arr[i]) for i in range(len(planned))]
            continue
        if isinstance(buf, (bytes, str)) or not isinstance(buf, Sequence) or len(buf) < len(planned):
            raise InvalidInput(f"out[{g}]: expected {len(planned)} writable buffers")
        vs = []
        for i in range(len(planned)):
            try:
                mv = memoryview(buf[i])
            except TypeError:
                mv = None
            if mv is None or mv.readonly or not mv.c_contiguous or mv.nbytes < size:
                raise InvalidInput(
                    f"out[{g}][{i}]: expected a writable, C-contiguous buffer of >= {size} bytes"
                )
            vs.append(mv.cast("B"))
        views[g] = vs
    return views


def fetched(layout: PageLayout, match: Match, out: OutBuffers | None,
            fetch: Callable[[OutBuffers], FetchResult]) -> Fetched:
    """``match``'s needed rows through ``fetch`` into ``out`` (None: new buffers sized from
    ``layout``); nothing is fetched when the bound needs no rows (``result`` None)."""
    if not any(match.resume.pages):
        return Fetched(match, None, {} if out is None else out)
    bufs = out_buffers(layout, match.resume.pages) if out is None else out
    return Fetched(match, fetch(bufs), bufs)
