"""The data plane (remote page bodies over the node's data port) against the HTTP paths,
byte for byte, and its failure rules: a put cut off (its client killed) leaves nothing
visible, a fetch cut off resumes under its fetch id, tickets are single use and expire
with their lease, the connection bound holds, and SIGTERM with a transfer in flight
still exits 0. Every node here is a real ``kvbank serve`` process."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvbank import Client, Match, full_attention, hybrid_mamba, wire
from kvbank.client.dataport import DataLink, DataPortUnreachable
from kvbank.client.io import put_head
from kvbank.errors import InvalidInput, LeaseExpired, TierUnavailable
from kvbank.keys import DEFAULT_SCOPE
from kvbank.service.config import DATA_PORT_OFF, ServiceConfig
from kvbank.service.launch import NodeProcess
from kvbank.wire.dataport import REPLY, Op
from kvbank.wire.framing import PutKind
from tests.service.conftest import start_node

LAYOUT = full_attention("dataplane@1", num_layers=4, num_kv_heads=4, head_dim=128)  # 256 KiB pages
PAGE = LAYOUT.group_page_bytes[0]
MAMBA = hybrid_mamba("dataplane-mamba@1", [0, 2], [1], 2, 32, conv_shape=(64, 3), ssm_shape=(4, 16))


def rand(n: int, size: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8))


def toks(base: int, pages: int) -> list[int]:
    return list(range(base * 10_000, base * 10_000 + pages * LAYOUT.tokens_per_page))


def moved(node: NodeProcess, direction: str, path: str) -> float:
    """The node's ``kvbank_moved_bytes_total{direction, path}``."""
    text = urllib.request.urlopen(node.url + "/metrics", timeout=10).read().decode()
    m = re.search(rf'kvbank_moved_bytes_total{{direction="{direction}",path="{path}"}} (\S+)', text)
    return 0.0 if m is None else float(m.group(1))


def data_port(node: NodeProcess) -> int | None:
    doc = json.loads(urllib.request.urlopen(node.url + "/v1/node", timeout=10).read())
    port = doc["data_port"]
    assert port is None or isinstance(port, int)
    return port


def link(node: NodeProcess) -> DataLink:
    out = DataLink("127.0.0.1", 10.0)
    out.port = data_port(node)
    return out


def ticketed_fetch(c: Client, m: Match, fetch_id: str | None = None) -> dict[str, Any]:
    """The data plane's fetch control call, as the client makes it."""
    doc: dict[str, Any] = c._call("POST", "/v1/fetch", body={"match": wire.to_dict(m), "fetch_id": fetch_id,
                                                             "max_rows": None, "via": "data"})
    return doc


def put_lease(c: Client, lid: bytes, tokens: list[int], pages: torch.Tensor) -> dict[str, Any]:
    """The data plane's put control call (a WRITE lease and its ticket), as the client makes it."""
    views = [pages[i].numpy().data for i in range(len(pages))]
    head = put_head(PutKind.PAGES, lid, tokens, None, DEFAULT_SCOPE, 0, 0, None, None, views,
                    len(views[0]))
    doc: dict[str, Any] = c._call("POST", "/v1/put/lease?via=data", content=head)
    return doc


# ---- byte for byte ---------------------------------------------------------------------


