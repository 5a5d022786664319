"""The node's admin state: the admin token, draining, in-flight data requests, health
reasons, and the rows listing's cursors.

Primitives:

- :class:`AdminState` — what the admin routes and the gate share. ``draining`` refuses
  new puts (the put routes and WRITE leases answer 503 ``Busy``) and makes the node
  unready; ``in_flight`` counts ``/v1/`` requests in progress.
- :meth:`AdminState.add_health_reasons` — the hook other parts (the fleet) register:
  a callable answering the reasons, if any, this node is degraded (``"fleet: …"``).
  :meth:`AdminState.degraded` joins them with the store's (a tier degraded or off for
  want of hardware, the mover stopped, the disk nearly full) and draining.
- :class:`Cursors` — opaque rows-listing cursors: the last name of a page, the query it
  belongs to and when it was issued, under an HMAC keyed by a secret drawn at start. A
  cursor that was forged, altered, made for another query or by an earlier run of the
  node, or older than :data:`CURSOR_TTL_S`, is refused (400 naming ``cursor``).
- :class:`GateMiddleware` — counts in-flight data requests and refuses put bodies while
  draining.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from kvbank.errors import Busy, InvalidInput
from kvbank.keys import ROW_NAME_BYTES
from kvbank.results import HealthState, StoreHealth, StoreStats
from kvbank.tiers.base import TierKind

CURSOR_TTL_S = 600.0
DISK_NEARLY_FULL = 0.95  # a fill ratio of the disk budget reported as degraded
_PUT_PATHS = frozenset({"/v1/put", "/v1/put_state", "/v1/put/lease"})
_STAMP = struct.Struct("<d")
_MAC_BYTES = 16

HealthReasons = Callable[[], Iterable[str]]


class Cursors:
    """Signed rows-listing cursors. See the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, ttl_s: float = CURSOR_TTL_S) -> None:
        self._key = secrets.token_bytes(32)
        self._clock = clock
        self._ttl = ttl_s

    def _mac(self, query: str, body: bytes) -> bytes:
        return hmac.new(self._key, query.encode() + b"\0" + body, hashlib.sha256).digest()[:_MAC_BYTES]

    def issue(self, query: str, after: bytes) -> str:
        body = after + _STAMP.pack(self._clock())
        return base64.urlsafe_b64encode(body + self._mac(query, body)).decode().rstrip("=")

    def open(self, query: str, cursor: str) -> bytes:
        """The last name of the page ``cursor`` follows (InvalidInput if not ours)."""
        try:
            raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        except (ValueError, TypeError):
            raw = b""
        if len(raw) != ROW_NAME_BYTES + _STAMP.size + _MAC_BYTES:
            raise InvalidInput("cursor: not a cursor of this node", field="cursor")
        body, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(query, body)):
            raise InvalidInput("cursor: forged, altered, for another query, or from an earlier "
                               "run of this node; list again from the start", field="cursor")
        (issued,) = _STAMP.unpack(body[ROW_NAME_BYTES:])
        if self._clock() - issued > self._ttl:
            raise InvalidInput(f"cursor: stale (older than {self._ttl:.0f} s); list again from the start",
                               field="cursor")
        return body[:ROW_NAME_BYTES]


class AdminState:
    """State the admin routes and the gate share. See the module docstring."""

    def __init__(self, token: str, token_file: Path | None) -> None:
        self.token = token
        self.token_file = token_file
        self.cursors = Cursors()
        self._lock = threading.Lock()
        self._draining = False
        self._in_flight = 0
        self._reasons: list[HealthReasons] = []

    # -- draining and in-flight ---------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    def set_draining(self, on: bool) -> None:
        with self._lock:
            self._draining = on

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def check_writable(self) -> None:
        if self._draining:
            raise Busy("node: draining; new puts are refused (undrain to accept them)", field="node")

    # -- health -------------------------------------------------------------------------

    def add_health_reasons(self, provider: HealthReasons) -> None:
        """Register a source of degraded reasons (called at every health query)."""
        with self._lock:
            self._reasons.append(provider)

    def degraded(self, health: StoreHealth, stats: StoreStats) -> list[str]:
        out: list[str] = []
        if not health.mover_running:
            out.append("mover: not running")
        for t in health.tiers:
            if t.state is HealthState.DEGRADED:
                out.append(f"{t.kind.value}: {t.detail or 'degraded'}")
        disk = stats.tier(TierKind.DISK)
        if disk.enabled and disk.budget_bytes and disk.used_bytes >= DISK_NEARLY_FULL * disk.budget_bytes:
            out.append(f"disk: nearly full ({disk.used_bytes} of {disk.budget_bytes} bytes)")
        if self._draining:
            out.append("node: draining")
        with self._lock:
            providers = list(self._reasons)
        for p in providers:
            try:
                out.extend(str(r) for r in p())
            except Exception as exc:  # a broken provider is itself a reason, never a 500
                out.append(f"health provider {getattr(p, '__name__', p)!r} failed: {exc}")
        return out


class GateMiddleware:
    """Counts ``/v1/`` requests in flight; refuses put bodies while draining (503)."""

    def __init__(self, app: ASGIApp, state: AdminState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        st = self.state
        if st.draining and scope["path"] in _PUT_PATHS:
            body = json.dumps({"type": "Busy", "field": "node",
                               "message": "node: draining; new puts are refused"}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        st.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            st.leave()
