"""``kvbank bench fleet``: the fleet index and the remote tier on real Redis.

====================  ===========================================  ===========================
case                  ours                                         baseline (same run)
====================  ===========================================  ===========================
``match-1000-fleet``  ms of the fleet lookup of a 1,000-row chain  one Redis round trip (PING)
                      (``FleetIndex.lookup``: one MGET of its probe)
``match-1000-cluster``  the same on a local 3-master cluster (one   one PING to each master
                      read script per master)
``peer-fetch``        GB/s of a match on node B whose 16 x 2 MiB   the holder's own
                      rows come from node A (index, fetch, store)  ``fetch-remote`` (Client)
``remote-get``        GB/s of ``RedisFrameStore.read_into``, 2 MiB  raw redis-py GETs of the
                      frames (checksum verified, decoded)          same frames
``index-bytes-per-row-redis``  bytes per row (``used_memory`` delta) the 230-byte target
                      at 100 k rows, 3 holders each
====================  ===========================================  ===========================

Every figure is a median of several runs; buffers are preallocated; Redis servers, the
cluster and the nodes are started here on loopback and stopped by pid.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvbank.bench.common import BenchRow, paired_rates, paired_seconds, row

SUITE = "fleet"
TARGET_BYTES = 230


def _names(n: int, salt: int = 0) -> list[bytes]:
    import hashlib

    return [(b"\x07" * 16 + hashlib.sha256(b"%d:%d" % (salt, i)).digest()
             + b"\x00\x00\x00\x01\x00\x00") for i in range(n)]


def _paired_ms(fn: Callable[[], object], base: Callable[[], object], reps: int) -> tuple[float, float]:
    ours, theirs = paired_seconds(fn, base, reps, warmup=3)
    return ours * 1e3, theirs * 1e3


def _lookup_rows(quick: bool) -> Iterator[BenchRow]:
    from kvbank.procs import RedisClusterProcs
    from kvbank.procs import RedisProc as RedisServer
    from kvbank.service.fleet.index import FleetIndex
    from kvbank.tiers.remote import connect

    reps = 30 if quick else 300
    names = _names(1000)
    server = RedisServer.start()
    try:
        c: Any = connect(server.url)
        ix = FleetIndex(c)
        nid = ix.register("bench", "http://127.0.0.1:1", "bench", [])
        ix.publish(names[:500], nid)
        ours, base = _paired_ms(lambda: ix.lookup([names]), c.ping, reps)
        yield row(SUITE, "match-1000-fleet", "ms", ours, "one Redis round trip (PING)", base)
        c.close()
    finally:
        server.stop()
    cl = RedisClusterProcs.start(masters=3)
    try:
        rc: Any = connect(cluster=cl.seeds.split(","))
        ix = FleetIndex(rc)
        nid = ix.register("bench", "http://127.0.0.1:1", "bench", [])
        ix.publish(names[:500], nid)
        masters = rc.get_primaries()

        def pings() -> None:
            for m in masters:
                rc.execute_command("PING", target_nodes=m)

        ours, base = _paired_ms(lambda: ix.lookup([names]), pings, reps)
        yield row(SUITE, "match-1000-cluster", "ms", ours, "one PING to each of 3 masters", base)
        rc.close()
    finally:
        cl.stop()


def _remote_get(quick: bool) -> BenchRow:
    from kvbank.procs import RedisProc as RedisServer
    from kvbank.tiers.remote import RedisFrameStore, connect

    n, page = (8 if quick else 32), 2 << 20
    server = RedisServer.start()
    try:
        c: Any = connect(server.url)
        fs = RedisFrameStore(c, 1 << 30)
        names = _names(n, 7)
        rng = np.random.default_rng(0)
        for name in names:  # incompressible: the codec stores them raw, checksum kept
            data = rng.integers(0, 256, page, dtype=np.uint8).tobytes()
            fs.write_frame(name, fs.frame(data, "uint8"), raw_len=page, dtype="uint8")
        out = bytearray(page)
        keys = [fs.frame_key(nm) for nm in names]

        def ours() -> None:
            for nm in names:
                fs.read_into(nm, out)

        def raw() -> None:
            for k in keys:
                c.get(k)

        a, b = paired_rates(n * page / 1e9, ours, raw, repeat=3 if quick else 7)
        c.close()
        return row(SUITE, "remote-get", "GB/s", a, "raw redis-py GETs of the same frames", b)
    finally:
        server.stop()


def _index_bytes(quick: bool) -> BenchRow:
    from kvbank.procs import RedisProc as RedisServer
    from kvbank.service.fleet.index import FleetIndex
    from kvbank.tiers.remote import connect

    n = 20_000 if quick else 100_000
    server = RedisServer.start()
    try:
        c: Any = connect(server.url)
        ix = FleetIndex(c)
        ids = [ix.register(f"n{i}", f"http://127.0.0.1:{i}", "bench", []) for i in range(3)]
        before = int(c.info("memory")["used_memory"])
        names = _names(n, 3)
        for nid in ids:
            for i in range(0, n, 5000):
                ix.publish(names[i:i + 5000], nid)
        after = int(c.info("memory")["used_memory"])
        c.close()
        return row(SUITE, "index-bytes-per-row-redis", "bytes", (after - before) / n,
                   "target", TARGET_BYTES)
    finally:
        server.stop()


def _peer_fetch(quick: bool) -> BenchRow:
    import torch

    from kvbank.builders import full_attention
    from kvbank.client.client import Client
    from kvbank.procs import RedisProc as RedisServer
    from kvbank.service.launch import NodeProcess

    reps, pages = (2 if quick else 9), 16
    layout = full_attention("bench-fleet@1", 32, 8, 128, tokens_per_page=16)
    page = layout.group_page_bytes[0]
    server = RedisServer.start()
    args = ["--host-bytes", "1G", "--disk-bytes", "1G", "--device-bytes", "0",
            "--max-body-bytes", "256M", "--redis", server.url]
    with tempfile.TemporaryDirectory() as da, tempfile.TemporaryDirectory() as db:
        a = NodeProcess.start(["--data-dir", da, *args])
        b = NodeProcess.start(["--data-dir", db, *args])
        try:
            src = torch.from_numpy((np.arange(pages * page, dtype=np.uint64) % 251)
                                   .astype(np.uint8).reshape(pages, page))
            out = torch.zeros((pages, page), dtype=torch.uint8)
            with Client(a.url, same_host=False) as ca, Client(b.url, same_host=False) as cb:
                lid = ca.register(layout)
                cb.register(layout)
                prompts = [list(range(p * 20_000, p * 20_000 + pages * 16))
                           for p in range(reps + 2)]  # A's own, a warm-up, then the timed ones
                for toks in prompts:
                    ca.put(lid, toks, group=0, pages=src)
                time.sleep(2.5)  # two heartbeats: A's rows are in the index
                m_a = ca.match(lid, [*prompts[0], 1])
                ours, base = [], []
                cb.match(lid, [*prompts[1], 1])  # warm-up: B's client for A, first slots
                for toks in prompts[2:]:
                    t0 = time.perf_counter()
                    m = cb.match(lid, [*toks, 1])  # B fetches the rows from A, keeps them
                    t1 = time.perf_counter()
                    ca.fetch(m_a, out={0: out})
                    t2 = time.perf_counter()
                    if m.resume.tokens != pages * 16:
                        raise RuntimeError(f"peer-fetch: B matched {m.resume.tokens} tokens")
                    ours.append(t1 - t0)
                    base.append(t2 - t1)
            gb = pages * page / 1e9
            return row(SUITE, "peer-fetch", "GB/s", gb / statistics.median(ours),
                       "the holder's fetch-remote (Client.fetch over TCP)",
                       gb / statistics.median(base))
        finally:
            a.stop()
            b.stop()
            server.stop()


def run(quick: bool = False) -> Iterator[BenchRow]:
    yield from _lookup_rows(quick)
    yield _peer_fetch(quick)
    yield _remote_get(quick)
    yield _index_bytes(quick)
