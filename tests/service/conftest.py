"""A real ``kvbank serve`` subprocess on a free loopback port, stopped by pid."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbank.service.launch import NodeProcess

NODE_ARGS = ["--host-bytes", "96M", "--disk-bytes", "512M", "--device-bytes", "0",
             "--max-body-bytes", "64M", "--body-timeout-s", "5"]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node per test module (starting one costs seconds: torch loads)."""
    data = tmp_path_factory.mktemp("node")
    proc = NodeProcess.start(["--data-dir", str(data), *NODE_ARGS])
    try:
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, "".join(proc.lines)[-3000:]


def start_node(data: Path, *extra: str) -> NodeProcess:
    return NodeProcess.start(["--data-dir", str(data), *NODE_ARGS, *extra])


def admin_headers(node: NodeProcess) -> dict[str, str]:
    """The admin bearer header of a node started without a token: the ready line names
    the generated token's file."""
    m = re.search(r"admin token in (\S+)", "".join(node.lines))
    assert m is not None, "".join(node.lines)[-2000:]
    token = Path(m.group(1).rstrip(",;)")).read_text().strip()
    return {"Authorization": f"Bearer {token}"}
