"""A streamed fetch's READ leases end only at *that stream's* acknowledgement.

The transport may still send from a slot after the last ``write()`` returned (uvloop
keeps a pointer to the slot, not a copy), so a lease that ends early lets the slot go to
another row while its old bytes are still on the way: the client would read another
row's bytes. These tests drive :class:`kvbank.service.node.Node` over a real bank (host
and disk tiers) the way :class:`kvbank.service.stream.RowStream` does, one call at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbank import Bank, full_attention
from kvbank.config import BankConfig
from kvbank.errors import InvalidInput, LeaseNotFound
from kvbank.lender.base import LeaseMode, MemoryKind
from kvbank.results import Match
from kvbank.service.config import ServiceConfig
from kvbank.service.node import Node

LAYOUT = full_attention("streamleases@1", num_layers=2, num_kv_heads=2, head_dim=64)
PAGE = LAYOUT.group_page_bytes[0]
TOKENS = list(range(5000, 5000 + 4 * LAYOUT.tokens_per_page))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Node, Match]]:
    cfg = BankConfig(data_dir=tmp_path, host_bytes=64 << 20, disk_bytes=256 << 20, device_bytes=0)
    bank = Bank(cfg)
    n = Node(bank, ServiceConfig(bank=cfg))
    try:
        lid = bank.register(LAYOUT)
        bank.put(lid, TOKENS, group=0, pages=[bytes([i + 1]) * PAGE for i in range(4)])
        yield n, bank.match(lid, [*TOKENS, 1])
    finally:
        n.close()
        bank.close()


def _stream_all(n: Node, match: Match, fetch_id: str | None = None) -> tuple[str, str, str]:
    """Open a stream and 'send' every row under one READ lease, as RowStream does."""
    opened = n.open_fetch(match, fetch_id, None)
    lease = n.bank.lend(opened.names, mode=LeaseMode.READ, kind=MemoryKind.HOST)
    n.hold(opened.fetch_id, opened.stream, lease.id, list(opened.names))
    return opened.fetch_id, opened.stream, lease.id


def test_a_resume_never_ends_another_streams_leases(node: tuple[Node, Match]) -> None:
    n, m = node
    fid, a, lease_a = _stream_all(n, m)
    # A second stream of the same fetch id opens while A's bytes may still be in flight.
    again = n.open_fetch(m, fid, None)
    assert again.stream != a and again.fetch_id == fid
    n.bank.check_live(lease_a)  # raised LeaseNotFound when the resume ended A's leases
    result = n.acknowledge(fid, [0, 1, 2, 3], None, a)
    assert result.complete and result.nbytes == 4 * PAGE
    with pytest.raises(LeaseNotFound):
        n.bank.check_live(lease_a)  # A's acknowledgement released it


def test_an_ack_counts_only_rows_its_own_stream_sent(node: tuple[Node, Match]) -> None:
    n, m = node
    fid, a, lease_a = _stream_all(n, m)
    b = n.open_fetch(m, fid, None).stream  # sends nothing
    # B's client claims every row: none came in B, so none counts, and A's lease stays.
    result = n.acknowledge(fid, [0, 1, 2, 3], None, b)
    assert not result.complete and result.nbytes == 0
    n.bank.check_live(lease_a)
    assert n.acknowledge(fid, [0, 1], None, a).nbytes == 2 * PAGE
    with pytest.raises(InvalidInput, match="stream"):
        n.acknowledge(fid, [2], None, a)  # acknowledged once: the stream is closed
    with pytest.raises(InvalidInput, match="stream"):
        n.acknowledge(fid, [2], None, None)  # rows without the stream they came in


def test_an_expired_lease_makes_its_rows_a_miss(tmp_path: Path) -> None:
    now = [0.0]
    cfg = BankConfig(data_dir=tmp_path, host_bytes=64 << 20, disk_bytes=256 << 20, device_bytes=0)
    bank = Bank(cfg, clock=lambda: now[0], reaper=False)
    n = Node(bank, ServiceConfig(bank=cfg))
    try:
        lid = bank.register(LAYOUT)
        bank.put(lid, TOKENS, group=0, pages=[bytes([7]) * PAGE] * 4)
        fid, a, _ = _stream_all(n, bank.match(lid, [*TOKENS, 1]))
        now[0] += cfg.lease_ttl_s + 1  # the client read slowly: the lease ran out meanwhile
        result = n.acknowledge(fid, [0, 1, 2, 3], None, a)
        assert result.nbytes == 0 and not result.complete  # what it sent may be another row's
    finally:
        n.close()
        bank.close()


def test_a_stream_the_node_forgot_keeps_its_lease_to_its_ttl(node: tuple[Node, Match]) -> None:
    n, m = node
    opened = n.open_fetch(m, None, None)
    lease = n.bank.lend(opened.names, mode=LeaseMode.READ, kind=MemoryKind.HOST)
    n.hold("no-such-fetch", opened.stream, lease.id, list(opened.names))
    n.bank.check_live(lease.id)  # not released under a transport that may still send
    n.bank.release(lease.id)
