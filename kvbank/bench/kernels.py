"""``kvbank bench kernels``: gather and scatter of canonical pages against memcpy.

Cases ``gather`` (pool blocks -> pages, the store path) and ``scatter`` (pages -> pool
blocks, the fetch path): GB/s for 1,000 random 64 KiB pages out of a 2,048-block pool,
measured for both pool shapes a worker has, and reported for the slower of the two (the
target, >= 0.8x memcpy, holds for each). The per-shape figures are the cases
``gather-split``, ``gather-fused``, ``scatter-split``, ``scatter-fused``:

- *split*: one contiguous tensor per ``(layer, role)``, ``[blocks, P, heads, dim]`` (vLLM
  FlashAttention's ``[2, blocks, …]`` pool is this, K and V each contiguous);
- *fused*: one tensor per layer, ``[blocks, 2, P, heads, dim]`` (FlashInfer's layout): K
  and V of a block are neighbours, so each role's rows are strided.

The page is :func:`~kvbank.builders.full_attention` with 2 layers, 4 KV heads of 128,
bfloat16, 16 tokens a page: four 16 KiB regions, 65,536 bytes. Baseline: ``copy_`` of one
contiguous 64 MB tensor into another (the same bytes with no gather), interleaved run by
run with ours; medians of several runs; every buffer is allocated before timing.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvbank.bench.common import BenchRow, paired_rates, row
from kvbank.builders import full_attention
from kvbank.kernels.pages import Pool, gather_pages, scatter_pages
from kvbank.layout import Role

SUITE = "kernels"
POOL_BLOCKS = 2048
PAGES = 1000


def _pools(p: int, quick: bool) -> dict[str, Pool]:
    heads, dim = 4, 128
    blocks = POOL_BLOCKS // 4 if quick else POOL_BLOCKS
    gen = torch.Generator().manual_seed(0)

    def fill(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(torch.bfloat16)

    split: dict[tuple[int, Role], torch.Tensor] = {
        (layer, role): fill(blocks, p, heads, dim)
        for layer in range(2) for role in (Role.KEY, Role.VALUE)
    }
    fused: dict[tuple[int, Role], torch.Tensor] = {}
    for layer in range(2):
        t = fill(blocks, 2, p, heads, dim)
        fused[(layer, Role.KEY)] = t[:, 0]
        fused[(layer, Role.VALUE)] = t[:, 1]
    return {"split": split, "fused": fused}


def run(quick: bool = False) -> Iterator[BenchRow]:
    layout = full_attention("bench/kernels", 2, 4, 128, tokens_per_page=16, dtype="bfloat16")
    page_bytes = layout.group_bytes(0)
    pools = _pools(layout.tokens_per_page, quick)
    blocks = next(iter(pools["split"].values())).shape[0]
    count = min(PAGES, blocks // 2)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(blocks, generator=gen)[:count]  # distinct: a scatter needs that
    pages = torch.empty((count, page_bytes), dtype=torch.uint8)
    src = torch.randint(0, 255, (count, page_bytes), dtype=torch.uint8, generator=gen)
    dst = torch.empty_like(src)
    work = count * page_bytes / 1e9  # GB
    repeat = 3 if quick else 9

    def memcpy() -> None:
        dst.copy_(src)

    worst: dict[str, tuple[float, float]] = {}
    for shape, pool in pools.items():
        gather_pages(pool, ids, layout, 0, pages)  # warm the pages once: scatter reads them

        def gather(pool: Pool = pool) -> None:
            gather_pages(pool, ids, layout, 0, pages)

        def scatter(pool: Pool = pool) -> None:
            scatter_pages(pages, pool, ids, layout, 0)

        for case, fn in (("gather", gather), ("scatter", scatter)):
            value, base = paired_rates(work, fn, memcpy, repeat=repeat)
            yield row(SUITE, f"{case}-{shape}", "GB/s", value, "memcpy (copy_) of the same bytes", base)
            if case not in worst or value / base < worst[case][0] / worst[case][1]:
                worst[case] = (value, base)
    for case, (value, base) in worst.items():
        yield row(SUITE, case, "GB/s", value, "memcpy (copy_), slower pool shape", base)
