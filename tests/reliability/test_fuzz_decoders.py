"""Hypothesis against every decoder a socket reaches, where the unit tests do not already
fuzz it: no crash, no hang, only typed errors, and never a row counted from bytes that
were not its own.

Covered elsewhere, not repeated here: the put body's prefix and header documents and the
fetch stream's frame and header forms (tests/wire/test_framing.py), codec frames
(tests/codec/test_codec.py: random frames and flipped bits only ever CorruptPage or the
exact bytes), mutated wire documents of every wire type (tests/wire/test_forms.py), every JSON
route's schema (tests/service/test_openapi.py and test_schemathesis_stateful.py here).

Here: the client's fetch-stream reader fed by a hostile server over a real socket; whole
put bodies (prefix, header, tokens, pages) through the node's application; lease JSON
and error documents as arbitrary text; JSON nested past the parser's depth limit in every
JSON decoder; forged admin cursors.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbank import wire
from kvbank.client.http import raise_for
from kvbank.client.io import fetch_stream
from kvbank.errors import InvalidInput, KvbankError
from kvbank.lender.base import Lease
from kvbank.wire.framing import (
    FETCH_MAGIC,
    FRAME,
    PREFIX,
    PUT_MAGIC,
    VERSION,
    decode_fetch_header,
    decode_put_header,
)
from tests.service.admin_app import FA, PAGE, P, auth, served

FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DEEP = [b"[" * 100_000, b'{"a":' * 100_000, b"[" * 900 + b"]" * 900]


# ---- the client's fetch-stream reader against a hostile server ----------------------------


class HostileServer:
    """A real loopback socket server answering every request with ``self.answer``."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.answer = b""
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                try:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    head, _, body = data.partition(b"\r\n\r\n")
                    n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")), 0)
                    while len(body) < n:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        body += chunk
                    conn.sendall(self.answer)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        self._thread.join(10)


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileServer]:
    server = HostileServer()
    yield server
    server.close()


SLOTS = {0: 3, 1: 1}  # group -> slots the caller has buffers for
SLOT_BYTES = {0: 64, 1: 16}

rows_st = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 2), st.integers(0, 3),
                             st.integers(0, 80)), max_size=5)
frames_st = st.lists(st.tuples(st.sampled_from([1, 1, 2, 3, 0, 9]), st.integers(0, 7),
                               st.one_of(st.none(), st.integers(0, 100))), max_size=7)


def _stream(rows: list[tuple[int, int, int, int]], frames: list[tuple[int, int, int | None]],
            header_edit: Any) -> tuple[bytes, dict[int, tuple[int, bytes]]]:
    """A stream and, per position, where its first ROW frame ends and what it carries."""
    doc: Any = {"fetch_id": "f1", "stream": "s1", "rows": [list(r) for r in rows]}
    if header_edit is not None:
        doc = header_edit
    text = json.dumps(doc).encode()
    out = bytearray(PREFIX.pack(FETCH_MAGIC, VERSION, len(text)) + text)
    sizes = {r[0]: r[3] for r in rows}
    firsts: dict[int, tuple[int, bytes]] = {}
    for tag, (kind, pos, length) in enumerate(frames):
        n = sizes.get(pos, 0) if length is None and kind == 1 else (length or 0)
        payload = bytes([tag + 1]) * n
        out += FRAME.pack(kind, pos, n) + payload
        if kind == 1 and pos not in firsts:
            firsts[pos] = (len(out), payload)
    return bytes(out), firsts


@FUZZ
@given(rows=rows_st, frames=frames_st, cut=st.one_of(st.none(), st.integers(0, 400)),
       extra=st.binary(max_size=8), status=st.sampled_from([200, 200, 200, 404, 500]),
       header_edit=st.one_of(st.none(), st.just([]), st.just({"fetch_id": "f", "stream": "s", "rows": "x"}),
                             st.just({"fetch_id": 1, "stream": "s", "rows": []})),
       raw=st.one_of(st.none(), st.binary(max_size=300)))
def test_fetch_stream_reader_survives_a_hostile_server(
        hostile: HostileServer, rows: list[tuple[int, int, int, int]],
        frames: list[tuple[int, int, int | None]], cut: int | None, extra: bytes, status: int,
        header_edit: Any, raw: bytes | None) -> None:
    """Whatever the server sends, the reader returns (never raises), its error is typed,
    and every row it reports whole holds exactly the bytes of that row's frame, which
    arrived complete: no short, misaligned or foreign bytes pass for a row."""
    body, firsts = _stream(rows, frames, header_edit)
    body = (raw if raw is not None else body) + extra
    delivered = body if cut is None else body[:cut]
    # a content-length longer than what is sent: the server closes early (a break-off)
    hostile.answer = (f"HTTP/1.1 {status} X\r\ncontent-length: {len(body)}\r\n"
                      "connection: close\r\n\r\n").encode() + delivered
    views = {g: [memoryview(bytearray(b"\xee" * SLOT_BYTES[g])) for _ in range(n)]
             for g, n in SLOTS.items()}
    conn = http.client.HTTPConnection("127.0.0.1", hostile.port, timeout=10)
    try:
        got = fetch_stream(conn, b"{}", views)
    finally:
        conn.close()
    assert got.error is None or isinstance(got.error, (KvbankError, OSError, http.client.HTTPException))
    if status != 200:
        assert got.got == [] and got.error is not None
        return
    assert len(set(got.got)) == len(got.got)
    plan = {r[0]: r for r in rows}
    for pos in got.got:
        assert raw is None and header_edit is None
        _, group, slot, size = plan[pos]
        end, payload = firsts[pos]
        assert end <= len(delivered)  # the whole frame arrived
        assert bytes(views[group][slot][:size]) == payload


