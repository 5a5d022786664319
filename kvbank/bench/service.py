"""``kvbank bench service``: a served node against raw TCP and memcpy, across processes.

The node runs as ``kvbank serve`` in its own process; a raw TCP server (a thread per
connection, ``sendall`` / ``recv_into`` of preallocated 2 MiB pages) runs in another; the
clients run in further processes (``python -m kvbank.bench.service _client SPEC``), each
timing ours and its baseline in turns, medians of several runs, into preallocated and
pre-touched buffers. A same-host client maps the node's segment (and builds its page
tables) before timing, as a worker does once at start (``Client.map_host``). Each case
starts once the node's mover is idle (``Client.flush``): the rows earlier cases put are
written back to disk in the background, which is not the next case's path.

====================  ==========================================  ============================
case                  ours                                        baseline (same run)
====================  ==========================================  ============================
``fetch-remote``      ``Client.fetch`` of 64 x 2 MiB rows, TCP    raw TCP, same bytes
``put-remote``        ``Client.put`` of 64 x 2 MiB pages, TCP     raw TCP, same bytes
``fetch-local``       ``Client.fetch``, same-host (local channel), memcpy of the same bytes
                      control calls included
``put-local``         ``Client.put``: WRITE lease, fill, commit   memcpy of the same bytes
``fetch-local-check``  ``fetch-local`` as it runs (each copy        the same fetch with the
                      verified against the row's checksum)        client's check left out
``checksum``          xxh3-64 of 64 x 2 MiB pages, GB/s (what     memcpy of the same bytes
                      a network serve adds per verification)
``check-floor``       the floor of ``fetch-local-check``: numpy's  the same copies, chunk by
                      copy and the xxhash package alone, 64 x     chunk, unchecked
                      2 MiB in the checked read's chunks, each
                      hashed right after it lands, two lanes
``match-1000``        p50 ms of ``Client.match``, 1,000 pages     in-process ``Bank.match``
``match-1000-keys``   the same chain given as 32-byte engine keys  in-process ``Bank.match(keys=)``
``match-1000-8clients`` p99 ms of ``Client.match`` of 8 client      ``match-1000``'s single-client
                      processes at once                           p50 (this run)
``match-1000-8banks``  the machine's floor for the case above: p99  ``match-1000``'s in-process
                      ms of in-process ``Bank.match`` in 8         ``Bank.match`` p50 (this run)
                      processes at once, no node
``fetch-prefix-252``  GB/s of ``Client.fetch_prefix`` of 252 x     in-process ``Bank.fetch_prefix``
                      32 KiB rows into given buffers              of the same rows
``fetch-remote-16``   aggregate GB/s, 16 client processes, each   raw TCP, 16 connections
                      fetching 16 x 2 MiB rows a call
====================  ==========================================  ============================
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvbank.bench.common import BenchRow, row

SUITE = "service"
PAGES = 64
PAGES_16 = 16  # rows per call of each of the 16 concurrent clients
LAYERS = 32  # 32 layers x (K+V) x 8 heads x 128 x 16 tokens x bf16 = 2 MiB pages
REQ = struct.Struct("<BQ")  # op (1 = send me n bytes, 2 = take n bytes), n
MATCH_PAGES = 1000
PREFIX_ROWS = 252  # fetch-prefix-252: rows of 32 KiB
MATCH_CLIENTS = 8


def _layout(layers: int = LAYERS) -> Any:
    from kvbank.builders import full_attention

    return full_attention("bench-service@1", layers, 8, 128, tokens_per_page=16)


def _tokens(base: int, pages: int) -> list[int]:
    """Token ids of a distinct prompt per ``base`` (at most 1,250 pages; ids stay int32)."""
    return list(range(base * 20_000, base * 20_000 + pages * 16))


def _pages(page: int) -> Any:
    import torch

    src = (np.arange(PAGES * page, dtype=np.uint64) % 251).astype(np.uint8).reshape(PAGES, page)
    return torch.from_numpy(src)


# ---- the raw TCP baseline server ---------------------------------------------------------


def _raw_server() -> None:
    page = _layout().group_page_bytes[0]
    src = np.full(PAGES * page, 7, dtype=np.uint8)
    flat = memoryview(src.data)
    views = [flat[i * page : (i + 1) * page] for i in range(PAGES)]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)

    def handle(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sink = memoryview(bytearray(page))
        head = bytearray(REQ.size)
        with conn:
            while True:
                if conn.recv_into(head, REQ.size, socket.MSG_WAITALL) != REQ.size:
                    return
                op, n = REQ.unpack(head)
                if op == 1:
                    for i in range(n // page):
                        conn.sendall(views[i % PAGES])
                else:
                    left = n
                    while left:
                        k = conn.recv_into(sink, min(left, page), socket.MSG_WAITALL)
                        if not k:
                            return
                        left -= k
                    conn.sendall(b"\x01")

    while True:
        c, _ = sock.accept()
        threading.Thread(target=handle, args=(c,), daemon=True).start()


# ---- a client process ----------------------------------------------------------------------


def _client(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from kvbank.client.client import Client

    layout = _layout()
    page = layout.group_page_bytes[0]
    case, reps = spec["case"], spec["reps"]
    if case == "match-1000-8banks":
        return _match_case(None, case, reps)
    if case in ("match-1000", "match-1000-keys", "match-1000-8clients"):
        return _match_case(Client(spec["url"]), case, reps)
    if case == "fetch-prefix-252":
        return _prefix_case(Client(spec["url"]), reps)
    # 16 clients at once: 16 rows a call each keeps 16 processes' buffers in memory
    n_pages = PAGES_16 if case == "fetch-remote-16" else PAGES
    nbytes = n_pages * page
    out = torch.zeros((n_pages, page), dtype=torch.uint8)  # zeroed: pre-touched, reused
    out_views = [memoryview(out.numpy()[i]) for i in range(n_pages)]
    needs_src = case in ("put-remote", "put-local", "fetch-local", "checksum", "check-floor")
    src = np.full((n_pages, page) if needs_src else (0, page), 3, dtype=np.uint8)
    raw = socket.create_connection(("127.0.0.1", spec["raw_port"]))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def raw_fetch() -> None:
        raw.sendall(REQ.pack(1, nbytes))
        for v in out_views:
            raw.recv_into(v, page, socket.MSG_WAITALL)

    def raw_put() -> None:
        raw.sendall(REQ.pack(2, nbytes))
        for i in range(n_pages):
            raw.sendall(memoryview(src[i]))
        raw.recv(1)

    def memcpy() -> None:
        np.copyto(out.numpy(), src)

    if case == "checksum":  # the verification's cost per byte, against a copy of the same
        from kvbank.codec import checksum

        def hash_pages() -> None:
            for i in range(n_pages):
                checksum(memoryview(src[i]))
        return _turns(hash_pages, memcpy, reps, nbytes)
    if case == "check-floor":
        return _check_floor(src, out.numpy(), reps)
    local = case in ("fetch-local", "put-local", "fetch-local-check")
    client = Client(spec["url"], same_host=False if case in ("fetch-remote", "put-remote", "fetch-remote-16")
                    else None)
    if local and not client.map_host(wait_s=300.0):
        raise RuntimeError("bench client: the node's segment did not map (or populate) in time")
    lid = client.register(layout)
    pages = _pages(page) if case in ("put-remote", "put-local") else torch.empty((0, page), dtype=torch.uint8)
    m = client.match(lid, [*_tokens(0, n_pages), 1])
    counter = [spec["seed"] * 50]  # up to 50 puts per client before prompts overlap

    def fetch() -> None:
        got = client.fetch(m, out={0: out})
        if not got.complete:
            raise RuntimeError(f"fetch incomplete: {got.missing}")

    def put() -> None:
        counter[0] += 1  # new rows every time: a stored row would be skipped, not sent
        client.put(lid, _tokens(counter[0], PAGES), group=0, pages=pages)

    if case == "fetch-local-check":
        link = client._chan()
        if link is None or not link.memory:
            raise RuntimeError("bench client: fetch-local-check needs the local channel with host memory")

        def unchecked() -> None:  # the same path with the client's checksum check left out
            link._verify = False
            try:
                fetch()
            finally:
                link._verify = True
        fetch()
        unchecked()
        return _turns(fetch, unchecked, reps, nbytes)
    fn, baseline = {
        "fetch-remote": (fetch, raw_fetch), "put-remote": (put, raw_put),
        "fetch-local": (fetch, memcpy), "put-local": (put, memcpy),
        "fetch-remote-16": (fetch, raw_fetch),
    }[case]
    for _ in range(2):
        fn()
        baseline()
    if case == "fetch-remote-16":  # aggregate: start together, time each side alone
        times: dict[str, Any] = {}
        for side, f in (("ours", fn), ("base", baseline)):
            print("ready", flush=True)
            sys.stdin.readline()
            t0 = time.monotonic()
            for _ in range(reps):
                f()
            times[side] = [t0, time.monotonic()]
        return {**times, "bytes": reps * nbytes}
    timed = _turns(fn, baseline, reps, nbytes)
    client.close()
    return timed


def _check_floor(src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any], reps: int) -> dict[str, Any]:
    """``check-floor``: what a checked read's two passes cost done by the raw libraries
    (``np.copyto`` and ``xxhash``, no kvbank): each row copied a ``HASH_CHUNK`` at a time,
    each chunk fed to the row's hash right after it lands, half the rows on a second lane;
    against the same copies with no hash. A checked ``fetch-local`` cannot beat this
    ratio with a check made of a copy and a hash."""
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    from kvbank.client.shm import HASH_CHUNK

    rows, page = src.shape
    half = rows // 2

    def checked(lo: int, hi: int) -> None:
        for r in range(lo, hi):
            h = xxhash.xxh3_64()
            for at in range(0, page, HASH_CHUNK):
                d = dst[r, at : at + HASH_CHUNK]
                np.copyto(d, src[r, at : at + HASH_CHUNK])
                h.update(d.data)
            h.intdigest()

    def plain(lo: int, hi: int) -> None:  # the same copies, chunk by chunk (one copy of
        for r in range(lo, hi):  # 64 MiB streams past the cache, and is slower here)
            for at in range(0, page, HASH_CHUNK):
                np.copyto(dst[r, at : at + HASH_CHUNK], src[r, at : at + HASH_CHUNK])

    with ThreadPoolExecutor(1) as lane:
        def two(part: Any) -> Any:
            def run() -> None:
                other = lane.submit(part, half, rows)
                part(0, half)
                other.result()
            return run
        ours, base = two(checked), two(plain)
        for _ in range(2):
            ours()
            base()
        return _turns(ours, base, reps, rows * page)


def _turns(fn: Any, baseline: Any, reps: int, nbytes: int) -> dict[str, Any]:
    """``fn`` and ``baseline`` timed in turns, ``reps`` times each."""
    ours, base = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        baseline()
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        base.append(t2 - t1)
    return {"ours": ours, "base": base, "bytes": nbytes}


def _match_case(client: Any | None, case: str, reps: int) -> dict[str, Any]:
    """``match-1000`` (by tokens) / ``-keys`` (by engine keys) against the in-process
    ``Bank.match`` of the same chain; ``-8clients``: this process's latencies only, timed
    once every client said ready (the orchestrator starts them together); ``-8banks``: the
    same with an in-process ``Bank`` (no ``client``), what many processes on this machine's
    cores cost with no node at all."""
    import hashlib

    import torch

    from kvbank.bank.bank import Bank

    small = _layout(1)
    toks = _tokens(99_000, MATCH_PAGES)
    keys = [hashlib.sha256(b"bench-service-key-%d" % i).digest() for i in range(MATCH_PAGES)]
    by_keys = case == "match-1000-keys"
    zeros = torch.zeros((MATCH_PAGES, small.group_page_bytes[0]), dtype=torch.uint8)
    prompt = MATCH_PAGES * 16 + 1
    q = [*toks, 1]
    if client is None:
        with Bank.open(host_bytes="256M", device_bytes=0) as floor:
            flid = floor.register(small)
            floor.put(flid, toks, group=0, pages=zeros)
            if floor.match(flid, q).resume.tokens == 0:
                raise RuntimeError("bench client: the bank's match missed")
            return _timed_together(lambda: floor.match(flid, q), reps)
    slid = client.register(small)
    if by_keys:
        client.put(slid, keys=keys, group=0, pages=zeros)
    else:
        client.put(slid, toks, group=0, pages=zeros)

    def ours_call() -> Any:
        return client.match(slid, keys=keys, prompt_tokens=prompt) if by_keys else client.match(slid, q)

    if case == "match-1000-8clients":
        try:
            return _timed_together(ours_call, reps)
        finally:
            client.close()
    with Bank.open(host_bytes="256M", device_bytes=0) as bank:
        bank.register(small)
        if by_keys:
            bank.put(slid, keys=keys, group=0, pages=zeros)
        else:
            bank.put(slid, toks, group=0, pages=zeros)

        def base_call() -> Any:
            return bank.match(slid, keys=keys, prompt_tokens=prompt) if by_keys else bank.match(slid, q)

        if ours_call().resume.tokens != base_call().resume.tokens or base_call().resume.tokens == 0:
            raise RuntimeError("bench client: the node's match and the bank's differ")
        ours, base = [], []
        for _ in range(5):
            ours_call()
            base_call()
        for _ in range(reps):
            t0 = time.perf_counter()
            ours_call()
            t1 = time.perf_counter()
            base_call()
            t2 = time.perf_counter()
            ours.append(t1 - t0)
            base.append(t2 - t1)
    client.close()
    return {"ours": ours, "base": base}


def _timed_together(call: Any, reps: int) -> dict[str, Any]:
    """``reps`` latencies of ``call``, timed once the orchestrator says go (after this
    process said ready), so that every process of a together-case runs at once."""
    for _ in range(5):
        call()
    print("ready", flush=True)
    sys.stdin.readline()
    lat = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        lat.append(time.perf_counter() - t0)
    return {"ours": lat}


def _prefix_case(client: Any, reps: int) -> dict[str, Any]:
    """``fetch-prefix-252``: 252 rows of 32 KiB matched and fetched into given buffers,
    through the node's local channel and through an in-process ``Bank``."""
    import torch

    from kvbank.bank.bank import Bank
    from kvbank.builders import full_attention

    layout = full_attention("bench-service-prefix@1", 2, 2, 128, tokens_per_page=16)  # 32 KiB pages
    page = layout.group_page_bytes[0]
    plid = client.register(layout)
    toks = _tokens(88_000, PREFIX_ROWS)
    pages = torch.from_numpy((np.arange(PREFIX_ROWS * page, dtype=np.uint64) % 253).astype(np.uint8)
                             .reshape(PREFIX_ROWS, page))
    client.put(plid, toks, group=0, pages=pages)
    q = [*toks, 1]
    mine = torch.zeros((PREFIX_ROWS, page), dtype=torch.uint8)
    theirs = torch.zeros((PREFIX_ROWS, page), dtype=torch.uint8)
    with Bank.open(host_bytes="256M", device_bytes=0) as bank:
        bank.register(layout)
        bank.put(plid, toks, group=0, pages=pages)
        got = client.fetch_prefix(plid, q, out={0: mine})
        if got.tokens != PREFIX_ROWS * 16 or not torch.equal(mine, pages):
            raise RuntimeError(f"bench client: fetch_prefix got {got.tokens} tokens or other bytes")
        ours, base = [], []
        for _ in range(3):
            client.fetch_prefix(plid, q, out={0: mine})
            bank.fetch_prefix(plid, q, out={0: theirs})
        for _ in range(reps):
            t0 = time.perf_counter()
            client.fetch_prefix(plid, q, out={0: mine})
            t1 = time.perf_counter()
            bank.fetch_prefix(plid, q, out={0: theirs})
            t2 = time.perf_counter()
            ours.append(t1 - t0)
            base.append(t2 - t1)
    client.close()
    return {"ours": ours, "base": base, "bytes": PREFIX_ROWS * page}


