"""kvbank.service.sockets.listen: one way to bind the node's ports, refused by name."""

from __future__ import annotations

import socket

import pytest

from kvbank.errors import ConfigError
from kvbank.service.sockets import listen


def test_listen_binds_a_free_port_and_accepts() -> None:
    sock = listen("127.0.0.1", 0, field="port", backlog=4)
    try:
        port = sock.getsockname()[1]
        assert port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            conn, _ = sock.accept()
            conn.close()
    finally:
        sock.close()


def test_a_taken_port_is_a_config_error_naming_the_setting() -> None:
    taken = listen("127.0.0.1", 0, field="port", backlog=4)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"data_port: cannot bind 127.0.0.1:{port}") as info:
            listen("127.0.0.1", port, field="data_port", backlog=4)
        assert info.value.field == "data_port"
    finally:
        taken.close()