# ---- whole put bodies through the node's application --------------------------------------


@pytest.fixture(scope="module")
def app() -> Iterator[Any]:
    with served(None) as (client, node):
        node.bank.register(FA)
        yield client


header_docs = st.fixed_dictionaries({}, optional={
    "kind": st.sampled_from(["pages", "state", "blob", 3]),
    "layout_id": st.sampled_from([FA.layout_id.hex(), "00" * 32, "zz", 5]),
    "scope": st.sampled_from([{}, {"tenant": "t"}, {"tenant": 1}, "x", {"other": ""}]),
    "group": st.sampled_from([0, 1, -1, 2**40, "0"]),
    "first_page": st.sampled_from([0, 1, 2**31, -5, None]),
    "shard": st.sampled_from([None, 0, 7, -1]),
    "at": st.sampled_from([None, 0, 1, P, 2**62]),
    "tokens": st.sampled_from([0, 1, P, 2 * P, 2**25, None]),
    "keys": st.sampled_from([None, 1, 2]),
    "pages": st.sampled_from([0, 1, 2, 2**24, -1]),
    "page_bytes": st.sampled_from([PAGE, PAGE - 1, 1, 0, 2**40]),
})


@FUZZ
@given(doc=header_docs, version=st.sampled_from([VERSION, VERSION, 0, 2]),
       declared=st.one_of(st.none(), st.integers(0, 1 << 20)), tail=st.integers(0, 3 * PAGE + 200),
       path=st.sampled_from(["/v1/put", "/v1/put_state", "/v1/put/lease"]),
       raw=st.one_of(st.none(), st.binary(max_size=120)))
def test_put_bodies_fuzzed_whole_are_answered_4xx_or_stored_never_5xx(
        app: Any, doc: dict[str, Any], version: int, declared: int | None, tail: int,
        path: str, raw: bytes | None) -> None:
    text = json.dumps(doc).encode()
    body = raw if raw is not None else PREFIX.pack(PUT_MAGIC, version, len(text)) + text + b"\x05" * tail
    r = app.post(path, content=body, headers={"content-type": "application/octet-stream"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()
        assert set(err) == {"type", "field", "message"} and err["field"], err


# ---- lease JSON, error documents and deep nesting -----------------------------------------

json_text = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["id", "kind", "mode", "rows", "type", "field", "message", "ttl_s", "x"]),
        inner, max_size=5),
    max_leaves=15,
).map(json.dumps)


@FUZZ
@given(st.one_of(json_text, st.text(max_size=200), st.binary(max_size=200)))
def test_lease_json_of_any_text_is_a_lease_or_invalid_input(text: str | bytes) -> None:
    for decode in (lambda t: wire.from_json(Lease, t),):
        try:
            got = decode(text)
        except InvalidInput:
            continue
        assert isinstance(got, Lease)


@FUZZ
@given(st.one_of(json_text, st.binary(max_size=200)), st.integers(400, 599))
def test_error_documents_of_any_body_raise_a_typed_error(body: str | bytes, status: int) -> None:
    """A node's error body, whatever it holds, becomes a KvbankError of kvbank.errors (a
    document can never name another class to build)."""
    raw = body.encode() if isinstance(body, str) else body
    with pytest.raises(KvbankError) as caught:
        raise_for(status, raw)
    assert type(caught.value).__module__ == "kvbank.errors"


@pytest.mark.parametrize("deep", DEEP, ids=["list", "object", "900-deep"])
def test_json_nested_past_the_depth_limit_is_a_typed_error_everywhere(app: Any, deep: bytes) -> None:
    """Regression: a put header or lease of nested brackets raised RecursionError (a 500
    on the node)."""
    for decode in (decode_put_header, decode_fetch_header, lambda d: wire.from_json(Lease, d)):
        with contextlib.suppress(InvalidInput):  # a value, or InvalidInput; nothing else
            decode(deep)
    with pytest.raises(KvbankError):
        raise_for(500, deep)
    head = PREFIX.pack(PUT_MAGIC, VERSION, len(deep)) + deep
    r = app.post("/v1/put", content=head, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 400 and r.json()["field"] == "header"
    for path in ("/v1/match", "/v1/layouts", "/v1/leases", "/v1/fetch"):
        r = app.post(path, content=deep, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500 and set(r.json()) == {"type", "field", "message"}, r.text


def test_a_fetch_stream_planning_rows_the_caller_has_no_buffer_for_is_refused(hostile: HostileServer) -> None:
    """Regression: a header naming another group or slot, or a row larger than its buffer,
    raised KeyError / IndexError out of the reader, or read the row short and took the rest
    of its bytes for the next frame."""
    for row in ([0, 5, 0, 8], [0, 0, 9, 8], [0, 0, 0, 65]):
        body, _ = _stream([tuple(row)], [(1, 0, None), (3, 0, 0)], None)  # type: ignore[list-item]
        hostile.answer = (f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
        conn = http.client.HTTPConnection("127.0.0.1", hostile.port, timeout=10)
        try:
            got = fetch_stream(conn, b"{}", {0: [memoryview(bytearray(64))]})
        finally:
            conn.close()
        assert got.got == [] and isinstance(got.error, InvalidInput) and "stream.rows" in str(got.error)


# ---- forged admin cursors ------------------------------------------------------------------


@FUZZ
@given(st.text(max_size=200))
def test_a_forged_rows_cursor_is_400_never_5xx(app: Any, cursor: str) -> None:
    r = app.get("/admin/rows", params={"cursor": cursor}, headers=auth())
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["field"] in ("cursor", "query.cursor"), r.text
