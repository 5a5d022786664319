"""Connection-level limits of ``kvbank serve``: what uvicorn's HTTP protocol leaves open.

uvicorn (httptools) bounds neither how long a client may take to send its request
headers nor how many bytes they may hold, and it accepts every connection: a client that
connects and trickles a header byte by byte, or thousands that connect and say nothing,
each keep a socket, a parser and its buffers for as long as they like. :func:`protocol`
builds the node's HTTP protocol, uvicorn's own with three limits added:

- **header timeout** (``header_timeout_s``): the request line and headers must be complete
  within this long of the connection's accept (the first request) or of the first byte of
  a later request on a kept-alive connection; past it the node answers 408 and closes.
  Idle time between requests is uvicorn's keep-alive timeout (``idle_timeout_s``); a body
  is bounded by ``body_timeout_s`` where the routes read it.
- **header bytes** (``max_header_bytes``): a request whose head has not ended within this
  many bytes is answered 431 and closed, before the parser buffers more of it; and a
  head that did end (one that arrived in a single read) is counted as parsed — request
  line and every header — and answered 431 before it reaches the application.
- **connections** (``max_connections``): a connection beyond the limit makes room by
  closing (503) the one that has waited longest for its request head — a connection
  that says nothing, or trickles its head, holds a slot only until a newcomer needs it,
  so idle connections cannot starve anyone (served-node review D9); when every
  connection is being served, the newcomer is answered 503 at once and closed. Idle
  connections cost at most the limit in file descriptors.

:class:`RequestLimits` is the ASGI side, on the application itself (so an in-process
node has it too): at most ``max_headers`` headers (431); a body over its limit is 413
before it is read (declared ``Content-Length``) or as soon as it passes the limit
(chunked). Put bodies (``streamed`` paths) are read, bounded by ``max_body_bytes`` and
timed by the routes themselves; every other body is JSON, read here whole — at most
``min(max_json_bytes, max_body_bytes)`` bytes within ``body_timeout_s`` (400 past it) —
and handed to the route, so no JSON route can be made to buffer more or wait longer.

Everything else — request smuggling included (conflicting ``Content-Length`` and
``Transfer-Encoding``, duplicate ``Content-Length``: llhttp refuses them, uvicorn answers
400 and closes) — is uvicorn's, checked end to end in ``tests/reliability``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Collection
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvbank.service.config import ServiceConfig

logger = logging.getLogger(__name__)

__all__ = ["RequestLimits", "protocol", "refusal"]

_LINE_BYTES = 16  # a request line's bytes besides its URL: method, spaces, version, CRLF


def refusal(status: int, reason: str, message: str) -> bytes:
    """A whole ``Connection: close`` HTTP/1.1 answer with a JSON error body."""
    body = ('{"type":"InvalidInput","field":"connection","message":"' + message + '"}').encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def protocol(config: ServiceConfig) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the node's connection limits (module docstring)."""
    header_timeout = config.header_timeout_s
    max_header_bytes = config.max_header_bytes
    max_connections = config.max_connections
    too_slow = refusal(408, "Request Timeout",
                       f"connection: request headers did not arrive within {header_timeout}s")
    too_big = refusal(431, "Request Header Fields Too Large",
                      f"connection: request headers over {max_header_bytes} bytes")
    too_many = refusal(503, "Service Unavailable",
                       f"connection: more than {max_connections} connections")

    class NodeHttpProtocol(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _in_head = False  # between a request's first byte (or the accept) and its headers' end
        _in_message = False  # the parser is inside a request (its head or its body)
        _head_bytes = 0  # bytes of the head received since it began (a head spanning reads)
        _head_tail = b""  # the head's last bytes so far (a CR LF CR LF may straddle reads)
        _parsed = 0  # bytes of the head the parser has handed over (its line and headers)
        _refused = False  # answered and closing: the parser's callbacks do nothing more
        _head_since = 0.0  # loop time the current head began (the wait for it, at first)

        def connection_made(self, transport: Any) -> None:  # uvicorn's own signature
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                victim = self._longest_waiting()
                if victim is None:  # every other connection is being served
                    self._refuse(too_many)
                    return
                victim._refuse(too_many)  # it made room: a newcomer may have a request
            self._start_head()

        def _longest_waiting(self) -> NodeHttpProtocol | None:
            """The open connection that has waited longest for its request head."""
            best: NodeHttpProtocol | None = None
            for c in self.connections:
                if (c is not self and isinstance(c, NodeHttpProtocol) and c._in_head
                        and not c._refused and (best is None or c._head_since < best._head_since)):
                    best = c
            return best

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return  # refused: nothing more is parsed
            if not self._in_head and not self._in_message:
                self._start_head()  # the first bytes of the next request (even bare CRLFs)
            if self._in_head:
                # Counted up to the head's end, before the parser sees the chunk: a head
                # that arrives whole in one read would otherwise complete (and escape the
                # limit) before it was counted. The parser's count (on_headers_complete)
                # covers a head that begins inside a chunk, after a pipelined request.
                seen = self._head_bytes
                end = (self._head_tail + data[:max_header_bytes + 4]).find(b"\r\n\r\n")
                self._head_bytes += len(data) if end < 0 else end + 4 - len(self._head_tail)
                self._head_tail = data[-3:] if len(data) >= 3 else (self._head_tail + data)[-3:]
                if self._head_bytes > max_header_bytes and seen <= max_header_bytes:
                    self._refuse(too_big)
                    return
            super().data_received(data)
            if self._in_head and self._head_bytes > max_header_bytes and not self.transport.is_closing():
                self._refuse(too_big)

        def on_message_begin(self) -> None:
            if self._refused:
                return
            super().on_message_begin()
            self._in_message = True
            self._parsed = 0
            if not self._in_head:
                self._start_head()

        def on_url(self, url: bytes) -> None:
            if self._refused:
                return
            self._parsed += len(url) + _LINE_BYTES
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if self._refused:
                return
            self._parsed += len(name) + len(value) + 4  # ": " and CRLF
            super().on_header(name, value)

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refused:
                return
            self._in_message = False
            super().on_message_complete()

        def on_headers_complete(self) -> None:
            if self._refused:
                return
            self._in_head = False
            self._stop_head_timer()
            if self._parsed > max_header_bytes:  # a whole head in one read: counted here
                self._refuse(too_big)
                return
            super().on_headers_complete()

        def _start_head(self) -> None:
            self._in_head = True
            self._head_bytes = 0
            self._head_tail = b""
            self._head_since = self.loop.time()
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self._in_head or self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # a pipelined request waits while the node itself is still answering the
                # one before it: that is the node's time, not the client's
                self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)
                return
            logger.debug("connection %s: request headers timed out", self.client)
            self._refuse(too_slow)

        def _refuse(self, answer: bytes) -> None:
            self._refused = True
            self._in_head = False
            self._stop_head_timer()
            self.transport.write(answer)
            self.transport.close()

    return NodeHttpProtocol


