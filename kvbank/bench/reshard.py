"""``kvbank bench reshard``: building pages of one TP size from pages of another.

Cases ``reshard-4to2`` and ``reshard-2to4``: GB/s of destination pages (bytes of the
pages built per second) of a 32-layer GQA layout (8 KV heads, head dim 128, 16 tokens a
page, bfloat16) built by :func:`kvbank.kernels.reshard.reshard_pages` from the source
pages of the other shard count, one destination rank, a batch of pages per call.
Baseline: ``copy_`` of the same number of bytes between two contiguous tensors (memcpy),
in the same run, interleaved run by run. All buffers are preallocated; the plan is made
once, outside the timing. With CUDA present the same cases run on the device too, named
with a ``-cuda`` suffix.

Case ``match-1000-cross-tp``: ``Bank.match`` latency (ms) of a TP 2 rank for a
1,000-page prompt whose rows exist only under TP 4 (so the match looks them up under TP 4
too: two source rows a page), against the direct match of a TP 4 rank whose own rows are
there, same bank, same run. A 2-layer layout keeps the stored rows small; match cost does
not depend on page size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from kvbank.bank.bank import Bank
from kvbank.bench.common import BenchRow, paired_rates, row
from kvbank.builders import full_attention
from kvbank.config import BankConfig
from kvbank.kernels.reshard import reshard_pages
from kvbank.layout import PageLayout
from kvbank.reshard.plan import plan_reshard

SUITE = "reshard"


def _case(n: int, m: int, pages: int, device: str) -> tuple[Callable[[], None], Callable[[], None], int]:
    """(reshard, memcpy baseline, destination bytes per call) for TP n -> TP m, rank 0."""
    src = full_attention("bench/reshard@1", 32, 8, 128, shard_count=n)
    dst = full_attention("bench/reshard@1", 32, 8, 128, shard_count=m)
    plan = plan_reshard(src, dst)
    gen = torch.Generator().manual_seed(0)
    sources = {
        s: torch.randint(0, 256, (pages, src.group_page_bytes[0]), dtype=torch.uint8,
                         generator=gen).to(device)
        for s in plan.sources
    }
    out = torch.empty((pages, dst.group_page_bytes[0]), dtype=torch.uint8, device=device)
    flat_src = torch.randint(0, 256, (out.numel(),), dtype=torch.uint8, generator=gen).to(device)
    flat_dst = torch.empty_like(flat_src)
    on_cuda = device == "cuda"

    def sync() -> None:
        if on_cuda:  # time the copy, not its launch
            torch.cuda.synchronize()

    def ours() -> None:
        reshard_pages(plan, 0, sources, out)
        sync()

    def memcpy() -> None:
        flat_dst.copy_(flat_src)
        sync()

    return ours, memcpy, out.numel()


def run(quick: bool = False) -> Iterator[BenchRow]:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    repeat = 3 if quick else 9
    for device in devices:
        pages = (16 if quick else 64) if device == "cpu" else 256
        for n, m in ((4, 2), (2, 4)):
            ours, memcpy, nbytes = _case(n, m, pages, device)
            value, base = paired_rates(nbytes / 1e9, ours, memcpy, repeat=repeat, warmup=2)
            suffix = "" if device == "cpu" else f"-{device}"
            yield row(SUITE, f"reshard-{n}to{m}{suffix}", "GB/s", value,
                      f"memcpy of the same bytes ({device})", base)
    yield _match_cross_tp(repeat)


def _match_cross_tp(repeat: int) -> BenchRow:
    pages = 1000
    tokens = [(i * 7919) % 128_000 for i in range(pages * 16 + 1)]

    def layout(n: int, r: int) -> PageLayout:
        return full_attention("bench/match-cross-tp@1", 2, 8, 32, shard_count=n, shard_index=r)

    with Bank(BankConfig(host_bytes=64 << 20, device_bytes=0)) as bank:
        lid4 = b""
        for r in (0, 1):  # the two TP 4 ranks a TP 2 rank 0 needs
            lid4 = bank.register(layout(4, r))
            body = torch.zeros((pages, layout(4, r).group_page_bytes[0]), dtype=torch.uint8)
            bank.put(lid4, tokens, group=0, pages=body, shard=r)
        lid2 = bank.register(layout(2, 0))
        assert bank.match(lid2, tokens).resume.tokens == pages * 16  # found under TP 4

        def cross() -> None:
            bank.match(lid2, tokens, shard=0)

        def direct() -> None:
            bank.match(lid4, tokens, shard=0)

        per_s, base_per_s = paired_rates(1.0, cross, direct, repeat=repeat)
    return row(SUITE, "match-1000-cross-tp", "ms", 1e3 / per_s,
               "direct match of the same chain (TP 4 rank, own rows)", 1e3 / base_per_s)
