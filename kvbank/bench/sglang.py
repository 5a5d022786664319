"""``kvbank bench sglang``: the SGLang HiCache backend against kvbank's own fetch and SGLang's file backend.

Needs SGLang in the running venv (``.ci/sglang`` builds one; see ``docs/integrations.md``).
A ``kvbank serve`` node is started for the run on this host (the backend reaches it
through its shared memory), with a real ``MHATokenToKVPoolHost`` (page-first, bfloat16,
8 layers, 8 KV heads of 128, pages of 16 tokens: 512 KiB a page) built by
:mod:`kvbank.integrations.sglang.harness`.

Case ``hicache-get-64`` — 64 pages (32 MiB) that the backend stored (``batch_set_v1``),
found and loaded again, pages per second (medians of ``repeat`` runs, each interleaved
with its baseline's). Each side does what a prefetch of the pages costs it, the hit query
included:

- value: ``KvbankHiCacheStorage.batch_exists``, then ``batch_get_v1`` into the host pool's
  slots (what SGLang's prefetch and IO threads call with ``interface_v1``).
- baseline ``Client.fetch_prefix``: the same 64 rows matched and fetched by their keys into
  preallocated page buffers (kvbank's own fastest path for a worker). Target ratio >= 0.9.
- baseline ``HiCacheFile``: SGLang's own file backend holding the same pages (written by
  its ``batch_set`` from the same host slots, in a temporary folder: the page cache holds
  them), queried and read the way SGLang reads a backend without ``interface_v1``:
  ``batch_exists``, ``batch_get`` into flat pages, then ``set_from_flat_data_page`` into
  the same host slots. Target ratio >= 1.0.
"""

from __future__ import annotations

import importlib.util
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvbank.bench.common import BenchRow, paired_rates, row

SUITE = "sglang"
PAGES = 64
PAGE_TOKENS = 16
NODE_ARGS = ("--host-bytes", "512M", "--disk-bytes", "0", "--device-bytes", "0")


def run(quick: bool = False) -> Iterator[BenchRow]:
    if importlib.util.find_spec("sglang") is None:
        raise ImportError("bench sglang needs SGLang in this venv (.ci/sglang builds one: "
                          "sglang 0.5.23 --no-deps on the CPU torch)")
    import torch

    from kvbank.integrations.sglang import KvbankHiCacheStorage
    from kvbank.integrations.sglang.harness import (
        file_backend,
        mha_pools,
        page_hashes,
        storage_config,
    )
    from kvbank.service.launch import NodeProcess

    repeat = 15 if quick else 41  # paired runs of ~5 ms each: a median of 9 swung by ±0.07
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-sglang-") as tmp_name:
        tmp = Path(tmp_name)
        node = NodeProcess.start(["--data-dir", str(tmp / "node"), *NODE_ARGS])
        try:
            _, _, host = mha_pools(tokens=PAGES * PAGE_TOKENS, page_size=PAGE_TOKENS, heads=8,
                                   head_dim=128, layers=8, host_ratio=2.0)
            model = "bench-llama"
            ours = KvbankHiCacheStorage(storage_config(model, {"kvbank_url": node.url}), {})
            ours.register_mem_pool_host(host)
            theirs = file_backend(model, str(tmp / "hicache"))
            theirs.register_mem_pool_host(host)

            tokens = list(range(1000, 1000 + PAGES * PAGE_TOKENS))
            keys = page_hashes(tokens, PAGE_TOKENS)
            idx = host.alloc(PAGES * PAGE_TOKENS)
            g = torch.Generator().manual_seed(0)
            for i in range(0, idx.numel(), PAGE_TOKENS):
                page = host.get_data_page(int(idx[i]), flat=True)
                host.set_from_flat_data_page(int(idx[i]), torch.randn(page.numel(), generator=g).to(page.dtype))
            if not all(ours.batch_set_v1(keys, idx)):
                raise RuntimeError("bench sglang: the backend did not store the pages")
            firsts = [int(idx[i]) for i in range(0, idx.numel(), PAGE_TOKENS)]
            if not theirs.batch_set(keys, [host.get_data_page(i, flat=True) for i in firsts]):
                raise RuntimeError("bench sglang: HiCacheFile did not store the pages")

            pm = ours._pool("kv")
            client = ours.clients.get()
            kb = [bytes.fromhex(k) for k in keys]
            out = {0: torch.zeros((PAGES, pm.layout.group_page_bytes[0]), dtype=torch.uint8)}

            def backend_get() -> None:
                if ours.batch_exists(keys) != PAGES or not all(ours.batch_get_v1(keys, idx)):
                    raise RuntimeError("bench sglang: batch_get_v1 missed")

            def fetch_prefix() -> None:
                got = client.fetch_prefix(pm.layout_id, keys=kb, prompt_tokens=PAGES * PAGE_TOKENS + 1,
                                          scope=ours.scope, shard=pm.shard, out=out)
                if got.tokens != PAGES * PAGE_TOKENS:
                    raise RuntimeError("bench sglang: fetch_prefix missed")

            flat = [host.get_dummy_flat_data_page() for _ in keys]

            def file_get() -> None:
                if theirs.batch_exists(keys) != PAGES:
                    raise RuntimeError("bench sglang: HiCacheFile missed")
                pages = theirs.batch_get(keys, flat)
                for i, p in zip(firsts, pages, strict=True):
                    if p is None:
                        raise RuntimeError("bench sglang: HiCacheFile missed")
                    host.set_from_flat_data_page(i, p)

            ours_rate, base = paired_rates(PAGES, backend_get, fetch_prefix, repeat, warmup=3)
            yield row(SUITE, "hicache-get-64", "pages/s", ours_rate, "Client.fetch_prefix", base)
            ours_rate, base = paired_rates(PAGES, backend_get, file_get, repeat, warmup=3)
            yield row(SUITE, "hicache-get-64", "pages/s", ours_rate, "HiCacheFile", base)
            ours.close()
        finally:
            node.stop()
