"""The same-host (shared memory) and TCP paths forced each way and compared byte for
byte, with 2 MiB pages, rows staged back from disk, and many clients at once; a raw
lease's answer carries what a worker needs to verify its reads."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbank import Client, full_attention, wire
from kvbank.client.shm import Borrower
from kvbank.codec.frame import checksum
from kvbank.errors import PageSizeMismatch
from kvbank.lender.base import Lease, LeaseMode, MemoryKind
from kvbank.service.launch import NodeProcess

# 2 MiB pages: 32 layers x (K+V) x 8 heads x 128 dims x 16 tokens x 2 bytes
BIG = full_attention("paths@1", num_layers=32, num_kv_heads=8, head_dim=128)
BIG_PAGE = BIG.group_page_bytes[0]


def pages(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, BIG_PAGE), dtype=np.uint8))


@pytest.fixture(scope="module")
def small_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A node whose host tier holds 24 of the 2 MiB pages: the rest live on disk."""
    data: Path = tmp_path_factory.mktemp("paths")
    proc = NodeProcess.start(["--data-dir", str(data), "--host-bytes", "48M", "--disk-bytes", "1G",
                              "--device-bytes", "0", "--max-body-bytes", "256M"])
    yield proc
    assert proc.stop() == 0, "".join(proc.lines)[-3000:]


def test_paths_agree_byte_for_byte_with_2mib_pages(node: NodeProcess) -> None:
    assert BIG_PAGE == 2 << 20
    data = pages(16, 1)
    toks = list(range(100, 100 + 16 * 16))
    with Client(node.url, same_host=True) as shm, Client(node.url, same_host=False) as tcp:
        lid = shm.register(BIG)
        names = shm.put(lid, toks[: 8 * 16], group=0, pages=data[:8])  # WRITE lease, in place
        assert tcp.put(lid, toks, group=0, pages=data[8:], first_page=8) == tcp.put(
            lid, toks, group=0, pages=data[8:], first_page=8)
        m = tcp.match(lid, [*toks, 1])
        assert m.resume.tokens == 256 and len(names) == 8
        a = torch.zeros((16, BIG_PAGE), dtype=torch.uint8)
        b = torch.ones((16, BIG_PAGE), dtype=torch.uint8)
        ra = shm.fetch(m, out={0: a})
        rb = tcp.fetch(m, out={0: b})
    assert ra.complete and rb.complete and ra.nbytes == rb.nbytes == 16 * BIG_PAGE
    assert torch.equal(a, data) and torch.equal(b, data)


def test_paths_through_the_disk_tier_and_many_clients(small_node: NodeProcess) -> None:
    """64 pages on a node whose host tier holds 24: fetches stage rows back from disk in
    batches while earlier batches are on the wire; slots are reused under the stream, so
    a view released before the transport sent it would show here as wrong bytes."""
    data = pages(64, 2)
    toks = list(range(9000, 9000 + 64 * 16))
    digest = [hashlib.sha256(data[i].numpy().tobytes()).hexdigest() for i in range(64)]
    with Client(small_node.url, same_host=False) as c:
        lid = c.register(BIG)
        for k in range(0, 64, 8):
            c.put(lid, toks, group=0, pages=data[k : k + 8], first_page=k)
        m = c.match(lid, [*toks, 1])
        assert m.resume.tokens == 64 * 16

    def fetch(i: int) -> list[str]:
        with Client(small_node.url, same_host=bool(i % 2)) as cl:
            out = torch.zeros((64, BIG_PAGE), dtype=torch.uint8)
            got = cl.fetch(m, out={0: out})
            assert got.complete, got.missing
            return [hashlib.sha256(out[j].numpy().tobytes()).hexdigest() for j in range(64)]

    with ThreadPoolExecutor(4) as pool:
        for result in pool.map(fetch, range(4)):
            assert result == digest


