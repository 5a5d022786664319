"""The local channel's one-way acknowledgement (docs/wire.md "The local channel"): a
same-host fetch is one round trip, the result the client builds is the one the node
would have answered, the node's counters add up after many fetches, an acknowledgement
of a lease that already ended counts nothing (and is logged), and one sent just before
its connection closed is still applied."""

from __future__ import annotations

import dataclasses
import re
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from kvbank import Client, Scope, full_attention
from kvbank.client.local import LocalLink
from kvbank.results import FetchResult
from kvbank.service.launch import NodeProcess
from kvbank.wire import local as fr

from .conftest import admin_headers, start_node

LAYOUT = full_attention("local-ack@1", num_layers=1, num_kv_heads=2, head_dim=64)  # 8 KiB pages
PAGE = LAYOUT.group_page_bytes[0]
P = 16
SHM_OUT = 'kvbank_moved_bytes_total{direction="out",path="shm"}'


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    proc = start_node(tmp_path_factory.mktemp("local-ack"))
    yield proc
    assert proc.stop() == 0, "".join(proc.lines)[-3000:]


def pages(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8))


def metric(node: NodeProcess, name: str) -> float:
    text = httpx.get(node.url + "/metrics", headers=admin_headers(node), timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return 0.0 if m is None else float(m.group(1))


class Counted:
    """The frames a client's link sends: each round trip (a call answered) and each
    one-way frame, by op."""

    def __init__(self, link: LocalLink) -> None:
        self.trips: list[str] = []
        self.oneway: list[str] = []
        call_once, send_oneway = link._call_once, link.send_oneway

        def trip(op: fr.Op, cols: Any, deadline: Any) -> Any:
            self.trips.append(op.name)
            return call_once(op, cols, deadline)

        def one(op: fr.Op, cols: Any) -> None:
            self.oneway.append(op.name)
            send_oneway(op, cols)

        link._call_once = trip  # type: ignore[method-assign]
        link.send_oneway = one  # type: ignore[method-assign]

    def take(self) -> tuple[list[str], list[str]]:
        got = (self.trips, self.oneway)
        self.trips, self.oneway = [], []
        return got


def test_a_fetch_on_the_channel_is_one_round_trip_and_a_put_two(served: NodeProcess) -> None:
    data = pages(5, 1)
    prompt = [*range(1000, 1000 + 5 * P), 3]
    with Client(served.url, channel="local") as c:
        lid = c.register(LAYOUT)
        c.match(lid, prompt)  # the channel opened (HELLO) and the layout known
        link = c._link
        assert link is not None and link.memory and link.oneway
        n = Counted(link)
        c.put(lid, prompt[:-1], group=0, pages=data)
        assert n.take() == (["PUT_RESERVE", "COMMIT"], [])
        got = c.fetch_prefix(lid, prompt)
        assert got.result is not None and got.result.complete and torch.equal(got.pages[0], data)
        assert n.take() == (["FETCH_PREFIX"], ["ACK"])
        m = c.match(lid, prompt)
        n.take()
        out = torch.zeros((5, PAGE), dtype=torch.uint8)
        assert c.fetch(m, out={0: out}).complete and torch.equal(out, data)
        assert n.take() == (["FETCH"], ["ACK"])
        # an HTTP call first waits until the node applied this thread's one-way ack
        assert c.stats().live_leases == 0
        assert n.take() == (["SYNC"], [])
        assert c.stats().live_leases == 0
        assert n.take() == ([], [])  # nothing sent one-way since: no SYNC


def test_the_node_counters_add_up_after_many_one_way_fetches(served: NodeProcess) -> None:
    """60 fetches (fetch_prefix and fetch of a held match): every one acknowledged
    one-way; the node's gets, hits, bytes out and open fetches agree with what the
    client saw, read right after the last one returned. (First of the fetching tests:
    no fetch left open by another can expire from the node's ledger meanwhile.)"""
    data = pages(4, 3)
    toks = list(range(3000, 3000 + 4 * P))
    with Client(served.url, channel="local") as c:
        lid = c.register(LAYOUT)
        c.put(lid, toks, group=0, pages=data)
        m = c.match(lid, [*toks, 1])
        before = c.stats()
        moved = metric(served, SHM_OUT)
        seen = rows = 0
        out = torch.zeros((4, PAGE), dtype=torch.uint8)
        for i in range(60):
            got = (c.fetch_prefix(lid, [*toks, 1], out={0: out}).result if i % 2
                   else c.fetch(m, out={0: out}))
            assert got is not None and got.complete
            seen += got.nbytes
            rows += sum(map(len, got.delivered))
        after = c.stats()
        assert after.live_leases == before.live_leases
        assert after.served_fetches == before.served_fetches  # every fetch closed on the node
        assert after.store.gets - before.store.gets == rows == 240
        assert after.store.hits - before.store.hits == rows
        assert seen == rows * PAGE
        assert metric(served, SHM_OUT) - moved == seen


def _same(a: FetchResult, b: FetchResult) -> None:
    assert dataclasses.replace(a, fetch_id="") == dataclasses.replace(b, fetch_id="")


def test_the_result_built_by_the_client_is_the_one_the_node_answers(served: NodeProcess) -> None:
    """Whole, cut by ``max_rows`` and with rows evicted between match and fetch: the
    client's own FetchResult equals the node's answer to the same acknowledgement."""
    data = pages(6, 2)
    toks = list(range(2000, 2000 + 6 * P))
    prompt = [*toks, 5]
    with Client(served.url, channel="local") as oneway, Client(served.url, channel="local") as answered:
        lid = oneway.register(LAYOUT)
        names = oneway.put(lid, toks, group=0, pages=data)
        answered.match(lid, prompt)
        assert answered._link is not None
        answered._link.oneway = False  # this one waits for the node's result, as before
        for max_rows in (None, 4, 0):
            mine = oneway.fetch_prefix(lid, prompt, max_rows=max_rows).result
            theirs = answered.fetch_prefix(lid, prompt, max_rows=max_rows).result
            assert mine is not None and theirs is not None
            _same(mine, theirs)
            assert mine.complete == (max_rows is None)
        m1, m2 = oneway.match(lid, prompt), answered.match(lid, prompt)
        gone = httpx.post(served.url + "/admin/evict", headers=admin_headers(served), timeout=10,
                          json={"names": [n.hex() for n in names[3:5]]})
        assert gone.status_code == 200 and len(gone.json()["evicted"]) == 2, gone.text
        a = oneway.fetch(m1, out={0: torch.zeros((6, PAGE), dtype=torch.uint8)})
        b = answered.fetch(m2, out={0: torch.zeros((6, PAGE), dtype=torch.uint8)})
        _same(a, b)
        assert sum(map(len, a.delivered)) == 4 and not a.complete and a.resume.tokens == 3 * P


class Raw:
    """One connection to the node's socket, spoken frame by frame."""

    def __init__(self, path: str) -> None:
        self.s = socket.socket(socket.AF_UNIX)
        self.s.settimeout(30)
        self.s.connect(path)
        assert self.call(fr.Op.HELLO, [""])[0] is fr.Kind.OK

    def send(self, kind: fr.Kind, op: int, cols: list[fr.Column]) -> None:
        self.s.sendall(fr.encode_bytes(kind, op, cols))

    def call(self, op: int, cols: list[fr.Column]) -> tuple[fr.Kind, list[fr.Column]]:
        self.send(fr.Kind.REQUEST, op, cols)
        head = self._exact(fr.HEADER.size)
        kind, _, n, body = fr.decode_header(head)
        return kind, fr.decode_body(self._exact(body), n)

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.s.recv(n - len(buf))
            assert chunk, "the node closed the connection"
            buf += chunk
        return buf

    def fetch_prefix(self, lid: bytes, tokens: list[int]) -> tuple[str, str, np.ndarray[Any, Any]]:
        """A FETCH_PREFIX: its fetch id, lease id and the positions lent."""
        prompt = LocalLink.prompt_columns(lid, Scope(), None, np.asarray(tokens, dtype="<i4").tobytes(),
                                          None, None)
        assert prompt is not None
        kind, cols = self.call(fr.Op.FETCH_PREFIX, [*prompt, np.array([-1], dtype="<i8")])
        assert kind is fr.Kind.OK, cols
        at = fr.MATCH_COLUMNS
        fetch_id, lease_id = cols[at], cols[at + 4]
        assert isinstance(fetch_id, str) and isinstance(lease_id, str) and lease_id
        pos = fr.ints(cols, at + 1, "positions")
        return fetch_id, lease_id, pos[fr.ints(cols, at + 6, "slots.index")]

    def ack(self, fetch_id: str, lease_id: str, positions: np.ndarray[Any, Any]) -> None:
        self.send(fr.Kind.ONEWAY, fr.Op.ACK, [fetch_id, lease_id, positions.astype("<i8"),
                                              np.zeros(0, dtype="<i8")])

    def close(self) -> None:
        self.s.close()


def _socket(node: NodeProcess) -> str:
    with Client(node.url, channel="http") as c:
        path = c._call("GET", "/v1/node")["host"]["socket"]
    assert isinstance(path, str)
    return path


def test_an_ack_of_a_lease_already_ended_counts_nothing_and_is_logged(served: NodeProcess) -> None:
    data = pages(3, 4)
    toks = list(range(4000, 4000 + 3 * P))
    with Client(served.url, channel="local") as c:
        lid = c.register(LAYOUT)
        c.put(lid, toks, group=0, pages=data)
    raw = Raw(_socket(served))
    try:
        moved = metric(served, SHM_OUT)
        logged = sum("was not applied" in line for line in served.lines)
        fetch_id, lease_id, lent = raw.fetch_prefix(lid, [*toks, 1])
        assert len(lent) == 3
        kind, _ = raw.call(fr.Op.RELEASE, [lease_id])  # the lease ends before the ack comes
        assert kind is fr.Kind.OK
        raw.ack(fetch_id, lease_id, lent)
        # a one-way frame of an op not taken one-way: logged too, never answered
        raw.send(fr.Kind.ONEWAY, fr.Op.MATCH, [])
        kind, cols = raw.call(fr.Op.SYNC, [])  # the next answer is the SYNC's own
        assert (kind, cols) == (fr.Kind.OK, [])
        assert metric(served, SHM_OUT) == moved  # not one byte counted delivered
        for _ in range(100):  # the log lines come from the node's process
            if sum("was not applied" in line for line in served.lines) >= logged + 2:
                break
            raw.call(fr.Op.SYNC, [])
        text = "".join(served.lines)
        assert sum("was not applied" in line for line in served.lines) == logged + 2, text[-2000:]
        assert "one-way ACK was not applied: Lease" in text and "one-way MATCH was not applied" in text
        with Client(served.url, channel="http") as h:
            assert h.stats().served_fetches >= 1  # the fetch stays open: no row of it delivered
    finally:
        raw.close()


def test_an_ack_sent_just_before_the_connection_closed_is_applied(served: NodeProcess) -> None:
    data = pages(3, 5)
    toks = list(range(5000, 5000 + 3 * P))
    with Client(served.url, channel="http") as h:
        lid = h.register(LAYOUT)
        h.put(lid, toks, group=0, pages=data)
        moved = metric(served, SHM_OUT)
        raw = Raw(_socket(served))
        fetch_id, lease_id, lent = raw.fetch_prefix(lid, [*toks, 1])
        raw.ack(fetch_id, lease_id, lent)
        raw.close()  # at once: the node reads the ack before the connection's end
        for _ in range(200):  # the node handles the end on its own thread: until it has
            if lease_id not in {x.id for x in h.leases()}:
                break
            h.stats()
        assert lease_id not in {x.id for x in h.leases()}
        # released by the ack, not by the close: its rows counted delivered
        assert metric(served, SHM_OUT) - moved == 3 * PAGE


def test_a_client_closes_each_connection_after_the_node_applied_its_acks(
        served: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three threads fetch, each on a connection of its own, and leave an ACK not yet
    answered; ``close`` syncs each of those connections (and no other), so a reader on
    another connection right after it sees every row counted."""
    import threading

    from kvbank.client import local as client_local

    synced: list[socket.socket] = []
    sync = client_local._sync

    def counted(sock: socket.socket, timeout_s: float) -> None:
        synced.append(sock)
        sync(sock, timeout_s)

    monkeypatch.setattr(client_local, "_sync", counted)
    data = pages(4, 6)
    toks = list(range(6000, 6000 + 4 * P))
    with Client(served.url, channel="http") as h:
        lid = h.register(LAYOUT)
        h.put(lid, toks, group=0, pages=data)
    moved = metric(served, SHM_OUT)
    c = Client(served.url, channel="local")
    c.register(LAYOUT)
    c.match(lid, [*toks, 1])  # this thread's connection: answered, nothing pending on it
    got: list[int] = []

    def fetch() -> None:
        res = c.fetch_prefix(lid, [*toks, 1]).result
        assert res is not None
        got.append(res.nbytes)

    threads = [threading.Thread(target=fetch) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [4 * PAGE] * 3
    c.close()
    assert len(synced) == 3 and len(set(synced)) == 3
    assert metric(served, SHM_OUT) - moved == 3 * 4 * PAGE
