"""A ``kvbank serve`` whose stop takes more than a second says on stderr what it waits for."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from tests.service.conftest import admin_headers, start_node


def test_a_slow_stop_says_what_it_waits_for(tmp_path: Path) -> None:
    """A put whose body stalls holds the stop for the shutdown timeout (2 s): past a
    second the node names the request in flight; it still exits 0."""
    node = start_node(tmp_path / "node", "--shutdown-timeout-s", "2")
    try:
        u = urlsplit(node.url)
        stalled = socket.create_connection((u.hostname, u.port))
        stalled.sendall(b"POST /v1/put HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                        b"Content-Length: 100000\r\n\r\n")  # and no byte of the body
        headers = admin_headers(node)
        give_up = time.monotonic() + 60  # the request is in flight once the gate counts it
        while httpx.get(node.url + "/admin/health", headers=headers).json()["in_flight"] != 1:
            assert time.monotonic() < give_up, "the stalled request never counted as in flight"
            time.sleep(0.05)
        try:
            assert node.stop() == 0
        finally:
            stalled.close()
    finally:
        node.kill()
    said = [line for line in node.lines if line.startswith("kvbank serve: stopping")]
    assert said and "waiting for 1 requests in flight to finish (at most 2 s)" in said[0], "".join(node.lines)[-2000:]
