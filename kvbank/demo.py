"""``kvbank demo``: the embedded core end to end, explained as it runs.

A worker declares a layout, stores the pages of a prompt it computed, then a second
prompt shares the first one's prefix: the bank answers where to resume and hands back
exactly the rows needed, byte for byte. The disk tier is on (a temp dir unless one is
given) with a host tier small enough that pages really move to disk and back.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TextIO

import torch

from kvbank.bank import Bank
from kvbank.layout import full_attention, hybrid_mamba
from kvbank.lender.base import MemoryKind


def run_demo(data_dir: str | Path | None, out: TextIO) -> int:
    with tempfile.TemporaryDirectory(prefix="kvbank-demo-") as tmp:
        path = Path(data_dir) if data_dir is not None else Path(tmp)
        return _demo(path, out)


def _demo(data_dir: Path, out: TextIO) -> int:
    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    gen = torch.Generator().manual_seed(0)
    with Bank.open(data_dir=data_dir, host_bytes="1M", disk_bytes="64M", device_bytes=0) as bank:
        layout = full_attention("demo-model@v1", num_layers=4, num_kv_heads=4, head_dim=64)
        lid = bank.register(layout)
        page = layout.group_page_bytes[0]
        say(f"kvbank demo — data dir {data_dir}")
        say(f"layout {lid.hex()[:16]}…: 4 layers, 4 KV heads × 64, {layout.tokens_per_page} "
            f"tokens a page, {page} bytes a page")

        prompt = torch.randint(0, 32_000, (1000,), generator=gen)
        n = len(prompt) // layout.tokens_per_page
        pages = torch.randint(0, 256, (n, page), dtype=torch.uint8, generator=gen)
        bank.put(lid, prompt.numpy(), group=0, pages=pages)
        bank.store.flush()
        say(f"stored {n} pages of a {len(prompt)}-token prompt (the last {len(prompt) - n * layout.tokens_per_page} tokens make a "
            "partial page, which is never stored)")

        follow_up = torch.cat([prompt[:970], torch.randint(0, 32_000, (60,), generator=gen)])
        m = bank.match(lid, follow_up.numpy())
        r = m.resume
        say(f"a new {len(follow_up)}-token prompt shares 970 tokens: resume at token "
            f"{r.tokens} with {r.row_count} rows ({r.reason.name if r.reason else 'best'})")

        buf = torch.empty((r.row_count, page), dtype=torch.uint8)
        got = bank.fetch(m, out={0: buf})
        same = torch.equal(buf[: len(got.delivered[0])], pages[: len(got.delivered[0])])
        say(f"fetched {got.nbytes} bytes into a preallocated buffer; complete={got.complete}, "
            f"bytes identical to what was stored: {same}")

        # A lease pins its rows in host memory, so it can hold at most what the host tier
        # holds (1 MiB here): lend the first 8 of the 60 rows.
        lease = bank.lend(m.needed[:8], kind=MemoryKind.HOST)
        first = lease.rows[0]
        say(f"a HOST read lease {lease.id[:8]}… locks {len(lease.rows)} rows in place (staged "
            f"back from disk where needed); row 0 lies in shared memory {first.location}")
        bank.release(lease.id)

        again = bank.match(lid, prompt.numpy())
        say(f"the original prompt again: resume at {again.resume.tokens} of {len(prompt)} "
            "(at least one token is always recomputed to produce logits)")

        hybrid = hybrid_mamba("demo-hybrid@v1", attention_layers=[1], mamba_layers=[0, 2],
                              num_kv_heads=2, head_dim=32, conv_shape=(64, 3),
                              ssm_shape=(2, 32, 16))
        hid = bank.register(hybrid)
        tokens = prompt[:64].numpy()
        kv = torch.randint(0, 256, (4, hybrid.group_page_bytes[0]), dtype=torch.uint8,
                           generator=gen)
        bank.put(hid, tokens, group=0, pages=kv)
        state = torch.randint(0, 256, (hybrid.group_page_bytes[1],), dtype=torch.uint8,
                              generator=gen)
        bank.put_state(hid, tokens[:32], group=1, state=state)
        hm = bank.match(hid, tokens)
        say(f"hybrid Mamba: KV for 64 tokens but a state snapshot only at 32 → resume at "
            f"{hm.resume.tokens} ({hm.resume.reason.name if hm.resume.reason else 'best'})")

        stats = bank.stats().store
        tiers = ", ".join(
            f"{t.kind.name.lower()} {t.rows} rows/{t.used_bytes >> 10} KiB"
            for t in stats.tiers
            if t.enabled
        )
        say(f"store: {tiers}")
        bank.check_invariants()
        say("invariants hold; closing (shared memory unlinked, LMDB closed)")
    return 0
