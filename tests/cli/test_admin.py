"""``kvbank admin …`` against a real served node, its token read from the node's token
file (``--data-dir``): every subcommand answers, in a table and with ``--json``; a wrong
token is exit 1; flush and drain draw their progress on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    runs = [("health",), ("stats",), ("tiers",), ("layouts",), ("leases",), ("fetches",),
            ("rows", "--limit", "1"),
            ("pin", *hexed), ("unpin", *hexed), ("evict", hexed[1]), ("flush",), ("drain", "--timeout", "5"),
            ("undrain",), ("check",), ("compact",), ("quarantine",)]
    # fleet needs a node in a fleet: tests/service/fleet/test_fleet.py runs it against one
    # unregister: test_unregister_forgets_a_layout_without_rows
    assert {r[0] for r in runs} == set(COMMANDS) - {"fleet", "unregister"}
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
    assert capsys.readouterr().out == "flushed\n"


def test_flush_and_drain_draw_a_bar_on_a_terminal_only(node, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: flush and drain drew their carriage-return bar into whatever stderr
    was (a log file, a pipe, under --json), and every error began with a blank line to
    end a bar that was never drawn. The bar is now drawn on a terminal only."""
    for argv in (("flush",), ("drain", "--timeout", "5"), ("--json", "flush")):
        assert main(admin(node, *argv)) == 0, argv
        got = capsys.readouterr()
        assert got.err == "", (argv, got.err)
    assert main(admin(node, "fleet")) == 1  # this node has no fleet: refused
    assert capsys.readouterr().err.startswith("kvbank admin: 400 InvalidInput: fleet")
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w") as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            assert main(admin(node, "flush")) == 0
            assert main(admin(node, "--json", "flush")) == 0
            monkeypatch.setenv("KVBANK_PROGRESS", "0")
            assert main(admin(node, "flush")) == 0
            tty.write("<end>")
            tty.flush()
            drawn = b""
            while b"<end>" not in drawn:
                drawn += os.read(master, 65536)
    finally:
        os.close(master)
    assert drawn.count(b"100% flushed") == 1, drawn  # once: not under --json, nor turned off
    assert main(admin(node, "undrain")) == 0


