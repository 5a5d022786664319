"""The soak of ``kvbank bench reliability``: N client processes x S seconds (or, in a
test, x a count of operations) against one ``kvbank serve`` whose budgets are small
enough that eviction and demotion never stop.

Each client process (``python -m kvbank.bench.soak _client SPEC``) holds two
:class:`~kvbank.client.client.Client` objects on the node, one forced onto the
shared-memory path (``same_host=True``) and one onto TCP (``same_host=False``), and until
its time is up draws an operation and a path at random:

- ``put`` — a prompt of 1-16 pages from one of :data:`FAMILIES` shared prompt families
  (clients store the same prefixes at once);
- ``match`` — the longest stored prefix of such a prompt;
- ``fetch`` — match, then fetch the resume bound's rows; every delivered page is
  compared with what its writer put;
- ``lend`` — match, a READ HOST lease on the needed rows, every ready row read through
  shared memory and compared (the TCP path only holds the lease, as a transfer engine
  would), release.

Page bytes are derived from the row's tokens (a seed from SHA-256 over the prompt's
tokens up to the end of the page), so any client can check any page, whoever wrote it;
half the pages are low-entropy, so the codec's compressing paths run too.

Outcomes: a short bound or a row missing from a fetch or lease is a *miss* (a return
value); ``TierFull`` / ``Busy`` / ``LeaseConflict`` are typed *refusals* of a node under
pressure; anything else raised is an *error*. Latencies are recorded per operation (a
``fetch`` or ``lend`` includes its match). Before the soak one client runs the same mix
alone; its p50s are the rows' same-run baselines.

Memory: while the clients run, the node's ``/proc/PID/status`` (``RssAnon``,
``RssFile``, ``RssShmem``) and its ``/dev/shm`` segment (allocated blocks) are sampled.
The figure is ``peak(RssAnon + RssFile - lmdb) + peak(shm)`` over the budget
``host_bytes + device_bytes + idle``, where ``idle`` is the first term on the node right
after start (Python, torch, the libraries; before any request). ``RssShmem`` is the host
segment again (mapped into the process), so it is counted once, as the segment; ``lmdb``
is the resident part of the disk tier's ``data.mdb`` map — file pages the kernel can
drop at any time, bounded by the disk tier's budget, reported apart
(``…-lmdb-resident``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kvbank.bench.common import BenchRow, row
from kvbank.bench.reliability import goal_row

P = 16
LAYERS = 1  # 1 layer x (K+V) x 8 heads x 128 x 16 tokens x bf16 = 64 KiB pages
MAX_PAGES = 16
FAMILIES = 256  # 256 prompts x 16 pages x 64 KiB = 256 MiB: more than host + disk
HOST_BYTES, DISK_BYTES = 48 << 20, 64 << 20
OPS = ("put", "match", "fetch", "lend")
WEIGHTS = (3, 2, 3, 2)
REFUSALS = frozenset({"TierFull", "Busy", "LeaseConflict"})
# The served node places puts and promotions in host (their pages must be in shared
# memory), so a device tier would sit empty and only pad the memory budget: none here.
DEVICE_BYTES = 0
NODE_ARGS = ["--host-bytes", str(HOST_BYTES), "--disk-bytes", str(DISK_BYTES),
             "--max-body-bytes", "64M"]


def _layout() -> Any:
    from kvbank.builders import full_attention

    return full_attention("reliability-soak@1", LAYERS, 8, 128, tokens_per_page=P)


def tokens(family: int, pages: int) -> list[int]:
    return [family * 100_000 + j for j in range(pages * P)]


@lru_cache(maxsize=256)
def page_bytes(family: int, index: int, size: int) -> np.ndarray:
    """The bytes of page ``index`` of prompt ``family``: a function of its tokens alone."""
    digest = hashlib.sha256(np.asarray(tokens(family, index + 1), dtype="<i4").tobytes()).digest()
    data = np.random.default_rng(int.from_bytes(digest[:8], "little")).integers(
        0, 256, size, dtype=np.uint8)
    if digest[8] & 1:
        data &= 0x0F  # low entropy: byte planes + zstd compress it
    data.setflags(write=False)
    return data


# ---- a client process ------------------------------------------------------------------------


class _Miss(Exception):
    """The prompt matched no rows: there is nothing to fetch or lend."""



def _client(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from kvbank.client.client import Client
    from kvbank.client.shm import Borrower
    from kvbank.errors import KvbankError
    from kvbank.lender.base import Delivery

    layout = _layout()
    size = layout.group_page_bytes[0]
    rng = random.Random(spec["seed"])
    # per node, the shared-memory client and the TCP one (two nodes in a fleet soak)
    pairs = [(Client(u, same_host=True), Client(u, same_host=False)) for u in spec["urls"]]
    lid = pairs[0][0].register(layout)
    for a, b in pairs:
        a.register(layout)
        b.register(layout)
    src = torch.zeros((MAX_PAGES, size), dtype=torch.uint8)
    out = torch.zeros((MAX_PAGES, size), dtype=torch.uint8)
    one = torch.zeros(size, dtype=torch.uint8)
    reader = Borrower()
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    tally: Counter[str] = Counter()
    first: dict[str, str] = {}

    def check(family: int, j: int, got: Any) -> None:
        bad = int(np.count_nonzero(got.numpy() != page_bytes(family, j, size)))
        if bad:
            tally["wrong_bytes"] += bad
            tally["wrong_pages"] += 1

    def one_op(op: str, c: Client, family: int, n: int) -> None:
        toks = tokens(family, n)
        if op == "put":
            c.put(lid, toks, group=0, pages=src[:n])
            return
        m = c.match(lid, [*toks, 1])
        r = m.resume.tokens // P
        tally["rows_asked"] += n
        tally["rows_matched"] += r
        if op == "match":
            return
        if not r:
            raise _Miss
        if op == "fetch":
            res = c.fetch(m, out={0: out[:r]})
            tally["rows_missed"] += sum(len(x) for x in res.missing)
            at = {k: j for j, k in enumerate(m.resume.pages[0])}
            for k in res.delivered[0]:
                check(family, k, out[at[k]])
            return
        lease = c.lend(m)
        try:
            if c.same_host:
                pos = {name: j for j, name in enumerate(m.names[0])}
                for lr in lease.rows:
                    if lr.delivery is not Delivery.READY:
                        tally["rows_missed"] += 1
                        continue
                    reader.read_into(lease, lr.name, one.numpy().data)
                    check(family, pos[lr.name], one)
                c.check_live(lease.id)  # bytes read after expiry would not count
        finally:
            c.release(lease.id)

    def step() -> None:
        op = rng.choices(OPS, WEIGHTS)[0]
        path = rng.choice(("local", "tcp"))
        local, tcp = rng.choice(pairs)
        family, n = rng.randrange(spec["families"]), rng.randint(1, MAX_PAGES)
        if op == "put":
            for j in range(n):
                src[j].numpy()[:] = page_bytes(family, j, size)
        t0 = time.perf_counter()
        try:
            one_op(op, local if path == "local" else tcp, family, n)
        except _Miss:  # nothing to fetch or lend: a miss, not a timed operation
            tally[f"{op}-misses"] += 1
        except KvbankError as exc:
            kind = type(exc).__name__
            tally["refusals" if kind in REFUSALS else "errors"] += 1
            tally[f"{op}-{path}:{kind}"] += 1
            first.setdefault(kind, f"{op}-{path}: {exc}")
        except Exception as exc:  # untyped: always an error
            kind = type(exc).__name__
            tally["errors"] += 1
            tally[f"{op}-{path}:{kind}"] += 1
            first.setdefault(kind, f"{op}-{path}: {exc!r}")
        else:
            lat[op].append(time.perf_counter() - t0)
        tally["ops"] += 1

    # The orchestrator's commands, one a line: "go" runs for spec["seconds"] (the bench),
    # "ops N" runs N operations and answers "done" (a test's rounds), "end" stops.
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "end":
            break
        if cmd[0] == "go":
            deadline = time.monotonic() + spec["seconds"]
            while time.monotonic() < deadline:
                step()
            break
        for _ in range(int(cmd[1])):
            step()
        print("done", flush=True)
    reader.close()
    for a, b in pairs:
        a.close()
        b.close()
    return {"lat": lat, "tally": dict(tally), "first": first}


# ---- the orchestrator --------------------------------------------------------------------------


@dataclass
class SoakResult:
    """What :func:`soak` saw (times in seconds, memory in bytes)."""

    clients: int
    seconds: float
    lat: dict[str, list[float]] = field(default_factory=dict)
    idle_p50: dict[str, float] = field(default_factory=dict)
    tally: Counter[str] = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # the node's invariant check at the end
    exit_code: int = 0
    idle_rss: int = 0
    peak_private: int = 0  # RssAnon + RssFile, the LMDB map left out
    peak_lmdb: int = 0  # the LMDB map's resident pages
    peak_shm: int = 0
    peak_hwm: int = 0  # VmHWM, shared memory included, for the record
    budget: int = 0
    evictions: int = 0
    demotions: int = 0
    peer_rows: int = 0  # rows the nodes fetched from each other (fleet soak)
    flaps: int = 0  # Redis kills and restarts during a fleet soak
    tiers: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # demoted, evicted, promoted

    @property
    def errors(self) -> int:
        return self.tally["errors"] + (self.exit_code != 0)

    @property
    def wrong_bytes(self) -> int:
        return self.tally["wrong_bytes"]

    @property
    def rss_ratio(self) -> float:
        return (self.peak_private + self.peak_shm) / self.budget if self.budget else 0.0

    def rows(self, suite: str, case: str, rss_goal: float) -> list[BenchRow]:
        out = [goal_row(case, "errors", self.errors, 0),
               goal_row(f"{case}-rss", "ratio", self.rss_ratio, rss_goal),
               row(suite, f"{case}-lmdb-resident", "MiB", self.peak_lmdb / 2**20,
                   "disk budget", DISK_BYTES / 2**20),
               goal_row(f"{case}-check", "problems", len(self.problems), 0),
               row(suite, f"{case}-refusals", "ops", self.tally["refusals"], "ops run",
                   self.tally["ops"])]
        for op in OPS:
            ms = sorted(x * 1e3 for x in self.lat.get(op, ()))
            base = self.idle_p50.get(op, 0.0) * 1e3
            for q, name in ((0.5, "p50"), (0.99, "p99")):
                v = ms[min(len(ms) - 1, int(q * len(ms)))] if ms else 0.0
                out.append(row(suite, f"{case}-{name}-{op}", "ms", v,
                               "idle node p50, one client (same run)", base))
        return out


def _spawn(spec: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvbank.bench.soak", "_client", json.dumps(spec)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _run_clients(specs: list[dict[str, Any]], rounds: list[int] | None = None,
                 between: Callable[[int], None] | None = None,
                 timeout_s: float = 600) -> list[dict[str, Any]]:
    """Run the clients: for their ``seconds`` each, or (``rounds``) that many operations
    each round, all clients at once, ``between(i)`` called after round ``i`` but the last."""
    procs = [_spawn(s) for s in specs]
    try:
        for p in procs:
            assert p.stdout is not None  # PIPE was asked for
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("soak client did not get ready")

        def tell(line: str) -> None:
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(line + "\n")
                p.stdin.flush()

        if rounds is None:
            tell("go")
        else:
            for i, n in enumerate(rounds):
                tell(f"ops {n}")
                for p in procs:
                    assert p.stdout is not None
                    if p.stdout.readline().strip() != "done":
                        raise RuntimeError(f"soak client died in round {i} (rc {p.poll()})")
                if between is not None and i + 1 < len(rounds):
                    between(i)
            tell("end")
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=timeout_s)
            if p.returncode:
                raise RuntimeError(f"soak client failed (rc {p.returncode})")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def _lmdb_resident(pid: int) -> int:
    """Resident bytes of the disk tier's LMDB map (file pages: the page cache of
    ``data.mdb``, reclaimable, bounded by the disk tier, not by the memory budgets)."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if not line[:1].isupper() or line.split(":")[0] == line:  # a mapping's header line
            inside = line.rstrip().endswith("/data.mdb")
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def _shm_bytes(pid: int) -> int:
    from kvbank.tiers.host import DEFAULT_PREFIX, SHM_DIR

    total = 0
    for f in SHM_DIR.glob(f"{DEFAULT_PREFIX}-{pid}-*"):
        try:
            total += f.stat().st_blocks * 512
        except OSError:
            continue  # unlinked meanwhile
    return total


