"""``client.audit``: an engine's reuse-audit verdict, reported to the node (``POST /v1/audit``).

The same call as the embedded bank's ``bank.audit.report``
(:mod:`kvbank.bank.quarantine`): a mismatch quarantines the layout on the node, so its
rows stop being served. An operator's calls (the list, the clear) are admin routes, not
here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvbank.errors import InvalidInput

__all__ = ["ClientAudit"]

Call = Callable[..., Any]  # Client._call


class ClientAudit:
    """A node's audit report route (see the module docstring)."""

    def __init__(self, call: Call) -> None:
        self._call = call

    def report(self, layout_id: bytes, *, ok: bool, pages: int = 0, error: float = 0.0,
               tolerance: float = 0.0, detail: str = "") -> bool:
        """Report an audit of ``layout_id``'s rows; whether the layout is quarantined now."""
        if not isinstance(layout_id, bytes) or len(layout_id) != 32:
            raise InvalidInput(f"layout_id: expected 32 bytes, got {layout_id!r:.80}", field="layout_id")
        body = {"layout_id": layout_id.hex(), "ok": ok, "pages": pages,
                "error": error if math.isfinite(error) else None, "tolerance": tolerance,
                "detail": detail[:2000]}
        doc = self._call("POST", "/v1/audit", body=body)
        return bool(doc["quarantined"])
