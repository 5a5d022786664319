"""The fleet's registry and prefix index on a real redis-server (fake clocks, no sleeps)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest
import redis

from kvbank.errors import TierUnavailable
from kvbank.service.fleet_index import FleetIndex
from kvbank.testing.servers import RedisServer
from kvbank.testing.tiers import name_of
from kvbank.tiers.remote import connect

_ns = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = connect(redis_server.url)
    assert isinstance(c, redis.Redis)
    yield c
    c.close()


def _index(client: redis.Redis, clock: Clock, ns: bytes | None = None) -> FleetIndex:
    return FleetIndex(client, namespace=ns or b"f%d:" % next(_ns), clock=clock)


def test_fleet_registry_liveness_by_heartbeat_score(client: redis.Redis) -> None:
    clock = Clock()
    ix = _index(client, clock)
    a = ix.register("a", "http://127.0.0.1:1", "1", ["ab"])
    b = ix.register("b", "http://127.0.0.1:2", "1", [])
    assert a != b and ix.register("a", "http://127.0.0.1:1", "1", []) == a
    assert ix.live() == {a, b}
    clock.now += ix.deadline_s / 2
    assert ix.heartbeat(a, "a", rows=3, layouts=["ab"])
    clock.now += ix.deadline_s / 2 + 0.5  # b's beat is now past the deadline, a's is not
    assert ix.live() == {a}
    nodes = {n.node_id: n for n in ix.nodes()}
    assert nodes[a].rows == 3 and nodes[a].layouts == ("ab",)
    assert nodes[b].heartbeat_age_s > ix.deadline_s
    assert ix.address(b) == "http://127.0.0.1:2"


def test_fleet_heartbeat_after_redis_lost_everything_asks_to_reregister(
        client: redis.Redis) -> None:
    ix = _index(client, Clock())
    a = ix.register("a", "http://x:1", "1", [])
    client.delete(ix._reg(b"n:%d" % a))  # what a restarted, empty Redis looks like
    assert ix.heartbeat(a, "a", rows=0, layouts=[]) is False
    b = ix.register("b", "http://x:2", "1", [])  # ids handed out again: b may get a's
    client.hset(ix._reg(b"n:%d" % a), "name", "b")
    assert ix.heartbeat(a, "a", rows=0, layouts=[]) is False and b


def test_fleet_lookup_is_one_mget_for_the_whole_chain(client: redis.Redis) -> None:
    ix = _index(client, Clock())
    a = ix.register("a", "http://x:1", "1", [])
    names = [name_of(i) for i in range(1000)]
    ix.publish(names[:600], a)
    before = client.info("commandstats").get("cmdstat_mget", {}).get("calls", 0)
    got = ix.holders(names, {a})
    after = client.info("commandstats")["cmdstat_mget"]["calls"]
    assert after - before == 1
    assert got == [(a,)] * 600 + [()] * 400


def test_fleet_two_nodes_publishing_at_once_leave_one_holder_set(client: redis.Redis) -> None:
    clock = Clock()
    ns = b"f%d:" % next(_ns)
    ia, ib = _index(client, clock, ns), _index(client, clock, ns)
    a, b = ia.register("a", "http://x:1", "1", []), ib.register("b", "http://x:2", "1", [])
    names = [name_of(i) for i in range(400)]
    go = threading.Barrier(2)

    def pub(ix: FleetIndex, nid: int) -> None:
        go.wait()
        for i in range(0, len(names), 25):
            ix.publish(names[i:i + 25], nid)

    ts = [threading.Thread(target=pub, args=(ia, a)), threading.Thread(target=pub, args=(ib, b))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert ia.holders(names, {a, b}) == [tuple(sorted((a, b)))] * len(names)
    raw = {client.get(ia.entry_key(n)) for n in names}
    assert len(raw) == 1  # the same packed string everywhere: sorted, no repeats
    ia.withdraw(names[:10], a)
    assert ia.holders(names[:10], {a, b}) == [(b,)] * 10
    ib.withdraw(names[:10], b)
    assert client.exists(*[ia.entry_key(n) for n in names[:10]]) == 0  # empty = gone


def test_fleet_forged_entries_are_ignored_and_counted(client: redis.Redis) -> None:
    ix = _index(client, Clock())
    a = ix.register("a", "http://x:1", "1", [])
    client.set(ix.entry_key(name_of(1)), b"\x01")  # odd length
    client.set(ix.entry_key(name_of(2)), b"\x99\x99")  # a node nobody registered
    client.set(ix.entry_key(name_of(3)), b"\x00" * 4000)  # longer than any fleet
    assert ix.holders([name_of(1), name_of(2), name_of(3)], {a}) == [(), (), ()]
    assert ix.forged == 3


def test_fleet_entries_expire_unless_refreshed(client: redis.Redis) -> None:
    ix = FleetIndex(client, namespace=b"f%d:" % next(_ns), entry_ttl_s=30, clock=Clock())
    a = ix.register("a", "http://x:1", "1", [])
    ix.publish([name_of(1)], a)
    assert 0 < client.pttl(ix.entry_key(name_of(1))) <= 30_000


def test_fleet_redis_down_is_typed() -> None:
    server = RedisServer.start()
    c = connect(server.url, retries=0)
    ix = FleetIndex(c, namespace=b"down:")
    server.stop()
    try:
        with pytest.raises(TierUnavailable):
            ix.holders([name_of(1)])
        with pytest.raises(TierUnavailable):
            ix.register("a", "http://x:1", "1", [])
    finally:
        c.close()
