"""Session fixtures shared by every test folder."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbank.testing.servers import INSTALL_HINT, RedisServer, in_ci, redis_binary


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server on a free loopback port, stopped by pid at the end.

    Skips with an install hint where the binary is missing, but fails under CI=true.
    """
    if redis_binary() is None:
        if in_ci():
            pytest.fail("CI=true but " + INSTALL_HINT)
        pytest.skip(INSTALL_HINT)
    server = RedisServer.start()
    try:
        yield server
    finally:
        server.stop()