def test_dataplane_put_and_fetch_agree_with_http_and_same_host(node: NodeProcess) -> None:
    """Each path stores a prompt, each path fetches every prompt: all the bytes agree, and
    the data plane (not HTTP) carried the data client's bodies."""
    data = {name: rand(8, PAGE, seed) for seed, name in enumerate(("data", "http", "shm"))}
    with Client(node.url, same_host=False, data_plane=True) as dp, \
            Client(node.url, same_host=False, data_plane=False) as http, \
            Client(node.url, same_host=True) as shm:
        clients = {"data": dp, "http": http, "shm": shm}
        lid = dp.register(LAYOUT)
        before_out = moved(node, "out", "data")
        for base, (name, c) in enumerate(clients.items()):
            data_in, tcp_in = moved(node, "in", "data"), moved(node, "in", "tcp")
            c.put(lid, toks(base + 1, 8), group=0, pages=data[name])
            over_data, over_http = moved(node, "in", "data") - data_in, moved(node, "in", "tcp") - tcp_in
            if name == "data":  # the pages over the data port, only the put's head over HTTP
                assert over_data == 8 * PAGE and over_http < PAGE
            else:
                assert over_data == 0 and (over_http > 8 * PAGE) == (name == "http")
        for base, name in enumerate(clients):
            m = dp.match(lid, [*toks(base + 1, 8), 1])
            assert m.resume.tokens == 8 * LAYOUT.tokens_per_page
            for reader in clients.values():
                out = torch.zeros((8, PAGE), dtype=torch.uint8)
                got = reader.fetch(m, out={0: out})
                assert got.complete and got.nbytes == 8 * PAGE
                assert torch.equal(out, data[name])
        assert moved(node, "out", "data") - before_out == 3 * 8 * PAGE  # the data client's fetches


def test_dataplane_state_rows_and_a_resumed_fetch(node: NodeProcess) -> None:
    """STATE snapshots go both ways over the data port; a fetch cut to ``max_rows``
    resumes under its fetch id with the rows not yet delivered, and only those."""
    with Client(node.url, same_host=False, data_plane=True) as dp, \
            Client(node.url, same_host=False, data_plane=False) as http:
        mid = dp.register(MAMBA)
        t = list(range(900, 964))
        pages = rand(4, MAMBA.group_page_bytes[0], 11)
        state = rand(1, MAMBA.group_page_bytes[1], 12)[0]
        dp.put(mid, t, group=0, pages=pages)
        dp.put_state(mid, t[:32], group=1, state=state)
        hm = http.match(mid, t)
        assert hm.resume.tokens == 32
        for c in (dp, http):
            bufs = {0: [bytearray(MAMBA.group_page_bytes[0]) for _ in range(2)],
                    1: [bytearray(MAMBA.group_page_bytes[1])]}
            got = c.fetch(hm, out=bufs)
            assert got.complete and bytes(bufs[1][0]) == state.numpy().tobytes()
            assert [bytes(b) for b in bufs[0]] == [pages[i].numpy().tobytes() for i in range(2)]

        lid = dp.register(LAYOUT)
        data = rand(6, PAGE, 13)
        http.put(lid, toks(40, 6), group=0, pages=data)
        m = dp.match(lid, [*toks(40, 6), 1])
        out = torch.zeros((6, PAGE), dtype=torch.uint8)
        first = dp.fetch(m, out={0: out}, max_rows=2)
        assert not first.complete and first.delivered == ((0, 1),) and first.nbytes == 2 * PAGE
        rest = dp.fetch(m, out={0: out}, fetch_id=first.fetch_id)
        assert rest.complete and rest.nbytes == 4 * PAGE and rest.fetch_id == first.fetch_id
        assert torch.equal(out, data)


def test_dataplane_rows_on_disk_only(tmp_path: Path) -> None:
    """Rows a restarted node holds on disk only are staged into host slots by the lease
    and sent from there."""
    data = rand(6, PAGE, 21)
    n = start_node(tmp_path)
    try:
        with Client(n.url, same_host=False, data_plane=False) as c:
            lid = c.register(LAYOUT)
            c.put(lid, toks(50, 6), group=0, pages=data)
    finally:
        assert n.stop() == 0
    n = start_node(tmp_path)
    try:
        with Client(n.url, same_host=False, data_plane=True) as c:
            lid = c.register(LAYOUT)
            m = c.match(lid, [*toks(50, 6), 1])
            assert {t.name for ts in m.tiers for t in ts if t is not None} == {"DISK"}
            out = torch.zeros((6, PAGE), dtype=torch.uint8)
            before = moved(n, "out", "data")
            got = c.fetch(m, out={0: out})
            assert got.complete and torch.equal(out, data)
            assert moved(n, "out", "data") - before == 6 * PAGE
    finally:
        assert n.stop() == 0


# ---- failures ----------------------------------------------------------------------------