def test_local_channel_fetches_more_rows_than_the_host_tier_can_lend_at_once(
        small_node: NodeProcess) -> None:
    """40 pages on a node whose host tier holds 24: the local channel cannot lend them all
    in one lease (TierFull), so fetch and fetch_prefix go on as the HTTP path does, the
    stream sending them in batches, and every byte arrives."""
    data = pages(40, 5)
    toks = list(range(70_000, 70_000 + 40 * 16))
    with Client(small_node.url, same_host=False) as c:
        lid = c.register(BIG)
        for k in range(0, 40, 8):
            c.put(lid, toks, group=0, pages=data[k : k + 8], first_page=k)
    with Client(small_node.url, channel="local") as cl:
        assert cl._local_memory() is not None  # the channel, with the host memory passed
        m = cl.match(lid, [*toks, 1])
        assert m.resume.tokens == 40 * 16
        out = torch.zeros((40, BIG_PAGE), dtype=torch.uint8)
        got = cl.fetch(m, out={0: out})
        assert got.complete, got.missing
        assert torch.equal(out, data)
        out2 = torch.zeros((40, BIG_PAGE), dtype=torch.uint8)
        f = cl.fetch_prefix(lid, [*toks, 1], out={0: out2})
        assert f.match.resume.tokens == 40 * 16
        assert f.result is not None and f.result.complete, f.result
        assert torch.equal(out2, data)


def test_fetch_of_disk_rows_completes_while_other_readers_hold_the_host_tier(
        small_node: NodeProcess) -> None:
    """Rows on disk are still served whole when another client's READ leases hold every
    host slot: the stream copies them out without needing a host slot, never as MISSING."""
    data = pages(40, 4)
    toks = list(range(50_000, 50_000 + 40 * 16))
    with Client(small_node.url, same_host=False) as c:
        lid = c.register(BIG)
        for k in range(0, 40, 8):
            c.put(lid, toks, group=0, pages=data[k : k + 8], first_page=k)
        m = c.match(lid, [*toks, 1])
        assert m.resume.tokens == 40 * 16
        held = c.lend(m.needed[-24:])  # every host slot, held by a reader
        try:
            out = torch.zeros((40, BIG_PAGE), dtype=torch.uint8)
            got = c.fetch(m, out={0: out})
            assert got.complete, got.missing
            assert torch.equal(out, data)
        finally:
            c.release(held.id)


def test_client_checks_page_sizes_before_sending(node: NodeProcess) -> None:
    with Client(node.url, same_host=False) as c:
        lid = c.register(BIG)
        with pytest.raises(PageSizeMismatch, match="pages"):
            c.put(lid, list(range(32)), group=0, pages=[bytes(BIG_PAGE - 1)])


def test_stream_holds_its_read_leases_until_the_ack(node: NodeProcess) -> None:
    """The transport may still send from a slot after its last write() returned (uvloop
    keeps a pointer, not a copy), so a streamed fetch's leases end only at the ack."""
    from kvbank.client import io as client_io
    from kvbank.client.client import Client as C

    data = pages(4, 3)
    toks = list(range(30_000, 30_000 + 4 * 16))
    with C(node.url, same_host=False) as c:
        lid = c.register(BIG)
        c.put(lid, toks, group=0, pages=data)
        m = c.match(lid, [*toks, 1])
        before = c.stats().live_leases
        out = torch.zeros((4, BIG_PAGE), dtype=torch.uint8)
        views = {0: [memoryview(out.numpy()[i]) for i in range(4)]}
        import json

        from kvbank import wire

        conn = c._conn()
        body = json.dumps({"match": wire.to_dict(m), "fetch_id": None, "max_rows": None, "via": "stream"})
        read = client_io.fetch_stream(conn, body.encode(), views)
        conn.close()
        got, fid = read.got, read.fetch_id
        assert read.error is None and fid is not None and sorted(got) == [0, 1, 2, 3]
        assert c.stats().live_leases > before  # streamed, not yet acknowledged
        result = c._ack(fid, got, None, read.stream)
        assert result.complete and torch.equal(out, data)
        assert c.stats().live_leases == before


