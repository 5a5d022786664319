"""A peer fetch storing rows a local lease holds locked: found by the fleet soak, where a
fetch's READ lease on a row and a peer fetch covering the same row met, and the match
raised ``RowLocked`` instead of answering."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbank import Client, full_attention
from kvbank.service.launch import NodeProcess
from tests.service.conftest import start_node

from .fleet_helpers import Redis, health, require_redis, wait_for

LAYOUT = full_attention("fleet-locked@1", num_layers=2, num_kv_heads=2, head_dim=64)
PAGE = LAYOUT.group_page_bytes[0]
P = 16


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    require_redis()
    rds = Redis()
    procs: list[NodeProcess] = []
    try:
        for tag in ("a", "b"):
            procs.append(start_node(tmp_path / tag, "--redis", rds.url))
            wait_for(lambda: health(procs[-1]).get("fleet", {}).get("state") == "ok", 30,
                     "the node to join")
        yield procs[0], procs[1]
    finally:
        for p in procs:
            p.stop()
        rds.close()


def test_fleet_peer_fetch_over_rows_a_local_reader_holds_answers_not_row_locked(
        two_nodes: tuple[NodeProcess, NodeProcess]) -> None:
    """B holds the first two of A's four rows itself, under a READ lease; B's match
    fetches the prompt's bound from A, which covers those two again. The match answers
    (no ``RowLocked`` from storing over a leased row): the locked rows are skipped, as
    equal names hold equal bytes, the other two are kept, and all four fetch bit-exact."""
    a, b = two_nodes
    data = torch.from_numpy(np.random.default_rng(5).integers(0, 256, (4, PAGE), dtype=np.uint8))
    toks = list(range(3000, 3000 + 4 * P))
    with Client(a.url, same_host=False) as ca:
        lid = ca.register(LAYOUT)
        names = ca.put(lid, toks, group=0, pages=data)
    wait_for(lambda: int(health(a)["fleet"]["published"]) >= 4, 10, "A to publish")
    with Client(b.url) as cb:
        cb.register(LAYOUT)
        cb.put(lid, toks[: 2 * P], group=0, pages=data[:2])
        reader = cb.lend(names[:2])
        try:
            m = cb.match(lid, [*toks, 1])
        finally:
            cb.release(reader.id)
        assert m.resume.tokens == 4 * P
        out = torch.zeros((4, PAGE), dtype=torch.uint8)
        res = cb.fetch(m, out={0: out})
        assert res.complete and torch.equal(out, data)