def _private(pid: int) -> tuple[int, int, dict[str, int]]:
    """(RssAnon + RssFile without the LMDB map, the LMDB map's resident bytes, status)."""
    st = _status(pid)
    lmdb = _lmdb_resident(pid)
    return st["RssAnon"] + st["RssFile"] - lmdb, lmdb, st


def _sample(pid: int, result: SoakResult) -> bool:
    """One sample of the node's memory into the peaks; False once the node is gone."""
    try:
        private, lmdb, st = _private(pid)
    except OSError:
        return False
    result.peak_private = max(result.peak_private, private)
    result.peak_lmdb = max(result.peak_lmdb, lmdb)
    result.peak_hwm = max(result.peak_hwm, st["VmHWM"])
    result.peak_shm = max(result.peak_shm, _shm_bytes(pid))
    return True


def _sampler(pid: int, result: SoakResult, stop: threading.Event) -> None:
    # a sample at once and (by the caller) one at the end: a short run has its peaks too
    while _sample(pid, result) and not stop.wait(0.25):
        pass


def _p50s(results: list[dict[str, Any]]) -> dict[str, float]:
    return {op: statistics.median(xs) for op in OPS
            if (xs := [x for r in results for x in r["lat"][op]])}


def _fill(url: str, families: int, result: SoakResult) -> None:
    """Store prompt families ``0 .. families-1`` in full (16 pages each) on one node: more
    than its host and disk budgets hold, so it has demoted and evicted by a count of
    puts, however fast the machine, and every later put evicts again."""
    import torch

    from kvbank.client.client import Client
    from kvbank.errors import KvbankError

    layout = _layout()
    size = layout.group_page_bytes[0]
    src = torch.zeros((MAX_PAGES, size), dtype=torch.uint8)
    with Client(url) as c:  # shared memory where it can: the fill is not what is tested
        lid = c.register(layout)
        for f in range(families):
            for j in range(MAX_PAGES):
                src[j].numpy()[:] = page_bytes(f, j, size)
            try:
                c.put(lid, tokens(f, MAX_PAGES), group=0, pages=src)
            except KvbankError as exc:
                kind = type(exc).__name__
                result.tally["refusals" if kind in REFUSALS else "errors"] += 1
                result.first.setdefault(kind, f"fill: {exc}")
        c.flush()


