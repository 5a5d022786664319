"""``scatter_strided`` / ``gather_strided``: canonical pages to and from a pool whose
tensors are permuted views, for every axis order of a ``[B, H, N, D]`` block; moved
blocks equal, untouched blocks unchanged, the source unchanged, padding zero, and bad
input refused before anything moves."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
import torch

from kvbank import full_attention
from kvbank.codec.planes import copy_bytes
from kvbank.errors import InvalidInput, PageSizeMismatch
from kvbank.kernels import pages as lanes_of
from kvbank.kernels import strided
from kvbank.kernels.pages import PARALLEL_BYTES
from kvbank.kernels.strided import gather_strided, scatter_strided
from kvbank.layout import Role

P, H, D, B = 4, 2, 3, 10  # head_dim 3 of fp16: regions of 24 bytes, padded to the alignment
LAYOUT = full_attention("strided@1", num_layers=2, num_kv_heads=H, head_dim=D, tokens_per_page=P, dtype="float16")
ORDERS = list(itertools.permutations(range(4)))  # physical order of the logical [B, N, H, D]


def pool(order: tuple[int, ...], seed: int) -> dict[tuple[int, Role], torch.Tensor]:
    """Each buffer a [B, N, H, D] view of storage laid out in ``order``."""
    g = torch.Generator().manual_seed(seed)
    shape = (B, P, H, D)
    out = {}
    for layer, role in itertools.product(range(2), (Role.KEY, Role.VALUE)):
        phys = torch.randn([shape[a] for a in order], generator=g).to(torch.float16)
        out[(layer, role)] = phys.permute([order.index(a) for a in range(4)])
    return out


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: "".join("BNHD"[a] for a in o))
def test_gather_then_scatter_moves_blocks_through_any_stride_order(order: tuple[int, ...]) -> None:
    assert LAYOUT.padding(0)  # the page has gaps between regions
    src, dst = pool(order, 1), pool(order, 2)
    src_before = {k: t.clone() for k, t in src.items()}
    dst_before = {k: t.clone() for k, t in dst.items()}
    pages = torch.full((3, LAYOUT.group_page_bytes[0]), 0xAB, dtype=torch.uint8)
    gather_strided(LAYOUT, 0, src, [7, 2, 5], pages)
    for a, b in LAYOUT.padding(0):
        assert not pages[:, a:b].any()  # padding zeroed: equal pages are equal rows
    views = LAYOUT.views(pages, 0)
    for k, t in src.items():
        assert torch.equal(views[k], t[[7, 2, 5]]) and torch.equal(t, src_before[k])
    scatter_strided(LAYOUT, 0, pages, dst, [0, 9, 4])
    for k, t in dst.items():
        assert torch.equal(t[[0, 9, 4]], src[k][[7, 2, 5]])
        rest = [i for i in range(B) if i not in (0, 9, 4)]
        assert torch.equal(t[rest], dst_before[k][rest])


def test_rows_may_be_strided_like_slots_of_a_segment() -> None:
    size = LAYOUT.group_page_bytes[0]
    seg = torch.zeros(4 * size * 2, dtype=torch.uint8)
    rows = seg.view(4, 2 * size)[:, :size]  # every other slot
    src, dst = pool((0, 1, 2, 3), 3), pool((0, 2, 1, 3), 4)
    gather_strided(LAYOUT, 0, src, [1, 2, 3, 4], rows)
    assert not seg.view(4, 2 * size)[:, size:].any()  # nothing written between the rows
    scatter_strided(LAYOUT, 0, rows, dst, [5, 6, 7, 8])
    for k in src:
        assert torch.equal(dst[k][5:9], src[k][1:5])


def test_bad_input_is_refused_before_anything_moves() -> None:
    src = pool((0, 1, 2, 3), 5)
    before = {k: t.clone() for k, t in src.items()}
    pages = torch.zeros((2, LAYOUT.group_page_bytes[0]), dtype=torch.uint8)
    with pytest.raises(InvalidInput, match="twice"):
        scatter_strided(LAYOUT, 0, pages, src, [1, 1])
    with pytest.raises(InvalidInput, match=r"block_ids\[1\]"):
        scatter_strided(LAYOUT, 0, pages, src, [1, B])
    missing = dict(src)
    del missing[(1, Role.KEY)]
    with pytest.raises(InvalidInput, match="layer 1 KEY"):
        scatter_strided(LAYOUT, 0, pages, missing, [1, 2])
    wrong = {**src, (0, Role.KEY): src[(0, Role.KEY)].float()}
    with pytest.raises(InvalidInput, match="dtype"):
        gather_strided(LAYOUT, 0, wrong, [1, 2], pages)
    short = {**src, (0, Role.VALUE): src[(0, Role.VALUE)][:, :2]}
    with pytest.raises(PageSizeMismatch):
        scatter_strided(LAYOUT, 0, pages, short, [1, 2])
    for k, t in src.items():
        assert torch.equal(t, before[k])


def test_a_large_move_split_over_lanes_moves_every_row() -> None:
    """Past PARALLEL_BYTES the rows are split over the kernel lanes: every row still lands."""
    big = full_attention("strided-big@1", num_layers=2, num_kv_heads=8, head_dim=128, tokens_per_page=16,
                         dtype="float32")
    n, blocks = 72, 80
    assert n * big.group_page_bytes[0] >= 2 * PARALLEL_BYTES  # two lanes where there are two threads
    g = torch.Generator().manual_seed(7)
    src = {(i, r): torch.randn(blocks, 8, 16, 128, generator=g).transpose(1, 2)
           for i in range(2) for r in (Role.KEY, Role.VALUE)}
    dst = {k: torch.zeros_like(t) for k, t in src.items()}
    ids = torch.randperm(blocks, generator=g)[:n].tolist()
    pages = torch.empty((n, big.group_page_bytes[0]), dtype=torch.uint8)
    gather_strided(big, 0, src, ids, pages)
    scatter_strided(big, 0, pages, dst, ids)
    for k in src:
        assert torch.equal(dst[k][ids], src[k][ids])
        rest = [i for i in range(blocks) if i not in ids]
        assert not dst[k][rest].any()


def test_a_gather_hands_each_row_over_once_after_it_is_filled() -> None:
    """``then`` of a gather split over the lanes is told of every row once, only after
    that row holds its block's page (a writer's checksums hash it there); a failing
    ``then`` is raised to the caller."""
    big = full_attention("strided-then@1", num_layers=2, num_kv_heads=8, head_dim=128, tokens_per_page=16,
                         dtype="float32")
    n, blocks = 72, 80
    assert n * big.group_page_bytes[0] >= 2 * PARALLEL_BYTES
    g = torch.Generator().manual_seed(13)
    src = {(i, r): torch.randn(blocks, 8, 16, 128, generator=g).transpose(1, 2)
           for i in range(2) for r in (Role.KEY, Role.VALUE)}
    ids = torch.randperm(blocks, generator=g)[:n].tolist()
    want = torch.empty((n, big.group_page_bytes[0]), dtype=torch.uint8)
    gather_strided(big, 0, src, ids, want)
    pages = torch.zeros_like(want)
    seen: list[int] = []
    landed: list[bool] = []
    lock = threading.Lock()

    def then(first: int, end: int) -> None:
        ok = torch.equal(pages[first:end], want[first:end])
        with lock:
            seen.extend(range(first, end))
            landed.append(ok)

    gather_strided(big, 0, src, ids, pages, then=then)
    assert sorted(seen) == list(range(n)) and len(landed) > 1 and all(landed)
    assert torch.equal(pages, want)

    def fails(first: int, end: int) -> None:
        raise KeyError("a hash failed")

    with pytest.raises(KeyError, match="a hash failed"):
        gather_strided(big, 0, src, ids, pages, then=fails)


def test_a_pool_of_long_contiguous_regions_moves_as_bytes_and_hands_each_row_over_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A page-first pool (each page's region of a buffer contiguous, 128 KiB here) takes
    the byte path: a copy a run of consecutive blocks and region (with ``then``, a run of
    at most ``HASHED_RUN_BYTES``), the caller's thread one of the lanes, and ``then`` told
    of every row once, after that row landed. The pool ends equal to the rows; blocks not
    named are untouched; a failing ``then`` is raised to the caller."""
    big = full_attention("strided-bytes@1", num_layers=1, num_kv_heads=8, head_dim=128, tokens_per_page=64,
                         dtype="bfloat16")
    n, blocks = 72, 90
    page = big.group_page_bytes[0]
    assert page // 2 >= strided.BYTES_MIN and n * page >= 2 * PARALLEL_BYTES
    dst = {(0, r): torch.zeros(blocks, 64, 8, 128, dtype=torch.bfloat16) for r in (Role.KEY, Role.VALUE)}
    bits = {k: t.view(torch.int16) for k, t in dst.items()}  # random bytes hold NaNs: compare bits
    assert all(strided._page_bytes(t) is not None for t in dst.values())
    g = torch.Generator().manual_seed(11)
    rows = torch.randint(0, 256, (n, page), dtype=torch.uint8, generator=g)
    before = rows.clone()
    others = [b for b in torch.randperm(blocks, generator=g).tolist() if not 10 <= b < 40]
    ids = [*range(10, 40), *others[: n - 30]]  # a run, then scattered ids, each once
    views = {k: v.view(torch.int16) for k, v in big.views(rows, 0).items()}
    seen: list[int] = []
    landed: list[bool] = []
    lock = threading.Lock()

    def then(first: int, end: int) -> None:
        ok = all(torch.equal(bits[k][ids[r]], views[k][r]) for r in range(first, end) for k in dst)
        with lock:
            seen.extend(range(first, end))
            landed.append(ok)

    parts: list[dict[str, Any]] = []
    lanes = lanes_of._cpu_parts

    def counted(fn: Any, count: int, nbytes: int, **kw: Any) -> None:
        parts.append(kw)
        lanes(fn, count, nbytes, **kw)

    copies: list[int] = []

    def counted_copy(d: Any, s: Any) -> None:
        copies.append(d.shape[0])
        copy_bytes(d, s)

    monkeypatch.setattr(strided, "_cpu_parts", counted)
    monkeypatch.setattr(strided, "copy_bytes", counted_copy)
    scatter_strided(big, 0, rows, dst, ids, then=then)
    assert [kw["caller"] for kw in parts] == [True]  # the byte path: the caller's thread is a lane
    assert sum(copies) == 2 * n and max(copies) > 1  # every page of both regions, runs in one copy
    # a run hashed after its copy is short enough to be in cache still; with no ``then``, longer
    assert max(copies) * page <= strided.HASHED_RUN_BYTES
    assert sorted(seen) == list(range(n)) and all(landed)
    for k, t in bits.items():
        assert torch.equal(t[ids], views[k])
        rest = [i for i in range(blocks) if i not in ids]
        assert not t[rest].any()
    assert torch.equal(rows, before)

    copies.clear()
    for t in dst.values():
        t.zero_()
    scatter_strided(big, 0, rows, dst, ids)
    assert sum(copies) == 2 * n and max(copies) * page > strided.HASHED_RUN_BYTES
    for k, t in bits.items():
        assert torch.equal(t[ids], views[k])

    def fails(first: int, end: int) -> None:
        raise KeyError("a check failed")

    with pytest.raises(KeyError, match="a check failed"):
        scatter_strided(big, 0, rows, dst, ids, then=fails)


