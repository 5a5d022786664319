"""Bad input, broken clients and a killed server, against a real ``kvbank serve``."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from kvbank import Client
from kvbank.errors import InvalidInput, TierUnavailable
from kvbank.service.launch import NodeProcess
from kvbank.wire.framing import PREFIX, PUT_MAGIC, PutHeader, PutKind, encode_put_prefix
from tests.service.conftest import start_node
from tests.service.worker import LAYOUT, PAGE, page, tokens

WORKER = str(Path(__file__).with_name("worker.py"))
ROOT = Path(__file__).parents[2]


def _raw(url: str, method: str, path: str, body: bytes = b"",
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, object]]:
    parts = urlsplit(url)
    assert parts.hostname is not None
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def _body(lid: bytes, n_pages: int, page_bytes: int = PAGE, seed: int = 1, cut: int = 0) -> bytes:
    toks = tokens(seed, n_pages)
    head = PutHeader(PutKind.PAGES, lid, "", "", "", 0, 0, None, None, len(toks), None, n_pages, page_bytes)
    full = encode_put_prefix(head) + b"".join(t.to_bytes(4, "little") for t in toks) + b"\x07" * (n_pages * page_bytes)
    return full[: len(full) - cut]


def _stored(url: str, seed: int, n_pages: int) -> int:
    with Client(url, same_host=False) as c:
        c.register(LAYOUT)  # layouts are declared by workers, again after a restart
        return c.match(LAYOUT.layout_id, [*tokens(seed, n_pages), 1]).resume.tokens


def _worker(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, text=True, cwd=ROOT)


def test_bad_input_answers_4xx_json_naming_the_field(node: NodeProcess) -> None:
    with Client(node.url) as c:
        lid = c.register(LAYOUT)
    status, doc = _raw(node.url, "POST", "/v1/put", _body(b"\x05" * 32, 1))
    assert status == 404 and doc["type"] == "UnknownLayout"
    status, doc = _raw(node.url, "POST", "/v1/put", _body(lid, 2, page_bytes=PAGE // 2))
    assert status == 400 and doc["type"] == "PageSizeMismatch" and doc["field"] == "header.page_bytes"
    status, doc = _raw(node.url, "POST", "/v1/put", b"KVBX" + bytes(8))
    assert status == 400 and doc["field"] == "body.magic"
    bad = PREFIX.pack(PUT_MAGIC, 1, 5) + b"{oops"
    status, doc = _raw(node.url, "POST", "/v1/put", bad)
    assert status == 400 and doc["field"] == "header"
    status, doc = _raw(node.url, "POST", "/v1/match", b'{"layout_id": 5}', {"Content-Type": "application/json"})
    assert status == 400 and doc["type"] == "InvalidInput" and doc["field"] == "layout_id"
    status, doc = _raw(node.url, "GET", "/v1/layouts/zz")
    assert status == 400 and doc["field"] == "layout_id"
    status, doc = _raw(node.url, "POST", "/v1/leases/x/renew", b"{}", {"Content-Type": "application/json"})
    assert status == 404 and doc["type"] == "LeaseNotFound"
    status, doc = _raw(node.url, "GET", "/v1/health", headers={f"x-h{i}": "1" for i in range(80)})
    assert status == 431 and doc["field"] == "headers"


def test_short_or_long_or_huge_bodies_store_nothing(node: NodeProcess) -> None:
    with Client(node.url) as c:
        lid = c.register(LAYOUT)
    body = _body(lid, 4, seed=31)
    status, doc = _raw(node.url, "POST", "/v1/put", body[:-100], {"Content-Length": str(len(body))})
    assert status == 400 and doc["field"] == "body"
    status, doc = _raw(node.url, "POST", "/v1/put", body[:-100])  # declared length is short
    assert status == 400 and doc["field"] == "body"
    status, doc = _raw(node.url, "POST", "/v1/put", body + b"extra")
    assert status == 400 and doc["field"] == "body"
    assert _stored(node.url, 31, 4) == 0
    huge = _body(lid, 2100, seed=32)  # ~69 MiB, over the node's 64M limit
    status, doc = _raw(node.url, "POST", "/v1/put", huge)
    assert status == 413 and doc["field"] == "body"
    status, _ = _raw(node.url, "POST", "/v1/put", body)
    assert status == 200 and _stored(node.url, 31, 4) == 64


def test_client_killed_mid_put_leaves_nothing_visible(node: NodeProcess) -> None:
    w = _worker("halfput", node.url)
    try:
        assert w.stdout is not None and w.stdout.readline().strip() == "sent-half"
    finally:
        w.kill()
        w.wait()
        if w.stdout is not None:
            w.stdout.close()
    with Client(node.url, same_host=False) as c:
        # A request after the disconnect is served, and none of the 8 rows is visible.
        assert c.match(LAYOUT.layout_id, [*tokens(77, 8), 1]).resume.tokens == 0
        deadline = time.monotonic() + 30
        while c.stats().live_leases and time.monotonic() < deadline:
            time.sleep(0.05)  # the node notices the disconnect and releases its WRITE lease
        assert c.stats().live_leases == 0
        assert c.match(LAYOUT.layout_id, [*tokens(77, 8), 1]).resume.tokens == 0


def test_client_killed_mid_fetch_resumes_under_its_fetch_id(node: NodeProcess) -> None:
    w = _worker("halffetch", node.url, "41")
    try:
        assert w.stdout is not None
        line = w.stdout.readline().split()
        assert line[0] == "fetch", line
        fid = line[1]
    finally:
        w.kill()
        w.wait()
        if w.stdout is not None:
            w.stdout.close()
    with Client(node.url, same_host=False) as c:
        m = c.match(LAYOUT.layout_id, [*tokens(41, 8), 1])
        out = torch.zeros((8, PAGE), dtype=torch.uint8)
        got = c.fetch(m, out={0: out}, fetch_id=fid)
    assert got.complete and got.fetch_id == fid
    assert got.nbytes == 5 * PAGE  # the 3 rows acknowledged before the kill are not resent
    for i in range(3, 8):
        assert out[i].numpy().tobytes() == page(41 * 100 + i)


def test_sigterm_with_requests_in_flight_finishes_them_and_exits_0(tmp_path: Path) -> None:
    proc = start_node(tmp_path)
    errors: list[BaseException] = []
    done: list[int] = []
    with Client(proc.url, same_host=False) as c:
        lid = c.register(LAYOUT)
        started = threading.Event()

        def put(i: int) -> None:
            try:
                started.set()
                c.put(lid, tokens(600 + i, 16), group=0, pages=[page(600 * 16 + i)] * 16)
                done.append(i)
            except TierUnavailable as exc:  # refused once the node stopped accepting
                errors.append(exc)

        threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        started.wait()
        code = proc.stop()
        for t in threads:
            t.join()
    assert code == 0, "".join(proc.lines)[-2000:]
    assert done, "no in-flight put finished"
    again = start_node(tmp_path)
    try:
        for i in done:  # what the node answered is on disk after the graceful close
            assert _stored(again.url, 600 + i, 16) == 16 * 16
    finally:
        assert again.stop() == 0


@pytest.mark.slow
def test_sigkill_during_1000_concurrent_puts_then_every_committed_row_reads_back(tmp_path: Path) -> None:
    # write-through: a put is answered once its row is on disk, so "answered" = durable.
    proc = start_node(tmp_path, "--threads", "8", "--write-policy", "write-through")
    w = _worker("hammer", proc.url, "1000")
    ok: list[tuple[int, str]] = []
    assert w.stdout is not None
    for line in w.stdout:
        parts = line.split()
        if parts and parts[0] == "ok":
            ok.append((int(parts[1]), parts[2]))
        if len(ok) == 300:
            proc.kill()  # mid-run, with puts in flight
            break
    w.wait(timeout=120)
    w.stdout.close()
    again = start_node(tmp_path)
    try:
        with Client(again.url) as c:
            # Every put the node answered is readable bit-exactly after the crash: rows
            # committed before the kill were on disk, or the node had not answered.
            lid = c.register(LAYOUT)
            lost = 0
            for i, _hex in ok:
                m = c.match(lid, [*tokens(1000 + i, 1), 1])
                if m.resume.tokens == 0:
                    lost += 1
                    continue
                buf = bytearray(PAGE)
                assert c.fetch(m, out={0: [buf]}).complete
                assert bytes(buf) == page(5000 + i)
    finally:
        assert again.stop() == 0
    assert lost == 0, f"{lost} of {len(ok)} answered puts lost"


def test_transport_failure_is_tier_unavailable() -> None:
    with Client("http://127.0.0.1:9", retry_s=0.2) as c, pytest.raises(TierUnavailable):
        c.stats()
    with pytest.raises(InvalidInput, match="url"):
        Client("ftp://x")


def test_a_full_tier_is_507_with_the_reason(node: NodeProcess) -> None:
    """A WRITE lease larger than the node's whole host tier (96M) cannot be had: 507, and
    the client raises TierFull, as Bank.lend does."""
    from kvbank import LeaseMode, full_attention
    from kvbank.errors import TierFull
    from kvbank.keys import DEFAULT_SCOPE, namespace, page_keys, row_names

    big = full_attention("faults-big@1", num_layers=32, num_kv_heads=8, head_dim=128)  # 2 MiB
    toks = list(range(64 * 16))
    names = row_names(namespace(big.layout_id, DEFAULT_SCOPE), page_keys(toks, 16), 0, 1, 0)
    with Client(node.url, same_host=False) as c:
        c.register(big)
        before = c.stats().live_leases
        with pytest.raises(TierFull, match="host"):
            c.lend(names, mode=LeaseMode.WRITE)
        assert c.stats().live_leases == before  # a refused lend holds nothing
    status, doc = _raw(node.url, "POST", "/v1/leases",
                       json.dumps({"names": [n.hex() for n in names], "mode": "WRITE"}).encode(),
                       {"Content-Type": "application/json"})
    assert status == 507 and doc["type"] == "TierFull" and doc["message"]


def test_every_error_class_has_a_status_and_bad_input_is_never_5xx() -> None:
    import kvbank.errors as errors
    from kvbank.service.app import status_of

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.KvbankError)]
    for cls in classes:
        status = status_of(cls("x: y"))
        if issubclass(cls, (errors.InvalidInput, errors.ConfigError, errors.UnknownLayout,
                            errors.LeaseError, errors.FetchNotFound)):
            assert 400 <= status < 500, cls
    assert status_of(errors.TierFull("x")) == 507 and status_of(errors.Busy("x")) == 503
