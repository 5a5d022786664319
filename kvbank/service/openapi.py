"""The node's OpenAPI document, as ``/openapi.json`` serves it and ``docs/openapi.json``
commits it: ``python -m kvbank.service.openapi > docs/openapi.json`` regenerates the
file (a test checks the two agree). Built on a throwaway bank with the default service
settings (metrics on, not behind the token), since the served document depends on them.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kvbank.bank.bank import Bank
from kvbank.config import BankConfig
from kvbank.service.app import create_app
from kvbank.service.config import ServiceConfig
from kvbank.service.node import Node

_PROBE_TOKEN = "openapi-document-probe-token"


def document() -> dict[str, Any]:
    """The OpenAPI document of a node with the default service settings."""
    cfg = BankConfig(host_bytes=8 << 20, device_bytes=0, disk_bytes=0, data_dir=None)
    with Bank(cfg, reaper=False) as bank:
        node = Node(bank, ServiceConfig(bank=cfg, threads=1, admin_token=_PROBE_TOKEN))
        try:
            return create_app(node).openapi()
        finally:
            node.close()


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(render(document()))
