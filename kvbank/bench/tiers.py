"""``kvbank bench tiers``: the tiered store against the raw operations it is built from.

Pages are 2 MiB of random-normal bfloat16 (compresses like real KV, machine-limits.md 3).

========================  ==============================  ==================================
case                      ours                            baseline (same run, same bytes)
========================  ==============================  ==================================
host-put                  ``store.put`` into the host     memcpy of the pages into one
                          slab (no eviction)              preallocated buffer of that size
host-get                  ``store.get_into`` a            memcpy from a preallocated copy of
                          preallocated buffer             the pages into the same buffer
disk-get-warm             ``store.get_into`` of rows on   ``codec.decode_into`` of the same
                          disk (host tier off, warm       frames held in memory
                          page cache)
demote                    puts past the host budget,      LMDB puts of the same frames, one
                          then ``flush``: GB/s moved to   transaction each, same sync setting
                          disk (encode + durable commit)
index-bytes-per-row       tracemalloc delta per row of    a plain ``dict[bytes, int]`` of the
                          the store after N tiny puts     same names
evict-1m                  ms of the put that meets a      ``np.argsort`` of the LRU stamps
                          full host tier of 1 Mi rows     of the same rows (what a full-
                          (half of them reread) and       sort selection pays at least)
                          evicts 1024 of them (one round)
evict-1m-value-choice     ms of the value rule's choice   the LRU rule's choice on the same
                          of one round's victims on that  index, interleaved run by run
                          index (the default rule)
stage-host-many-64        ``stage_host_many`` of 64 rows  64 ``stage_host`` calls on the
                          (in host, locked): calls/s      same rows
========================  ==============================  ==================================

``quick=True`` (CI) uses fewer pages, 100 k rows for the index and 128 Ki rows for the
eviction case (``evict-128k``); the full run uses 1 M (and 1 Mi) rows. Ratios > 1 mean
ours is faster, except for index-bytes-per-row and evict-* where the value is bytes or
milliseconds and the ratio is ours / baseline (lower is better).
"""

from __future__ import annotations

import functools
import gc
import logging
import shutil
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import lmdb
import numpy as np
import torch

from kvbank.bench.common import BenchRow, paired_rates, paired_seconds, row
from kvbank.codec import decode_into, encode
from kvbank.config import BankConfig, EvictionPolicy
from kvbank.tiers.base import TierKind
from kvbank.tiers.index import HOST
from kvbank.tiers.store import policy
from kvbank.tiers.store.store import TieredStore

SUITE = "tiers"
PAGE = 2 << 20
GB = 1e9


def _name(i: int) -> bytes:
    return (b"bench" + i.to_bytes(8, "big")).rjust(54, b"\x00")