def _p(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def _together(spec: dict[str, Any], n: int) -> list[float]:
    """``n`` client processes of ``spec``'s case, timed together; every latency."""
    procs = [_spawn("_client", json.dumps({**spec, "seed": spec["seed"] + i})) for i in range(n)]
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("bench client did not get ready")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    lat: list[float] = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode:
            raise RuntimeError(f"bench client failed (rc {p.returncode})")
        lat.extend(json.loads(out.strip().splitlines()[-1])["ours"])
    return lat


# ---- the orchestrator ----------------------------------------------------------------------


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvbank.bench.service", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _one(spec: dict[str, Any]) -> dict[str, Any]:
    p = _spawn("_client", json.dumps(spec))
    out, _ = p.communicate(timeout=900)
    if p.returncode:
        raise RuntimeError(f"bench client {spec['case']} failed (rc {p.returncode})")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def _many(spec: dict[str, Any], n: int) -> dict[str, float]:
    procs = [_spawn("_client", json.dumps({**spec, "seed": spec["seed"] + i})) for i in range(n)]
    for side in ("ours", "base"):
        for p in procs:
            assert p.stdout is not None and p.stdin is not None  # PIPEs were asked for
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("bench client did not get ready")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        _ = side
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode:
            raise RuntimeError(f"bench client failed (rc {p.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    total = sum(r["bytes"] for r in results)
    rate = {}
    for side in ("ours", "base"):
        t0 = min(r[side][0] for r in results)
        t1 = max(r[side][1] for r in results)
        rate[side] = total / (t1 - t0) / 1e9
    return rate


def run(quick: bool = False) -> Iterator[BenchRow]:
    from kvbank.client.client import Client
    from kvbank.service.launch import NodeProcess

    reps = 3 if quick else 5
    raw = _spawn("_raw")
    assert raw.stdout is not None  # PIPE was asked for
    raw_port = int(raw.stdout.readline())
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-service-") as tmp:
        node = NodeProcess.start(["--data-dir", tmp, "--host-bytes", "2560M", "--disk-bytes", "1G",
                                  "--device-bytes", "0", "--max-body-bytes", "512M"])
        try:
            layout = _layout()
            with Client(node.url) as c:
                lid = c.register(layout)
                c.put(lid, _tokens(0, PAGES), group=0, pages=_pages(layout.group_page_bytes[0]))
            spec = {"url": node.url, "raw_port": raw_port, "reps": reps, "seed": 1}

            def settle() -> None:
                # the node's mover writes the rows earlier cases put back to disk in the
                # background: a case starts once it is idle, so it times its own path
                with Client(node.url) as c:
                    c.flush()

            for case, base in (("fetch-remote", "raw TCP socket"), ("put-remote", "raw TCP socket"),
                               ("fetch-local", "memcpy"), ("put-local", "memcpy"),
                               ("fetch-local-check", "fetch-local, client check off"),
                               ("checksum", "memcpy"),
                               ("check-floor", "the same copies, unchecked (numpy, two lanes)")):
                settle()
                r = _one({**spec, "case": case, "seed": len(case)})
                gb = r["bytes"] / 1e9
                yield row(SUITE, case, "GB/s", gb / statistics.median(r["ours"]), base,
                          gb / statistics.median(r["base"]))
            settle()
            r = _one({**spec, "case": "match-1000", "reps": 15 if quick else 50, "seed": 99})
            single = statistics.median(r["ours"]) * 1e3
            in_process = statistics.median(r["base"]) * 1e3
            yield row(SUITE, "match-1000", "ms p50", single, "in-process Bank.match", in_process)
            r = _one({**spec, "case": "match-1000-keys", "reps": 15 if quick else 50, "seed": 98})
            yield row(SUITE, "match-1000-keys", "ms p50", statistics.median(r["ours"]) * 1e3,
                      "in-process Bank.match(keys=)", statistics.median(r["base"]) * 1e3)
            lat = _together({**spec, "case": "match-1000-8clients", "reps": 15 if quick else 50, "seed": 97},
                            MATCH_CLIENTS)
            yield row(SUITE, "match-1000-8clients", "ms p99", _p(lat, 0.99) * 1e3,
                      "match-1000 single-client p50", single)
            lat = _together({**spec, "case": "match-1000-8banks", "reps": 15 if quick else 50, "seed": 97},
                            MATCH_CLIENTS)
            yield row(SUITE, "match-1000-8banks", "ms p99", _p(lat, 0.99) * 1e3,
                      "match-1000 in-process Bank.match p50", in_process)
            settle()
            r = _one({**spec, "case": "fetch-prefix-252", "reps": 10 if quick else 30, "seed": 96})
            gb = r["bytes"] / 1e9
            yield row(SUITE, "fetch-prefix-252", "GB/s", gb / statistics.median(r["ours"]),
                      "in-process Bank.fetch_prefix", gb / statistics.median(r["base"]))
            n = 4 if quick else 16
            settle()
            agg = _many({**spec, "case": "fetch-remote-16", "reps": 2 if quick else 4, "seed": 200}, n)
            yield row(SUITE, "fetch-remote-16", "GB/s", agg["ours"], f"raw TCP, {n} connections", agg["base"])
        finally:
            node.stop()
            raw.kill()
            raw.wait()
            raw.stdout.close()
            if raw.stdin is not None:
                raw.stdin.close()


if __name__ == "__main__":
    if sys.argv[1] == "_raw":
        _raw_server()
    elif sys.argv[1] == "_client":
        print(json.dumps(_client(json.loads(sys.argv[2]))), flush=True)
    os._exit(0)