def test_small_pages_of_a_consecutive_run_move_in_pieces_of_a_hashed_run() -> None:
    """A run of consecutive blocks through strided views (a cache's ``[1, H, T, D]``,
    head-major) moves in pieces of ``HASHED_RUN_BYTES`` of rows where pages are small (one
    ``copy_`` a buffer and piece; pieces of 8 pages cost 256 copies for 252 pages of 32
    KiB), of ``SPAN_PAGES`` where pages are large; ``then`` is told of each piece once,
    after it landed; every block arrives."""
    small = full_attention("strided-span@1", num_layers=4, num_kv_heads=2, head_dim=32, tokens_per_page=16,
                           dtype="float32")
    row = small.group_page_bytes[0]
    assert row == 32 << 10
    n = 100
    g = torch.Generator().manual_seed(5)
    want = {(i, r): torch.randn(1, 2, n * 16, 32, generator=g) for i in range(4) for r in (Role.KEY, Role.VALUE)}
    src = {k: t[0].view(2, n, 16, 32).permute(1, 2, 0, 3) for k, t in want.items()}  # [blocks, P, H, D]
    rows = torch.empty((n, row), dtype=torch.uint8)
    gather_strided(small, 0, src, list(range(n)), rows)
    got = {k: torch.zeros_like(t) for k, t in want.items()}
    dst = {k: t[0].view(2, n, 16, 32).permute(1, 2, 0, 3) for k, t in got.items()}
    pieces: list[tuple[int, int]] = []
    landed: list[bool] = []
    lock = threading.Lock()

    def then(first: int, end: int) -> None:
        ok = all(torch.equal(dst[k][first:end], src[k][first:end]) for k in src)
        with lock:
            pieces.append((first, end))
            landed.append(ok)

    scatter_strided(small, 0, rows, dst, list(range(n)), then=then)
    assert all(torch.equal(got[k], want[k]) for k in want) and all(landed)
    per = strided.HASHED_RUN_BYTES // row
    assert per > strided.SPAN_PAGES
    assert sorted(pieces) == [(a, min(n, a + per)) for a in range(0, n, per)]
    assert strided._span_pages(2 << 20) == strided.SPAN_PAGES  # large pages: pieces of 8