def _pages(n: int) -> list[bytes]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randn(PAGE // 2, generator=gen).to(torch.bfloat16)
        out.append(t.view(torch.uint8).numpy().tobytes())
    return out


def _store(tmp: Path | None, **kw: object) -> TieredStore:
    fields: dict[str, object] = {"data_dir": tmp, "device_bytes": 0}
    fields.update(kw)
    return TieredStore(BankConfig(**fields))  # type: ignore[arg-type]


def _host(pages: list[bytes], repeat: int) -> Iterator[BenchRow]:
    n = len(pages)
    total = n * PAGE
    store = _store(None, host_bytes=2 * total + (64 << 20))
    try:
        names = [_name(i) for i in range(n)]
        dst = bytearray(total)
        dmv = memoryview(dst)

        def put() -> None:
            for name, page in zip(names, pages, strict=True):
                store.put(name, page, dtype="bfloat16")

        def memcpy_in() -> None:
            for i, page in enumerate(pages):
                dmv[i * PAGE : (i + 1) * PAGE] = page

        ours, base = paired_rates(total / GB, put, memcpy_in, repeat=repeat)
        yield row(SUITE, "host-put", "GB/s", ours, "memcpy into a preallocated buffer", base)

        out = memoryview(bytearray(PAGE))

        def get() -> None:
            for name in names:
                store.get_into(name, out)

        def memcpy_out() -> None:
            for i in range(n):
                out[:] = dmv[i * PAGE : (i + 1) * PAGE]

        ours, base = paired_rates(total / GB, get, memcpy_out, repeat=repeat)
        yield row(SUITE, "host-get", "GB/s", ours, "memcpy into a preallocated buffer", base)
    finally:
        store.close()


def _disk_get(pages: list[bytes], tmp: Path, repeat: int) -> Iterator[BenchRow]:
    n = len(pages)
    total = n * PAGE
    store = _store(tmp / "get", host_bytes=0, disk_bytes=4 * total, disk_sync=False)
    try:
        names = [_name(i) for i in range(n)]
        for name, page in zip(names, pages, strict=True):
            store.put(name, page, dtype="bfloat16")  # no host tier: straight to disk
        frames = [encode(p, "bfloat16") for p in pages]
        out = memoryview(bytearray(PAGE))

        def get() -> None:
            for name in names:
                if store.get_into(name, out) != PAGE:
                    raise RuntimeError("bench: a disk row went missing")

        def decode() -> None:
            for f in frames:
                decode_into(f, out)

        ours, base = paired_rates(total / GB, get, decode, repeat=repeat)
        yield row(SUITE, "disk-get-warm", "GB/s", ours, "codec.decode_into of the same frames",
                  base)
    finally:
        store.close()


def _demote(pages: list[bytes], tmp: Path, repeat: int) -> Iterator[BenchRow]:
    n = len(pages)
    host_pages = 8
    frames = [encode(p, "bfloat16") for p in pages]
    moved: list[float] = []
    raw: list[float] = []
    for rep in range(repeat):
        d = tmp / f"demote{rep}"
        store = _store(d, host_bytes=host_pages * PAGE, disk_bytes=8 * n * PAGE,
                       disk_sync=True, high_watermark=0.5, low_watermark=0.25)
        try:
            t0 = time.perf_counter()
            for i, page in enumerate(pages):
                store.put(_name(i), page, dtype="bfloat16")
            store.flush()
            dt = time.perf_counter() - t0
            st = store.stats()
            moved.append(st.tier(TierKind.DISK).rows * PAGE / GB / dt)
        finally:
            store.close()
        env = lmdb.open(str(tmp / f"raw{rep}"), map_size=16 * n * PAGE + (1 << 30), sync=True,
                        metasync=True, writemap=False, readahead=True)
        try:
            t0 = time.perf_counter()
            for i, f in enumerate(frames):
                with env.begin(write=True) as txn:
                    txn.put(_name(i), f)
            dt = time.perf_counter() - t0
            raw.append(n * PAGE / GB / dt)
        finally:
            env.close()
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(tmp / f"raw{rep}", ignore_errors=True)
    yield row(SUITE, "demote", "GB/s", float(np.median(moved)),
              "LMDB puts of the same frames (sync, 1 txn each)", float(np.median(raw)))


def _index(rows: int) -> Iterator[BenchRow]:
    names = [(b"idx" + i.to_bytes(8, "big")).rjust(54, b"\x00") for i in range(rows)]
    page = b"\x01" * 64
    gc.collect()
    tracemalloc.start()
    try:
        base0 = tracemalloc.get_traced_memory()[0]
        plain = {name: i for i, name in enumerate(names)}
        # The names already exist in both cases; a dict owning fresh copies pays for
        # the bytes objects too, so both sides are charged for them below.
        dict_bytes = tracemalloc.get_traced_memory()[0] - base0
        del plain
        gc.collect()
        store = _store(None, host_bytes=rows * 64 + (16 << 20))
        try:
            before = tracemalloc.get_traced_memory()[0]
            for name in names:
                store.put(name, page)
            ours = tracemalloc.get_traced_memory()[0] - before
        finally:
            store.close()
    finally:
        tracemalloc.stop()
    name_obj = 54 + 33 + 1  # the bytes object of a 54-byte name, pymalloc-rounded
    per_row = ours / rows + name_obj
    per_dict = dict_bytes / rows + name_obj
    yield row(SUITE, f"index-bytes-per-row-{rows // 1000}k", "bytes/row", per_row,
              "dict[bytes, int] of the same names", per_dict)


def _evict(rows: int, victims: int, repeat: int) -> Iterator[BenchRow]:
    """One eviction round at ``rows`` rows: the host tier holds exactly ``rows`` 64-byte
    slots (a power of two: budget/64 units of whole slots), the watermark band is
    ``victims`` slots, so the put that finds it full evicts ``victims`` LRU rows (no disk:
    they leave the store) before it lands."""
    page = b"\x02" * 64
    budget = rows * 64
    store = _store(None, host_bytes=budget, high_watermark=1.0,
                   low_watermark=1.0 - victims / rows)
    try:
        names = [(b"ev" + i.to_bytes(8, "big")).rjust(54, b"\x00") for i in range(rows)]
        for name in names:
            store.put(name, page)
        out = bytearray(64)
        rng = np.random.default_rng(0)
        # The baseline sorts stamps in the store's own LRU order (put order, then half of
        # the rows reread), kept here as the store's logical clock would stamp them.
        stamps = np.arange(1, rows + 1, dtype=np.uint32)
        clock = rows
        for i in rng.permutation(rows)[: rows // 2].tolist():  # reads reorder the LRU
            store.get_into(names[i], out)
            clock += 1
            stamps[i] = clock
        fresh = iter([(b"fr" + i.to_bytes(8, "big")).rjust(54, b"\x00")
                      for i in range((repeat + 1) * victims)])
        ours: list[float] = []
        base: list[float] = []
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            store.put(next(fresh), page)  # full: this put pays for the round
            t1 = time.perf_counter()
            np.argsort(stamps, kind="stable")
            t2 = time.perf_counter()
            ours.append(t1 - t0)
            base.append(t2 - t1)
            for _ in range(victims - 1):  # refill the slots the round freed
                store.put(next(fresh), page)
        if store.stats().tier(TierKind.HOST).evictions != (repeat + 1) * victims:
            raise RuntimeError("bench: the eviction rounds did not happen")
        # The two rules' choice of one round's victims on this very index, interleaved.
        st = store._st
        rules = {rule: functools.partial(policy.victims, st.ix, HOST, victims * 64, keep=(),
                                         busy_offs=set(), host_copy={}, charge=lambda rid: 64,
                                         rule=rule)
                 for rule in EvictionPolicy}
        with st.lock:
            value_s, lru_s = paired_seconds(rules[EvictionPolicy.VALUE],
                                            rules[EvictionPolicy.LRU], repeat=repeat)
    finally:
        store.close()
    label = f"{rows >> 20}m" if rows >= 1 << 20 else f"{rows >> 10}k"
    yield row(SUITE, f"evict-{label}", "ms", float(np.median(ours[1:])) * 1e3,
              f"np.argsort of {rows} LRU stamps", float(np.median(base[1:])) * 1e3)
    yield row(SUITE, f"evict-{label}-value-choice", "ms", value_s * 1e3,
              f"the lru rule's choice of {victims} victims of the same {rows} rows", lru_s * 1e3)


def _stage_many(repeat: int) -> Iterator[BenchRow]:
    """A 64-row lease's staging when its rows are in host: one call against 64."""
    store = _store(None, host_bytes=64 << 20)
    try:
        names = [_name(i) for i in range(64)]
        for name in names:
            store.put(name, b"\x03" * 4096)
        store.locks.lock(names, "bench")

        def many() -> None:
            for _ in range(50):
                store.host.stage_many(names)

        def single() -> None:
            for _ in range(50):
                for name in names:
                    store.host.stage(name)

        ours, base = paired_rates(50, many, single, repeat=repeat)
        yield row(SUITE, "stage-host-many-64", "calls/s", ours, "64 stage_host calls", base)
    finally:
        store.close()


def run(quick: bool = False) -> Iterator[BenchRow]:
    logging.getLogger("kvbank.tiers").setLevel(logging.ERROR)  # "device tier off" once
    n_pages = 16 if quick else 64
    repeat = 3 if quick else 7
    pages = _pages(n_pages)
    tmp = Path(tempfile.mkdtemp(prefix="kvbank-bench-tiers-"))
    try:
        yield from _host(pages, repeat)
        yield from _disk_get(pages, tmp, repeat)
        yield from _demote(pages, tmp, 1 if quick else 3)
        yield from _index(100_000 if quick else 1_000_000)
        yield from _evict(1 << 17 if quick else 1 << 20, 1024, repeat)
        yield from _stage_many(repeat)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
