"""The node's promises to its clients across a crash and a restart: the ``node`` part of
``kvbank bench reliability``.

Every case runs a real ``kvbank serve`` (:class:`NodeProcess`), real SIGKILLs and real
``kvbank.Client`` objects on the three page paths (same host, data port, HTTP bodies).
Each case is a function that returns what it observed (the CI tests in
``tests/reliability`` call the same functions with smaller sizes); :func:`run_part`
turns them into rows.

- ``crash-puts-partial`` — multi-page puts in flight at a SIGKILL of a write-through node
  that come back partly stored after the restart (goal 0: a put is all or nothing);
- ``client-restart`` — transfers that fail once the node is back, for long-lived clients
  on every path that lived through a SIGKILL and a restart (the data port changes)
  (goal 0);
- ``tenant-neighbour`` — a same-host worker of tenant B (the node's uid, its own token)
  maps the host segment without a lease and overwrites pages of tenant A's; A's fetches
  on every path that hand back B's bytes (goal 0; any such byte is wrong bytes too).
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvbank.bench.common import BenchRow
from kvbank.bench.reliability_procs import node_args
from kvbank.bench.reliability_worker import LAYOUT, PAGE, TOKENS_PER_PAGE, chain_tokens
from kvbank.client.client import Client
from kvbank.client.shm import Borrower
from kvbank.errors import KvbankError
from kvbank.keys import DEFAULT_SCOPE, namespace, page_keys, row_names
from kvbank.service.launch import NodeProcess

HANG_S = 120.0  # a hang detector, never a timing target
PATHS = ("same-host", "data-port", "http")  # the three page paths of a put


def path_client(url: str, path: str, *, retry_s: float = 0.0, timeout_s: float = 60.0,
                token: str | None = None) -> Client:
    """A ``Client`` held to one page path."""
    if path == "same-host":
        return Client(url, same_host=True, retry_s=retry_s, timeout_s=timeout_s, token=token)
    return Client(url, same_host=False, data_plane=path == "data-port", retry_s=retry_s,
                  timeout_s=timeout_s, token=token)


def prompt_pages(client: int, round_: int, put: int, n: int) -> list[bytes]:
    rng = random.Random(f"partial/{client}/{round_}/{put}")
    return [rng.randbytes(PAGE) for _ in range(n)]


def prompt_names(client: int, round_: int, put: int, n: int) -> list[bytes]:
    toks = chain_tokens(client, round_ * 100_000 + put, n)
    return row_names(namespace(LAYOUT.layout_id, DEFAULT_SCOPE),
                     page_keys(toks, TOKENS_PER_PAGE), 0)


# ---- crash-puts-partial --------------------------------------------------------------


@dataclass
class PartialResult:
    interrupted: int  # puts in flight at a kill (attempted, never acknowledged)
    partial: int  # of those, came back with some but not all of their pages
    whole: int  # of those, came back whole
    acked: int  # puts acknowledged before a kill
    lost: int  # acknowledged puts not wholly there after the restart
    wrong: int  # wrong bytes read back
    restart_failures: int


class _Putter(threading.Thread):
    """One client on one path, putting ``pages``-page prompts until a put fails."""

    def __init__(self, url: str, client: int, path: str, round_: int, pages: int) -> None:
        super().__init__(name=f"kvbank-partial-{client}", daemon=True)
        self.url, self.client, self.path, self.round, self.pages = url, client, path, round_, pages
        self.acked = 0
        self.in_flight: int | None = None  # the put that failed

    def run(self) -> None:
        k = 0
        try:
            with path_client(self.url, self.path, retry_s=0, timeout_s=60) as c:
                lid = c.register(LAYOUT)
                while True:
                    toks = chain_tokens(self.client, self.round * 100_000 + k, self.pages)
                    self.in_flight = k
                    c.put(lid, toks, group=0,
                          pages=prompt_pages(self.client, self.round, k, self.pages))
                    self.in_flight = None
                    self.acked = k = k + 1
        except KvbankError:
            return  # the node was killed: the put ``in_flight`` (if any) did not answer


def crash_puts_partial(workdir: Path, *, rounds: int = 3, pages: int = 64,
                       seed: int = 27) -> PartialResult:
    """Rounds of: one client per page path puts ``pages``-page prompts into a
    write-through node, one after another; the node is SIGKILLed once a random number
    of rows is stored (polled on its stats, so the kill lands while puts are being
    committed); restart; every acknowledged prompt must be whole, every prompt in flight
    whole or absent, and every stored byte right."""
    rng = random.Random(seed)
    args = node_args(workdir / "data", "--write-policy", "write-through")
    res = PartialResult(0, 0, 0, 0, 0, 0, 0)
    node = NodeProcess.start(args)
    try:
        for r in range(rounds):
            with Client(node.url, same_host=False) as watch:
                base = watch.stats().store.rows
                putters = [_Putter(node.url, i, p, r, pages) for i, p in enumerate(PATHS)]
                for t in putters:
                    t.start()
                target = base + rng.randint(pages // 2, 4 * pages)
                deadline = time.monotonic() + HANG_S
                while watch.stats().store.rows < target and time.monotonic() < deadline:
                    time.sleep(0.001)
            node.kill()
            for t in putters:
                t.join(HANG_S)
            try:
                node = NodeProcess.start(args)
            except Exception:
                res.restart_failures += 1
                raise
            with Client(node.url, same_host=False) as c:
                c.register(LAYOUT)
                for t in putters:
                    for k in range(t.acked):
                        names = prompt_names(t.client, r, k, pages)
                        if any(w is None for w in c.locate(names)):
                            res.lost += 1
                    res.wrong += sum(_wrong(c, t.client, r, k, pages) for k in range(t.acked))
                    if t.in_flight is None:
                        continue
                    res.interrupted += 1
                    names = prompt_names(t.client, r, t.in_flight, pages)
                    held = sum(w is not None for w in c.locate(names))
                    res.partial += 0 < held < pages
                    res.whole += held == pages
                    res.wrong += _wrong(c, t.client, r, t.in_flight, pages)
                res.acked += sum(t.acked for t in putters)
    finally:
        node.stop()
    return res


def _wrong(c: Client, client: int, round_: int, put: int, pages: int) -> int:
    """Wrong bytes among the stored prefix of one prompt (match + fetch over HTTP)."""
    toks = chain_tokens(client, round_ * 100_000 + put, pages)
    m = c.match(LAYOUT.layout_id, [*toks, 1])
    got = m.resume.pages[0] if m.resume.pages else ()
    if not got:
        return 0
    out = [bytearray(PAGE) for _ in got]
    c.fetch(m, out={0: out})
    want = prompt_pages(client, round_, put, pages)
    return sum(sum(a != b for a, b in zip(out[j], want[i], strict=True))
               for j, i in enumerate(got))


# ---- client-restart ------------------------------------------------------------------


CLIENT_KINDS = ("same-host", "data-port", "data-auto", "http")  # data-auto: data_plane=None


@dataclass
class RestartResult:
    transfers: int  # puts and fetches tried after the node was back
    failed: int  # of those, raised or came back short
    wrong: int  # wrong bytes fetched
    auto_on_data_port: bool  # the data_plane=None client moves pages on the new port


def _kind_client(url: str, kind: str) -> Client:
    if kind == "data-auto":
        return Client(url, same_host=False, timeout_s=60)
    return path_client(url, kind, retry_s=5.0)


def client_restart(workdir: Path, *, rounds: int = 2, transfers: int = 8) -> RestartResult:
    """One long-lived ``Client`` per kind (same host, data port required, data port
    when offered, HTTP) puts and fetches; the node is SIGKILLed and restarted on the same
    HTTP port (its data port is a new one); every client then makes ``transfers`` puts
    and fetches, each checked. Value: the transfers that failed once the node was back."""
    args = node_args(workdir / "data")
    node = NodeProcess.start(args)
    port = node.url.rsplit(":", 1)[1]
    clients = {k: _kind_client(node.url, k) for k in CLIENT_KINDS}
    res = RestartResult(0, 0, 0, False)
    try:
        for c in clients.values():
            c.register(LAYOUT)
        for r in range(rounds + 1):
            if r:
                node.kill()
                node = NodeProcess.start([*args, "--port", port])
            for j, c in enumerate(clients.values()):
                for k in range(transfers if r else 1):
                    client = 1000 + j
                    put = r * 1000 + k
                    res.transfers += 2 * bool(r)
                    try:
                        toks = chain_tokens(client, put, 4)
                        c.put(LAYOUT.layout_id, toks, group=0, pages=prompt_pages(client, 0, put, 4))
                        f = c.fetch_prefix(LAYOUT.layout_id, [*toks, 1])
                        got = f.pages[0] if f.pages else None
                        want = prompt_pages(client, 0, put, 4)
                        if got is None or got.shape[0] != 4:
                            res.failed += bool(r)
                            continue
                        res.wrong += sum(sum(a != b for a, b in zip(got[i].numpy().tobytes(), want[i],
                                                                    strict=True)) for i in range(4))
                    except KvbankError:
                        if not r:
                            raise
                        res.failed += 1
        auto = clients["data-auto"]
        res.auto_on_data_port = auto._data.port == auto._call("GET", "/v1/node")["data_port"]
    finally:
        for c in clients.values():
            c.close()
        node.stop()
    return res


# ---- tenant-neighbour ------------------------------------------------------------------

SCRIBBLE = b"\xee" * 64  # what B writes over the start of a page of A's


@dataclass
class NeighbourResult:
    attacks: int  # pages of A's that B overwrote in the segment (one per fetch)
    served: int  # fetches of A's after an overwrite that handed B's bytes back as A's
    wrong: int  # bytes of A's fetches that were not A's


def tenant_neighbour(workdir: Path, *, rounds: int = 2, pages: int = 4) -> NeighbourResult:
    """A node without tenant tokens (on a node with them the segment's name is unlinked at
    start, so no neighbour can open it: ``tests/reliability/test_tenant_neighbour.py``),
    and a neighbour process of its uid. Each round, on each path, A puts a prompt; the
    neighbour learns the segment from ``GET /v1/node``, maps it writable with no lease,
    finds one of A's pages by its bytes and overwrites its first 64 bytes; A fetches the
    prompt. Value: the fetches that handed A the overwritten page (goal 0: the page is a
    miss, never the neighbour's bytes)."""
    node = NodeProcess.start(node_args(workdir / "data"), env=_env())
    res = NeighbourResult(0, 0, 0)
    try:
        info = httpx.get(node.url + "/v1/node", timeout=60)
        segment = info.json()["host"]["segment"]  # named on a node without tenant tokens
        with Borrower(writable=True) as mapped:
            seg = mapped.segment(segment)
            for r in range(rounds):
                for j, path in enumerate(PATHS):
                    put = 50_000 + r * 100 + j
                    want = prompt_pages(3000, 0, put, pages)
                    toks = chain_tokens(3000, put, pages)
                    with path_client(node.url, path) as a:
                        a.register(LAYOUT)
                        a.put(LAYOUT.layout_id, toks, group=0, pages=want)
                        victim = want[(r + j) % pages]
                        at = bytes(seg).find(victim)
                        if at < 0:
                            continue  # not in host memory (written to disk): nothing to attack
                        seg[at : at + len(SCRIBBLE)] = SCRIBBLE
                        res.attacks += 1
                        try:
                            f = a.fetch_prefix(LAYOUT.layout_id, [*toks, 1])
                        except KvbankError:
                            continue  # a typed refusal: nothing served
                        if f.result is None:
                            continue
                        planned = f.match.resume.pages[0]
                        got = [f.pages[0][planned.index(k)].numpy().tobytes()
                               for k in f.result.delivered[0]]
                        res.served += any(g.startswith(SCRIBBLE) for g in got)
                        res.wrong += sum(sum(x != y for x, y in zip(g, want[k], strict=True))
                                         for g, k in zip(got, f.result.delivered[0], strict=True))
    finally:
        node.stop()
    return res


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "KVBANK_ADMIN_TOKEN"}


def run_part(quick: bool) -> tuple[list[BenchRow], int]:
    from kvbank.bench.reliability import goal_row

    rows: list[BenchRow] = []
    wrong = 0
    with tempfile.TemporaryDirectory(prefix="kvbank-reliability-") as tmp:
        root = Path(tmp)
        partial = crash_puts_partial(root / "partial", rounds=3 if quick else 10)
        wrong += partial.wrong
        rows.append(goal_row("crash-puts-partial",
                             f"puts in flight at a kill that came back partly stored "
                             f"(of {partial.interrupted})", partial.partial, 0))
        back = client_restart(root / "restart", rounds=2 if quick else 5)
        wrong += back.wrong
        rows.append(goal_row("client-restart",
                             f"transfers of long-lived clients that failed once a restarted "
                             f"node was back (of {back.transfers})", back.failed, 0))
        neighbour = tenant_neighbour(root / "neighbour", rounds=2 if quick else 5)
        wrong += neighbour.wrong
        rows.append(goal_row("tenant-neighbour",
                             f"fetches that handed a tenant the bytes a same-host neighbour "
                             f"wrote into its pages (of {neighbour.attacks} overwrites)",
                             neighbour.served, 0))
    return rows, wrong
