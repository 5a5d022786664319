"""``kvbank demo``: a worker's calls against a served node, explained as they run.

A worker declares a layout, stores the pages of a prompt it computed, then a second
prompt shares the first one's prefix: the node answers where to resume and hands back
exactly the rows needed, byte for byte — once through shared memory (the node runs on
this host) and once over TCP, as a worker on another host would get them. Without
``--url`` a node is started on a free port (its disk tier in a temp dir unless one is
given) and stopped at the end with SIGTERM, which persists its host rows to disk.
"""

from __future__ import annotations

import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import TextIO

import torch

from kvbank.builders import full_attention, hybrid_mamba
from kvbank.client.client import Client
from kvbank.lender.base import MemoryKind
from kvbank.service.launch import NodeProcess

SYSTEM_TOKENS = 2048  # the shared system prompt of the model part
QUESTION_TOKENS = 64


def run_demo(url: str | None, data_dir: str | Path | None, out: TextIO, *, model: bool = True) -> int:
    if url is not None:
        return _demo(url, out) or (_model_demo(url, out) if model else 0)
    with tempfile.TemporaryDirectory(prefix="kvbank-demo-") as tmp:
        path = Path(data_dir) if data_dir is not None else Path(tmp)
        node = NodeProcess.start(["--data-dir", str(path), "--host-bytes", "64M",
                                  "--disk-bytes", "256M", "--device-bytes", "0"])
        try:
            print(f"kvbank demo — started a node at {node.url} (pid {node.pid}), data dir {path}",
                  file=out, flush=True)
            rc = _demo(node.url, out) or (_model_demo(node.url, out) if model else 0)
        finally:
            code = node.stop()
        where = (f"host rows written to {path}" if data_dir is not None else
                 f"host rows written to its temporary data dir {path}, removed now "
                 "(--data-dir DIR keeps them)")
        print(f"node stopped with SIGTERM: exit {code}, {where}", file=out, flush=True)
        return rc or code


def _demo(url: str, out: TextIO) -> int:
    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    gen = torch.Generator().manual_seed(0)
    with Client(url) as node, Client(url, same_host=False) as remote:
        layout = full_attention("demo-model@v1", num_layers=4, num_kv_heads=4, head_dim=64)
        lid = node.register(layout)
        page = layout.group_page_bytes[0]
        say(f"layout {lid.hex()[:16]}…: 4 layers, 4 KV heads × 64, {layout.tokens_per_page} "
            f"tokens a page, {page} bytes a page")

        prompt = torch.randint(0, 32_000, (1000,), generator=gen)
        n = len(prompt) // layout.tokens_per_page
        pages = torch.randint(0, 256, (n, page), dtype=torch.uint8, generator=gen)
        node.put(lid, prompt.numpy(), group=0, pages=pages)
        say(f"stored {n} pages of a {len(prompt)}-token prompt (the last "
            f"{len(prompt) - n * layout.tokens_per_page} tokens make a partial page, which is "
            f"never stored); path: {'shared memory' if node.same_host else 'TCP'}")

        follow_up = torch.cat([prompt[:970], torch.randint(0, 32_000, (60,), generator=gen)])
        m = node.match(lid, follow_up.numpy())
        r = m.resume
        say(f"a new {len(follow_up)}-token prompt shares 970 tokens: resume at token "
            f"{r.tokens} with {r.row_count} rows ({r.reason.name if r.reason else 'best'})")

        for client, how in ((node, "shared memory" if node.same_host else "TCP"), (remote, "TCP")):
            buf = torch.empty((r.row_count, page), dtype=torch.uint8)
            got = client.fetch(m, out={0: buf})
            same = torch.equal(buf[: len(got.delivered[0])], pages[: len(got.delivered[0])])
            say(f"fetched {got.nbytes} bytes over {how} into a preallocated buffer; "
                f"complete={got.complete}, bytes identical to what was stored: {same}")

        lease = node.lend(m.needed[:8], kind=MemoryKind.HOST)
        first = lease.rows[0]
        say(f"a HOST read lease {lease.id[:8]}… locks {len(lease.rows)} rows in place for "
            f"{lease.expires_wall - time.time():.0f} s; row 0 lies in shared "
            f"memory {first.location}")
        node.release(lease.id)

        again = node.match(lid, prompt.numpy())
        say(f"the original prompt again: resume at {again.resume.tokens} of {len(prompt)} "
            "(at least one token is always recomputed to produce logits)")

        hybrid = hybrid_mamba("demo-hybrid@v1", attention_layers=[1], mamba_layers=[0, 2],
                              num_kv_heads=2, head_dim=32, conv_shape=(64, 3),
                              ssm_shape=(2, 32, 16))
        hid = remote.register(hybrid)
        tokens = prompt[:64].numpy()
        kv = torch.randint(0, 256, (4, hybrid.group_page_bytes[0]), dtype=torch.uint8,
                           generator=gen)
        remote.put(hid, tokens, group=0, pages=kv)
        state = torch.randint(0, 256, (hybrid.group_page_bytes[1],), dtype=torch.uint8,
                              generator=gen)
        remote.put_state(hid, tokens[:32], group=1, state=state)
        hm = remote.match(hid, tokens)
        say(f"hybrid Mamba: KV for 64 tokens but a state snapshot only at 32 → resume at "
            f"{hm.resume.tokens} ({hm.resume.reason.name if hm.resume.reason else 'best'})")

        stats = node.stats().store
        tiers = ", ".join(
            f"{t.kind.name.lower()} {t.rows} rows/{t.used_bytes >> 10} KiB"
            for t in stats.tiers
            if t.enabled
        )
        say(f"node store: {tiers}")
    return 0


def _worker_a(url: str) -> None:
    """Worker A, in its own process: store the system prompt's prefill on the node."""
    from kvbank.integrations.scenario import store_system_prompt

    with Client(url) as node:
        store_system_prompt(node, system_tokens=SYSTEM_TOKENS, question_tokens=QUESTION_TOKENS)


def _model_demo(url: str, out: TextIO) -> int:
    """The shared-system-prompt scenario of a real (tiny) model; 1 if B's answer differs."""
    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    try:
        import transformers  # noqa: F401  (only to say what is missing)
    except ImportError:
        say("\nmodel part skipped: it needs transformers (pip install 'kvbank[transformers]')")
        return 0
    from kvbank.integrations.scenario import resume_system_prompt

    say(f"\na real model: a tiny random-weight Llama (4 layers, GQA), a {SYSTEM_TOKENS:,}-token "
        "system prompt shared by two workers")
    worker = multiprocessing.get_context("spawn").Process(target=_worker_a, args=(url,))
    worker.start()
    worker.join()
    if worker.exitcode != 0:
        say(f"worker A (pid {worker.pid}) failed: exit {worker.exitcode}")
        return 1
    say(f"worker A (pid {worker.pid}, its own process) prefilled its prompt and stored the pages")
    with Client(url) as node:
        result = resume_system_prompt(node, system_tokens=SYSTEM_TOKENS, question_tokens=QUESTION_TOKENS)
    say(result.summary())
    return 0 if result.same_tokens else 1
