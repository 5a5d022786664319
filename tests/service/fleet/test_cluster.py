"""The fleet index and the remote tier on a real local Redis Cluster (3 masters, then 3
masters with replicas for a failover): the same code as on one Redis."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import redis.cluster
import torch

from kvbank import Client, full_attention
from kvbank.procs import RedisClusterProcs, free_pairs
from kvbank.service.fleet.index import FleetIndex
from kvbank.testing.servers import in_ci
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.remote import RedisFrameStore, connect

from ..conftest import start_node

LAYOUT = full_attention("fleet-cluster@1", num_layers=2, num_kv_heads=2, head_dim=64)


def _need_binaries() -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        if in_ci():
            pytest.fail("CI=true but redis-server / redis-cli are not installed")
        pytest.skip("redis-server and redis-cli are needed for the cluster tests")


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterProcs]:
    _need_binaries()
    c = RedisClusterProcs.start(masters=3)
    yield c
    c.stop()


class Clock:
    now = 5_000_000.0

    def __call__(self) -> float:
        return self.now


def test_cluster_index_publish_lookup_one_script_per_master(cluster: RedisClusterProcs) -> None:
    rc = connect(cluster=cluster.seeds.split(","))
    assert isinstance(rc, redis.cluster.RedisCluster)
    try:
        ix = FleetIndex(rc, namespace=b"c1:", clock=Clock())
        a = ix.register("a", "http://x:1", "1", [])
        b = ix.register("b", "http://x:2", "1", [])
        names = [name_of(i) for i in range(1000)]
        ix.publish(names[:700], a)
        ix.publish(names[300:], b)
        ix.holders(names, ix.live())  # loads the read script where it is missing
        calls = {n.name: n for n in rc.get_primaries()}
        before = {k: int(rc.info("commandstats", target_nodes=n).get("cmdstat_evalsha", {})
                         .get("calls", 0)) for k, n in calls.items()}
        got = ix.holders(names, ix.live())
        after = {k: int(rc.info("commandstats", target_nodes=n)["cmdstat_evalsha"]["calls"])
                 for k, n in calls.items()}
        diffs = {k: after[k] - before[k] for k in calls}
        assert diffs == dict.fromkeys(calls, 1), diffs  # one read script per master
        ab = tuple(sorted((a, b)))
        assert got == [(a,)] * 300 + [ab] * 400 + [(b,)] * 300
        ix.withdraw(names[:300], a)
        assert ix.holders(names[:300], ix.live()) == [()] * 300
    finally:
        rc.close()


def test_cluster_remote_tier_round_trip(cluster: RedisClusterProcs) -> None:
    rc = connect(cluster=cluster.seeds.split(","))
    try:
        fs = RedisFrameStore(rc, 1 << 20, namespace=b"c2:")
        frame = fs.frame(page_of(1, 4096), "uint8")
        fs.write_frame(name_of(1), frame, raw_len=4096, dtype="uint8")
        out = bytearray(4096)
        assert fs.read_into(name_of(1), out) == 4096 and bytes(out) == page_of(1, 4096)
        fs.check()
        again = RedisFrameStore(rc, 1 << 20, namespace=b"c2:")
        assert [r.name for r in again.scan()] == [name_of(1)]
    finally:
        rc.close()


def _caught_up(cl: RedisClusterProcs, timeout_s: float = 20.0) -> None:
    """Wait until every master's replicas have acknowledged its whole replication stream."""
    deadline = time.monotonic() + timeout_s
    for port in cl.ports:
        r = redis.Redis(port=port)
        try:
            while True:
                info = r.info("replication")
                if info.get("role") != "master":
                    break
                offsets = [v["offset"] for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
                if offsets and min(offsets) >= info["master_repl_offset"]:
                    break
                assert time.monotonic() < deadline, f"replicas of :{port} did not catch up: {info}"
                time.sleep(0.05)
        finally:
            r.close()


def test_cluster_failover_is_waited_out_with_a_deadline() -> None:
    """A master killed mid-run: its replica takes over (~2x node timeout) and index calls
    made meanwhile succeed late instead of failing; the retries are counted."""
    _need_binaries()
    cl = RedisClusterProcs.start(masters=3, replicas=1)
    rc = connect(cluster=cl.seeds.split(","))
    try:
        ix = FleetIndex(rc, namespace=b"c3:", clock=Clock(), failover_s=25.0)
        a = ix.register("a", "http://x:1", "1", [])
        names = [name_of(i) for i in range(200)]
        ix.publish(names, a)
        victim = cl.master_of(ix.entry_key(names[0]))
        # Redis replicates asynchronously: a master killed before its replica has the
        # entries loses them at failover. This test is about waiting the outage out, so
        # the kill comes once every master's replica has caught up.
        _caught_up(cl)
        errors: list[BaseException] = []
        done = threading.Event()

        def reader() -> None:
            while not done.is_set():
                try:
                    assert ix.holders(names, {a}) == [(a,)] * len(names)
                except BaseException as exc:
                    errors.append(exc)
                    return

        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.2)
        cl.kill(victim)
        deadline = time.monotonic() + 25
        while cl.master_of(ix.entry_key(names[0])) in (victim, 0) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        ix.publish(names[:10], a)  # writes go through once the replica is promoted
        done.set()
        t.join(30)
        assert not errors, errors[0]
        assert ix.retries > 0  # the outage was seen, and waited out
    finally:
        rc.close()
        cl.stop()


def test_cluster_node_starts_with_no_seed_answering_and_joins_when_it_appears(
        tmp_path: Path) -> None:
    """``--redis-cluster`` whose seeds do not answer yet: the node serves (degraded:
    fleet), and registers and publishes once the cluster comes up on those seeds."""
    _need_binaries()
    ports = free_pairs(3)
    node = start_node(tmp_path / "n", "--redis-cluster",
                      ",".join(f"127.0.0.1:{p}" for p in ports))
    cl: RedisClusterProcs | None = None
    try:
        h = httpx.get(node.url + "/v1/health", timeout=5).json()
        assert h["degraded"] == "fleet" and h["fleet"]["state"] == "degraded"
        with Client(node.url, same_host=False) as c:  # local serving is unaffected
            lid = c.register(LAYOUT)
            c.put(lid, list(range(2 * 16)), group=0,
                  pages=torch.zeros((2, LAYOUT.group_page_bytes[0]), dtype=torch.uint8))
        cl = RedisClusterProcs.start(masters=3, ports=ports)

        def joined() -> bool:
            f = httpx.get(node.url + "/v1/health", timeout=5).json()["fleet"]
            return bool(f["state"] == "ok" and f["published"] >= 2)

        deadline = time.monotonic() + 60  # a hang bound only: the rejoin time is a benchmark's
        while not joined():
            assert time.monotonic() < deadline, "the node never joined the cluster"
            time.sleep(0.1)
    finally:
        node.stop()
        if cl is not None:
            cl.stop()
