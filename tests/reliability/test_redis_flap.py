"""Redis SIGKILLed under a node serving fetches, then restarted empty on the same port:
local serving never fails, and the node comes back into the index."""

from __future__ import annotations

from kvbank.bench.reliability_fleet import redis_flap

from .fleet_helpers import require_redis


def test_redis_flap_local_fetches_never_fail_and_the_node_republishes() -> None:
    """Two real nodes on a real redis-server; Redis is SIGKILLed while a thread matches and
    fetches a stored prompt on node A over both paths (every match also asks the index
    about a missing page). Every local fetch during the outage is whole and bit-exact; once
    Redis is back, A's registration, heartbeat and every row's index entry are in Redis
    again, and node B fetches A's rows through the fleet bit-exactly. The rejoin time is
    the benchmark's figure; here only that it happened (within the helper's 60 s bound)."""
    require_redis()
    got = redis_flap(rounds=1, outage_s=1.0)
    assert got.failed == 0, got.errors
    assert got.outage_fetches >= 2 and got.fetches > got.outage_fetches
    assert got.wrong_bytes == 0
    assert len(got.rejoin_s) == 1
    assert got.peer_after


def test_redis_frozen_local_fetches_never_fail_and_the_node_resumes() -> None:
    """Redis SIGSTOPped (its connections stay open and nothing answers: a partition or a
    stalled server, not a refused connection) while node A serves fetches; every local
    fetch is whole and bit-exact throughout, and after SIGCONT A's entries are all there
    and node B fetches A's rows through the fleet."""
    require_redis()
    got = redis_flap(rounds=1, outage_s=2.0, freeze=True)
    assert got.failed == 0, got.errors
    assert got.outage_fetches >= 2
    assert got.wrong_bytes == 0
    assert got.peer_after
