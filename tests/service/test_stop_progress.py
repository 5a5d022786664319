"""A ``kvbank serve`` whose stop takes more than a second says on stderr what it waits for."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

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


@pytest.mark.timeout(60)  # a hang bound: the bug this guards against was a deadlock
def test_a_second_signal_during_the_stop_does_not_deadlock_it() -> None:
    """A second SIGTERM or SIGINT runs the server's exit handler, and so the stop notice's
    ``start``, in the main thread while it is already inside ``start`` or ``now`` (a node
    killed twice in a row, or by its starter's death and then by a supervisor). With a
    plain lock that call deadlocked, and the node ignored every later signal but SIGKILL."""
    import io

    from kvbank.service.server import _Stopping

    stopping = _Stopping(io.StringIO())
    with stopping._lock:  # as the main thread holds it inside start() or now()
        stopping.start("the server to stop")  # the nested call a signal handler makes
        stopping.now("the bank to close")
    stopping.start()  # idempotent
    stopping.stop()


def test_two_sigterms_in_a_row_stop_the_node(tmp_path: Path) -> None:
    """The same end to end: two SIGTERMs sent back to back, and the node exits 0."""
    import os
    import signal

    node = start_node(tmp_path / "node")
    try:
        os.kill(node.pid, signal.SIGTERM)
        os.kill(node.pid, signal.SIGTERM)
        assert node.proc.wait(120) == 0, "".join(node.lines)[-2000:]
    finally:
        node.kill()
