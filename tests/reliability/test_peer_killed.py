"""The holder node SIGKILLed while it streams rows to a fetching peer."""

from __future__ import annotations

from kvbank.bench.reliability_fleet import peer_killed

from .fleet_helpers import require_redis


def test_peer_killed_mid_stream_leaves_only_whole_bit_exact_rows() -> None:
    """Node B matches a prompt only the holder has; the holder is SIGKILLed once it has
    written 20-80 % of the rows' bytes to its sockets. Afterwards B's bound is whole pages,
    every row B counts present (fetched inside the bound, leased past it) is bit-exact, a
    second match does not shrink what the first one counted, and nothing partial is
    "loaded". Round 0 (no kill) checks the same on a whole peer fetch."""
    require_redis()
    got = peer_killed(rounds=2, pages=32, kill_share=(0.2, 0.8))
    assert got.rounds == 2
    assert got.mid >= 1, got  # at least one kill landed while the rows were streaming
    assert got.ragged == 0
    assert got.bad_rows == 0
    assert got.wrong_bytes == 0
