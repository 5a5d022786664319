"""A served node's read counters against what its clients saw, path by path.

Every row a fetch serves counts once in the node's ``gets``, as a hit (in the tier that
served it, a miss in each faster tier) or as a miss: over shared memory, the data port,
the HTTP stream (from READ leases, or from private copies when the host tier cannot
hold a batch), and ``fetch_prefix`` on each. Peer fetches and remote recalls are in
``tests/service/fleet/test_fleet.py``. ``gets == hits + misses`` throughout. Rows whose
host bytes fail their checksum are dropped, and counted once each, on every path.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from kvbank import Client, full_attention, wire
from kvbank.client.shm import Borrower
from kvbank.errors import KvbankError
from kvbank.lender.base import Lease
from kvbank.results import StoreStats
from kvbank.service.launch import NodeProcess
from kvbank.tiers.base import TierKind

from .conftest import admin_headers, start_node

LAYOUT = full_attention("counters@1", num_layers=1, num_kv_heads=2, head_dim=64)
PAGE = LAYOUT.group_page_bytes[0]
P = 16  # tokens per page


def _pages(n: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, PAGE), dtype=np.uint8))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    proc = start_node(tmp_path_factory.mktemp("counters"))
    yield proc
    assert proc.stop() == 0, "".join(proc.lines)[-3000:]


CLIENTS = {
    "shm": {"same_host": True},
    "data": {"same_host": False, "data_plane": True},
    "stream": {"same_host": False, "data_plane": False},
}


def _delta(before: StoreStats, after: StoreStats) -> tuple[int, int, int, int]:
    host = after.tier(TierKind.HOST).hits - before.tier(TierKind.HOST).hits
    return after.gets - before.gets, after.hits - before.hits, after.misses - before.misses, host


def _metric(node: NodeProcess, name: str) -> float:
    text = httpx.get(node.url + "/metrics", headers=admin_headers(node), timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return 0.0 if m is None else float(m.group(1))


MOVED = {"shm": "shm", "data": "data", "stream": "tcp"}  # the path label of each client's bytes


@pytest.mark.parametrize("path", sorted(CLIENTS))
def test_served_fetches_count_every_row_once_as_the_client_saw_it(
        served: NodeProcess, path: str) -> None:
    """6 rows fetched by match + fetch, then by ``fetch_prefix``: 12 gets, 12 hits (all in
    the host tier), 0 misses; then 2 of 6 rows evicted between match and fetch: the 2
    the client saw missing are the node's 2 misses. ``/metrics`` agrees."""
    seed = sorted(CLIENTS).index(path)
    data = _pages(6, seed)
    toks = list(range(10_000 * (seed + 1), 10_000 * (seed + 1) + 6 * P))
    with Client(served.url, **CLIENTS[path]) as c:  # type: ignore[arg-type]
        lid = c.register(LAYOUT)
        names = c.put(lid, toks, group=0, pages=data)
        before = c.stats().store
        out_label = f'kvbank_moved_bytes_total{{direction="out",path="{MOVED[path]}"}}'
        moved = _metric(served, out_label)
        m = c.match(lid, [*toks, 1])
        out = torch.zeros((6, PAGE), dtype=torch.uint8)
        got = c.fetch(m, out={0: out})
        assert got.complete and torch.equal(out, data)
        pre = c.fetch_prefix(lid, [*toks, 1]).result
        assert pre is not None and pre.complete and pre.nbytes == 6 * PAGE
        mid = c.stats().store
        assert _delta(before, mid) == (12, 12, 0, 12)
        assert mid.gets == mid.hits + mid.misses
        m = c.match(lid, [*toks, 1])
        gone = httpx.post(served.url + "/admin/evict", headers=admin_headers(served), timeout=10,
                          json={"names": [n.hex() for n in names[4:]]})
        assert gone.status_code == 200 and len(gone.json()["evicted"]) == 2, gone.text
        got = c.fetch(m, out={0: torch.zeros((6, PAGE), dtype=torch.uint8)})
        assert sum(map(len, got.delivered)) == 4 and sum(map(len, got.missing)) == 2
        after = c.stats().store
        assert _delta(mid, after) == (6, 4, 2, 4)
    assert _metric(served, "kvbank_gets_total") == after.gets
    assert _metric(served, "kvbank_hits_total") == after.hits
    # bytes served, once each: the page bytes of the 16 rows delivered, on every path
    # (a stream's frames and its padding for the 2 missing rows are not served bytes)
    assert _metric(served, out_label) - moved == 16 * PAGE


