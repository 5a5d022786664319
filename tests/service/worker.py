"""A client process for the service tests: ``python tests/service/worker.py MODE URL ...``.

Modes (each prints one line per event, flushed, so the parent can kill it at a known point):

- ``halfput URL`` — register, send a put body's header and half its pages, print
  ``sent-half``, then wait to be killed.
- ``halffetch URL SEED`` — put 8 pages, fetch 3 (acknowledged), then open a stream for the
  rest, read one row, print ``fetch <id>`` and wait to be killed.
- ``hammer URL N`` — N concurrent puts (32 threads) of one page each; ``ok <hex>`` for
  every put the node answered.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import torch

from kvbank import Client, full_attention
from kvbank.wire.framing import PutHeader, PutKind, encode_put_prefix

LAYOUT = full_attention("worker@1", num_layers=2, num_kv_heads=4, head_dim=64)
PAGE = LAYOUT.group_page_bytes[0]


def page(tag: int) -> bytes:
    block = hashlib.sha256(tag.to_bytes(8, "little")).digest()
    return (block * (PAGE // 32 + 1))[:PAGE]


def tokens(seed: int, n_pages: int) -> list[int]:
    return [seed * 100_000 + i for i in range(n_pages * LAYOUT.tokens_per_page)]


def _say(text: str) -> None:
    print(text, flush=True)


def halfput(url: str) -> None:
    with Client(url) as c:
        lid = c.register(LAYOUT)
    toks = tokens(77, 8)
    head = PutHeader(PutKind.PAGES, lid, "", "", "", 0, 0, None, None, len(toks), None, 8, PAGE)
    body = encode_put_prefix(head) + b"".join(t.to_bytes(4, "little") for t in toks)
    parts = urlsplit(url)
    assert parts.hostname is not None
    conn = http.client.HTTPConnection(parts.hostname, parts.port)
    conn.putrequest("POST", "/v1/put")
    conn.putheader("Content-Length", str(len(body) + 8 * PAGE))
    conn.endheaders(body)
    for i in range(4):
        conn.send(page(i))
    _say("sent-half")
    time.sleep(600)


def halffetch(url: str, seed: int) -> None:
    with Client(url, same_host=False) as c:
        lid = c.register(LAYOUT)
        toks = tokens(seed, 8)
        c.put(lid, toks, group=0, pages=[page(seed * 100 + i) for i in range(8)])
        m = c.match(lid, [*toks, 1])
        out = torch.zeros((8, PAGE), dtype=torch.uint8)
        first = c.fetch(m, out={0: out}, max_rows=3)
        parts = urlsplit(url)
        assert parts.hostname is not None
        conn = http.client.HTTPConnection(parts.hostname, parts.port)
        from kvbank import wire

        req = {"match": wire.to_dict(m), "fetch_id": first.fetch_id, "max_rows": None, "via": "stream"}
        conn.request("POST", "/v1/fetch", body=json.dumps(req).encode())
        resp = conn.getresponse()
        resp.readinto(memoryview(bytearray(64)))  # the prefix and a little of the stream
        _say(f"fetch {first.fetch_id}")
        time.sleep(600)


def hammer(url: str, n: int) -> None:
    with Client(url, same_host=False) as c:
        lid = c.register(LAYOUT)

        def one(i: int) -> None:
            names = c.put(lid, tokens(1000 + i, 1), group=0, pages=[page(5000 + i)])
            _say(f"ok {i} {names[0].hex()}")

        with ThreadPoolExecutor(32) as pool:
            for f in [pool.submit(one, i) for i in range(n)]:
                try:
                    f.result()
                except Exception as exc:  # the node is killed mid-run: report and go on
                    _say(f"err {type(exc).__name__}")


if __name__ == "__main__":
    mode, url = sys.argv[1], sys.argv[2]
    if mode == "halfput":
        halfput(url)
    elif mode == "halffetch":
        halffetch(url, int(sys.argv[3]))
    elif mode == "hammer":
        hammer(url, int(sys.argv[3]))
    else:
        raise SystemExit(f"unknown mode {mode}")
