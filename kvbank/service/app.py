"""The node's data API under ``/v1/``: JSON control routes (FastAPI, so ``/openapi.json``
describes them) and binary page bodies (:mod:`kvbank.service.stream`).

=======================================  ==================================================
route                                    what it does
=======================================  ==================================================
``GET  /live``                           ``alive``: a liveness probe, open to anyone (no
                                         token, even with tenant tokens; says nothing else)
``GET  /v1/node``                        version, budgets, what identifies the host
``GET  /v1/health``                      the store's health (each tier, the mover)
``POST /v1/locate``                      row names → the tier holding each (or null)
``GET  /v1/leases``                      every live lease
``POST /v1/flush``                       wait until the mover is idle (``timeout_s``)
``POST /v1/layouts``                     register a layout (wire form) → ``layout_id``
``GET  /v1/layouts/{layout_id}``         the registered layout
``POST /v1/layouts/{layout_id}/scopes``  register a scope for leases → ``namespace``
``POST /v1/put``, ``/v1/put_state``      binary put body (:mod:`~kvbank.wire.framing`)
``POST /v1/put/lease``                   same body without pages → names + a WRITE lease
                                         (``?via=data``: + a data-port ticket for it)
``POST /v1/match``                       layout id, tokens (or keys), scope → a Match
``POST /v1/presence``                    the same prompt, ``shards`` → a Presence
``POST /v1/fetch``                       a Match → streamed rows (or, ``via="lease"``, a
                                         READ lease on them; ``via="data"``: that lease
                                         and a data-port ticket for it)
``POST /v1/fetch/{fetch_id}/ack``        rows that arrived whole → the FetchResult
``POST /v1/leases``                      lend (NAMED or ALL, HOST or DEVICE, READ or WRITE)
``POST /v1/leases/{id}/renew``           renew → the lease
``POST /v1/leases/{id}/commit``          commit a WRITE lease → the CommitResult
``POST /v1/leases/{id}/check``           the completion check (``check_live``)
``DELETE /v1/leases/{id}``               release → ``{"released": bool}``
``GET  /v1/stats``                       BankStats
``/v1/engine/...``                       an engine's calls (:mod:`kvbank.service.engine_routes`)
``POST /v1/audit``                       a reuse audit's verdict (:mod:`~kvbank.service.admin.quarantine`)
=======================================  ==================================================

The admin API (``/admin/``), ``/metrics`` and the tenant and drain gates are installed by
:func:`kvbank.service.admin.routes.install_admin`; with tenant tokens configured, every route
above holds its caller to its tenant through ``guard`` (:mod:`kvbank.service.admin.tenants`).

Errors: every :class:`~kvbank.errors.KvbankError` answers its wire document
``{type, field, message}`` (:func:`kvbank.wire.forms.error_to_dict`) with the status of
:func:`status_of` — bad input 4xx, never 5xx; a full tier 507; an unavailable one 503.
Every blocking bank call runs on the node's bounded pool (:meth:`Node.call`).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvbank import wire
from kvbank._version import __version__
from kvbank.errors import (
    Busy,
    FetchError,
    FetchNotFound,
    InvalidInput,
    KvbankError,
    LeaseConflict,
    LeaseError,
    LeaseExpired,
    LeaseNotFound,
    PinBudgetExceeded,
    RowLocked,
    TierFull,
    TierUnavailable,
    UnknownLayout,
)
from kvbank.keys import ROW_NAME_BYTES
from kvbank.keys import Scope as KeyScope
from kvbank.layout import PageLayout
from kvbank.lender.base import Delivery, Lease, LeaseMode, MemoryKind, Selection
from kvbank.results import Match
from kvbank.service.admin.auth import Forbidden, Unauthorized
from kvbank.service.admin.quarantine import install_audit
from kvbank.service.admin.routes import install_admin
from kvbank.service.connections import RequestLimits
from kvbank.service.dataplane import DataPlane, Op, slot_names
from kvbank.service.engine_routes import install_engine
from kvbank.service.fast_routes import NodeAPI
from kvbank.service.node import Node, slots_doc
from kvbank.service.stream import BodyTooLarge, RowStream, receive_put, receive_put_lease
from kvbank.wire.forms import from_hex as _hex
from kvbank.wire.framing import PutKind, decode_match, encode_fetch_prefix, fetch_stream_bytes

logger = logging.getLogger(__name__)

JSON = "application/json"
STREAMED_PATHS = ("/v1/put", "/v1/put_state", "/v1/put/lease")  # binary bodies, read by the routes


def status_of(exc: KvbankError) -> int:
    """The HTTP status a typed error answers with."""
    for cls, status in (
        (Unauthorized, 401), (Forbidden, 403), (PinBudgetExceeded, 409), (BodyTooLarge, 413),
        (UnknownLayout, 404), (LeaseNotFound, 404), (FetchNotFound, 404),
        (LeaseExpired, 410), (LeaseConflict, 409), (RowLocked, 409), (InvalidInput, 400),
        (TierFull, 507), (TierUnavailable, 503), (Busy, 503),
        (LeaseError, 409), (FetchError, 400),
    ):
        if isinstance(exc, cls):
            return status
    return 400 if isinstance(exc, ValueError) else 500


def _json(doc: Any, status: int = 200) -> Response:
    # Pre-encoded: FastAPI's generic encoder walks every value, which dominates a
    # 1,000-row match answer.
    return Response(json.dumps(doc, separators=(",", ":")), status_code=status, media_type=JSON)


def _error(exc: KvbankError) -> Response:
    return _json(wire.error_to_dict(exc), status_of(exc))


class _Body(BaseModel):
    """A JSON request body, checked as strictly as the binary put header (wire.md): ``true``
    is not an integer, ``"30"`` is not a number, and a missing or unknown key is refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


