"""A node's publishing follows the bank's change feed (a real Bank and a real redis-server,
no thread: the test drives the beats): a full republish only on (re)join, TTLs refreshed
from the node's own list; and the bank's fleet calls (``bank.fleet``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from kvbank import Bank, full_attention
from kvbank.errors import InvalidInput
from kvbank.service.fleet.fleet import Fleet
from kvbank.testing.servers import RedisServer
from kvbank.tiers.redis_client import connect

LAYOUT = full_attention("fleet-feed@1", num_layers=1, num_kv_heads=2, head_dim=64)
PAGE = LAYOUT.group_page_bytes[0]
P = 16


@pytest.fixture
def bank(tmp_path: Path) -> Iterator[Bank]:
    with Bank.open(host_bytes="64M", device_bytes=0, data_dir=tmp_path, disk_bytes="64M") as b:
        yield b


def _pages(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, PAGE), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_fleet_follows_the_feed_and_republishes_only_on_join(
        bank: Bank, redis_server: RedisServer) -> None:
    c = connect(redis_server.url)
    assert isinstance(c, redis.Redis)
    lid = bank.register(LAYOUT)
    bank.put(lid, list(range(4 * P)), group=0, pages=_pages(4, 1))
    fl = Fleet(bank, c, name="feed-a", address="http://127.0.0.1:1", heartbeat_s=1.0,
               entry_ttl_s=8.0, namespace=b"feed1:")
    try:
        bank.admin.take_events(0)  # what start() does, without the thread
        fl.step()  # the join: one full republish of what is there
        assert fl.republishes == 1 and fl.health()["published"] == 4
        names = bank.row_names(lid, list(range(8 * P)), group=0)
        bank.put(lid, list(range(8 * P)), group=0, pages=_pages(8, 1)[4:], first_page=4)
        fl.step()
        assert fl.republishes == 1  # followed from the feed, no rescan
        assert fl.index.holders(names) == [(fl.node_id,)] * 8
        bank.admin.evict(names[6:])
        fl.step()
        assert fl.republishes == 1
        assert fl.index.holders(names) == [(fl.node_id,)] * 6 + [()] * 2
        # TTLs: every beat refreshes a slice (here ttl/4 = 2 beats: half the rows a beat)
        key = fl.index.entry_key(names[0])
        c.pexpire(key, 100)
        c.pexpire(fl.index.entry_key(names[5]), 100)
        fl.step()
        fl.step()
        assert c.pttl(key) > 1000 and c.pttl(fl.index.entry_key(names[5])) > 1000
        assert fl.republishes == 1
        c.flushall()  # Redis lost everything: the next beat re-registers and republishes
        fl.step()
        assert fl.republishes == 2 and fl.index.holders(names[:6]) == [(fl.node_id,)] * 6
    finally:
        fl.close()


def test_bank_fleet_held_names_put_rows_and_as_if_held(bank: Bank) -> None:
    lid = bank.register(LAYOUT)
    toks = list(range(6 * P))
    names = bank.row_names(lid, toks, group=0)
    data = _pages(6, 2)
    assert bank.fleet.put_rows(lid, [(n, data[i].numpy().data) for i, n in enumerate(names[:3])]) == 3
    assert bank.fleet.put_rows(lid, [(names[0], data[0].numpy().data)]) == 0  # stored: skipped
    got = [n for page in bank.fleet.held_names(page=2) for n in page]
    assert sorted(got) == sorted(names[:3])
    out = bytearray(PAGE)
    assert bank.get_into(names[2], out) == PAGE and bytes(out) == data[2].numpy().tobytes()
    m = bank.match(lid, [*toks, 1])
    assert m.resume.tokens == 3 * P
    assume = bank.fleet.as_if_held(m)
    assert assume.resume.tokens == 6 * P and list(assume.needed) == names
    with pytest.raises(InvalidInput):
        bank.fleet.put_rows(lid, [(b"short", data[0].numpy().data)])
    with pytest.raises(InvalidInput):
        list(bank.fleet.held_names(page=0))
