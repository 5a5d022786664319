"""``kvbank bench lmcache``: kvbank as LMCache's L2 tier, against LMCache's own file-system L2.

Needs LMCache 0.5.6 in the running venv (``.ci/lmcache`` builds one). The chunks are real
KV: the keys and values of all-MiniLM-L6-v2 (6 layers, hidden 384) on English text
(:mod:`kvbank.bench.realkv`) in ``bfloat16``, cut into LMCache objects of 256 tokens
(``KV_2LTD``: ``[2, 6, 256, 384]``, 2.25 MiB each). A ``kvbank serve`` node is started for
the run on this host (``--write-policy write-through``: every row also lands in the disk
tier, as LMCache's ``fs`` adapter writes every object to a file). Both adapters are driven
the way LMCache's controllers drive an L2 adapter (submit, wait on the event fd, query),
each with the same 64 chunks stored once:

- ``l2-load-64`` — ``GB/s`` of one load task of 64 chunks into LMCache buffers, after the
  lookup that locks them (kvbank: a READ lease; the copies come from the node's shared
  memory), against LMCache's ``fs`` adapter loading the same chunks from its files (in the
  page cache: the files were just written). Medians of ``repeat`` runs, interleaved.
  Target ratio >= 1.0.
- ``l2-lookup-load-64`` — the same with the lookup and the unlock timed too.
- ``l2-footprint-bf16`` — bytes on disk for the 64 chunks: kvbank's disk-tier frames
  (its codec: bfloat16 byte planes + zstd, checksummed) against the sizes of the ``fs``
  adapter's files. Target ratio <= 0.7.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvbank.bench.common import BenchRow, row

SUITE = "lmcache"
CHUNKS = 64
CHUNK_TOKENS = 256
NODE_ARGS = ("--host-bytes", "1G", "--disk-bytes", "2G", "--device-bytes", "0",
             "--write-policy", "write-through")


def _chunks() -> list[torch.Tensor]:
    """64 ``[2, layers, 256, hidden]`` bfloat16 chunks of real KV."""
    from kvbank.bench.realkv import real_kv

    kv = real_kv("bfloat16", CHUNKS * CHUNK_TOKENS)  # [layers, 2, tokens, heads, head_dim]
    layers, _, tokens, heads, dim = kv.shape
    flat = kv.permute(1, 0, 2, 3, 4).reshape(2, layers, tokens, heads * dim)
    return [flat[:, :, c * CHUNK_TOKENS:(c + 1) * CHUNK_TOKENS].contiguous() for c in range(CHUNKS)]


def _obj(t: torch.Tensor) -> Any:
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    meta = MemoryObjMetadata(shape=t.shape, dtype=t.dtype, address=t.data_ptr(),
                             phy_size=t.numel() * t.element_size(), ref_count=1, fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(t.view(-1), meta, parent_allocator=None)


class _Driver:
    """An L2 adapter's tasks run to completion as LMCache's controllers run them."""

    def __init__(self, adapter: Any) -> None:
        self.a = adapter

    @staticmethod
    def _wait(fd: int) -> None:
        import select

        from lmcache.v1.platform import consume_fd

        poll = select.poll()
        poll.register(fd, select.POLLIN)
        if not poll.poll(120_000):
            raise TimeoutError(f"event fd {fd}: no completion in 120 s")
        with contextlib.suppress(BlockingIOError):
            consume_fd(fd)

    def store(self, keys: list[Any], objs: list[Any]) -> bool:
        task = self.a.submit_store_task(keys, objs)
        while True:
            self._wait(self.a.get_store_event_fd())
            done = self.a.pop_completed_store_tasks()
            if task in done:
                return bool(done[task].is_successful())

    def lookup(self, keys: list[Any], descs: dict[int, Any]) -> int:
        task = self.a.submit_lookup_and_lock_task(keys, descs)
        while True:
            self._wait(self.a.get_lookup_and_lock_event_fd())
            bits = self.a.query_lookup_and_lock_result(task)
            if bits is not None:
                return sum(bits.test(i) for i in range(len(keys)))

    def load(self, keys: list[Any], objs: list[Any]) -> int:
        task = self.a.submit_load_task(keys, objs)
        while True:
            self._wait(self.a.get_load_event_fd())
            bits = self.a.query_load_result(task)
            if bits is not None:
                return sum(bits.test(i) for i in range(len(keys)))


def _fs_adapter(base: Path) -> Any:
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    spec = json.dumps({"type": "fs", "base_path": str(base)})
    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
    return create_l2_adapter(cfg.adapters[0])


def _file_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def run(quick: bool = False) -> Iterator[BenchRow]:
    if importlib.util.find_spec("lmcache") is None:
        raise ImportError("bench lmcache needs LMCache in this venv: lmcache==0.5.6 next to "
                          "torch 2.13 (.ci/lmcache builds one)")
    with warnings.catch_warnings():  # LMCache's cloud clients warn at import
        warnings.simplefilter("ignore")
        from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey

        from kvbank.integrations.lmcache import KvbankL2Adapter
    from kvbank import Client
    from kvbank.service.launch import NodeProcess
    from kvbank.tiers.base import TierKind

    repeat = 5 if quick else 9
    chunks = _chunks()
    nbytes = sum(t.numel() * t.element_size() for t in chunks)
    keys = [ObjectKey(chunk_hash=os.urandom(32), model_name="sentence-transformers/all-MiniLM-L6-v2",
                      kv_rank=ObjectKey.ComputeKVRank(1, 0, 1, 0)) for _ in chunks]
    descs = {0: MemoryLayoutDesc(shapes=[chunks[0].shape], dtypes=[chunks[0].dtype])}
    outs = [torch.empty_like(t) for t in chunks]  # preallocated: both load into the same buffers
    out_objs = [_obj(t) for t in outs]
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-lmcache-") as tmp_name:
        tmp = Path(tmp_name)
        node = NodeProcess.start(["--data-dir", str(tmp / "node"), *NODE_ARGS],
                                 env={**os.environ, "KVBANK_DISK_SYNC": "0"})
        drivers: list[_Driver] = []
        try:
            ours = _Driver(KvbankL2Adapter({"url": node.url}))
            drivers.append(ours)
            theirs = _Driver(_fs_adapter(tmp / "fs"))
            drivers.append(theirs)
            for d in (ours, theirs):
                if not d.store(keys, [_obj(t) for t in chunks]):
                    raise RuntimeError(f"bench lmcache: storing into {type(d.a).__name__} failed")
            with Client(node.url) as c:
                c.flush(120)  # the write-through copies reach the disk tier
                disk = c.stats().store.tier(TierKind.DISK).allocated_bytes

            def check(d: _Driver) -> None:
                got = d.load(keys, out_objs)
                if got != CHUNKS or not all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                                            for a, b in zip(outs, chunks, strict=True)):
                    raise RuntimeError(f"bench lmcache: {type(d.a).__name__} loaded {got}/{CHUNKS} "
                                       "or wrong bytes")

            for d in (ours, theirs):  # warm (the first mapping of the node's memory), and check
                for _ in range(3):
                    if d.lookup(keys, descs) != CHUNKS:
                        raise RuntimeError(f"bench lmcache: {type(d.a).__name__} lost chunks")
                    check(d)
                    d.a.submit_unlock(keys)

            load_s: dict[str, list[float]] = {"ours": [], "theirs": []}
            cycle_s: dict[str, list[float]] = {"ours": [], "theirs": []}
            for _ in range(repeat):
                for name, d in (("ours", ours), ("theirs", theirs)):
                    t0 = time.perf_counter()
                    hit = d.lookup(keys, descs)
                    t1 = time.perf_counter()
                    got = d.load(keys, out_objs)
                    t2 = time.perf_counter()
                    d.a.submit_unlock(keys)
                    t3 = time.perf_counter()
                    if hit != CHUNKS or got != CHUNKS:
                        raise RuntimeError(f"bench lmcache: {name} hit {hit}, loaded {got} of {CHUNKS}")
                    load_s[name].append(t2 - t1)
                    cycle_s[name].append((t1 - t0) + (t2 - t1) + (t3 - t2))
            gb = nbytes / 1e9
            yield row(SUITE, "l2-load-64", "GB/s", gb / statistics.median(load_s["ours"]),
                      "LMCache fs L2 adapter, same chunks", gb / statistics.median(load_s["theirs"]))
            yield row(SUITE, "l2-lookup-load-64", "GB/s", gb / statistics.median(cycle_s["ours"]),
                      "LMCache fs L2 adapter, same chunks", gb / statistics.median(cycle_s["theirs"]))
            yield row(SUITE, "l2-footprint-bf16", "bytes", float(disk),
                      "LMCache fs L2 adapter's files", float(_file_bytes(tmp / "fs")))
        finally:
            for d in drivers:
                d.a.close()
            node.stop()
