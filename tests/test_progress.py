"""Progress of long work on a terminal (kvbank.progress): bars on stderr only when the
command line asked for them and stderr is a terminal; the write-back at close, a salvage
and a bench suite each draw theirs."""

from __future__ import annotations

import fcntl
import importlib
import io
import os
import struct
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvbank import Bank, full_attention, progress
from kvbank.bench.common import BenchRow, row
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.disk import DiskTier
from kvbank.tiers.diskfile import salvage

cli = importlib.import_module("kvbank.cli.main")  # the module (kvbank.cli.main is also its function's name)


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], str]]:
    """Call it to put stderr on a pseudo-terminal (in the test's body: pytest's capture
    sets sys.stderr again as the test starts), bars on and drawn at once; it answers what
    the terminal got so far."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal's size
    err = os.fdopen(slave, "w", buffering=1)
    got: list[bytes] = []

    def drain() -> None:  # keep the pty's buffer from filling (a full one blocks the writer)
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            got.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "REDRAW_S", 0.0)
    monkeypatch.delenv("KVBANK_PROGRESS", raising=False)
    progress.enable(True)

    def seen() -> str:
        if sys.stderr is not err:
            monkeypatch.setattr(sys, "stderr", err)
            return ""
        # A mark after everything written so far: the reader has all of it once the mark
        # arrives (the terminal keeps the order), however long the reader was held off.
        mark = f"<end of output {len(got)}-{time.monotonic_ns()}>"
        err.write(mark)
        err.flush()
        give_up = time.monotonic() + 60  # a hang bound only
        while mark.encode() not in b"".join(got):
            assert time.monotonic() < give_up, "the terminal's reader never got the output"
            time.sleep(0.01)
        return b"".join(got).decode(errors="replace").replace(mark, "")

    try:
        yield seen
    finally:
        progress.enable(False)
        err.close()
        reader.join(5)
        os.close(master)


def test_progress_draws_nothing_unless_asked_for_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """An embedding program never gets a bar; the command line gets one only on a terminal,
    and KVBANK_PROGRESS=0 turns it off."""
    assert isinstance(progress.bar(10, "x"), progress.Quiet)
    progress.enable(True)
    try:
        monkeypatch.setattr(sys, "stderr", io.StringIO())
        assert isinstance(progress.bar(10, "x"), progress.Quiet)
        master, slave = os.openpty()
        with os.fdopen(slave, "w") as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            assert not isinstance(progress.bar(10, "x"), progress.Quiet)
            monkeypatch.setenv("KVBANK_PROGRESS", "0")
            assert isinstance(progress.bar(10, "x"), progress.Quiet)
        os.close(master)
    finally:
        progress.enable(False)


def test_write_back_at_close_draws_its_bar(terminal: Callable[[], str], tmp_path: Path) -> None:
    terminal()
    layout = full_attention("progress@1", num_layers=1, num_kv_heads=2, head_dim=64)
    with Bank.open(host_bytes="16M", device_bytes=0, disk_bytes="64M", data_dir=tmp_path) as bank:
        lid = bank.register(layout)
        bank.put(lid, list(range(40 * 16)), group=0,
                 pages=torch.zeros((40, layout.group_page_bytes[0]), dtype=torch.uint8))
    out = terminal()
    assert "writing memory rows to disk" in out and "/40" in out, out[-500:]


def test_salvage_draws_its_bar(terminal: Callable[[], str], tmp_path: Path) -> None:
    terminal()
    # frames as LMDB values (the older layout): the walk knows its total from the start
    tier = DiskTier(tmp_path, 64 << 20, sync=False, segments=False)
    for i in range(30):
        tier.put(name_of(i), page_of(i, 512))
    tier.close()

    def keep(name: bytes, frame: bytes | None, meta: bytes | None) -> tuple[bytes, bytes | None]:
        assert meta is not None  # a whole environment: every row has its meta record
        return meta, frame

    report = salvage(tmp_path / "lmdb", "a test", keep, map_size=64 << 20)
    assert report.copied == 30
    out = terminal()
    assert "salvaging" in out and "/30" in out, out[-500:]


def run(quick: bool = False) -> Iterator[BenchRow]:
    """A suite of two cases, for the bench command's own test."""
    yield row("fake", "one", "ms", 1.0, "nothing", 1.0)
    yield row("fake", "two", "ms", 2.0, "nothing", 1.0)


@pytest.mark.parametrize("json_rows", [False, True])
def test_bench_draws_a_bar_on_a_terminal_but_not_under_json(terminal: Callable[[], str], json_rows: bool,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    terminal()
    monkeypatch.setitem(cli.SUITES, "fake", __name__)
    monkeypatch.setattr(cli, "BENCH_BAR_AFTER_S", 0.0)
    assert cli.main(["bench", "fake", *(["--json"] if json_rows else [])]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 2 and ('"case": "two"' in rows[1] if json_rows else "two" in rows[1])
    assert ("bench fake" in terminal()) is not json_rows
