"""A brute-force reference for resharding, written apart from :mod:`kvbank.reshard.plan`.

It splits a TP 1 page element by element with numpy fancy indexing along each buffer's
split axis (no byte arithmetic, no plan), so the plan and the kernel are checked against
an independent statement of what a rank holds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvbank import builders as B
from kvbank import layout as L

Arr = npt.NDArray[np.generic]  # a page's bytes, or one label per byte


def held(total: int, count: int, rank: int) -> list[int]:
    """Units of a run of ``total`` (heads, or one section's channels) rank ``rank`` holds."""
    if total % count == 0:
        per = total // count
        return list(range(rank * per, (rank + 1) * per))
    assert count % total == 0, (total, count)
    return [rank // (count // total)]


def split_reference(full: L.PageLayout, page: Arr, group: int, shard: L.PageLayout) -> Arr:
    """Rank ``shard.shard_index``'s page of ``group`` from the TP 1 page ``page`` (one
    entry per byte, any dtype); entries outside every region are -1."""
    assert full.shard_count == 1
    out = np.full(shard.group_page_bytes[group], -1, dtype=page.dtype)
    n, r = shard.shard_count, shard.shard_index
    tokens = full.tokens_per_page if full.groups[group].kind is L.GroupKind.ATTENTION else 1
    for fr, sr in zip(full.regions[group], shard.regions[group], strict=True):
        b = fr.buffer
        arr = page[fr.offset : fr.offset + fr.nbytes].reshape(tokens, *b.shape, b.itemsize)
        if b.head_axis is not None:
            idx: list[int] = []
            base = 0
            for total in b.sections or (b.shape[b.head_axis],):
                idx += [base + u for u in held(total, n, r)]
                base += total
            arr = np.take(arr, idx, axis=b.head_axis + 1)
        flat = arr.reshape(-1)
        assert flat.size == sr.nbytes
        out[sr.offset : sr.offset + sr.nbytes] = flat
    return out


def _hand(count: int, index: int) -> L.PageLayout:
    """Per-buffer head counts: a target layer of 8 KV heads beside a draft layer of 2
    (on axis 1, after an outer axis of 3), a replicated float32 buffer between them."""
    full = L.PageLayout(
        model="hand@draft",
        tokens_per_page=4,
        groups=(L.LayerGroup(L.GroupKind.ATTENTION, (0, 1)),),
        buffers=(
            L.BufferSpec(0, L.Role.KEY, "bfloat16", (8, 16), head_axis=0),
            L.BufferSpec(0, L.Role.VALUE, "bfloat16", (8, 16), head_axis=0),
            L.BufferSpec(0, L.Role.INDEX_KEY, "float32", (5,)),
            L.BufferSpec(1, L.Role.KEY, "float32", (3, 2, 4), head_axis=1),
            L.BufferSpec(1, L.Role.VALUE, "float32", (3, 2, 4), head_axis=1),
        ),
    )
    from kvbank.reshard.plan import shard_layout

    return shard_layout(full, count, index)


BUILDERS: dict[str, Callable[[int, int], L.PageLayout]] = {
    "gqa": lambda n, r: B.full_attention("gqa", 2, 8, 16, tokens_per_page=4,
                                         shard_count=n, shard_index=r),
    "gqa-duplicated": lambda n, r: B.full_attention("gqa2", 2, 2, 16, tokens_per_page=4,
                                                    shard_count=n, shard_index=r),
    "mha": lambda n, r: B.full_attention("mha", 2, 16, 8, tokens_per_page=4,
                                         shard_count=n, shard_index=r),
    "gqa-fp8": lambda n, r: B.full_attention("fp8", 2, 8, 16, tokens_per_page=4,
                                             quant=L.QuantMode.FP8, shard_count=n, shard_index=r),
    "mla": lambda n, r: B.mla("mla", 2, 64, tokens_per_page=4, index_key_dim=16,
                              shard_count=n, shard_index=r),
    "sliding-window": lambda n, r: B.sliding_window(
        "swa", 3, 4, 16, window=8, sink_tokens=2, full_layers=[2], tokens_per_page=4,
        shard_count=n, shard_index=r),
    "hybrid-mamba": lambda n, r: B.hybrid_mamba(
        "mamba", attention_layers=[1], mamba_layers=[0, 2], num_kv_heads=8, head_dim=8,
        conv_shape=(32 // n, 3), conv_sections=(16 // n, 8 // n, 8 // n),
        ssm_shape=(8 // n, 4, 4), tokens_per_page=4, shard_count=n, shard_index=r),
    "non-dividing": lambda n, r: B.full_attention("six", 2, 6, 16, tokens_per_page=4,
                                                  shard_count=n, shard_index=r),
    "per-buffer-heads": _hand,
}
COUNTS = (1, 2, 4, 8)


def valid(name: str, n: int) -> bool:
    """Whether builder ``name`` has a layout at ``n`` shards (heads divide or duplicate)."""
    if name == "non-dividing":
        return n in (1, 2)
    return True