def test_paths_map_host_then_put_and_fetch_agree(node: NodeProcess) -> None:
    """A worker that maps the node's (resident) segment up front, its page tables built
    before the first put, still puts and fetches exactly the bytes given."""
    data = pages(4, 7)
    toks = list(range(9_000, 9_000 + 4 * 16))
    with Client(node.url, same_host=True) as shm:
        assert shm.map_host(wait_s=120.0) is True
        lid = shm.register(BIG)
        shm.put(lid, toks, group=0, pages=data)
        m = shm.match(lid, [*toks, 1])
        out = torch.zeros((4, BIG_PAGE), dtype=torch.uint8)
        assert shm.fetch(m, out={0: out}).complete
    assert torch.equal(out, data)
    with Client(node.url, same_host=False) as tcp:
        assert tcp.map_host() is False  # the TCP path maps nothing


def test_a_raw_read_lease_carries_each_rows_checksum(node: NodeProcess) -> None:
    """A worker that takes a READ HOST lease over HTTP (``POST /v1/leases``, not the
    local channel) can verify what it reads: the answer's ``sums`` hold, in the lease's
    row order, each row's checksum, equal to the checksum of the bytes read through the
    lease (and of the page put); a row with no bytes in the lease has none, and a WRITE
    lease's answer carries none."""
    data = pages(3, 21)
    toks = list(range(70_000, 70_000 + 3 * 16))
    with Client(node.url, same_host=False) as c:
        lid = c.register(BIG)
        names = c.put(lid, toks, group=0, pages=data)
        absent = bytes(names[0][:-1]) + bytes([names[0][-1] ^ 1])  # a row never stored
        doc = c._call("POST", "/v1/leases", body={"names": [n.hex() for n in [*names, absent]],
                                                  "mode": "READ", "kind": "HOST"})
        try:
            lease = wire.from_dict(Lease, doc)
            sums = list(lease.sums)
            assert [r.name for r in lease.rows] == [*names, absent] and len(sums) == 4
            with Borrower() as b:
                read = [bytes(b.view(lease, n)) for n in names]
            assert sums[3] is None
            for i in range(3):
                assert read[i] == bytes(data[i].numpy())
                assert sums[i] == f"{checksum(read[i]):016x}"
        finally:
            c.release(doc["id"])
        wdoc = c._call("POST", "/v1/leases", body={"names": [absent.hex()], "mode": "WRITE"})
        c.release(wdoc["id"])
        assert wdoc["sums"] == []


@pytest.mark.parametrize("channel", ["local", "http"])
def test_a_client_lease_carries_each_rows_checksum(node: NodeProcess, channel: str) -> None:
    """``Client.lend`` of a READ HOST lease, on the local channel and over HTTP, hands
    the reader each row's checksum (``Lease.sums``, ``Lease.checksums()``): equal to the
    checksum of the bytes read through the lease, and so does its renewal; a WRITE lease
    carries none."""
    data = pages(2, 23)
    toks = list(range(80_000, 80_000 + 2 * 16))
    with Client(node.url, channel=channel) as c:
        lid = c.register(BIG)
        names = c.put(lid, toks, group=0, pages=data)
        lease = c.lend(names, mode=LeaseMode.READ, kind=MemoryKind.HOST)
        try:
            with Borrower() as b:
                read = [bytes(b.view(lease, n)) for n in names]
            assert read == [bytes(d.numpy()) for d in data]
            assert lease.checksums() == {n: checksum(r) for n, r in zip(names, read, strict=True)}
            renewed = c.renew(lease.id, ttl_s=60)  # the new snapshot carries them too
            assert renewed.sums == lease.sums and renewed.expires_at >= lease.expires_at
        finally:
            c.release(lease.id)
        absent = bytes(names[0][:-1]) + bytes([names[0][-1] ^ 1])
        w = c.lend([absent], mode=LeaseMode.WRITE, kind=MemoryKind.HOST)
        c.release(w.id)
        assert w.sums == () and w.checksums() == {}
