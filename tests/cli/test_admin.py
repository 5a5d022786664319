"""``kvbank admin …`` against a real served node, its token read from the node's token
file (``--data-dir``): every subcommand answers, in a table and with ``--json``; a wrong
token is exit 1; flush and drain draw their progress on stderr."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvbank import Client, full_attention
from kvbank.cli import main
from kvbank.cli.admin import COMMANDS
from kvbank.service.admin.auth import TOKEN_FILE
from kvbank.service.launch import NodeProcess
from tests.service.conftest import start_node

FA = full_attention("admin-cli@1", num_layers=1, num_kv_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeProcess, Path]]:
    data = tmp_path_factory.mktemp("cli")
    proc = start_node(data)
    try:
        yield proc, data
    finally:
        assert proc.stop() == 0, "".join(proc.lines)[-3000:]


def admin(node: tuple[NodeProcess, Path], *argv: str) -> list[str]:
    proc, data = node
    return ["admin", "--url", proc.url, "--data-dir", str(data), *argv]


def test_ready_line_names_the_token_file_not_the_token(node) -> None:
    proc, data = node
    token = (data / TOKEN_FILE).read_text().strip()
    ready = next(line for line in proc.lines if "ready on" in line)
    assert str(data / TOKEN_FILE) in ready and token not in "".join(proc.lines)


def test_every_subcommand_answers(node, capsys: pytest.CaptureFixture[str]) -> None:
    proc, _ = node
    with Client(proc.url) as c:
        lid = c.register(FA)
        names = c.put(lid, list(range(32)), group=0,
                      pages=torch.zeros((2, FA.group_page_bytes[0]), dtype=torch.uint8))
    hexed = [n.hex() for n in names]
    runs = [("health",), ("stats",), ("tiers",), ("layouts",), ("leases",), ("rows", "--limit", "1"),
            ("pin", *hexed), ("unpin", *hexed), ("evict", hexed[1]), ("flush",), ("drain", "--timeout", "5"),
            ("undrain",), ("check",), ("compact",), ("quarantine",)]
    # fleet needs a node in a fleet: tests/service/fleet/test_fleet.py runs it against one
    assert {r[0] for r in runs} == set(COMMANDS) - {"fleet"}
    for argv in runs:
        assert main(admin(node, *argv)) == 0, argv
        out = capsys.readouterr()
        assert out.out.strip(), argv
        assert main(admin(node, "--json", *argv)) == 0, argv
        doc = json.loads(capsys.readouterr().out)
        assert isinstance(doc, dict)
    assert main(admin(node, "--json", "rows")) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["name"] for r in rows] == [hexed[0]]  # the other was evicted
    assert main(admin(node, "flush")) == 0
    assert "flushed" in capsys.readouterr().err


def test_a_wrong_token_is_exit_1(node, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    proc, _ = node
    monkeypatch.delenv("KVBANK_ADMIN_TOKEN", raising=False)
    assert main(["admin", "--url", proc.url, "--token", "w" * 20, "health"]) == 1
    assert "403" in capsys.readouterr().err
    assert main(["admin", "--url", proc.url, "--data-dir", "/nonexistent-dir", "health"]) == 1
