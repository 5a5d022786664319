"""``/metrics`` after a known workload, parsed with ``prometheus_client.parser``: request
counts per route template, bytes moved per direction and path, the bank's counters;
its own registry per node; behind the admin token with ``metrics_auth``; off entirely."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from kvbank import Scope, wire
from kvbank.client.io import put_head
from kvbank.wire.framing import PREFIX, PutKind, decode_fetch_header
from tests.service.admin_app import FA, PAGE, P, auth, served


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_a_known_workload(tmp_path: Path) -> None:
    with served(tmp_path) as (client, _):
        client.post("/v1/layouts", json={"layout": wire.to_dict(FA)})
        tokens = list(range(3 * P))
        pages = [memoryview(np.full(PAGE, i, dtype=np.uint8).tobytes()) for i in range(3)]
        head = put_head(PutKind.PAGES, FA.layout_id, tokens, None, Scope(), 0, 0, None, None, pages, PAGE)
        body = head + b"".join(bytes(p) for p in pages)
        r = client.post("/v1/put", content=body, headers={"content-type": "application/octet-stream"})
        assert r.status_code == 200, r.text
        for _ in range(3):
            m = client.post("/v1/match", json={"layout_id": FA.layout_id.hex(), "tokens": [*tokens, 1]})
            assert m.status_code == 200
        stream = client.post("/v1/fetch", json={"match": m.json()})
        assert stream.status_code == 200 and len(stream.content) > 3 * PAGE
        head = PREFIX.size + PREFIX.unpack_from(stream.content)[2]
        fid, sid, rows = decode_fetch_header(stream.content[PREFIX.size:head])
        ack = client.post(f"/v1/fetch/{fid}/ack", json={"rows": [r.position for r in rows], "stream": sid})
        assert ack.status_code == 200 and ack.json()["complete"], ack.text
        client.post("/v1/match", json={"layout_id": "zz", "tokens": [1]})  # a 400
        text = client.get("/metrics").text
        s = _samples(text)
        req = "kvbank_requests_total"
        assert s[(req, (("code", "200"), ("method", "POST"), ("route", "/v1/match")))] == 3
        assert s[(req, (("code", "400"), ("method", "POST"), ("route", "/v1/match")))] == 1
        assert s[("kvbank_request_duration_seconds_count",
                  (("method", "POST"), ("route", "/v1/match")))] == 4
        assert s[("kvbank_moved_bytes_total", (("direction", "in"), ("path", "tcp")))] == len(body)
        # bytes served: the page bytes of the rows acknowledged whole (not the frames)
        assert s[("kvbank_moved_bytes_total", (("direction", "out"), ("path", "tcp")))] == 3 * PAGE
        assert s[("kvbank_puts_total", ())] == 3
        assert s[("kvbank_tier_rows", (("tier", "host"),))] == 3
        assert s[("kvbank_rows", ())] == 3 and s[("kvbank_ready", ())] == 1
        assert s[("kvbank_leases", ())] == 0  # the stream's READ lease, released at its ack
        assert all(k[0].startswith("kvbank_") for k in s)
        # its own registry: nothing of it in the process-global one
        assert not any(m.name.startswith("kvbank") for m in REGISTRY.collect())


def test_metrics_behind_the_admin_token_or_off(tmp_path: Path) -> None:
    with served(None, metrics_auth=True) as (client, _):
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=auth()).status_code == 200
    with served(None, metrics=False) as (client, _):
        assert client.get("/metrics").status_code == 404
