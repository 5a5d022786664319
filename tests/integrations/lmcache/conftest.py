"""Fixtures for the LMCache adapter tests: a real ``kvbank serve`` node, LMCache's own pieces.

The tests need LMCache in their venv; without it every test here skips with the recipe
below (``KVBANK_REQUIRE_LMCACHE=1``, as ``.ci/lmcache`` sets, turns the skip into a failure).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import select
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

LMCACHE_HINT = ("LMCache is not installed in this venv. Set it up with .ci/lmcache (or: python3 -m "
                "venv /work/lmcache-venv && /work/lmcache-venv/bin/pip install 'torch==2.13.0' "
                "'lmcache==0.5.6' && /work/lmcache-venv/bin/pip install --no-deps -e . && "
                "/work/lmcache-venv/bin/pip install numpy lmdb zstandard xxhash 'redis[hiredis]' "
                "'uvicorn[standard]' fastapi prometheus-client httpx nvidia-ml-py tqdm pytest "
                "pytest-timeout), then run pytest tests/integrations/lmcache with that venv's python")
HAVE_LMCACHE = importlib.util.find_spec("lmcache") is not None


def require_lmcache() -> None:
    """Skip (or, under KVBANK_REQUIRE_LMCACHE=1, fail) when LMCache is missing."""
    if HAVE_LMCACHE:
        # LMCache's and its cloud clients' import-time warnings are theirs, not ours: import
        # what the tests use once with them silenced (pytest runs with warnings as errors)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for mod in ("lmcache.v1.distributed.storage_manager", "lmcache.v1.distributed.config",
                        "lmcache.v1.distributed.l2_adapters", "kvbank.integrations.lmcache"):
                importlib.import_module(mod)
        return
    if os.environ.get("KVBANK_REQUIRE_LMCACHE") == "1":
        pytest.fail(LMCACHE_HINT)
    pytest.skip(LMCACHE_HINT, allow_module_level=True)


def plugin_spec(url: str, **params: Any) -> str:
    """The ``--l2-adapter`` JSON that loads kvbank's adapter against ``url``."""
    return json.dumps({"type": "plugin", "module_path": "kvbank.integrations.lmcache",
                       "class_name": "KvbankL2Adapter", "adapter_params": {"url": url, **params}})


def wait_fd(fd: int, timeout_s: float = 60.0) -> None:
    """Block until an adapter's event fd fires, then consume it."""
    from lmcache.v1.platform import consume_fd

    poll = select.poll()
    poll.register(fd, select.POLLIN)
    if not poll.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"event fd {fd} did not fire in {timeout_s} s")
    with contextlib.suppress(BlockingIOError):
        consume_fd(fd)


class Driver:
    """Runs an L2 adapter's tasks to completion the way LMCache's controllers do."""

    def __init__(self, adapter: Any) -> None:
        self.a = adapter

    def store(self, keys: list[Any], objs: list[Any]) -> bool:
        task = self.a.submit_store_task(keys, objs)
        while True:
            wait_fd(self.a.get_store_event_fd())
            done = self.a.pop_completed_store_tasks()
            if task in done:
                return bool(done[task].is_successful())

    def lookup(self, keys: list[Any], descs: dict[int, Any]) -> list[bool]:
        task = self.a.submit_lookup_and_lock_task(keys, descs)
        while True:
            wait_fd(self.a.get_lookup_and_lock_event_fd())
            bits = self.a.query_lookup_and_lock_result(task)
            if bits is not None:
                return [bits.test(i) for i in range(len(keys))]

    def load(self, keys: list[Any], objs: list[Any]) -> list[bool]:
        task = self.a.submit_load_task(keys, objs)
        while True:
            wait_fd(self.a.get_load_event_fd())
            bits = self.a.query_load_result(task)
            if bits is not None:
                return [bits.test(i) for i in range(len(keys))]


def _start(tmp: Any) -> Any:
    from kvbank.service.launch import NodeProcess

    return NodeProcess.start(["--data-dir", str(tmp), "--host-bytes", "256M", "--disk-bytes", "512M",
                              "--device-bytes", "0"], env={**os.environ, "KVBANK_DISK_SYNC": "0"})


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A ``kvbank serve`` on a free loopback port for the module's tests, stopped by pid."""
    require_lmcache()
    n = _start(tmp_path_factory.mktemp("node"))
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture
def own_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A node of the test's own, for a test that kills it."""
    require_lmcache()
    n = _start(tmp_path_factory.mktemp("own-node"))
    try:
        yield n
    finally:
        if n.proc.poll() is None:
            n.stop()
