"""The node's promises across a SIGKILL and a restart (served-node review D2, D3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbank.bench.reliability_node import client_restart, crash_puts_partial

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


def test_long_lived_clients_carry_on_after_a_node_restart(tmp_path: Path) -> None:
    """Regression (review D3): a restarted node listens on a new data port, and a
    ``Client`` read the port once: with ``data_plane=True`` every transfer then failed
    with ``DataPortUnreachable``, and a default client fell back to HTTP for good. Now a
    refused data port makes the client read ``/v1/node`` again."""
    res = client_restart(tmp_path, rounds=1, transfers=3)
    print(res)
    assert res.failed == 0, f"{res.failed} of {res.transfers} transfers failed after the restart"
    assert res.wrong == 0
    assert res.auto_on_data_port, "the default client gave the data port up after the restart"
