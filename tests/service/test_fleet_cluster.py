"""The fleet index and the remote tier on a real local Redis Cluster (3 masters, then 3
masters with replicas for a failover): the same code as on one Redis."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator

import pytest
import redis.cluster

from kvbank.bench.redis_procs import RedisClusterProcs
from kvbank.service.fleet_index import FleetIndex
from kvbank.testing.servers import in_ci
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.remote import RedisFrameStore, connect


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
        calls = {n.name: n for n in rc.get_primaries()}  # type: ignore[no-untyped-call]
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
