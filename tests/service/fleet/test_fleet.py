"""Two real ``kvbank serve`` nodes and a real redis-server: a prefix stored on A is matched
and fetched through B bit-exactly; scopes never meet in the index; Redis killed and
restarted mid-run; a dead holder's rows are misses and its entries are withdrawn."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import torch

from kvbank import Client, Scope, full_attention
from kvbank.cli import main
from kvbank.service.fleet.index import FleetIndex
from kvbank.service.launch import NodeProcess
from kvbank.testing.servers import INSTALL_HINT, free_port, in_ci, redis_binary

from ..conftest import admin_headers, start_node

LAYOUT = full_attention("fleet@1", num_layers=2, num_kv_heads=2, head_dim=64)
PAGE = LAYOUT.group_page_bytes[0]
P = 16  # tokens per page


class Redis:
    """A redis-server on a fixed port that the test can kill and start again."""

    def __init__(self) -> None:
        binary = redis_binary()
        if binary is None:
            if in_ci():
                pytest.fail("CI=true but " + INSTALL_HINT)
            pytest.skip(INSTALL_HINT)
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvbank-fleet-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        c = redis.Redis(port=self.port)
        wait_for(lambda: _pings(c), 10, "redis-server to answer")
        c.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def _pings(c: redis.Redis) -> bool:
    try:
        return bool(c.ping())
    except redis.RedisError:
        return False


HANG_S = 60.0  # every wait here is a hang bound; the figures are the fleet bench's


def wait_for(cond: Callable[[], Any], within_s: float, what: str) -> Any:
    """Poll ``cond`` until it holds. ``within_s`` is what a quiet machine needs; the wait
    gives up only after ``HANG_S`` (or more), so a loaded machine fails no assertion."""
    bound = max(within_s, HANG_S)
    deadline = time.monotonic() + bound
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {bound}s for {what}")
        time.sleep(0.05)


def health(node: NodeProcess) -> dict[str, Any]:
    return dict(httpx.get(node.url + "/v1/health", timeout=5).json())


DATA: dict[str, Path] = {}  # a node's url -> its data dir (where its admin token is)


def fleet(node: NodeProcess) -> dict[str, Any]:
    got = httpx.get(node.url + "/admin/fleet", headers=admin_headers(node), timeout=5)
    assert got.status_code == 200, got.text
    return dict(got.json())


def pages(n: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, PAGE), dtype=np.uint8))


@pytest.fixture(scope="module")
def rds() -> Iterator[Redis]:
    r = Redis()
    yield r
    r.close()


@pytest.fixture(scope="module")
def nodes(rds: Redis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:
    procs: list[NodeProcess] = []
    try:
        for tag in ("a", "b"):
            data: Path = tmp_path_factory.mktemp(f"fleet-{tag}")
            procs.append(start_node(data, "--redis", rds.url))
            DATA[procs[-1].url] = data
        for p in procs:
            def up(p: NodeProcess = p) -> bool:
                return bool(health(p).get("fleet", {}).get("state") == "ok")
            wait_for(up, 30, "the node to register")
        yield procs
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.stop()


def _store(node: NodeProcess, toks: list[int], data: torch.Tensor,
           scope: Scope | None = None) -> bytes:
    with Client(node.url, same_host=False) as c:
        lid = c.register(LAYOUT)
        kw: dict[str, Any] = {} if scope is None else {"scope": scope}
        c.put(lid, toks, group=0, pages=data, **kw)
    return lid


def _published(node: NodeProcess, n: int) -> bool:
    return int(health(node)["fleet"]["published"]) >= n


def test_fleet_prefix_from_a_is_fetched_bit_exact_through_b(nodes: list[NodeProcess]) -> None:
    a, b = nodes
    data = pages(8, 1)
    toks = list(range(1000, 1000 + 8 * P))
    lid = _store(a, toks, data)
    wait_for(lambda: _published(a, 8), 10, "A to publish its rows")
    with Client(a.url, same_host=False) as ca:
        served_a = ca.stats().store
    with Client(b.url, same_host=False) as cb:
        assert cb.register(LAYOUT) == lid
        before_b = cb.stats().store
        m = cb.match(lid, [*toks, 1])
        assert m.resume.tokens == 8 * P
        out = torch.zeros((8, PAGE), dtype=torch.uint8)
        res = cb.fetch(m, out={0: out})
        assert res.complete and torch.equal(out, data)
        after_b = cb.stats().store
        # the counters add up: A served the 8 rows to B (its peer), B served them to its
        # client; each counts them once, as hits
        assert (after_b.gets - before_b.gets, after_b.hits - before_b.hits) == (8, 8)
        assert after_b.misses == before_b.misses
        # another tenant's same tokens name other rows: nothing leaks through the index
        other = cb.match(lid, [*toks, 1], scope=Scope(tenant="other"))
        assert other.resume.tokens == 0
    with Client(a.url, same_host=False) as ca:
        now_a = ca.stats().store
    assert (now_a.gets - served_a.gets, now_a.hits - served_a.hits) == (8, 8)
    assert int(health(b)["fleet"]["peer_rows"]) == 8
    assert int(health(b)["fleet"]["peer_copied"]) == 0  # received in place, under a lease
    listed = {n["node_id"]: n for n in fleet(b)["nodes"]}
    assert len(listed) == 2 and all(n["state"] == "live" for n in listed.values())


def test_fleet_a_scheduler_s_match_many_sees_a_peer_s_rows(nodes: list[NodeProcess]) -> None:
    """match_many on B answers from the fleet as B's match does: A's rows count, and B
    has them by the time a worker loads by the handle."""
    a, b = nodes
    keys = [bytes([7, i]) * 8 for i in range(4)]  # an engine's 16-byte keys
    before = int(health(a)["fleet"]["published"])
    with Client(a.url, same_host=False) as ca:
        lid = ca.register(LAYOUT)
        ca.put(lid, group=0, pages=pages(4, 9), keys=keys)
    wait_for(lambda: _published(a, before + 4), 10, "A to publish its rows")
    with Client(b.url, same_host=False) as cb:
        assert cb.register(LAYOUT) == lid
        (bound,) = cb.match_many(lid, [keys], prompt_tokens=[4 * P + 1], hold=True, timeout=30)
        assert bound.tokens == 4 * P and bound.missing == ((),) and bound.handle is not None
        assert cb.release_match(bound.handle)

def test_fleet_admin_cli_lists_nodes_state_age_and_rows(
        nodes: list[NodeProcess], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = nodes
    _store(a, list(range(3000, 3000 + 2 * P)), pages(2, 5))
    wait_for(lambda: _published(a, 2), 10, "A to publish")
    wait_for(lambda: any(n["rows"] >= 2 for n in fleet(b)["nodes"]), 10, "A's beat to count its rows")
    argv = ["admin", "--url", b.url, "--data-dir", str(DATA[b.url])]
    assert main([*argv, "fleet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["node", "address", "state", "heartbeat_age_s", "rows", "version",
                              "layouts"]
    body = [line.split() for line in out[2:]]
    assert {line[-6] for line in body} == {a.url, b.url}  # the address column
    assert all(line[-5] == "live" for line in body)
    assert sum(1 for line in out[2:] if line.startswith("*")) == 1  # B marks itself
    assert main([*argv, "--json", "fleet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    mine = next(n for n in doc["nodes"] if n["address"] == a.url)
    assert doc["self"] != mine["node_id"] and mine["rows"] >= 2 and mine["heartbeat_age_s"] < 10


def test_fleet_peer_rows_without_a_host_tier_are_stored_by_name(
        nodes: list[NodeProcess], rds: Redis, tmp_path: Path) -> None:
    """A node with no host slots to lease (disk only) still keeps a peer's rows: they
    are received into buffers and stored by name, bit-exact."""
    a, _ = nodes
    data = pages(3, 6)
    toks = list(range(30000, 30000 + 3 * P))
    had = int(health(a)["fleet"]["published"])
    lid = _store(a, toks, data)
    wait_for(lambda: _published(a, had + 3), 10, "A to publish")
    c = start_node(tmp_path / "c", "--redis", rds.url, "--host-bytes", "0")
    try:
        wait_for(lambda: health(c).get("fleet", {}).get("state") == "ok", 30, "C to join")
        with Client(c.url, same_host=False) as cc:
            cc.register(LAYOUT)
            m = cc.match(lid, [*toks, 1])
            assert m.resume.tokens == 3 * P
            out = torch.zeros((3, PAGE), dtype=torch.uint8)
            assert cc.fetch(m, out={0: out}).complete and torch.equal(out, data)
        f = health(c)["fleet"]
        assert f["peer_rows"] == 3 and f["peer_copied"] == 3
    finally:
        c.stop()


def test_fleet_rows_held_here_are_not_leased_again_only_the_missing_are_received(
        nodes: list[NodeProcess]) -> None:
    """B holds the prompt's first two rows (a reader holds them leased); a match fetches
    only what B lacks into leased slots: the rows held here are never leased for writing
    (that would conflict with the reader), and all four fetch bit-exact. Regression: found
    by the reliability soak, where storing a peer's rows over a leased row made the match
    raise ``RowLocked`` instead of answering."""
    a, b = nodes
    data = pages(4, 7)
    toks = list(range(40000, 40000 + 4 * P))
    had = int(health(a)["fleet"]["published"])
    lid = _store(a, toks, data)
    wait_for(lambda: _published(a, had + 4), 10, "A to publish")
    before = health(b)["fleet"]
    with Client(b.url) as cb:
        cb.register(LAYOUT)
        names = cb.put(lid, toks[:2 * P], group=0, pages=data[:2])
        reader = cb.lend(names)
        try:
            m = cb.match(lid, [*toks, 1])
        finally:
            cb.release(reader.id)
        assert m.resume.tokens == 4 * P
        out = torch.zeros((4, PAGE), dtype=torch.uint8)
        assert cb.fetch(m, out={0: out}).complete and torch.equal(out, data)
    after = health(b)["fleet"]
    assert after["peer_rows"] - before["peer_rows"] == 2
    assert after["peer_copied"] == before["peer_copied"]


def test_fleet_same_prefix_on_both_nodes_has_both_holders(
        nodes: list[NodeProcess], rds: Redis) -> None:
    a, b = nodes
    data = pages(4, 2)
    toks = list(range(5000, 5000 + 4 * P))
    _store(a, toks, data)
    _store(b, toks, data)
    ids = {fleet(a)["self"], fleet(b)["self"]}
    c: Any = redis.Redis(port=rds.port)  # replies typed bytes | str by the stubs
    try:
        def both() -> bool:
            keys = [k for k in c.scan_iter(match=b"kvb:{b*}i*", count=10000)]
            vals = [bytes(v) for k in keys if (v := c.get(k)) is not None]
            return any(len(v) == 4 and set(np.frombuffer(v, "<u2").tolist()) == ids
                       for v in vals)
        wait_for(both, 10, "both holders in one entry")
    finally:
        c.close()


def test_fleet_redis_restart_degrades_then_rejoins_within_5s(
        nodes: list[NodeProcess], rds: Redis) -> None:
    a, b = nodes
    data = pages(4, 3)
    toks = list(range(9000, 9000 + 4 * P))
    lid = _store(a, toks, data)
    rds.kill()
    wait_for(lambda: health(a).get("degraded") == "fleet", 15, "A to report degraded: fleet")
    with Client(a.url, same_host=False) as ca:  # local serving goes on: 0 failed fetches
        for _ in range(5):
            m = ca.match(lid, [*toks, 1])
            out = torch.zeros((4, PAGE), dtype=torch.uint8)
            assert ca.fetch(m, out={0: out}).complete and torch.equal(out, data)
    rds.start()  # empty: every registration and entry is gone
    # The 5 s rejoin figure is a benchmark's to measure; here a generous bound only keeps
    # a loaded machine from failing a test whose subject is that the node rejoins at all.
    wait_for(lambda: health(a).get("fleet", {}).get("state") == "ok"
             and _published(a, 4), 30, "A to re-register and republish")
    with Client(b.url, same_host=False) as cb:
        wait_for(lambda: health(b).get("fleet", {}).get("state") == "ok", 5, "B to rejoin")
        cb.register(LAYOUT)
        assert wait_for(lambda: cb.match(lid, [*toks, 1]).resume.tokens == 4 * P, 5,
                        "B to find A's rows again")


def test_fleet_dead_holder_rows_are_misses_and_its_entries_withdrawn(
        nodes: list[NodeProcess], rds: Redis) -> None:
    a, b = nodes
    data = pages(4, 4)
    toks = list(range(13000, 13000 + 4 * P))
    wait_for(lambda: health(a)["fleet"]["state"] == "ok", 10, "A to be in the fleet")
    had = int(health(a)["fleet"]["published"])
    lid = _store(a, toks, data)
    wait_for(lambda: _published(a, had + 4), 10, "A to publish")
    before = int(health(b)["fleet"]["peer_rows"])
    a.kill()  # its heartbeat is still fresh: B's index still lists it
    with Client(b.url, same_host=False) as cb:
        cb.register(LAYOUT)
        m = cb.match(lid, [*toks, 1])
        assert m.resume.tokens == 0  # nothing delivered is a miss, never "loaded"
        misses = sum(1 for t in m.tiers[0] if t is None)
        assert misses == 4
    h = health(b)["fleet"]
    assert h["state"] == "ok" and h["peer_rows"] == before  # nothing came from the dead
    a_id = next(n["node_id"] for n in fleet(b)["nodes"] if n["address"] == a.url)
    c: Any = redis.Redis(port=rds.port)  # replies typed bytes | str by the stubs
    try:
        ix = FleetIndex(c)
        for name in m.names[0][:4]:  # B withdrew the dead holder's entries for them
            v = c.get(ix.entry_key(name))
            assert v is None or a_id not in np.frombuffer(bytes(v), "<u2").tolist()
    finally:
        c.close()


BIG = full_attention("fleet-big@1", num_layers=16, num_kv_heads=8, head_dim=128)  # 1 MiB


def test_fleet_holder_killed_mid_fetch_leaves_only_whole_rows(
        nodes: list[NodeProcess], rds: Redis, tmp_path: Path) -> None:
    """Whenever the holder dies (before, during or after the stream), what B answers is
    a bound over rows that arrived whole and bit-exact; nothing partial is "loaded"."""
    _, b = nodes
    page = BIG.group_page_bytes[0]
    n = 48
    data = torch.from_numpy(np.random.default_rng(9).integers(0, 256, (n, page), dtype=np.uint8))
    toks = list(range(20000, 20000 + n * P))
    holder = start_node(tmp_path / "holder", "--redis", rds.url)
    try:
        with Client(holder.url, same_host=False) as ch:
            lid = ch.register(BIG)
            ch.put(lid, toks, group=0, pages=data)
        wait_for(lambda: _published(holder, n), 10, "the holder to publish")
        killer = threading.Timer(0.15, holder.kill)
        with Client(b.url, same_host=False) as cb:
            cb.register(BIG)
            killer.start()
            m = cb.match(lid, [*toks, 1])
            killer.join()
            r = m.resume.tokens // P
            assert m.resume.tokens % P == 0 and 0 <= r <= n
            if r:
                out = torch.zeros((r, page), dtype=torch.uint8)
                res = cb.fetch(m, out={0: out})
                assert res.complete and torch.equal(out, data[:r])
    finally:
        holder.kill()


def test_served_match_recalls_rows_only_the_remote_tier_holds(
        rds: Redis, tmp_path: Path) -> None:
    """A node whose small tiers pushed a prompt's rows down to the remote tier (Redis):
    a served match reads them back before it answers, so the prompt resumes in full and
    fetches bit-exact over TCP; a worker never has to know which tier held them."""
    node = NodeProcess.start(["--data-dir", str(tmp_path), "--host-bytes", "64K",
                              "--disk-bytes", "192K", "--device-bytes", "0",
                              "--remote-url", rds.url, "--remote-bytes", "16M"])
    try:
        layout = full_attention("fleet-recall@1", num_layers=1, num_kv_heads=1, head_dim=64,
                                dtype="float16")
        page = layout.group_page_bytes[0]
        rng = np.random.default_rng(11)
        a = torch.from_numpy(rng.integers(0, 256, (24, page), dtype=np.uint8))
        b = torch.from_numpy(rng.integers(0, 256, (64, page), dtype=np.uint8))
        ta, tb = list(range(24 * 16)), list(range(20_000, 20_000 + 64 * 16))
        with Client(node.url, same_host=False) as c:
            lid = c.register(layout)
            names = c.put(lid, ta, group=0, pages=a)
            c.put(lid, tb, group=0, pages=b)  # a's rows leave for the remote tier
            c.flush()
            assert None in c.locate(names)  # not held locally any more
            before = c.stats().store
            m = c.match(lid, [*ta, 1])
            assert m.resume.tokens == 24 * 16
            out = torch.zeros((24, page), dtype=torch.uint8)
            got = c.fetch(m, out={0: out})
            assert got.complete and torch.equal(out, a)
            after = c.stats().store
            # each recalled row counts once, when it is served (not again at the recall)
            assert (after.gets - before.gets, after.hits - before.hits) == (24, 24)
            assert after.misses == before.misses and after.gets == after.hits + after.misses
    finally:
        assert node.stop() == 0

