"""Tenant tokens on the data API: a token binds its caller to one tenant.

With ``tenants`` configured (``tenant = token`` pairs), every ``/v1/`` call needs a
bearer token (401 without, 403 for an unknown one); :class:`TenantMiddleware` resolves it
once per request into ``request.state.tenant``. The routes then hold the caller to it
through :class:`TenantGuard`:

- a scope (match, put header, a Match given to fetch) naming no tenant gets the caller's
  tenant forced in; one naming another tenant is 403;
- row names (locate, a NAMED lease) must lie in namespaces the caller itself has used (a
  row name's namespace is a one-way digest of its scope, so the guard records, per
  tenant, the namespaces its own scopes produced: a bounded LRU). A name of another
  namespace is 403, never a hit;
- leases and fetches are owned by the tenant that opened them; another tenant's renew,
  commit, check, release or acknowledgement is 403, and ``GET /v1/leases`` lists only
  the caller's own. An ALL lease (every pool of a tier, every tenant's bytes) is refused
  to tenants.

Without tenant tokens the guard answers at once (one attribute test per call).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvbank.errors import Forbidden, KvbankError, Unauthorized
from kvbank.keys import Scope as KeyScope
from kvbank.keys import namespace, namespace_of
from kvbank.lender.base import Lease
from kvbank.results import Match
from kvbank.service.admin.auth import TenantTokens
from kvbank.wire.framing import PutHeader

MAX_OWNED = 65_536  # namespaces, leases and fetches remembered per node (LRU)


class _Lru:
    def __init__(self, cap: int) -> None:
        self._d: OrderedDict[object, str] = OrderedDict()
        self._cap = cap

    def put(self, key: object, tenant: str) -> None:
        self._d[key] = tenant
        self._d.move_to_end(key)
        while len(self._d) > self._cap:
            self._d.popitem(last=False)

    def get(self, key: object) -> str | None:
        return self._d.get(key)


def tenant_of(request: Request) -> str | None:
    """The tenant a request is bound to (None: no tenant tokens configured)."""
    # from the scope itself: request.state raises (and catches) AttributeError for an
    # unset name, which every route pays several times a request without tenants
    state = request.scope.get("state")
    return None if state is None else state.get("tenant")


def bind_put_header(request: Request, header: PutHeader) -> PutHeader:
    """A put body's header bound to the request's tenant (unchanged without tokens)."""
    tenant = tenant_of(request)
    if tenant is None:
        return header
    guard = getattr(request.app.state, "admin").guard  # noqa: B009 - set by install_admin
    assert isinstance(guard, TenantGuard)
    return guard.header(tenant, header)


class TenantGuard:
    """Holds each request to its tenant. See the module docstring."""

    def __init__(self, tokens: TenantTokens) -> None:
        self.tokens = tokens
        self._lock = threading.Lock()
        self._spaces = _Lru(MAX_OWNED)
        self._leases = _Lru(MAX_OWNED)
        self._fetches = _Lru(MAX_OWNED)

    def _learn(self, tenant: str, layout_id: bytes, scope: KeyScope) -> None:
        ns = namespace(layout_id, scope)
        with self._lock:
            self._spaces.put(ns, tenant)

    def scope(self, request: Request, layout_id: bytes, scope: KeyScope) -> KeyScope:
        """``scope`` bound to the caller's tenant (forced when empty, 403 if another)."""
        tenant = tenant_of(request)
        if tenant is None:
            return scope
        if scope.tenant not in ("", tenant):
            raise Forbidden(f"scope.tenant: this token is bound to another tenant than "
                            f"{scope.tenant!r}", field="scope.tenant")
        bound = scope if scope.tenant == tenant else KeyScope(tenant, scope.cache_salt, scope.lora)
        self._learn(tenant, layout_id, bound)
        return bound

    def header(self, tenant: str | None, header: PutHeader) -> PutHeader:
        """A put header bound to ``tenant`` (the same rule as :meth:`scope`)."""
        if tenant is None:
            return header
        if header.tenant not in ("", tenant):
            raise Forbidden(f"header.scope.tenant: this token is bound to another tenant than "
                            f"{header.tenant!r}", field="header.scope.tenant")
        self._learn(tenant, header.layout_id, KeyScope(tenant, header.cache_salt, header.lora))
        return dataclasses.replace(header, tenant=tenant)

    def match(self, request: Request, m: Match) -> Match:
        """A Match handed to fetch: its scope the caller's, every row in it too."""
        tenant = tenant_of(request)
        if tenant is None:
            return m
        scope = self.scope(request, m.layout_id, m.scope)
        if scope != m.scope:
            raise Forbidden("match.scope.tenant: a fetch names its tenant (the match this "
                            "tenant's match call answered)", field="match.scope.tenant")
        self.names(request, [n for rows in m.resume.rows for n in rows], "match.resume.rows")
        return m

    def names(self, request: Request, names: Iterable[bytes], field: str = "names") -> None:
        tenant = tenant_of(request)
        if tenant is None:
            return
        with self._lock:
            for i, n in enumerate(names):
                if self._spaces.get(namespace_of(n)) != tenant:
                    raise Forbidden(f"{field}[{i}]: not a row of this tenant's scopes", field=f"{field}[{i}]")

    def no_all_lease(self, request: Request) -> None:
        if tenant_of(request) is not None:
            raise Forbidden("all: an ALL lease spans every tenant's rows; tenants lease by name",
                            field="all")

    def own_lease(self, request: Request, lease: Lease | None) -> None:
        tenant = tenant_of(request)
        if tenant is not None and lease is not None:
            with self._lock:
                self._leases.put(lease.id, tenant)

    def lease(self, request: Request, lease_id: str) -> None:
        tenant = tenant_of(request)
        if tenant is None:
            return
        with self._lock:
            owner = self._leases.get(lease_id)
        if owner != tenant:
            raise Forbidden(f"lease_id: {lease_id} is not a lease of this tenant", field="lease_id")

    def leases(self, request: Request, leases: Sequence[Lease]) -> list[Lease]:
        tenant = tenant_of(request)
        if tenant is None:
            return list(leases)
        with self._lock:
            return [x for x in leases if self._leases.get(x.id) == tenant]

    def own_fetch(self, request: Request, fetch_id: str) -> None:
        tenant = tenant_of(request)
        if tenant is not None:
            with self._lock:
                self._fetches.put(fetch_id, tenant)

    def fetch(self, request: Request, fetch_id: str | None) -> None:
        """A fetch id given to ack (or resumed by fetch) must be the caller's own."""
        tenant = tenant_of(request)
        if tenant is None or fetch_id is None:
            return
        with self._lock:
            owner = self._fetches.get(fetch_id)
        if owner not in (None, tenant):
            raise Forbidden(f"fetch_id: {fetch_id} is not a fetch of this tenant", field="fetch_id")


class TenantMiddleware:
    """Resolves ``/v1/`` requests' tenant tokens (401/403 before any route runs)."""

    def __init__(self, app: ASGIApp, tokens: TenantTokens) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            try:
                tenant = self.tokens.tenant_of(auth)
            except KvbankError as exc:
                status = 401 if isinstance(exc, Unauthorized) else 403
                body = json.dumps({"type": type(exc).__name__, "field": exc.field,
                                   "message": str(exc)}).encode()
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
