"""What ``kvbank serve`` says at start, as a new operator reads it: a fleet whose Redis
does not answer is in the health and the ready line, a host tier too small for the data
port is said, a CPU machine starts without a device warning, --no-reserve-host turns the
up-front claim off, and a bad remote tier URL names its own setting."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import httpx
import pytest

from kvbank import Bank
from kvbank.errors import InvalidInput
from kvbank.service.launch import NodeProcess
from kvbank.testing.servers import free_port

from .conftest import admin_headers, start_node


def _health(node: NodeProcess) -> dict[str, object]:
    got = httpx.get(node.url + "/admin/health", headers=admin_headers(node), timeout=10)
    assert got.status_code == 200, got.text
    return dict(got.json())


def test_a_fleet_whose_redis_does_not_answer_is_in_health_and_the_ready_line(tmp_path: Path) -> None:
    """W3: with nothing listening at --redis, the node said ready and healthy, with no
    degraded reason and no word of the fleet in its ready line."""
    port = free_port()  # nothing listens there
    node = start_node(tmp_path, "--redis", f"redis://:secret@127.0.0.1:{port}/0")
    try:
        ready = next(line for line in node.lines if "ready on" in line)
        assert f"fleet through Redis redis://127.0.0.1:{port}" in ready and "secret" not in ready
        degraded = _health(node)["degraded"]
        assert isinstance(degraded, list) and any(str(r).startswith("fleet: ") for r in degraded), degraded
        assert not any(str(r).startswith("fleet: fleet") for r in degraded), degraded  # said once
    finally:
        assert node.stop() == 0


def test_a_cpu_start_is_quiet_and_a_host_tier_without_a_data_port_is_said(tmp_path: Path) -> None:
    """W20: every CPU start warned "device tier off" though no device was asked for.
    W6: ``--host-bytes 1`` switched the data port off without a word."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a machine with a GPU: the device tier is on")
    node = NodeProcess.start(["--data-dir", str(tmp_path), "--host-bytes", "1", "--disk-bytes", "64M",
                              "--no-reserve-host"])
    try:
        text = "".join(node.lines)
        assert not re.search(r"WARNING \S+: device tier off", text), text[-2000:]
        assert re.search(r"WARNING \S+: data port off: the host tier \(1 B\)", text), text[-2000:]
        assert "data port off" in next(line for line in node.lines if "ready on" in line)
    finally:
        assert node.stop() == 0


def test_reserve_host_flag_turns_the_up_front_claim_on_and_off(tmp_path: Path) -> None:
    """The host budget's up-front claim had no flag (only KVBANK_RESERVE_HOST or TOML)."""
    from kvbank.cli import main

    for flag, want in (("--no-reserve-host", "false"), ("--reserve-host", "true")):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["serve", "--data-dir", str(tmp_path), "--print-config", flag]) == 0
        assert f"reserve_host = {want}" in buf.getvalue()
    node = start_node(tmp_path / "node", "--no-reserve-host")
    try:
        info = httpx.get(node.url + "/v1/node", timeout=10).json()
        assert info["host"]["resident"] is False
    finally:
        assert node.stop() == 0


def test_a_bad_remote_url_names_remote_url(tmp_path: Path) -> None:
    """W4: ``--remote-url ::::`` was refused as ``redis_cluster: expected HOST:PORT``."""
    pytest.importorskip("redis")
    with pytest.raises(InvalidInput, match=r"^remote_url: expected HOST:PORT") as e:
        Bank.open(data_dir=tmp_path, host_bytes="8M", disk_bytes="64M", device_bytes=0,
                  remote_url="::::", remote_bytes="16M")
    assert e.value.field == "remote_url"


def test_a_fleet_error_is_named_fleet_once_in_health() -> None:
    """Health said ``fleet: fleet: registering: Error 111 …``: the fleet's own errors
    already begin with the word."""
    from types import SimpleNamespace

    from kvbank.service.fleet.fleet import health_reasons

    def reasons(error: str | None, degraded: bool = True) -> list[str]:
        return health_reasons(SimpleNamespace(degraded=degraded, last_error=error))  # type: ignore[arg-type]

    assert reasons("fleet: registering: Error 111 connecting") == ["fleet: registering: Error 111 connecting"]
    assert reasons("Error 111 connecting") == ["fleet: Error 111 connecting"]
    assert reasons(None) == ["fleet: not registered yet"]
    assert reasons("fleet: x", degraded=False) == []


STARTER = """
import sys, threading
from kvbank.service.launch import NodeProcess
data_dir, where = sys.argv[1], sys.argv[2]
got = []
if where == "main":
    got.append(NodeProcess.start(["--data-dir", data_dir + "/main", "--host-bytes", "16M", "--disk-bytes", "0",
                                   "--device-bytes", "0"]))
else:
    t = threading.Thread(target=lambda: got.append(NodeProcess.start(
        ["--data-dir", data_dir + "/thread", "--host-bytes", "16M", "--disk-bytes", "0", "--device-bytes", "0"])))
    t.start()
    t.join()
print(got[0].pid, flush=True)
sys.stdin.read()  # until killed
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_node_started_by_a_process_ends_when_that_process_is_killed(tmp_path: Path) -> None:
    """A test or bench killed on its hang guard left the nodes it started running (one held
    3 GB). A node that NodeProcess.start launched from the main thread now stops when its
    starter ends, SIGKILL included; one launched from another thread (which may end before
    the process: the kernel's signal follows the thread) is not tied, and is stopped here."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pids = {}
    for where in ("main", "thread"):
        with subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path), where], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()}) as starter:
            assert starter.stdout is not None
            pids[where] = int(starter.stdout.readline())
            assert _alive(pids[where])
            starter.kill()
            starter.wait(30)
    try:
        for _ in range(600):  # a hang bound: the node's stop takes a moment
            if not _alive(pids["main"]):
                break
            time.sleep(0.1)
        assert not _alive(pids["main"]), "the node outlived the process that started it"
        assert _alive(pids["thread"])
    finally:
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGTERM)
