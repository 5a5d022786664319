"""The node's promises across a SIGKILL and a restart (served-node review D2, D3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbank.bench.reliability_node import crash_puts_partial

pytestmark = pytest.mark.slow


def test_a_put_in_flight_at_a_sigkill_comes_back_whole_or_absent(tmp_path: Path) -> None:
    """Regression (review D2): a write-through node committed a put's rows one disk
    transaction each, so a SIGKILL mid-commit left a prefix of the prompt stored. Three
    clients (same host, data port, HTTP) put 64-page prompts; the node is killed while
    rows are being committed, twice; every put in flight comes back whole or absent."""
    res = crash_puts_partial(tmp_path, rounds=2, pages=64)
    print(res)
    assert res.restart_failures == 0
    assert res.interrupted > 0, "no put was in flight at a kill"
    assert res.partial == 0, f"{res.partial} of {res.interrupted} puts in flight came back partly stored"
    assert res.lost == 0 and res.wrong == 0
