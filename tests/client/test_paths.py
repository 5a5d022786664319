"""A Client routes a call's page bodies through one page path (``kvbank.client.paths``):
shared memory on the node's host, else the data port where it has one, else the HTTP
stream; a path that answers None sends the call over the stream. No node is needed: the
handlers are replaced by fakes that record what they were asked."""

from __future__ import annotations

from typing import Any

import torch

from kvbank import full_attention
from kvbank.client.client import Client
from kvbank.client.io import Deadline
from kvbank.client.paths import DataPort, PagePath, SharedMemory, Stream
from kvbank.wire.framing import PutKind

LAYOUT = full_attention("paths@1", num_layers=1, num_kv_heads=1, head_dim=8)
PAGE = LAYOUT.group_page_bytes[0]
LID = b"\x01" * 32
URL = "http://127.0.0.1:9"  # nothing is ever sent there


class FakePath:
    """A page path that answers ``answer`` to every put and records each one."""

    def __init__(self, answer: list[bytes] | None) -> None:
        self.answer = answer
        self.puts: list[tuple[PutKind, int]] = []

    def put(self, kind: PutKind, head: bytes, views: list[memoryview],
            deadline: Deadline | None) -> list[bytes] | None:
        self.puts.append((kind, len(views)))
        return self.answer

    def fetch(self, req: dict[str, Any], views: dict[int, list[memoryview]], out: Any,
              deadline: Deadline | None) -> None:
        raise AssertionError("no fetch in these tests")

    def prefix(self, prompt: dict[str, Any], out: Any, max_rows: int | None) -> None:
        raise AssertionError("no prefix in these tests")

    def close(self) -> None:
        pass


def offline(**kw: Any) -> Client:
    c = Client(URL, **kw)
    c._layouts[LID] = LAYOUT  # known already: register() would call the node
    return c


def test_paths_every_handler_holds_the_protocol() -> None:
    with Client(URL, same_host=False, data_plane=False) as c:
        paths: list[PagePath] = [c._shm, c._dataport, c._stream, FakePath(None)]
        assert [type(p) for p in paths[:3]] == [SharedMemory, DataPort, Stream]


def test_paths_a_call_picks_shm_then_data_port_then_stream() -> None:
    with Client(URL, same_host=True) as c:
        assert c._path() is c._shm
    with Client(URL, same_host=False, data_plane=False) as c:
        assert c._path() is c._stream
    with Client(URL, same_host=False) as c:
        c._data_known, c._data.port = True, 9  # as /v1/node would have told it
        assert c._path() is c._dataport
        c._data.port = None  # the port was given up: the stream from now on
        assert c._path() is c._stream


def test_paths_a_put_the_chosen_path_takes_is_not_sent_again() -> None:
    names = [b"n" * 32, b"m" * 32]
    with offline(same_host=True, channel="http") as c:
        c._shm, c._stream = shm, stream = FakePath(names), FakePath(None)  # type: ignore[assignment]
        got = c.put(LID, list(range(2 * LAYOUT.tokens_per_page)), group=0,
                    pages=torch.zeros((2, PAGE), dtype=torch.uint8))
    assert got == names and shm.puts == [(PutKind.PAGES, 2)] and stream.puts == []


def test_paths_a_path_that_answers_none_sends_the_put_over_the_stream() -> None:
    names = [b"s" * 32]
    with offline(same_host=False) as c:
        c._data_known, c._data.port = True, 9
        c._dataport, c._stream = data, stream = FakePath(None), FakePath(names)  # type: ignore[assignment]
        got = c.put_state(LID, list(range(LAYOUT.tokens_per_page)), group=0, state=bytes(PAGE))
    assert got == names[0]
    assert data.puts == [(PutKind.STATE, 1)] and stream.puts == [(PutKind.STATE, 1)]
