"""The node's local channel (its Unix socket) on a real ``kvbank serve``: a Client picks it
by itself and answers as over HTTP; HTTP when told or when the node is elsewhere (the
reason logged); the socket's mode, its uid check and tenant tokens; hostile frames
answered and the node serving on; a worker killed holding a lease leaves none held."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbank import Client, Scope, full_attention
from kvbank.client.io import deadline_of
from kvbank.client.local import ChannelBroken, LocalLink
from kvbank.client.paths import SharedMemory
from kvbank.codec import checksum
from kvbank.errors import (
    Busy,
    Forbidden,
    InvalidInput,
    LeaseNotFound,
    TierUnavailable,
    Unauthorized,
)
from kvbank.service.launch import NodeProcess
from kvbank.wire import local as fr
from tests.service.conftest import NODE_ARGS

LAYOUT = full_attention("local-channel@1", num_layers=2, num_kv_heads=2, head_dim=64)  # 16 KiB pages
PAGE = LAYOUT.group_page_bytes[0]
TA, TB = "tenant-a-token-0123456789abcdef", "tenant-b-token-0123456789abcdef"


def rand(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, PAGE), dtype=np.uint8))


def socket_of(node: NodeProcess) -> str:
    with Client(node.url, channel="http") as c:
        doc = c._call("GET", "/v1/node")
    path = doc["host"]["socket"]
    assert isinstance(path, str) and path
    return path


def raw_call(path: str, frames: list[bytes]) -> list[tuple[fr.Kind, list[fr.Column]]]:
    """Send each frame on one connection and read one answer to each (until it closes)."""
    got: list[tuple[fr.Kind, list[fr.Column]]] = []
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        for f in frames:
            try:
                s.sendall(f)
            except OSError:  # the node closed this connection after its last answer
                break
            head = _exact(s, fr.HEADER.size)
            if head is None:
                break
            kind, _, n, body = fr.decode_header(head)
            got.append((kind, fr.decode_body(_exact(s, body) or b"", n)))
    return got


def _exact(s: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            chunk = s.recv(n - len(buf))
        except ConnectionResetError:  # the node closed it with our bytes unread
            return None
        if not chunk:
            return None
        buf += chunk
    return buf


HELLO = fr.encode_bytes(fr.Kind.REQUEST, fr.Op.HELLO, [""])


def test_a_client_on_the_nodes_host_takes_the_channel_and_answers_as_over_http(node: NodeProcess) -> None:
    data = rand(6, 1)
    prompt = [*range(100, 100 + 6 * 16), 7]
    with Client(node.url) as local, Client(node.url, channel="http") as http:
        lid = local.register(LAYOUT)
        names = local.put(lid, prompt[: 6 * 16], group=0, pages=data)
        assert local._link is not None and local._link.memory and http._link is None
        assert names == http.row_names(lid, prompt[: 6 * 16], group=0)
        calls: list[str] = []
        inner = local._call

        def call(method: str, path: str, **kw: object) -> object:
            calls.append(path)
            return inner(method, path, **kw)  # type: ignore[arg-type]

        local._call = call  # type: ignore[method-assign]
        m = local.match(lid, prompt)
        assert m == http.match(lid, prompt) and m.resume.tokens == 6 * 16
        keys = [bytes([i]) * 32 for i in range(3)]
        assert local.match(lid, keys=keys, prompt_tokens=49) == http.match(lid, keys=keys, prompt_tokens=49)
        assert local.presence(lid, prompt) == http.presence(lid, prompt)
        got = local.fetch_prefix(lid, prompt)
        assert got.tokens == 6 * 16 and torch.equal(got.pages[0], data) and got.result is not None
        assert got.result.complete and got.result.nbytes == 6 * PAGE
        out = torch.zeros((6, PAGE), dtype=torch.uint8)
        res = local.fetch(m, out={0: out})
        assert res.complete and torch.equal(out, data)
        rows = [bytearray(PAGE) for _ in range(6)]  # buffers that are not one tensor: a copy each
        assert local.fetch_prefix(lid, prompt, out={0: rows}).tokens == 6 * 16
        assert [bytes(r) for r in rows] == [bytes(data[i].numpy()) for i in range(6)]
        lease = local.lend(names[:2], ttl_s=60)
        local.check_live(lease.id)
        assert local.release(lease.id) and not local.release(lease.id)
        with pytest.raises(LeaseNotFound):  # the same class HTTP raises
            local.check_live(lease.id)
        with pytest.raises(LeaseNotFound):
            http.check_live(lease.id)
        assert calls == [], calls  # not one of these went over HTTP
        assert local.stats().live_leases == 0


def test_channel_http_or_another_host_means_http_and_local_means_required(
        node: NodeProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with Client(node.url, channel="http") as c:
        c.register(LAYOUT)
        c.match(c.register(LAYOUT), list(range(40)))
        assert c._link is None
    with pytest.raises(InvalidInput, match="channel"):
        Client(node.url, channel="unix")
    monkeypatch.setattr(SharedMemory, "same_machine", staticmethod(lambda info: False))
    with caplog.at_level(logging.INFO, logger="kvbank.client.client"), Client(node.url) as c:
        lid = c.register(LAYOUT)
        assert c.match(lid, list(range(40))).resume.tokens == 0
        assert c._link is None
    assert any("over HTTP" in r.getMessage() and "another host" in r.getMessage() for r in caplog.records)
    with Client(node.url, channel="local") as c, pytest.raises(TierUnavailable, match="no local channel"):
        c.match(lid, list(range(40)))


def test_the_socket_is_the_nodes_uid_only(node: NodeProcess) -> None:
    path = socket_of(node)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    if os.getuid() != 0:
        pytest.skip("another uid to connect as needs root")
    # let uid 65534 reach the socket past the file mode (a hard link, opened up for the
    # test): the node itself must still refuse it by its peer credentials
    link = Path("/tmp") / f"kvbank-test-{os.getpid()}.sock"
    os.link(path, link)
    try:
        os.chmod(link, 0o666)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: uid 65534, one HELLO, whatever comes back into the pipe
            try:
                os.close(r)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(10)
                    s.connect(str(link))
                    with contextlib.suppress(OSError):  # refused at once: the answer is there
                        s.sendall(HELLO)
                    while chunk := s.recv(65536):
                        os.write(w, chunk)
            except BaseException as exc:
                os.write(w, repr(exc).encode())
            finally:
                os._exit(0)
        os.close(w)
        raw = b""
        while chunk := os.read(r, 65536):
            raw += chunk
        os.close(r)
        os.waitpid(pid, 0)
    finally:
        os.chmod(path, 0o600)
        link.unlink()
    assert raw[:2] == fr.MAGIC, raw
    kind, _, n, body = fr.decode_header(raw[: fr.HEADER.size])
    err = fr.raise_error(fr.decode_body(raw[fr.HEADER.size : fr.HEADER.size + body], n))
    assert kind is fr.Kind.ERROR and isinstance(err, Forbidden) and "uid 65534" in str(err)


def test_hostile_frames_are_answered_and_the_node_serves_on(node: NodeProcess) -> None:
    path = socket_of(node)
    # a call before HELLO, an unknown op, a body whose columns do not add up: typed
    # errors, and the connection goes on serving
    bad_body = fr.HEADER.pack(fr.MAGIC, fr.VERSION, 0, fr.Op.MATCH, 1, 8) + struct_col(4, 3) + b""
    got = raw_call(path, [fr.encode_bytes(fr.Kind.REQUEST, fr.Op.MATCH, []), HELLO,
                          fr.encode_bytes(fr.Kind.REQUEST, 999, []), bad_body,
                          fr.encode_bytes(fr.Kind.REQUEST, fr.Op.MATCH, [b"short"]),
                          fr.encode_bytes(fr.Kind.REQUEST, fr.Op.RELEASE, ["no-such-lease"])])
    kinds = [k for k, _ in got]
    assert kinds == [fr.Kind.ERROR, fr.Kind.OK, fr.Kind.ERROR, fr.Kind.ERROR, fr.Kind.ERROR, fr.Kind.ERROR], got
    errs = [fr.raise_error(c) for k, c in got if k is fr.Kind.ERROR]
    assert all(isinstance(e, InvalidInput) for e in errs[:4]), errs
    assert isinstance(errs[4], LeaseNotFound)  # as HTTP answers a release of no lease
    assert "HELLO" in str(errs[0]) and "unknown op" in str(errs[1]) and "layout_id" in str(errs[3])
    # an unframeable header, or one declaring a body over the limit: answered, then closed
    for head in (b"GET / HTTP/1.1\r\n\r\n",
                 fr.HEADER.pack(fr.MAGIC, fr.VERSION, 0, fr.Op.MATCH, 1, fr.MAX_FRAME_BYTES + 1)):
        got = raw_call(path, [HELLO, head, HELLO])
        assert [k for k, _ in got] == [fr.Kind.OK, fr.Kind.ERROR], got
        assert isinstance(fr.raise_error(got[1][1]), InvalidInput)
    # a connection that sends half a frame and goes away
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(HELLO[:5])
    with Client(node.url, channel="local") as c:  # and the node serves on
        assert c.match(c.register(LAYOUT), list(range(40))).prompt_tokens == 40


def struct_col(code: int, n: int) -> bytes:
    return fr.COLUMN.pack(code, n)


def _killed_holding(node: NodeProcess, script: str, names: list[bytes]) -> str:
    """Run ``script`` (it prints a lease id, then waits) and SIGKILL it: the lease's id."""
    p = subprocess.Popen([sys.executable, "-c", script, *(n.hex() for n in names)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.stdout is not None
    lease_id = p.stdout.readline().strip()
    os.kill(p.pid, signal.SIGKILL)
    p.communicate()
    return lease_id


def test_a_worker_killed_mid_fetch_leaves_no_lease_held(node: NodeProcess) -> None:
    """A fetch's own lease ends with its connection: the worker died before its copies'
    acknowledgement, and the rows are not held until the TTL."""
    data = rand(3, 5)
    prompt = list(range(900, 900 + 3 * 16))
    with Client(node.url, channel="local") as c:
        lid = c.register(LAYOUT)
        c.put(lid, prompt, group=0, pages=data)
        before = {x.id for x in c.leases()}
        script = (f"import sys; from kvbank import Client; from kvbank.client import local as L\n"
                  f"def hold(self, m, bufs, cols, at):\n"
                  f"    print(cols[at + 4], flush=True); sys.stdin.readline()\n"
                  f"L.LocalLink._read = hold\n"
                  f"c = Client({node.url!r}, channel='local'); lid = bytes.fromhex({lid.hex()!r})\n"
                  f"c.layout(lid); c.fetch_prefix(lid, {prompt!r})\n")
        lease_id = _killed_holding(node, script, [])
        assert lease_id, "the worker opened no lease"
        for _ in range(200):  # its connection's close releases it
            if lease_id not in {x.id for x in c.leases()}:
                break
            time.sleep(0.05)
        assert {x.id for x in c.leases()} == before


def test_a_lent_lease_outlives_the_connection_that_took_it(node: NodeProcess) -> None:
    """A lease taken by ``lend`` may have been handed to another process: its taker's
    death does not end it (its release or its TTL does), as over HTTP."""
    data = rand(3, 6)
    prompt = list(range(1900, 1900 + 3 * 16))
    with Client(node.url, channel="local") as c:
        lid = c.register(LAYOUT)
        names = c.put(lid, prompt, group=0, pages=data)
        script = (f"import sys; from kvbank import Client; c = Client({node.url!r}, channel='local'); "
                  f"lease = c.lend([bytes.fromhex(h) for h in sys.argv[1:]], ttl_s=600); "
                  f"print(lease.id, flush=True); sys.stdin.readline()")
        lease_id = _killed_holding(node, script, names)
        assert lease_id in {x.id for x in c.leases()}
        c.check_live(lease_id)  # still live after its taker's connection closed
        assert c.release(lease_id)


@pytest.fixture(scope="module")
def tenant_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    env = {**os.environ, "KVBANK_TENANTS": f"a={TA},b={TB}", "KVBANK_ADMIN_TOKEN": "admin-" + "0" * 32}
    proc = NodeProcess.start(["--data-dir", str(tmp_path_factory.mktemp("tenants")), *NODE_ARGS], env=env)
    try:
        yield proc
    finally:
        assert proc.stop() == 0


def test_tenant_tokens_hold_on_the_channel_and_no_memory_reaches_a_tenant(tenant_node: NodeProcess) -> None:
    path = socket_of_tenant(tenant_node)
    for token, exc in ((None, Unauthorized), ("wrong-token", Forbidden)):
        with pytest.raises(exc):
            LocalLink(path, token, 10.0).open()
    data = rand(2, 9)
    prompt = list(range(50, 50 + 2 * 16))
    with Client(tenant_node.url, token=TA) as a, Client(tenant_node.url, token=TB) as b:
        doc = a._call("GET", "/v1/node")
        assert doc["host"]["segment"] is None  # nothing to open by name
        lid = a.register(LAYOUT)
        names = a.put(lid, prompt, group=0, pages=data)
        assert a._link is not None and not a._link.memory  # control calls here, bodies over HTTP
        got = a.fetch_prefix(lid, [*prompt, 1])
        assert got.tokens == 32 and torch.equal(got.pages[0], data)
        assert a.match(lid, prompt).scope == Scope(tenant="a")
        with pytest.raises(Forbidden):
            b.match(lid, prompt, scope=Scope(tenant="a"))
        with pytest.raises(Forbidden):
            b.lend(names)
        lease = a.lend(names, ttl_s=60)
        with pytest.raises(Forbidden):
            b.release(lease.id)
        assert a.release(lease.id)
        assert b.match(lid, prompt).resume.tokens == 0  # B's own scope: none of A's rows


def socket_of_tenant(node: NodeProcess) -> str:
    with Client(node.url, token=TA, channel="http") as c:
        return str(c._call("GET", "/v1/node")["host"]["socket"])


def test_the_node_document_names_the_socket(node: NodeProcess) -> None:
    with Client(node.url, channel="http") as c:
        doc = c._call("GET", "/v1/node")
    assert doc["host"]["socket"].endswith("node.sock") and json.dumps(doc)


SCRIBBLE = b"\xee" * 64
OVERWRITE = """
import sys
from kvbank.client.shm import Borrower
segment, page = sys.argv[1], bytes.fromhex(sys.stdin.read())
with Borrower(writable=True) as b:
    mm = b.segment(segment)
    at = bytes(mm).find(page)
    assert at >= 0, "the page is not in the segment"
    mm[at : at + 64] = b"\\xee" * 64
"""


def test_a_row_changed_in_the_segment_is_a_miss_on_the_channel_and_dropped(node: NodeProcess) -> None:
    """Another process of the node's uid maps the host segment by its name (an untenanted
    node names it) and overwrites a committed row: the channel client's next fetch — by
    fetch_prefix and by fetch of a held match — copies it, finds it fails its checksum,
    and leaves it out (a miss, never the changed bytes); the node drops that host copy."""
    data = rand(4, 77)
    prompt = [*range(9000, 9000 + 4 * 16), 1]
    own = [bytes(data[i].numpy()) for i in range(4)]
    with Client(node.url) as c:
        lid = c.register(LAYOUT)
        c.put(lid, prompt[:-1], group=0, pages=data)
        m = c.match(lid, prompt)
        assert c._link is not None and c._link.memory
        segment = c._host_info()["segment"]
        before = sum("host copy dropped" in line for line in node.lines)
        subprocess.run([sys.executable, "-c", OVERWRITE, segment], input=own[2].hex(), text=True,
                       check=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
        calls: list[str] = []
        inner = c._call

        def call(method: str, path: str, **kw: object) -> object:
            calls.append(path)
            return inner(method, path, **kw)  # type: ignore[arg-type]

        c._call = call  # type: ignore[method-assign]
        out = torch.zeros((4, PAGE), dtype=torch.uint8)
        res = c.fetch(m, out={0: out})  # the held match: the FETCH call
        planned = m.resume.pages[0]
        assert not res.complete and 2 not in [planned.index(k) for k in res.delivered[0]]
        for k in res.delivered[0]:
            assert bytes(out[planned.index(k)].numpy()) == own[planned.index(k)]
        assert calls == [], calls  # the fetch went over the channel
        for _ in range(50):  # the log line comes from the node's process
            if sum("host copy dropped" in line for line in node.lines) > before:
                break
            time.sleep(0.1)
        assert sum("host copy dropped" in line for line in node.lines) > before, "".join(node.lines)[-2000:]
        got = c.fetch_prefix(lid, prompt)  # the row is gone from the host tier: never B's bytes
        assert got.result is not None
        for k in got.result.delivered[0]:
            row = bytes(got.pages[0][got.match.resume.pages[0].index(k)].numpy())
            assert not row.startswith(SCRIBBLE) and row in own


def test_timeout_on_the_channel_is_a_deadline_as_over_http(node: NodeProcess) -> None:
    """kvbank.api, difference 3: a passed deadline raises Busy on the channel as over HTTP,
    before anything is sent (nothing stored, nothing lent, not one call over HTTP)."""
    data = rand(2, 11)
    prompt = [*range(1200, 1200 + 2 * 16), 7]  # its last token is never a resume's
    with Client(node.url, channel="local") as c:
        lid = c.register(LAYOUT)
        before = c.stats().live_leases
        assert c.match(lid, prompt).resume.tokens == 0  # the channel opened
        calls: list[str] = []
        inner = c._call

        def call(method: str, path: str, **kw: object) -> object:
            calls.append(path)
            return inner(method, path, **kw)  # type: ignore[arg-type]

        c._call = call  # type: ignore[method-assign]
        with pytest.raises(Busy, match="timeout"):
            c.put(lid, prompt[:32], group=0, pages=data, timeout=0)
        assert c.match(lid, prompt).resume.tokens == 0  # nothing was stored
        names = c.put(lid, prompt[:32], group=0, pages=data, timeout=30)
        m = c.match(lid, prompt)
        assert m.resume.tokens == 32
        out = torch.zeros((2, PAGE), dtype=torch.uint8)
        with pytest.raises(Busy, match="timeout"):
            c.fetch(m, out={0: out}, timeout=0)
        with pytest.raises(Busy, match="timeout"):
            c.lend(names, timeout=0)
        assert c.fetch(m, out={0: out}, timeout=30).complete and torch.equal(out, data)
        assert c.release(c.lend(names, timeout=30).id)
        assert calls == [], calls
        c._call = inner  # type: ignore[method-assign]
        assert c.stats().live_leases == before


def test_a_channel_call_unanswered_by_its_deadline_is_busy_and_its_connection_dropped(tmp_path: Path) -> None:
    """A node that takes the HELLO but never answers the call: Busy once the deadline
    passes (not the link's own timeout_s), and the connection dropped (a late answer
    never read as the next call's)."""
    path = str(tmp_path / "mute.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    kept: list[socket.socket] = []

    def serve() -> None:
        conn, _ = srv.accept()
        kept.append(conn)
        head = _exact(conn, fr.HEADER.size)
        assert head is not None
        _exact(conn, fr.decode_header(head)[3])
        conn.sendall(fr.encode_bytes(fr.Kind.OK, fr.Op.HELLO, [np.array([0, 0, 0, os.getpid()], dtype="<i8")]))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    link = LocalLink(path, None, timeout_s=600)
    try:
        link.open()
        t.join(10)
        start = time.monotonic()
        with pytest.raises(Busy, match="timeout"):
            link.call(fr.Op.CHECK, ["x"], deadline_of(0.2))
        assert time.monotonic() - start < 60  # the deadline ended the wait, not timeout_s
        assert getattr(link._tls, "sock", None) is None
    finally:
        link.close()
        for s in kept:
            s.close()
        srv.close()


def test_a_connection_that_broke_while_idle_or_before_an_answer_is_opened_anew(node: NodeProcess) -> None:
    """A node that restarted closed every connection of a long-lived client: the next call
    opens a new one (and HELLO maps the memory again) instead of failing; a call that
    changes nothing, broken off before any answer, is made once more. A commit is not."""
    data = rand(2, 5)
    prompt = [*range(500, 500 + 2 * 16), 7]
    with Client(node.url) as c:
        lid = c.register(LAYOUT)
        c.put(lid, prompt[: 2 * 16], group=0, pages=data)
        link = c._link
        assert link is not None and link.memory
        old = link._tls.sock
        old.shutdown(socket.SHUT_RD)  # as the node's end closing it: end of file waits on it
        f = c.fetch_prefix(lid, prompt)
        assert link._tls.sock is not old and old.fileno() == -1
        assert f.pages is not None and torch.equal(f.pages[0][:2], data)

        inner, calls = link._call_once, []

        def broken_once(op: fr.Op, cols: object, deadline: object = None) -> object:
            calls.append(op)
            if len(calls) == 1:
                exc = ChannelBroken("node: the local channel broke off", field="socket")
                exc.before_answer = True
                raise exc
            return inner(op, cols, deadline)  # type: ignore[arg-type]

        link._call_once = broken_once  # type: ignore[method-assign,assignment]
        assert c.match(lid, prompt).resume.tokens == 2 * 16
        assert calls == [fr.Op.MATCH, fr.Op.MATCH]
        calls.clear()
        with pytest.raises(ChannelBroken):
            link.call(fr.Op.COMMIT, ["0" * 32, b""])
        assert calls == [fr.Op.COMMIT]


def test_a_put_on_the_channel_sends_its_rows_checksums_and_a_wrong_one_is_a_miss(
        node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the channel a put's client hashes each row in its slot right after copying it
    there, and COMMIT carries the sums: the node keeps them as the rows' (a READ lease
    answers exactly them), so a sum that does not match its row's bytes — sent here on
    purpose — makes that row a miss for the next fetch, never other bytes."""
    from kvbank.client.shm import Borrower

    data = rand(4, 91)
    with Client(node.url) as c:
        lid = c.register(LAYOUT)
        link = c._chan()
        assert link is not None and link.memory and link.commit_sums
        names = c.put(lid, list(range(5000, 5000 + 4 * 16)), group=0, pages=data)
        lease = c.lend(names, ttl_s=60)
        assert lease.checksums() == {n: checksum(bytes(data[i].numpy())) for i, n in enumerate(names)}
        c.release(lease.id)

        summed = Borrower.copy_slots_summed

        def off_by_one(self: Borrower, *args: object, **kwargs: object) -> list[int]:
            return [v ^ 1 for v in summed(self, *args, **kwargs)]  # type: ignore[arg-type]

        monkeypatch.setattr(Borrower, "copy_slots_summed", off_by_one)
        prompt = list(range(6000, 6000 + 4 * 16))
        c.put(lid, prompt, group=0, pages=data)  # its rows recorded under the wrong sums
        monkeypatch.setattr(Borrower, "copy_slots_summed", summed)
        out = torch.zeros((4, PAGE), dtype=torch.uint8)
        got = c.fetch(c.match(lid, [*prompt, 1]), out={0: out})
        assert not got.complete and got.delivered == ((),)  # every row a miss: none counts as loaded