def test_streamed_rows_copied_out_privately_count_once(tmp_path: Path) -> None:
    """A node whose host tier holds fewer rows than one stream batch: the stream copies
    its rows out with ``Bank.get_into`` (counted by the store itself), never twice."""
    node = start_node(tmp_path, "--host-bytes", "64K")
    try:
        data = _pages(16, 7)
        toks = list(range(16 * P))
        with Client(node.url, same_host=False, data_plane=False) as c:
            lid = c.register(LAYOUT)
            c.put(lid, toks, group=0, pages=data)
            c.flush()
            before = c.stats().store
            m = c.match(lid, [*toks, 1])
            out = torch.zeros((16, PAGE), dtype=torch.uint8)
            got = c.fetch(m, out={0: out})
            assert got.complete and torch.equal(out, data)
            after = c.stats().store
        gets, hits, misses, _ = _delta(before, after)
        assert (gets, hits, misses) == (16, 16, 0)
        disk = after.tier(TierKind.DISK).hits - before.tier(TierKind.DISK).hits
        host = after.tier(TierKind.HOST).hits - before.tier(TierKind.HOST).hits
        assert disk + host == 16 and disk > 0
    finally:
        assert node.stop() == 0


def _scribble(c: Client, names: list[bytes]) -> None:
    """Overwrite the first 64 bytes of each row's host copy in the node's segment, as
    another process of the node's uid can (an untenanted node names its segment): the
    rows' slots found through a raw READ lease, released before the writes."""
    doc = c._call("POST", "/v1/leases", body={"names": [n.hex() for n in names], "mode": "READ"})
    try:
        lease = wire.from_dict(Lease, doc)
    finally:
        c.release(doc["id"])
    with Borrower(writable=True) as b:
        for n in names:
            b.view(lease, n)[:64] = b"\xee" * 64


@pytest.mark.parametrize("path", sorted(CLIENTS))
def test_rows_that_fail_their_checksum_are_dropped_and_counted_once_each(
        served: NodeProcess, path: str) -> None:
    """2 of 5 committed rows changed in the host segment: a fetch on each path leaves
    exactly those 2 out (the client's check on shared memory, the node's own before it
    sends over the data port or the stream), the node drops their host copies, and the
    host tier's ``corrupt_rows`` and ``kvbank_tier_corrupt_frames_total{tier="host"}``
    rise by exactly 2; a second fetch drops nothing more."""
    seed = 10 + sorted(CLIENTS).index(path)
    data = _pages(5, seed)
    toks = list(range(10_000 * (seed + 1), 10_000 * (seed + 1) + 5 * P))
    label = 'kvbank_tier_corrupt_frames_total{tier="host"}'
    with Client(served.url, **CLIENTS[path]) as c:  # type: ignore[arg-type]
        lid = c.register(LAYOUT)
        names = c.put(lid, toks, group=0, pages=data)
        before, metric = c.stats().store.tier(TierKind.HOST).corrupt_rows, _metric(served, label)
        _scribble(c, [names[1], names[3]])
        m = c.match(lid, [*toks, 1])
        out = torch.zeros((5, PAGE), dtype=torch.uint8)
        try:
            got = c.fetch(m, out={0: out})
            kept = [m.resume.pages[0].index(k) for k in got.delivered[0]]
        except KvbankError:  # the data port refuses a transfer the node's check failed
            assert path == "data"
            kept = []
        assert 1 not in kept and 3 not in kept
        for i in kept:
            assert torch.equal(out[i], data[i])
        after = c.stats().store.tier(TierKind.HOST)
        assert after.corrupt_rows - before == 2
        assert _metric(served, label) - metric == 2
        c.fetch_prefix(lid, [*toks, 1])  # the dropped rows are gone: nothing more to drop
        assert c.stats().store.tier(TierKind.HOST).corrupt_rows - before == 2