def test_a_wrong_token_is_exit_1(node, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    proc, _ = node
    monkeypatch.delenv("KVBANK_ADMIN_TOKEN", raising=False)
    assert main(["admin", "--url", proc.url, "--token", "w" * 20, "health"]) == 1
    assert "403" in capsys.readouterr().err
    assert main(["admin", "--url", proc.url, "--data-dir", "/nonexistent-dir", "health"]) == 1


def test_leases_shows_each_lease_s_row_count(node, capsys: pytest.CaptureFixture[str]) -> None:
    """B2: the rows column counts the lease's rows (it showed 8, the keys of its columnar
    ``rows`` object, for every lease)."""
    proc, _ = node
    with Client(proc.url, same_host=False) as c:
        lid = c.register(FA)
        names = c.put(lid, list(range(500, 500 + 48)), group=0,
                      pages=torch.zeros((3, FA.group_page_bytes[0]), dtype=torch.uint8))
        one, three = c.lend(names[:1], ttl_s=60), c.lend(names, ttl_s=60)
        try:
            assert main(admin(node, "leases")) == 0
            lines = capsys.readouterr().out.splitlines()
            rows = {ln.split()[0]: ln.split()[3] for ln in lines[2:]}
            assert rows[one.id] == "1" and rows[three.id] == "3"
        finally:
            c.release(one.id)
            c.release(three.id)


def test_layout_ids_printed_are_the_ones_rows_takes(node, capsys: pytest.CaptureFixture[str]) -> None:
    """W1: ``layouts`` prints whole ids, and ``rows --layout`` takes one, or a prefix of
    one that names a single layout; an ambiguous prefix is refused by name."""
    proc, _ = node
    with Client(proc.url) as c:
        lid = c.register(FA)
    assert main(admin(node, "layouts")) == 0
    assert lid.hex() in capsys.readouterr().out
    for given in (lid.hex(), lid.hex()[:16]):
        assert main(admin(node, "rows", "--layout", given)) == 0, capsys.readouterr().err
        capsys.readouterr()
    assert main(admin(node, "rows", "--layout", "zz")) == 1
    assert "not of exactly one" in capsys.readouterr().err


def test_json_piped_into_head_ends_quietly(node) -> None:
    """W2: a reader that went away (``| head``) gets no BrokenPipeError traceback: here
    the pipe's read end is closed before the command writes, so every write fails."""
    proc, data = node
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r, w = os.pipe()
    os.close(r)
    try:
        got = subprocess.run([sys.executable, "-m", "kvbank.cli", "admin", "--url", proc.url,
                              "--data-dir", str(data), "--json", "stats"],
                             stdout=w, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    finally:
        os.close(w)
    assert "Traceback" not in got.stderr and "BrokenPipe" not in got.stderr, got.stderr
    assert got.returncode == 0


def test_url_with_a_path_says_the_url_is_the_node_s_root(node, capsys: pytest.CaptureFixture[str]) -> None:
    """W8: ``--url http://HOST:PORT/v1`` is refused saying --url is the node's root."""
    proc, data = node
    assert main(["admin", "--url", proc.url + "/v1", "--data-dir", str(data), "health"]) == 1
    assert "node's root" in capsys.readouterr().err


def test_drain_and_flush_refuse_a_timeout_not_above_zero(node, capsys: pytest.CaptureFixture[str]) -> None:
    """W9: ``drain --timeout -5`` is a usage error and leaves the node undrained."""
    for cmd in ("drain", "flush"):
        for bad in ("-5", "0", "nan"):
            with pytest.raises(SystemExit) as e:
                main(admin(node, cmd, "--timeout", bad))
            assert e.value.code == 2
    assert "positive" in capsys.readouterr().err
    assert main(admin(node, "--json", "health")) == 0
    assert json.loads(capsys.readouterr().out)["draining"] is False


def test_a_token_file_of_another_node_is_named_in_the_refusal(
        node, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """W22: a node refusing the token read from a file (another node's) says which file
    was read and how to give the right one."""
    proc, _ = node
    monkeypatch.delenv("KVBANK_ADMIN_TOKEN", raising=False)
    (tmp_path / TOKEN_FILE).write_text("x" * 43 + "\n")
    assert main(["admin", "--url", proc.url, "--data-dir", str(tmp_path), "health"]) == 1
    err = capsys.readouterr().err
    assert "403" in err and str(tmp_path / TOKEN_FILE) in err and "--token" in err
    # the file named by --data-dir is not called this machine's default (it was said so)
    assert "the --data-dir given" in err and "default" not in err
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cache" / "kvbank").mkdir(parents=True)
    (tmp_path / "cache" / "kvbank" / TOKEN_FILE).write_text("y" * 43 + "\n")
    assert main(["admin", "--url", proc.url, "health"]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "cache" / "kvbank" / TOKEN_FILE) in err and "this machine's default" in err


def test_flush_help_says_what_admin_md_says() -> None:
    """W25: one promise for flush: it waits until the mover is idle."""
    doc = (Path(__file__).parents[2] / "docs" / "admin.md").read_text()
    assert "wait until the mover is idle" in COMMANDS["flush"].help
    assert "wait until the mover is idle" in doc


def test_unregister_forgets_a_layout_without_rows(node, capsys: pytest.CaptureFixture[str]) -> None:
    """W14: ``kvbank admin unregister ID`` (a prefix works): refused while rows remain."""
    proc, _ = node
    gone = full_attention("admin-cli-gone@1", num_layers=1, num_kv_heads=2, head_dim=64)
    with Client(proc.url) as c:
        lid = c.register(gone)
        c.put(lid, list(range(16)), group=0, pages=torch.zeros((1, gone.group_page_bytes[0]), dtype=torch.uint8))
    assert main(admin(node, "unregister", lid.hex()[:12])) == 1
    assert "evict them first" in capsys.readouterr().err
    assert main(admin(node, "evict", "--layout", lid.hex())) == 0
    assert main(admin(node, "unregister", lid.hex()[:12])) == 0
    assert "unregistered" in capsys.readouterr().out
    assert main(admin(node, "layouts")) == 0
    assert lid.hex() not in capsys.readouterr().out
