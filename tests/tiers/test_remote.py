"""The remote tier: conformance on a real redis-server, TTL, checksums, budget, faults."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import redis
import torch
from redis.crc import key_slot

from kvbank.codec import HEADER_SIZE
from kvbank.errors import CorruptPage, TierFull, TierUnavailable
from kvbank.testing.frames import FrameStoreTests
from kvbank.testing.servers import RedisServer
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.base import FrameStore, FrameWrite, TierKind
from kvbank.tiers.remote import BUCKETS, RedisFrameStore, bucket_tag, connect

from .conftest import MakeStore
from .store.test_stats import assert_counters_agree

_ns = itertools.count()


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    c = connect(redis_server.url)
    assert isinstance(c, redis.Redis)
    yield c
    c.close()


class TestRedisFrames(FrameStoreTests):
    @pytest.fixture(autouse=True)
    def _redis(self, client: redis.Redis) -> None:
        self.client = client
        self.ns = b"t%d:" % next(_ns)  # a fresh namespace per test: an empty store

    def make_frames(self, budget: int) -> FrameStore:
        return RedisFrameStore(self.client, budget, namespace=self.ns)

    def reopen(self, fs: FrameStore) -> FrameStore:
        fs.close()
        return RedisFrameStore(self.client, self.budget, namespace=self.ns)


def _store(client: redis.Redis, budget: int = 1 << 20, **kw: object) -> RedisFrameStore:
    return RedisFrameStore(client, budget, namespace=b"u%d:" % next(_ns), **kw)  # type: ignore[arg-type]


def _write(fs: RedisFrameStore, i: int, size: int = 4096) -> bytes:
    frame = fs.frame(page_of(i, size), "uint8")
    fs.write_frame(name_of(i), frame, raw_len=size, dtype="uint8")
    return frame


def test_remote_bucket_tag_spreads_names_and_keeps_a_row_in_one_slot() -> None:
    tags = {bucket_tag(name_of(i)) for i in range(5000)}
    assert len(tags) > BUCKETS * 0.9
    name = name_of(3)
    fs_key, meta_suffix = b"kvb:" + bucket_tag(name) + b"f" + name, bucket_tag(name) + b"m"
    assert key_slot(fs_key) == key_slot(b"kvb:" + meta_suffix)


def test_remote_frame_has_a_ttl(client: redis.Redis) -> None:
    fs = _store(client, ttl_s=30)
    _write(fs, 1)
    ttl = client.pttl(fs.frame_key(name_of(1)))
    assert 0 < ttl <= 30_000


def test_remote_expired_frame_is_a_miss_and_leaves_the_accounting(client: redis.Redis) -> None:
    fs = _store(client)
    _write(fs, 1)
    frame2 = _write(fs, 2)
    client.delete(fs.frame_key(name_of(1)))  # what the TTL does when it runs out
    assert fs.read_into(name_of(1), bytearray(4096)) is None
    assert fs.used_bytes == len(frame2)
    fs.check()


def test_remote_checksum_failure_is_corrupt_never_bytes(client: redis.Redis) -> None:
    fs = _store(client)
    frame = bytearray(_write(fs, 1))
    frame[HEADER_SIZE + 5] ^= 0x5A  # damage the payload, keep the length
    client.set(fs.frame_key(name_of(1)), bytes(frame))
    out = bytearray(4096)
    with pytest.raises(CorruptPage):
        fs.read_into(name_of(1), out)
    fs.drop_corrupt(name_of(1))
    assert fs.corrupt_rows == 1 and fs.read_frame(name_of(1)) is None
    fs.check()


def test_remote_budget_follows_redis_maxmemory(client: redis.Redis) -> None:
    fs = _store(client, budget=1 << 30)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + 6000)
    try:
        fs._headroom = (-1e9, None)  # forget the cached figure
        with pytest.raises(TierFull):
            for i in range(8):
                _write(fs, i, size=4096)
        assert fs.failed_writes == 1 and fs.last_error is not None
        assert fs.health().failed_writes == 1 and fs.health().last_error == fs.last_error
    finally:
        client.config_set("maxmemory", 0)


def test_remote_unreachable_is_unavailable_and_counted_on_write() -> None:
    server = RedisServer.start()
    c = connect(server.url, retries=0)
    fs = RedisFrameStore(c, 1 << 20, namespace=b"gone:")
    server.stop()
    try:
        with pytest.raises(TierUnavailable):
            _write(fs, 1)
        assert fs.failed_writes == 1
        with pytest.raises(TierUnavailable):
            fs.read_frame(name_of(1))
    finally:
        fs.close()
        c.close()


def test_remote_store_spills_disk_evictions_and_reads_them_on_a_miss(
        make_store: MakeStore, redis_server: RedisServer, client: redis.Redis) -> None:
    """A row that left the disk under pressure is in the remote tier and a read of it
    answers its exact bytes; a row never stored is still a miss."""
    client.flushall()
    P = 4096
    pages = [np.random.default_rng(i).bytes(P) for i in range(80)]  # incompressible
    s = make_store(host_bytes=32 * 1024, disk_bytes=96 * 1024, remote_url=redis_server.url,
                   remote_bytes=1 << 20)
    for i, page in enumerate(pages):
        s.put(name_of(i), page)
    s.flush()
    assert s.stats().tier(TierKind.DISK).evictions > 0
    out = bytearray(P)
    assert s.get_into(name_of(0), out) == P and bytes(out) == pages[0]
    assert s.get_into(name_of(999), out) is None
    assert not [n for n in s.health().notes if n.startswith("remote")]
    st = s.stats()  # the remote answer is a hit of the store, a miss of every local tier
    assert (st.gets, st.hits, st.misses, st.remote_hits) == (2, 1, 1, 1)
    assert_counters_agree(st)


def test_remote_store_without_redis_serves_locally_and_says_so(
        make_store: MakeStore) -> None:
    from kvbank.testing.servers import free_port

    s = make_store(host_bytes=32 * 1024, disk_bytes=96 * 1024,
                   remote_url=f"redis://127.0.0.1:{free_port()}/0", remote_bytes=1 << 20)
    s.put(name_of(1), page_of(1, 4096))
    out = bytearray(4096)
    assert s.get_into(name_of(1), out) == 4096
    assert any(n.startswith("remote tier off") for n in s.health().notes)


def test_remote_every_entry_point_of_an_unreachable_tier_raises_only_kvbank_errors() -> None:
    """Every public method of the remote tier (listed by introspection) over a Redis that
    went away: a KvbankError, a miss or an answer; never redis' own exception."""
    import inspect

    from kvbank.errors import KvbankError

    server = RedisServer.start()
    c = connect(server.url, retries=0)
    fs = RedisFrameStore(c, 1 << 20, namespace=b"gone-all:")
    _write(fs, 0)
    frame = fs.frame(page_of(1, 4096), "uint8")
    server.stop()
    calls = {
        "check": fs.check,
        "contains_many": lambda: fs.contains_many([name_of(0)]),
        "delete_many": lambda: fs.delete_many([name_of(0)]),
        "drop_corrupt": lambda: fs.drop_corrupt(name_of(0)),
        "frame": lambda: fs.frame(page_of(2, 4096), "uint8"),
        "frame_key": lambda: fs.frame_key(name_of(0)),
        "headroom": fs.headroom,
        "health": fs.health,
        "names": fs.names,
        "read_frame": lambda: fs.read_frame(name_of(0)),
        "read_into": lambda: fs.read_into(name_of(0), bytearray(4096)),
        "scan": lambda: list(fs.scan()),
        "write_frame": lambda: fs.write_frame(name_of(1), frame, raw_len=4096, dtype="uint8"),
        "write_frames": lambda: fs.write_frames([FrameWrite(name_of(1), frame, 4096, "uint8")]),
        "close": fs.close,
    }
    public = {n for n in dir(RedisFrameStore) if not n.startswith("_")
              and inspect.isfunction(inspect.getattr_static(RedisFrameStore, n))}
    assert set(calls) == public
    leaked, raised = [], []
    try:
        for name, call in calls.items():
            try:
                call()
            except KvbankError:
                raised.append(name)
            except Exception as exc:  # the leak this test exists to catch
                leaked.append(f"{name}: {type(exc).__module__}.{type(exc).__name__}: {exc}")
    finally:
        fs.close()
        c.close()
    assert not leaked, leaked
    assert {"read_frame", "write_frame"} <= set(raised), raised


