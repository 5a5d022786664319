"""A real ``kvbank serve`` restarted on the same data dir: registered layouts come back
with the rows (no worker registers again), and the admin rows listing by layout alone
covers every scope stored before the restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from kvbank import Client, Scope
from kvbank.builders import full_attention
from kvbank.errors import UnknownLayout
from tests.service.conftest import admin_headers, start_node

LAYOUT = full_attention("restart@1", num_layers=2, num_kv_heads=2, head_dim=64)
PAGE = LAYOUT.group_page_bytes[0]
P = LAYOUT.tokens_per_page
N = 6
SCOPES = [Scope(), Scope("tenant-a"), Scope("tenant-b", cache_salt="s")]


def _pages(seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (N, PAGE), dtype=np.uint8))


def _tokens(seed: int) -> list[int]:
    return list(range(seed * 1000, seed * 1000 + N * P))


def _admin(url: str, headers: dict[str, str], path: str, **params: Any) -> dict[str, Any]:
    r = httpx.get(url + path, params=params, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_layouts_survive_a_restart_and_rows_list_by_layout_across_scopes(tmp_path: Path) -> None:
    node = start_node(tmp_path)
    try:
        with Client(node.url, same_host=False) as c:
            lid = c.register(LAYOUT)
            for i, s in enumerate(SCOPES):
                c.put(lid, _tokens(i), group=0, pages=_pages(i), scope=s)
    finally:
        assert node.stop() == 0, "".join(node.lines)[-3000:]

    node = start_node(tmp_path)
    try:
        with Client(node.url, same_host=False) as c:  # nobody registers the layout again
            assert c.layout(lid) == LAYOUT
            for i, s in enumerate(SCOPES):
                m = c.match(lid, [*_tokens(i), 1], scope=s)
                assert m.resume.tokens == N * P
                out = torch.zeros((N, PAGE), dtype=torch.uint8)
                got = c.fetch(m, out={0: out})
                assert got.complete and torch.equal(out, _pages(i))
        headers = admin_headers(node)
        listed = _admin(node.url, headers, "/admin/layouts")["layouts"]
        assert [x["layout_id"] for x in listed] == [lid.hex()]
        names: list[str] = []
        cursor = None
        while True:  # by layout alone, page by page: every scope stored before the restart
            params: dict[str, Any] = {"layout_id": lid.hex(), "limit": 4}
            if cursor is not None:
                params["cursor"] = cursor
            doc = _admin(node.url, headers, "/admin/rows", **params)
            names += [r["name"] for r in doc["rows"]]
            cursor = doc["next_cursor"]
            if cursor is None:
                break
        assert len(names) == len(SCOPES) * N and names == sorted(set(names))
    finally:
        assert node.stop() == 0, "".join(node.lines)[-3000:]


def test_a_registration_that_returned_survives_sigkill(tmp_path: Path) -> None:
    other = full_attention("restart-kill@1", num_layers=1, num_kv_heads=2, head_dim=64)
    node = start_node(tmp_path)
    try:
        with Client(node.url, same_host=False) as c:
            lid = c.register(other)
    finally:
        node.kill()
    node = start_node(tmp_path)
    try:
        with Client(node.url, same_host=False) as c:
            assert c.layout(lid) == other
            with pytest.raises(UnknownLayout):
                c.layout(LAYOUT.layout_id)  # never registered on this data dir
    finally:
        assert node.stop() == 0, "".join(node.lines)[-3000:]
