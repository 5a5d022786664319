"""A short soak: client processes on both paths against one node under constant eviction."""

from __future__ import annotations

from kvbank.bench.soak import soak

from .fleet_helpers import require_redis

OPS = 100  # operations per client process
# prompt families (1 MiB each) stored first: more than the 48 MiB host and 64 MiB disk
# budgets hold with the disk's frames compressed (~76 MiB of these pages: ~800 evictions)
FILL = 128


def test_soak_mixed_clients_see_no_errors_no_wrong_bytes_and_a_clean_check() -> None:
    """Three client processes x 100 operations of put / match / fetch / lend over shared
    memory and TCP against one ``kvbank serve`` with 48 MiB host and 64 MiB disk budgets,
    after 128 MiB of prompts stored first (a count, not a span of time: the node has
    demoted and evicted whatever the machine's load, and every later put evicts again):
    no operation raises anything but a typed refusal; every fetched or leased page equals
    what its writer put; the node's invariant check is clean; it exits 0; its memory
    stays near its budget (a leak bound, looser than the benchmark's 1.1 goal)."""
    got = soak(clients=3, ops=OPS, fill=FILL)
    assert got.errors == 0, (dict(got.tally), got.first)
    assert got.wrong_bytes == 0 and got.tally["wrong_pages"] == 0
    assert got.problems == []
    assert got.exit_code == 0
    assert all(got.lat[op] for op in ("put", "match", "fetch", "lend")), dict(got.tally)
    assert got.demotions > 0 and got.evictions > 0
    assert got.peak_shm > 0 and got.idle_rss > 0
    assert got.rss_ratio <= 1.25, (got.peak_private, got.peak_shm, got.budget)


def test_soak_fleet_peer_fetches_under_eviction_and_redis_kills_stay_bit_exact() -> None:
    """The same mix on two nodes sharing a redis-server, each operation on either node:
    reads of rows the other node stored go through the index and a peer fetch while both
    nodes evict, and the Redis is SIGKILLed and restarted empty twice, between rounds of
    operations (counts, not spans of time: the old 10 s run failed under load when too
    few puts landed to make an eviction). No errors, every page bit-exact, both
    invariant checks clean."""
    require_redis()
    got = soak(clients=3, ops=OPS, fill=FILL, fleet=True, flaps=2)
    assert got.flaps == 2
    assert got.errors == 0, (dict(got.tally), got.first)
    assert got.wrong_bytes == 0 and got.tally["wrong_pages"] == 0
    assert got.problems == []
    assert got.exit_code == 0
    assert got.peer_rows > 0 and got.evictions > 0
