"""The node's hot routes, dispatched without FastAPI's per-request machinery.

A same-host fetch or put makes two control calls and a resume a match before them, so a
control call's own cost is paid on every hit. Measured on the node, the framework spent
more of the event loop's time per call than the bank did: routing scans every route (the
admin ones included), then dependency solving and body validation run in pure Python,
inside three framework middlewares the node does not use (its own limits, gates and
counters are middlewares of their own).

:class:`NodeAPI` is the node's FastAPI application with a table of hot routes
(:meth:`HotTable.add`). A request for one of them goes through a lean chain: the node's
own middlewares exactly as installed (``user_middleware``: limits, tenant binding, drain
gate, counters — same classes, same settings, same shared state) around
:class:`_HotHandler`, which validates the JSON body with the route's own pydantic model
(``model_validate_json``, pydantic's compiled core) and awaits the same handler the
FastAPI route awaits, so the two cannot answer differently. A hot route may also take a
binary body (``binary``: ``POST /v1/match``'s, :func:`kvbank.wire.framing.decode_match`),
which only the lean chain reads. Every other request, and a body that is not JSON to a
hot route without a binary form, takes the full application. The FastAPI
routes stay registered: they describe the API in ``/openapi.json``.

A handler's typed errors answer as everywhere on the node (``errors``); a body the model
refuses answers ``InvalidInput`` naming the first faulty field, as the FastAPI route's
validation handler does; anything else propagates to the server, which answers 500 as
the framework's error middleware would.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvbank.errors import InvalidInput, KvbankError

_M = TypeVar("_M", bound=BaseModel)

Handler = Callable[..., Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class _Hot:
    parts: tuple[str | None, ...]  # path segments; None where a path parameter stands
    params: tuple[str, ...]  # the parameters' names, in path order
    model: type[BaseModel] | None  # the JSON body's model (None: no body)
    handler: Handler  # awaited as handler(request, body?, **params)
    route: object  # the FastAPI route of the same path (what counters label by)
    binary: Handler | None = None  # awaited as binary(request, **params) for an octet-stream body


class HotTable:
    """The hot routes, by method and path template."""

    def __init__(self) -> None:
        self._by_method: dict[str, list[_Hot]] = {}

    def add(self, method: str, template: str, handler: Handler, model: type[BaseModel] | None,
            route: object, *, binary: Handler | None = None) -> None:
        parts: list[str | None] = []
        params: list[str] = []
        for seg in template.split("/"):
            if seg.startswith("{") and seg.endswith("}"):
                parts.append(None)
                params.append(seg[1:-1])
            else:
                parts.append(seg)
        self._by_method.setdefault(method, []).append(
            _Hot(tuple(parts), tuple(params), model, handler, route, binary))

    def find(self, method: str, path: str) -> tuple[_Hot, dict[str, str]] | None:
        segs = path.split("/")
        for hot in self._by_method.get(method, ()):
            if len(hot.parts) != len(segs):
                continue
            values: list[str] = []
            for want, got in zip(hot.parts, segs, strict=True):
                if want is None:
                    if not got:
                        break
                    values.append(got)
                elif want != got:
                    break
            else:
                return hot, dict(zip(hot.params, values, strict=True))
        return None


def _media_type(scope: Scope) -> bytes:
    """The request's declared body type; ``application/json`` when it says none, as
    FastAPI allows."""
    for k, v in scope["headers"]:
        if k == b"content-type":
            return bytes(v.split(b";", 1)[0].strip().lower())
    return b"application/json"


class _HotHandler:
    """The innermost app of the lean chain: the hot route found for the request."""

    def __init__(self, errors: Callable[[KvbankError], Response]) -> None:
        self.errors = errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot: _Hot = scope["kvbank.hot"]
        request = Request(scope, receive)
        try:
            if scope["kvbank.binary"]:
                assert hot.binary is not None  # only such routes are given a binary body
                response = await hot.binary(request, **scope["path_params"])
            else:
                args: list[Any] = [request]
                if hot.model is not None:
                    args.append(validate_body(hot.model, await request.body()))
                response = await hot.handler(*args, **scope["path_params"])
        except KvbankError as exc:
            response = self.errors(exc)
        await response(scope, receive, send)


class NodeAPI(FastAPI):
    """The node's application: FastAPI, with the hot routes of :attr:`hot` taken by a
    lean chain. See the module docstring."""

    def __init__(self, *, errors: Callable[[KvbankError], Response], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hot = HotTable()
        self._errors = errors
        self._lean: ASGIApp | None = None

    def _lean_chain(self) -> ASGIApp:
        app: ASGIApp = _HotHandler(self._errors)
        for cls, args, kwargs in reversed(self.user_middleware):  # first listed = outermost
            app = cls(app, *args, **kwargs)
        return app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self.hot.find(scope["method"], scope["path"]) if scope["type"] == "http" else None
        kind = _media_type(scope) if found is not None and found[0].model is not None else b"application/json"
        binary = kind == b"application/octet-stream" and found is not None and found[0].binary is not None
        if found is None or (kind != b"application/json" and not binary):
            await super().__call__(scope, receive, send)
            return
        if self._lean is None:
            self._lean = self._lean_chain()  # middlewares are all added by the first request
        hot, params = found
        scope["app"] = self
        scope["route"] = hot.route  # as the router would: counters label by template
        scope["path_params"] = params
        scope["kvbank.hot"] = hot
        scope["kvbank.binary"] = binary
        await self._lean(scope, receive, send)


def validate_body(model: type[_M], raw: bytes | str) -> _M:
    """A JSON request body read as a FastAPI route reads it, but a field that does not fit
    is :class:`InvalidInput` naming it (the routes' typed error, not a 422). The hot routes
    and the local channel's JSON ops (LOAD, LOADED) read their bodies with it."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errs = exc.errors()
        loc = ".".join(str(p) for p in errs[0]["loc"]) if errs else ""
        msg = errs[0]["msg"] if errs else "invalid request"
        raise InvalidInput(f"{loc or 'body'}: {msg}", field=loc or "body") from None


__all__ = ["HotTable", "NodeAPI"]