_KILLED_PUT = textwrap.dedent("""
    import sys, numpy as np, torch
    from kvbank import Client, full_attention
    from kvbank.keys import DEFAULT_SCOPE
    from kvbank.client.io import put_head
    from kvbank.wire.dataport import Op
    from kvbank.wire.framing import PutKind
    url, base = sys.argv[1], int(sys.argv[2])
    layout = full_attention("dataplane@1", num_layers=4, num_kv_heads=4, head_dim=128)
    page = layout.group_page_bytes[0]
    pages = torch.from_numpy(np.random.default_rng(5).integers(0, 256, (8, page), dtype=np.uint8))
    c = Client(url, same_host=False, data_plane=True)
    lid = c.register(layout)
    tokens = list(range(base * 10_000, base * 10_000 + 8 * layout.tokens_per_page))
    views = [memoryview(pages[i].numpy()) for i in range(8)]
    doc = c._call("POST", "/v1/put/lease?via=data",
                  content=put_head(PutKind.PAGES, lid, tokens, None, DEFAULT_SCOPE, 0, 0, None, None, views, page))
    assert c._data_on()
    sock = c._data._start(Op.PUT, doc["ticket"], 8 * page)
    for v in views[:5]:
        sock.sendall(v)  # five whole slots and half of the sixth reach the node ...
    sock.sendall(views[5][: page // 2])
    print("mid", flush=True)
    sys.stdin.readline()  # ... and the client dies here
""")