class RequestLimits:
    """ASGI middleware: header count and body size and time bounds (module docstring)."""

    def __init__(self, app: ASGIApp, config: ServiceConfig, streamed: Collection[str]) -> None:
        self.app = app
        self.max_headers = config.max_headers
        self.max_body = config.max_body_bytes
        self.max_json = min(config.max_json_bytes, config.max_body_bytes)
        self.body_timeout_s = config.body_timeout_s
        self.streamed = frozenset(streamed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if len(headers) > self.max_headers:
            await _answer(send, 431, "headers", f"headers: {len(headers)}, more than {self.max_headers}",
                          close=False)
            return
        streamed = scope["path"] in self.streamed
        limit = self.max_body if streamed else self.max_json
        lengths = [v for k, v in headers if k == b"content-length"]
        if lengths and (len(lengths) > 1 or not lengths[0].isdigit()):
            # the HTTP parser refuses both before this; an in-process caller might not
            await _answer(send, 400, "content-length", "content-length: not one decimal length")
            return
        if lengths and int(lengths[0]) > limit:
            # kept alive: uvicorn reads and drops the rest of a declared body (never
            # buffering it), so a client that sends it whole before reading sees the 413
            await _answer(send, 413, "body", f"body: {int(lengths[0])} bytes, over the {limit}-byte limit",
                          close=False)
            return
        if streamed:
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await _read_body(receive, limit)
        except TimeoutError:
            await _answer(send, 400, "body", f"body: did not arrive within {self.body_timeout_s}s")
            return
        except _TooLarge:
            await _answer(send, 413, "body", f"body: over the {limit}-byte limit")
            return
        if body is None:
            return  # the client went away: there is no one to answer
        await self.app(scope, _replay(body, receive), send)


class _TooLarge(Exception):
    pass


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body (None if the client disconnected), refusing more than ``limit``."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out ``body`` once, then the connection's own messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(send: Send, status: int, field: str, message: str, *, close: bool = True) -> None:
    """A JSON error; ``close``: the connection ends with it (a body of unknown length, or
    one that stalled, is not worth reading on)."""
    body = json.dumps({"type": "InvalidInput", "field": field, "message": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
