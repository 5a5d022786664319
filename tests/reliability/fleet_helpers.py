"""What the fleet and soak reliability tests share: Redis must be there (a failure, not a
skip, under CI=true), and the fleet tests' own helpers, reused rather than copied."""

from __future__ import annotations

import pytest

from kvbank.testing.servers import INSTALL_HINT, in_ci, redis_binary
from tests.service.fleet.test_fleet import Redis, fleet, health, wait_for

__all__ = ["Redis", "fleet", "health", "require_redis", "wait_for"]


def require_redis() -> None:
    """Skip where redis-server is missing, with the install hint; fail under CI=true."""
    if redis_binary() is None:
        if in_ci():
            pytest.fail("CI=true but " + INSTALL_HINT)
        pytest.skip(INSTALL_HINT)