class ScopeBody(_Body):
    tenant: str = ""
    cache_salt: str = ""
    lora: str = ""

    def scope(self) -> KeyScope:
        return KeyScope(self.tenant, self.cache_salt, self.lora)


class MatchBody(_Body):
    layout_id: str = Field(description="hex of the 32-byte layout id")
    tokens: list[int] | None = Field(None, description="token ids")
    tokens_b64: str | None = Field(None, description="token ids as base64 of little-endian int32")
    keys: list[str] | None = Field(None, description="an engine's page-key chain (hex), instead of tokens")
    prompt_tokens: int | None = Field(None, ge=0, description="the prompt's length, with keys")
    scope: ScopeBody = ScopeBody()
    shard: int | None = None


class PresenceBody(_Body):
    layout_id: str = Field(description="hex of the 32-byte layout id")
    tokens: list[int] | None = Field(None, description="token ids")
    tokens_b64: str | None = Field(None, description="token ids as base64 of little-endian int32")
    keys: list[str] | None = Field(None, description="an engine's page-key chain (hex), instead of tokens")
    prompt_tokens: int | None = Field(None, ge=0, description="the prompt's length, with keys")
    scope: ScopeBody = ScopeBody()
    shards: list[int] | None = Field(None, description="shard indices (default: every shard of the layout)")


class FlushBody(_Body):
    timeout_s: float | None = Field(
        None, ge=0, description="Busy after this long (default: the store's wait_timeout_s)")


class FetchBody(_Body):
    match: dict[str, Any] | None = Field(None, description="a Match in its wire form")
    prompt: MatchBody | None = Field(
        None, description="instead of match: the prompt to match (a /v1/match body), matched and "
                          "lent in this call (via lease or data only); the answer carries the match")
    fetch_id: str | None = None
    max_rows: int | None = Field(None, ge=0)
    via: Literal["stream", "lease", "data"] = "stream"