def _flap(redis: Any, every_s: float, stop: threading.Event, result: SoakResult) -> None:
    """Kill the fleet's Redis every ``every_s`` and bring it back, empty, 1 s later."""
    while not stop.wait(every_s):
        redis.kill()
        stop.wait(1.0)
        redis.restart()
        result.flaps += 1


def _check(url: str, data_dir: str) -> list[str]:
    """The node's invariant check (``POST /admin/check``): its problems."""
    import httpx

    token = (Path(data_dir) / "admin.token").read_text().strip()
    doc = httpx.post(url + "/admin/check", timeout=60,
                     headers={"Authorization": f"Bearer {token}"}).json()
    problems = [str(p) for p in doc.get("problems", [])]
    if not doc.get("ok", False) and not problems:
        problems = [f"{url}: check answered {doc}"]
    return problems


def soak(clients: int = 16, seconds: float = 60.0, families: int = FAMILIES,
         idle_s: float | None = None, fleet: bool = False,
         device_bytes: int = DEVICE_BYTES, flap_every_s: float = 0.0,
         ops: int | None = None, fill: int = 0, flaps: int = 0) -> SoakResult:
    """One node, ``clients`` processes x ``seconds``; see the module docstring. ``fleet``:
    two nodes on one redis-server, each operation on either of them, so reads of rows
    the other node stored are peer fetches (memory is sampled on the first node).
    ``device_bytes``: a device tier's budget, held in CPU memory (``KVBANK_DEVICE=cpu``)
    so it runs on any machine; it counts in the memory budget. ``flap_every_s`` (fleet
    only): SIGKILL the Redis every that many seconds and restart it 1 s later.

    A test's soak is a count of operations, never a span of time (how much gets done in
    one depends on the machine's load): ``ops`` operations per client instead of
    ``seconds`` (the baseline run: a quarter of them, one client); ``fill`` prompt
    families stored in full on the first node before the clients start (more than its
    budgets: demotions and evictions by count); ``flaps`` (fleet only): the run split in
    ``2 * flaps + 1`` rounds of operations, the Redis SIGKILLed after one round and
    restarted, empty, after the next."""
    import httpx

    from kvbank.client.client import Client
    from kvbank.service.launch import NodeProcess

    result = SoakResult(clients, seconds)
    redis: Any = None
    nodes: list[tuple[NodeProcess, str]] = []
    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="kvbank-soak-") as tmp:
        try:
            extra: list[str] = []
            if fleet:
                from kvbank.procs import RedisProc

                redis = RedisProc.start()
                extra = ["--redis", redis.url]
            for i in range(2 if fleet else 1):
                data = os.path.join(tmp, str(i))
                nodes.append((NodeProcess.start(
                    ["--data-dir", data, *NODE_ARGS, "--device-bytes", str(device_bytes), *extra],
                    env={**os.environ, "KVBANK_DEVICE": "cpu"}), data))
            node = nodes[0][0]
            sampler = threading.Thread(target=_sampler, args=(node.pid, result, stop), daemon=True)
            with Client(node.url, same_host=False) as c:
                c.register(_layout())
                result.idle_rss = _private(node.pid)[0]
                result.budget = HOST_BYTES + device_bytes + result.idle_rss
                spec = {"urls": [n.url for n, _ in nodes], "families": families}
                if ops is None:
                    idle_run = _run_clients([{**spec, "seed": 0,
                                              "seconds": idle_s or min(8.0, seconds / 4)}])
                else:
                    idle_run = _run_clients([{**spec, "seed": 0}], rounds=[max(1, ops // 4)])
                result.idle_p50 = _p50s(idle_run)
                before = c.stats().store.tiers
                sampler.start()
                if fill:
                    _fill(node.url, fill, result)
                flapper = None
                if flap_every_s and redis is not None:
                    flapper = threading.Thread(target=_flap, args=(redis, flap_every_s, stop, result),
                                               daemon=True)
                    flapper.start()
                specs = [{**spec, "seed": 1 + i, "seconds": seconds} for i in range(clients)]
                if ops is None:
                    runs = _run_clients(specs)
                else:
                    parts = 2 * flaps + 1 if redis is not None else 1
                    rounds = [ops // parts + (k < ops % parts) for k in range(parts)]

                    def between(i: int) -> None:  # kill after even rounds, restart after odd
                        if i % 2 == 0:
                            redis.kill()
                        else:
                            redis.restart()
                            result.flaps += 1

                    runs = _run_clients(specs, rounds, between)
                stop.set()
                if sampler.is_alive():
                    sampler.join(5)
                _sample(node.pid, result)
                if flapper is not None:
                    flapper.join(30)
                after = c.stats().store.tiers
                for t0, t1 in zip(before, after, strict=True):
                    result.tiers[t1.kind.value] = (t1.demotions - t0.demotions,
                                                   t1.evictions - t0.evictions,
                                                   t1.promotions - t0.promotions)
                result.evictions = sum(t.evictions for t in after) - sum(t.evictions for t in before)
                result.demotions = sum(t.demotions for t in after) - sum(t.demotions for t in before)
            for r in runs:
                for op in OPS:
                    result.lat.setdefault(op, []).extend(r["lat"][op])
                result.tally.update(r["tally"])
                for k, v in r["first"].items():
                    result.first.setdefault(k, v)
            for n, data in nodes:
                result.problems += _check(n.url, data)
                if fleet:
                    health = httpx.get(n.url + "/v1/health", timeout=10).json()
                    result.peer_rows += int(health["fleet"]["peer_rows"])
        finally:
            stop.set()
            for n, _ in nodes:
                result.exit_code = n.stop() or result.exit_code
            if redis is not None:
                redis.stop()
    return result


if __name__ == "__main__":
    if sys.argv[1] == "_client":
        print(json.dumps(_client(json.loads(sys.argv[2]))), flush=True)
    os._exit(0)
