"""A borrower process holding HOST leases on a served node is SIGKILLed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbank.bench.reliability_procs import lease_holder_killed
from kvbank.bench.reliability_worker import HOLD_PAGES

pytestmark = pytest.mark.slow


def test_sigkilled_borrowers_rows_unlock_once_its_lease_expires(tmp_path: Path) -> None:
    """The dead borrower's rows stay locked until its lease runs out, never before, and
    then the reaper unlocks them and counts the lease expired. A row still locked two
    minutes past the TTL fails inside the scenario (a hang bound; the bench measures
    the delay)."""
    rounds = lease_holder_killed(tmp_path, rounds=2, ttl_s=5.0)
    for r in rounds:
        assert r.locked_after_kill == HOLD_PAGES, r
        assert r.past_expiry_s >= 0, f"rows unlocked {-r.past_expiry_s:.2f} s before the expiry"
        assert r.expired == 1, r
    print("unlocked past the expiry (s):", [round(r.past_expiry_s, 3) for r in rounds])