class AckBody(_Body):
    rows: list[int] = Field(description="plan positions of the rows that arrived whole")
    lease_id: str | None = Field(None, description="the READ lease a same-host fetch read through")
    stream: str | None = Field(None, description="the stream (its header's id) the rows came in")
    changed: list[int] = Field(default_factory=list, description=(
        "plan positions of lent rows whose copies failed their checksum (the lease answer's "
        "sums): not counted; the node checks them and drops the host copies that fail"))


class LendBody(_Body):
    names: list[str] | None = Field(None, description="row names (hex); omit with all=true")
    all: bool = False
    mode: Literal["READ", "WRITE"] = "READ"
    kind: Literal["HOST", "DEVICE"] = "HOST"
    ttl_s: float | None = Field(None, gt=0)


class NamesBody(_Body):
    names: list[str] = Field(description="row names (hex)")


class RenewBody(_Body):
    ttl_s: float | None = Field(None, gt=0)


class CommitBody(_Body):
    arrived: list[str] | list[bool] = Field(description="row names (hex) or one bool per row")


def create_app(node: Node) -> FastAPI:
    """The FastAPI application serving ``node``."""
    # /docs is the node's own (kvbank.service.admin.ui: assets in the package, offline)
    app = NodeAPI(title="kvbank node", version=__version__, errors=_error, docs_url=None, redoc_url=None,
                  description="Data API of one kvbank node: layouts, pages, matches, fetches, leases.")
    bank = node.bank
    admin = install_admin(app, node)
    install_audit(app, admin)  # the reuse audit's report route and quarantine
    # outermost: header and body bounds hold before any gate, token check or route runs
    app.add_middleware(RequestLimits, config=node.config, streamed=STREAMED_PATHS)
    guard, metrics = admin.guard, admin.metrics

    def _lease(lease: Lease) -> dict[str, Any]:
        # ttl_s against the bank's own clock, the one the lease's deadline is on
        return wire.to_dict(lease, now=bank.clock())

    @app.exception_handler(KvbankError)
    async def _typed(request: Request, exc: KvbankError) -> Response:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI's own refusals (an unparsable body, an unknown route or method) in the
        # node's error form, so every 4xx a client sees is {type, field, message}
        field = {404: "path", 405: "method"}.get(exc.status_code, "body")
        doc = {"type": "InvalidInput", "field": field, "message": f"{field}: {exc.detail}"}
        return Response(json.dumps(doc), status_code=exc.status_code, media_type=JSON,
                        headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        errs = exc.errors()
        # an unparsable body is the body's fault, not a position's (as on the hot path)
        loc = "" if not errs or errs[0].get("type") == "json_invalid" else ".".join(
            str(p) for p in errs[0]["loc"][1:])
        msg = errs[0]["msg"] if errs else "invalid request"
        return _error(InvalidInput(f"{loc or 'body'}: {msg}", field=loc or "body"))

    @app.get("/live", response_class=PlainTextResponse)
    async def live() -> PlainTextResponse:
        """A liveness probe for orchestrators: no token even on a tenant node, and nothing
        in the answer but that the process serves."""
        return PlainTextResponse("alive\n")

    @app.get("/v1/node")
    async def node_info() -> Response:
        doc = node.info()
        if guard.tokens:
            # tenants reach the host memory only as a descriptor the local channel passes
            # (never to a tenant-bound caller): the segment's name is unlinked at start,
            # and none is named here (served-node review D1)
            doc["host"]["segment"] = None
        return _json(doc)

    @app.get("/v1/health")
    async def health() -> Response:
        doc = wire.to_dict(await node.call(bank.health))
        if node.fleet is not None:
            doc["fleet"] = node.fleet.health()
            if node.fleet.degraded:
                doc["degraded"] = "fleet"
        return _json(doc)

    @app.post("/v1/locate")
    async def locate(body: NamesBody, request: Request) -> Response:
        names = [_hex(n, f"names[{i}]", ROW_NAME_BYTES) for i, n in enumerate(body.names)]
        guard.names(request, names)
        tiers = await node.call(bank.locate, names)
        return _json({"tiers": [None if t is None else t.name for t in tiers]})

    @app.get("/v1/leases")
    async def leases(request: Request) -> Response:
        return _json({"leases": [_lease(x) for x in guard.leases(request, await node.call(bank.leases))]})

    @app.post("/v1/flush")
    async def flush(body: FlushBody | None = None) -> Response:
        await node.call(bank.flush, None if body is None else body.timeout_s)
        return _json({"flushed": True})

    @app.post("/v1/layouts", responses=_links(get_layout=("get_layout_v1_layouts__layout_id__get",
                                                          {"layout_id": "$response.body#/layout_id"})))
    async def register(doc: dict[str, Any]) -> Response:
        if "layout" in doc and len(doc) != 1:  # {"layout": {...}} and nothing else
            extra = sorted(k for k in doc if k != "layout")[0]
            raise InvalidInput(f"{extra}: unknown key of a registration (only 'layout')", field=extra)
        layout = wire.from_dict(PageLayout, doc.get("layout", doc))
        lid = await node.call(bank.register, layout)
        return _json({"layout_id": lid.hex()})

    @app.get("/v1/layouts/{layout_id}")
    async def get_layout(layout_id: str) -> Response:
        layout = await node.call(bank.layout, _hex(layout_id, "layout_id", 32))
        return _json(wire.to_dict(layout))

    @app.post("/v1/layouts/{layout_id}/scopes")
    async def register_scope(layout_id: str, body: ScopeBody, request: Request) -> Response:
        lid = _hex(layout_id, "layout_id", 32)
        scope = guard.scope(request, lid, body.scope())
        return _json({"namespace": (await node.call(bank.register_scope, lid, scope)).hex()})

    @app.post("/v1/put", openapi_extra=_binary_doc("pages"))
    async def put(request: Request) -> Response:
        return _json(await receive_put(node, request, PutKind.PAGES))

    @app.post("/v1/put_state", openapi_extra=_binary_doc("state"))
    async def put_state(request: Request) -> Response:
        return _json(await receive_put(node, request, PutKind.STATE))

    @app.post("/v1/put/lease", openapi_extra={**_binary_doc("pages or state, without page bytes"),
                                              "parameters": [_VIA_DATA]},
              responses=_lease_links("$response.body#/lease/id"))
    async def put_lease(request: Request) -> Response:
        if request.query_params.get("via") != "data":
            node.check_named()  # a same-host put maps the segment by its name
        names, lease, fallback = await receive_put_lease(node, request)
        guard.own_lease(request, lease)
        doc: dict[str, Any] = {"names": [n.hex() for n in names], "fallback": fallback, "lease": None}
        if lease is not None:
            doc["lease"] = slots_doc(lease, names, Delivery.RESERVED, bank.clock(), named=node.segment_named)
            if request.query_params.get("via") == "data":
                doc["ticket"] = _data_plane(node).issue(Op.PUT, lease, slot_names(doc["lease"], names))
        return _json(doc)

    @app.post("/v1/match", openapi_extra=_match_binary_doc(), responses=_links(
        fetch=("fetch_v1_fetch_post", None, {"match": "$response.body", "via": "lease"})))
    async def match(body: MatchBody, request: Request) -> Response:
        return await match_core(request, body)

    async def match_binary(request: Request) -> Response:
        # the binary form (decode_match); the JSON one is match_core
        head, raw = decode_match(await request.body())
        lid = head.layout_id
        scope = guard.scope(request, lid, KeyScope(head.tenant, head.cache_salt, head.lora))
        import numpy as np

        return await matched(lid, dict(tokens=np.frombuffer(raw, dtype="<i4"), scope=scope, shard=head.shard,
                                       keys=None, prompt_tokens=None))

    async def match_core(request: Request, body: MatchBody) -> Response:
        lid, args = prompt_args(request, body)
        return await matched(lid, args)

    @app.post("/v1/presence")
    async def presence(body: PresenceBody, request: Request) -> Response:
        lid, args = prompt_args(request, body)
        del args["shard"]
        got = await node.call(bank.presence, lid, shards=body.shards, **args)
        return _json(wire.to_dict(got))

    def prompt_args(request: Request, body: MatchBody | PresenceBody) -> tuple[bytes, dict[str, Any]]:
        """The layout id and ``Bank.match`` keyword arguments of a JSON match (or presence) body."""
        lid = _hex(body.layout_id, "layout_id", 32)
        scope = guard.scope(request, lid, body.scope.scope())
        given = [x is not None for x in (body.tokens, body.tokens_b64, body.keys)]
        if sum(given) != 1:
            raise InvalidInput("tokens: give exactly one of tokens, tokens_b64 or keys")
        keys = None if body.keys is None else [_hex(k, f"keys[{i}]") for i, k in enumerate(body.keys)]
        tokens: Any = body.tokens
        if body.tokens_b64 is not None:
            import numpy as np

            try:
                raw = base64.b64decode(body.tokens_b64, validate=True)
            except ValueError:
                raise InvalidInput("tokens_b64: not base64") from None
            if len(raw) % 4:
                raise InvalidInput(f"tokens_b64: {len(raw)} bytes, not whole int32 tokens")
            tokens = np.frombuffer(raw, dtype="<i4")
        shard = body.shard if isinstance(body, MatchBody) else None
        return lid, dict(tokens=tokens, scope=scope, shard=shard, keys=keys,
                         prompt_tokens=body.prompt_tokens)

    async def matched(lid: bytes, args: dict[str, Any]) -> Response:
        return _json(wire.to_dict(await node.call(node.match, lid, args)))

    @app.post("/v1/fetch", responses=_links(
        "a fetch stream (framing), or (via=lease) a lease",
        ack=("ack_v1_fetch__fetch_id__ack_post", {"fetch_id": "$response.body#/fetch_id"}, None)))
    async def fetch(body: FetchBody, request: Request) -> Response:
        return await fetch_core(request, body)

    async def fetch_core(request: Request, body: FetchBody) -> Response:
        if (body.match is None) == (body.prompt is None):
            raise InvalidInput("match: give either match (a Match) or prompt (a prompt to match), not both or neither")
        m = None if body.match is None else guard.match(request, wire.from_dict(Match, body.match))
        guard.fetch(request, body.fetch_id)
        if body.prompt is not None and body.via == "stream":
            raise InvalidInput("prompt: a streamed fetch needs the match first (via lease or data take a prompt)")
        if body.via != "stream":
            # one hop to the pool: open the fetch and lend its rows (via="data": and a
            # ticket to read the lent slots over the data port; refused before lending
            # where the node serves none); with a prompt, match it first in that hop
            plane = _data_plane(node) if body.via == "data" else None
            if plane is None:
                node.check_named()  # a same-host fetch maps the segment by its name
            if m is None:
                assert body.prompt is not None  # one of the two, checked above
                lid, args = prompt_args(request, body.prompt)
                m, maybe, lease = await node.call(node.match_lend, lid, args, body.fetch_id, body.max_rows)
                if maybe is None:  # the bound needs no rows: nothing was opened or lent
                    nothing: dict[str, Any] = {"fetch_id": None, "rows": [], "lease": None,
                                               "match": wire.to_dict(m)}
                    return _json({**nothing, "ticket": None} if plane is not None else nothing)
                opened = maybe
            else:
                opened, lease = await node.call(node.lend_fetch, m, body.fetch_id, body.max_rows)
            guard.own_fetch(request, opened.fetch_id)
            guard.own_lease(request, lease)
            doc: dict[str, Any] = {"fetch_id": opened.fetch_id,
                                   "rows": [[r.position, r.group, r.slot, r.size] for r in opened.rows],
                                   "lease": None}
            if body.prompt is not None:
                doc["match"] = wire.to_dict(m)
            if lease is not None:
                # the client verifies what it copied (same host) or received (data port)
                # against the rows' checksums; the data port's sends are verified here too
                sums = await node.call(bank.checksums, lease.id)
                doc["lease"] = slots_doc(lease, opened.names, Delivery.READY, bank.clock(), sums,
                                         named=node.segment_named)
            if plane is not None:
                doc["ticket"] = None if lease is None else plane.issue(
                    Op.FETCH, lease, slot_names(doc["lease"], opened.names))
            return _json(doc)
        assert m is not None  # a prompt takes a lease or the data port, checked above
        opened = await node.call(node.open_fetch, m, body.fetch_id, body.max_rows)
        guard.own_fetch(request, opened.fetch_id)
        prefix = encode_fetch_prefix(opened.fetch_id, opened.rows, opened.stream)
        return RowStream(node, opened, prefix, fetch_stream_bytes(len(prefix), opened.rows))

    @app.post("/v1/fetch/{fetch_id}/ack")
    async def ack(fetch_id: str, body: AckBody, request: Request) -> Response:
        return await ack_core(request, body, fetch_id)

    async def ack_core(request: Request, body: AckBody, fetch_id: str) -> Response:
        guard.fetch(request, fetch_id)
        result = await node.call(node.acknowledge, fetch_id, body.rows, body.lease_id, body.stream,
                                 body.changed)
        # Bytes served count once, on every path, as the page bytes of the rows the client
        # acknowledged whole (a stream's padding for a missing row is not served bytes).
        if metrics is not None and body.lease_id is not None:
            plane = node.dataplane
            metrics.add_moved("out", "data" if plane is not None and plane.took(body.lease_id) else "shm",
                              result.nbytes)
        elif metrics is not None and body.stream is not None:
            metrics.add_moved("out", "tcp", result.nbytes)
        return _json(wire.to_dict(result))

    @app.post("/v1/leases", responses=_lease_links("$response.body#/id"))
    async def lend(body: LendBody, request: Request) -> Response:
        mode, kind = LeaseMode[body.mode], MemoryKind[body.kind]
        if mode is LeaseMode.WRITE:
            admin.state.check_writable()
        if body.all:
            guard.no_all_lease(request)
            if body.names is not None:
                raise InvalidInput("names: an ALL lease names no rows")
            lease = await node.call(bank.lend_all, kind=kind, mode=mode, ttl_s=body.ttl_s)
        else:
            if body.names is None:
                raise InvalidInput("names: a NAMED lease lists its rows (or set all=true)")
            names = [_hex(n, f"names[{i}]") for i, n in enumerate(body.names)]
            guard.names(request, names)
            lease = await node.call(bank.lend, names, mode=mode, kind=kind, ttl_s=body.ttl_s)
        guard.own_lease(request, lease)
        if mode is LeaseMode.READ and kind is MemoryKind.HOST and not body.all:
            # a worker that reads the rows in place verifies its copies as a fetch's
            # client does: each row's checksum, in the lease's row order
            lease = lease.with_sums(await node.call(bank.checksums, lease.id))
        return _json(_lease(lease))

    @app.post("/v1/leases/{lease_id}/renew", responses=_lease_links("$response.body#/id"))
    async def renew(lease_id: str, body: RenewBody, request: Request) -> Response:
        guard.lease(request, lease_id)
        lease = await node.call(bank.renew, lease_id, body.ttl_s)
        if lease.mode is LeaseMode.READ and lease.kind is MemoryKind.HOST and lease.selection is Selection.NAMED:
            # the renewed snapshot replaces the lent one: the same checksums, for the same reader
            lease = lease.with_sums(await node.call(bank.checksums, lease.id))
        return _json(_lease(lease))

    @app.post("/v1/leases/{lease_id}/commit")
    async def commit(lease_id: str, body: CommitBody, request: Request) -> Response:
        return await commit_core(request, body, lease_id)

    async def commit_core(request: Request, body: CommitBody, lease_id: str) -> Response:
        guard.lease(request, lease_id)
        arrived: list[bytes] | list[bool] = (
            [a for a in body.arrived if isinstance(a, bool)]
            if body.arrived and isinstance(body.arrived[0], bool)
            else [_hex(str(a), f"arrived[{i}]") for i, a in enumerate(body.arrived)]
        )
        return _json(wire.to_dict(await node.call(bank.commit, lease_id, arrived)))

    @app.post("/v1/leases/{lease_id}/check")
    async def check(lease_id: str, request: Request) -> Response:
        guard.lease(request, lease_id)
        await node.call(bank.check_live, lease_id)
        return _json({"live": True})

    @app.delete("/v1/leases/{lease_id}")
    async def release(lease_id: str, request: Request) -> Response:
        guard.lease(request, lease_id)
        return _json({"released": await node.call(bank.release, lease_id)})

    @app.get("/v1/stats")
    async def stats() -> Response:
        # the bank's counters, with the node's own ledger of served fetches beside its own
        got = dataclasses.replace(await node.call(bank.stats), served_fetches=len(node.ledger))
        return _json(wire.to_dict(got))

    install_engine(app, node, admin, _json)

    for method, path, handler, model in (
        ("POST", "/v1/match", match_core, MatchBody),
        ("POST", "/v1/fetch", fetch_core, FetchBody),
        ("POST", "/v1/fetch/{fetch_id}/ack", ack_core, AckBody),
        ("POST", "/v1/leases/{lease_id}/commit", commit_core, CommitBody),
        ("POST", "/v1/put", put, None),
        ("POST", "/v1/put_state", put_state, None),
        ("POST", "/v1/put/lease", put_lease, None),
    ):
        app.hot.add(method, path, handler, model, _route(app, method, path),
                    binary=match_binary if path == "/v1/match" else None)
    return app


_VIA_DATA = {"name": "via", "in": "query", "required": False, "schema": {"type": "string", "enum": ["data"]},
             "description": "data: the answer adds a data-port ticket for the lease (see docs/service.md)"}


def _data_plane(node: Node) -> DataPlane:
    """The node's data plane, for a control call that asks for a ticket."""
    if node.dataplane is None:
        raise InvalidInput("via: this node serves no data port (data_port is off)", field="via")
    return node.dataplane


def _route(app: FastAPI, method: str, path: str) -> object:
    for r in app.router.routes:
        if getattr(r, "path", None) == path and method in (getattr(r, "methods", None) or ()):
            return r
    raise LookupError(f"{method} {path}: no such route")  # a hot route must also be a FastAPI one


def _links(description: str = "Successful Response", /, **links: tuple[Any, ...]) -> dict[int | str, Any]:
    """OpenAPI links of a 200 answer: what a client (or a stateful fuzzer) may call next
    with values taken from it."""
    out: dict[str, Any] = {}
    for name, (operation, parameters, *body) in links.items():
        link: dict[str, Any] = {"operationId": operation}
        if parameters:
            link["parameters"] = parameters
        if body and body[0] is not None:
            link["requestBody"] = body[0]
        out[name] = link
    return {200: {"description": description, "links": out}}


def _lease_links(lease_id: str) -> dict[int | str, Any]:
    """A lease's follow-ups, the lease id taken from ``lease_id`` (a runtime expression)."""
    at = {"lease_id": lease_id}
    return _links(renew=("renew_v1_leases__lease_id__renew_post", at),
                  commit=("commit_v1_leases__lease_id__commit_post", at, {"arrived": []}),
                  check=("check_v1_leases__lease_id__check_post", at),
                  release=("release_v1_leases__lease_id__delete", at))


def _match_binary_doc() -> dict[str, Any]:
    """The match body's binary form, beside its JSON schema (merged into the operation)."""
    return {"requestBody": {"description": "a JSON body, or (application/octet-stream) a binary match "
                                           "body: see docs/service.md",
                            "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                "format": "binary"}}}}}


def _binary_doc(what: str) -> dict[str, Any]:
    return {"requestBody": {"required": True, "description": f"a put body ({what}): see docs/service.md",
                            "content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                "format": "binary"}}}}}
