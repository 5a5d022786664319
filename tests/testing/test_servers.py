"""The test infrastructure itself: a private redis-server, started and stopped by pid."""

from __future__ import annotations

import os

import pytest
import redis

from kvbank.testing.servers import MissingBinary, RedisServer, free_port, in_ci


def test_redis_server_fixture_serves_and_is_private(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.set(b"kvbank-probe", b"x" * 1024)
        assert client.get(b"kvbank-probe") == b"x" * 1024
        assert redis_server.port != 6379  # never the machine's shared instance
        assert client.config_get("save")["save"] == ""  # nothing persisted
    finally:
        client.close()


def test_redis_server_stop_ends_the_process() -> None:
    try:
        server = RedisServer.start()
    except MissingBinary as exc:
        if in_ci():
            raise
        pytest.skip(str(exc))
    pid = server.pid
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not server.workdir.exists()


def test_free_port_is_bindable_on_loopback() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