def test_remote_rows_are_recalled_for_a_match_and_fetch_bit_exact(
        tmp_path, redis_server: RedisServer, client: redis.Redis) -> None:
    """A prompt pushed out of the local tiers into the remote tier by a later prompt:
    its match stops short (a match never asks Redis); ``recall_remote`` reads those rows
    back, checksums verified, and stores them here in chain order, so the next match
    covers the prompt again and a fetch returns its exact bytes."""
    from kvbank import Bank, full_attention

    client.flushall()
    layout = full_attention("remote-recall@1", num_layers=1, num_kv_heads=1, head_dim=64,
                            dtype="float16")
    page = layout.group_page_bytes[0]
    assert page == 4096
    rng = np.random.default_rng(3)
    a = torch.from_numpy(rng.integers(0, 256, (20, page), dtype=np.uint8))
    b = torch.from_numpy(rng.integers(0, 256, (30, page), dtype=np.uint8))
    ta, tb = list(range(20 * 16)), list(range(10_000, 10_000 + 30 * 16))
    with Bank.open(data_dir=tmp_path, host_bytes=32 * 1024, disk_bytes=96 * 1024,
                   device_bytes=0, remote_url=redis_server.url, remote_bytes=1 << 20) as bank:
        lid = bank.register(layout)
        bank.put(lid, ta, group=0, pages=a)
        bank.put(lid, tb, group=0, pages=b)  # a's rows leave for the remote tier
        bank.flush()
        before = bank.match(lid, [*ta, 1])
        assert before.resume.tokens < 20 * 16
        assert bank.fleet.recall_remote(before) > 0
        after = bank.match(lid, [*ta, 1])
        assert after.resume.tokens == 20 * 16
        out = torch.zeros((20, page), dtype=torch.uint8)
        got = bank.fetch(after, out={0: out})
        assert got.complete and torch.equal(out, a)
        assert bank.fleet.recall_remote(after) == 0  # nothing missing: no lookup, nothing stored
        bank.check_invariants()  # raises naming the first broken invariant
