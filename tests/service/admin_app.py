"""An in-process node application (real Bank, real FastAPI app, no socket) for the admin
tests: ``starlette.testclient`` drives the ASGI app itself."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from starlette.testclient import TestClient

from kvbank import Bank, BankConfig, Scope, full_attention
from kvbank.keys import DEFAULT_SCOPE
from kvbank.service.app import create_app
from kvbank.service.config import ServiceConfig
from kvbank.service.node import Node

TOKEN = "admin-token-0123456789abcdef"
FA = full_attention("admin-api@1", num_layers=1, num_kv_heads=2, head_dim=64)  # 16 tokens a page
PAGE = FA.group_page_bytes[0]
P = FA.tokens_per_page


@contextmanager
def served(data: Path | None, host_bytes: int = 16 << 20, **service: Any) -> Iterator[tuple[TestClient, Node]]:
    bank_cfg = BankConfig(host_bytes=host_bytes, device_bytes=0, pin_bytes=4 * PAGE,
                          data_dir=data, disk_bytes=(64 << 20) if data else 0)
    service.setdefault("admin_token", TOKEN)
    config = ServiceConfig(bank=bank_cfg, threads=4, **service)
    bank = Bank(bank_cfg)
    node = Node(bank, config)
    try:
        with TestClient(create_app(node), raise_server_exceptions=False) as client:
            yield client, node
    finally:
        node.close()
        bank.close()


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def fill(bank: Bank, n: int, seed: int, scope: Scope = DEFAULT_SCOPE) -> list[bytes]:
    bank.register(FA)
    rng = np.random.default_rng(seed)
    pages = torch.from_numpy(rng.integers(0, 256, (n, PAGE), dtype=np.uint8))
    tokens = list(range(seed * 10_000, seed * 10_000 + n * P))
    return bank.put(FA.layout_id, tokens, group=0, pages=pages, scope=scope)