def test_dataplane_put_of_a_killed_client_leaves_nothing_visible(node: NodeProcess) -> None:
    """A client SIGKILLed mid-put: the node received five slots whole, but the server
    commits nothing by itself, so none of the eight rows is visible, then or later."""
    with subprocess.Popen([sys.executable, "-c", _KILLED_PUT, node.url, "60"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "mid"
            time.sleep(0.2)  # the node has the five slots by now
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    with Client(node.url, same_host=False, data_plane=True) as c:
        lid = c.register(LAYOUT)
        m = c.match(lid, [*toks(60, 8), 1])
        assert m.resume.tokens == 0 and all(t is None for ts in m.tiers for t in ts)
        time.sleep(0.3)
        assert c.match(lid, [*toks(60, 8), 1]).resume.tokens == 0
        # the node goes on serving the data plane
        other = rand(2, PAGE, 61)
        c.put(lid, toks(61, 2), group=0, pages=other)
        out = torch.zeros((2, PAGE), dtype=torch.uint8)
        assert c.fetch(c.match(lid, [*toks(61, 2), 1]), out={0: out}).complete and torch.equal(out, other)


def test_dataplane_fetch_dropped_mid_transfer_resumes(node: NodeProcess) -> None:
    """A data connection dropped after two and a half rows: the client acknowledges the
    two whole ones with the lease, and the fetch id resumes with the other four."""
    data = rand(6, PAGE, 31)
    with Client(node.url, same_host=False, data_plane=True) as c:
        lid = c.register(LAYOUT)
        c.put(lid, toks(70, 6), group=0, pages=data)
        m = c.match(lid, [*toks(70, 6), 1])
        doc = ticketed_fetch(c, m)
        fid, lease = doc["fetch_id"], doc["lease"]
        assert [s[0] for s in lease["slots"]] == list(range(6))
        out = torch.zeros((6, PAGE), dtype=torch.uint8)
        sock = link(node)._start(Op.FETCH, doc["ticket"], 6 * PAGE)
        for i in range(2):
            view = out[i].numpy().data
            got = 0
            while got < PAGE:
                got += sock.recv_into(view[got:], PAGE - got)
        sock.recv_into(out[2].numpy().data[: PAGE // 2], PAGE // 2)
        sock.close()  # mid-row
        part = c._ack(fid, [0, 1], lease["id"])
        assert part.delivered == ((0, 1),) and not part.complete
        rest = c.fetch(m, out={0: out}, fetch_id=fid)
        assert rest.complete and rest.nbytes == 4 * PAGE
        assert torch.equal(out, data)


def test_dataplane_bad_reused_and_wrong_way_tickets_are_refused(node: NodeProcess) -> None:
    """A ticket never issued, one used once already and one presented the other way are
    each refused with a typed error, and the connection closed; so is a request that is
    not one, and bytes after a put's slots. (The node's leases have the default TTL: a
    ticket here is refused for what it is, never because a slow machine let it expire.)"""
    n = node
    data = rand(3, PAGE, 41)
    with Client(n.url, same_host=False, data_plane=True) as c:
        lid = c.register(LAYOUT)
        c.put(lid, toks(80, 3), group=0, pages=data)
        m = c.match(lid, [*toks(80, 3), 1])
        lk = link(n)

        def refused(ticket: str, op: Op = Op.FETCH) -> BaseException:
            with pytest.raises((InvalidInput, LeaseExpired)) as err:
                lk._start(op, ticket, 3 * PAGE)
            return err.value

        assert "not issued" in str(refused(os.urandom(16).hex()))
        doc = ticketed_fetch(c, m)
        out = [memoryview(bytearray(PAGE)) for _ in range(3)]
        assert lk.fetch(doc["ticket"], out) == (3, None)
        assert bytes(out[2]) == data[2].numpy().tobytes()
        assert "already used" in str(refused(doc["ticket"]))
        c._ack(doc["fetch_id"], [0, 1, 2], doc["lease"]["id"])

        doc = ticketed_fetch(c, m)
        assert "issued for a fetch" in str(refused(doc["ticket"], Op.PUT))
        c._ack(doc["fetch_id"], [], doc["lease"]["id"])

        # not a request: refused, closed
        with socket.create_connection(("127.0.0.1", lk.port or 0), timeout=5) as s:
            s.sendall(b"GET /v1/node HTTP/1.1\r\nHost: x\r\n\r\n")  # longer than a request
            head = s.recv(REPLY.size, socket.MSG_WAITALL)
            assert REPLY.unpack(head)[1] == 1
            body = json.loads(s.recv(4096))
            assert body["type"] == "InvalidInput" and "magic" in body["message"]
            assert s.recv(1) == b""  # closed

        # bytes beyond a put's slots are never taken as page bytes
        fresh = rand(2, PAGE, 42)
        doc = put_lease(c, lid, toks(81, 2), fresh)
        sock = lk._start(Op.PUT, doc["ticket"], 2 * PAGE)
        sock.sendall(fresh.numpy().data.cast("B"))
        sock.sendall(b"\x00" * 100)
        assert REPLY.unpack(sock.recv(REPLY.size, socket.MSG_WAITALL))[1] == 0  # the two slots, whole
        assert REPLY.unpack(sock.recv(REPLY.size, socket.MSG_WAITALL))[1] == 1  # then a refusal
        sock.close()
        c.commit(doc["lease"]["id"], [bytes.fromhex(x) for x in doc["names"]])
        got = torch.zeros((2, PAGE), dtype=torch.uint8)
        assert c.fetch(c.match(lid, [*toks(81, 2), 1]), out={0: got}).complete
        assert torch.equal(got, fresh)


def test_dataplane_expired_ticket_is_refused(tmp_path: Path) -> None:
    """A ticket whose lease ran out is refused with LeaseExpired, and the connection
    closed. The wait is past the TTL, so a slower machine only makes it more expired."""
    n = NodeProcess.start(["--data-dir", str(tmp_path), "--host-bytes", "64M", "--disk-bytes", "256M",
                           "--device-bytes", "0"], env={**os.environ, "KVBANK_LEASE_TTL_S": "1.5"})
    try:
        with Client(n.url, same_host=False, data_plane=False) as c:
            lid = c.register(LAYOUT)
            c.put(lid, toks(82, 3), group=0, pages=rand(3, PAGE, 43))
            doc = ticketed_fetch(c, c.match(lid, [*toks(82, 3), 1]))
            time.sleep(1.7)  # past the lease's TTL
            with pytest.raises(LeaseExpired):
                link(n)._start(Op.FETCH, doc["ticket"], 3 * PAGE)
    finally:
        assert n.stop() == 0


def test_dataplane_idle_connections_make_room_for_a_transfer(tmp_path: Path) -> None:
    """Regression (served-node review D9): with ``--data-connections 2``, two idle
    connections made every further one ``Busy`` until the idle timeout (a client that
    requires the data plane failed, others fell back to HTTP). A newcomer now closes the
    connection idle longest and is served; the data plane takes the transfers."""
    n = start_node(tmp_path, "--data-connections", "2")
    try:
        port = data_port(n)
        assert port is not None
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        time.sleep(0.2)
        with Client(n.url, same_host=False, data_plane=True) as c:
            lid = c.register(LAYOUT)
            data = rand(2, PAGE, 91)
            tcp_in = moved(n, "in", "tcp")
            c.put(lid, toks(91, 2), group=0, pages=data)
            out = torch.zeros((2, PAGE), dtype=torch.uint8)
            assert c.fetch(c.match(lid, [*toks(91, 2), 1]), out={0: out}).complete
            assert torch.equal(out, data) and moved(n, "in", "tcp") - tcp_in < PAGE
        assert held[0].recv(1) == b""  # the one idle longest was closed to make room
        for s in held:
            s.close()
    finally:
        assert n.stop() == 0


def test_dataplane_sigterm_with_transfers_in_flight_exits_0(tmp_path: Path) -> None:
    """SIGTERM while a put is half sent and a fetch is unread: the node ends both data
    connections, closes its bank and exits 0; the half put is not visible after restart."""
    n = start_node(tmp_path)
    try:
        big = full_attention("dataplane-big@1", num_layers=32, num_kv_heads=8, head_dim=128)  # 2 MiB
        page = big.group_page_bytes[0]
        with Client(n.url, same_host=False, data_plane=True) as c:
            lid = c.register(big)
            pages = rand(16, page, 51)
            t = list(range(300_000, 300_000 + 16 * 16))
            c.put(lid, t, group=0, pages=pages)
            m = c.match(lid, [*t, 1])
            fetch = ticketed_fetch(c, m)
            reader = link(n)._start(Op.FETCH, fetch["ticket"], 16 * page)  # and never read
            t2 = list(range(400_000, 400_000 + 4 * 16))
            doc = put_lease(c, lid, t2, pages[:4])
            writer = link(n)._start(Op.PUT, doc["ticket"], 4 * page)
            writer.sendall(pages[0].numpy().data)
            time.sleep(0.2)
            assert n.stop() == 0, "".join(n.lines)[-3000:]
            reader.close()
            writer.close()
    finally:
        if n.proc.poll() is None:
            n.kill()
    n = start_node(tmp_path)
    try:
        with Client(n.url, same_host=False) as c:
            lid = c.register(big)
            assert c.match(lid, [*t2, 1]).resume.tokens == 0
            assert c.match(lid, [*t, 1]).resume.tokens == 16 * 16
    finally:
        assert n.stop() == 0


# ---- settings --------------------------------------------------------------------------


def test_dataplane_port_off_serves_http_only(tmp_path: Path) -> None:
    """``--data-port off``: no port advertised, a client puts and fetches over HTTP, one
    that requires the data plane is told so, and ``via=data`` is refused."""
    n = start_node(tmp_path, "--data-port", "off")
    try:
        assert data_port(n) is None
        data = rand(2, PAGE, 71)
        with Client(n.url, same_host=False) as c:
            lid = c.register(LAYOUT)
            c.put(lid, toks(95, 2), group=0, pages=data)
            m = c.match(lid, [*toks(95, 2), 1])
            out = torch.zeros((2, PAGE), dtype=torch.uint8)
            assert c.fetch(m, out={0: out}).complete and torch.equal(out, data)
            with pytest.raises(InvalidInput, match="data port"):
                ticketed_fetch(c, m)
        with Client(n.url, same_host=False, data_plane=True) as c, pytest.raises(TierUnavailable, match="data port"):
            c.put(lid, toks(96, 2), group=0, pages=data)
    finally:
        assert n.stop() == 0


def test_dataplane_settings_from_every_source(tmp_path: Path) -> None:
    cfg = ServiceConfig.load(env={"KVBANK_DATA_PORT": "off", "KVBANK_DATA_CONNECTIONS": "3"},
                             flags={"data_dir": tmp_path, "host_bytes": 1 << 26, "disk_bytes": 1 << 26})
    assert cfg.data_port == DATA_PORT_OFF and cfg.data_connections == 3
    toml = tmp_path / "n.toml"
    toml.write_text(cfg.to_toml())
    again = ServiceConfig.load(toml, env={})
    assert again.data_port == DATA_PORT_OFF and again.data_connections == 3
    toml.write_text('data_port = "off"\n')
    assert ServiceConfig.load(toml, env={}).data_port == DATA_PORT_OFF
    assert ServiceConfig.load(env={"KVBANK_DATA_PORT": "7411"}).data_port == 7411
    from kvbank.errors import ConfigError

    for bad in ({"data_port": 70000}, {"data_port": -2}, {"data_connections": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            ServiceConfig.load(env={}, flags=bad)
    out = subprocess.run([sys.executable, "-m", "kvbank.cli", "serve", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "--data-port" in out and "--data-connections" in out


def _firewalled(c: Client) -> None:
    """Make every connection from ``c`` to the data port refused, as a firewall would."""
    def refuse() -> socket.socket:
        raise DataPortUnreachable(f"data_port: 127.0.0.1:{c._data.port} unreachable: refused")
    c._data._connect = refuse  # type: ignore[method-assign]


def test_dataplane_port_unreachable_from_the_client_falls_back_to_http(node: NodeProcess) -> None:
    """A data port this client cannot connect to (as if firewalled off): a client that
    does not require the data plane releases the lease it took and puts, or streams the
    same fetch id, over HTTP; one that requires it gets TierUnavailable, nothing stored."""
    data = rand(3, PAGE, 101)
    with Client(node.url, same_host=False) as c:
        lid = c.register(LAYOUT)
        assert c._data_on()
        _firewalled(c)
        tcp_in = moved(node, "in", "tcp")
        c.put(lid, toks(101, 3), group=0, pages=data)
        assert moved(node, "in", "tcp") - tcp_in > 3 * PAGE and not c._data_on()
        m = c.match(lid, [*toks(101, 3), 1])
        out = torch.zeros((3, PAGE), dtype=torch.uint8)
        got = c.fetch(m, out={0: out})
        assert got.complete and torch.equal(out, data)
        held = {r.name for x in c.leases() for r in x.rows}
        assert not held & set(m.needed)  # the put's WRITE lease and the fetch's READ lease are gone
    with Client(node.url, same_host=False, data_plane=True) as c:
        assert c._data_on()
        _firewalled(c)
        with pytest.raises(TierUnavailable, match="unreachable"):
            c.put(lid, toks(102, 3), group=0, pages=data)
        assert c.match(lid, [*toks(102, 3), 1]).resume.tokens == 0


def test_dataplane_port_that_moved_is_read_again_from_the_node(node: NodeProcess) -> None:
    """A data port that refuses because the node moved it (a restart: the client holds
    the old number) is read again from ``/v1/node`` and the same transfer goes on the new
    one, for a client that requires the data plane and one that does not."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    nowhere = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    data = rand(3, PAGE, 103)
    for k, want in enumerate((None, True)):
        with Client(node.url, same_host=False, data_plane=want) as c:
            lid = c.register(LAYOUT)
            assert c._data_on()
            port = c._data.port
            c._data.port = nowhere
            tcp_in = moved(node, "in", "tcp")
            c.put(lid, toks(103 + k, 3), group=0, pages=data)
            assert moved(node, "in", "tcp") - tcp_in < PAGE and c._data.port == port
            m = c.match(lid, [*toks(103 + k, 3), 1])
            c._data.close()  # its pooled connections would still reach the node
            c._data.port = nowhere
            out = torch.zeros((3, PAGE), dtype=torch.uint8)
            assert c.fetch(m, out={0: out}).complete and torch.equal(out, data)
            assert c._data.port == port
