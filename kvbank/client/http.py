"""A client's control calls to its node, over a pool of keep-alive ``http.client`` connections.

- :class:`Pool` — the connections to one node: :meth:`~Pool.conn` takes one (a pooled one
  the node has not closed while idle, else a new one), :meth:`~Pool.give_back` returns it,
  :meth:`~Pool.call` makes one JSON (or binary) control call on it, retrying an idempotent
  one until ``retry_s`` has passed.
- :func:`raise_for` — a node's error answer as the :class:`~kvbank.errors.KvbankError` it
  names (:func:`kvbank.wire.forms.error_from_dict`).

The boundary: ``OSError`` and ``http.client.HTTPException`` become
:class:`~kvbank.errors.TierUnavailable` here; a call's deadline passing becomes
:class:`~kvbank.errors.Busy`. httpx cost ~0.3 ms more a call, which a same-host put or fetch
makes two of and a match one.

Lifecycle: ``Pool(...)`` (no connection yet) → ``conn``/``call`` → ``close()``.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from typing import Any, NoReturn

from kvbank import wire
from kvbank.client.io import Deadline
from kvbank.errors import KvbankError, TierUnavailable

JSON = "application/json"
OCTETS = "application/octet-stream"

# a request body up to this size goes out with its headers (a copy of it costs less than a
# second wakeup)
_ONE_SEND = 1 << 20


class _Connection(http.client.HTTPConnection):
    """``http.client`` sends a request's headers and its body in two ``send`` calls; with
    TCP_NODELAY that is two segments, and the node wakes, parses and waits once more per
    call. A small bytes body goes out with its headers in one."""

    def _send_output(self, message_body: Any = None, encode_chunked: bool = False) -> None:
        if isinstance(message_body, bytes) and len(message_body) <= _ONE_SEND:
            self._buffer.extend((b"", message_body))  # type: ignore[attr-defined]
            msg = b"\r\n".join(self._buffer)  # type: ignore[attr-defined]
            del self._buffer[:]  # type: ignore[attr-defined]
            self.send(msg)
            return
        super()._send_output(message_body, encode_chunked)  # type: ignore[misc]


def _usable(conn: http.client.HTTPConnection) -> bool:
    """An idle pooled connection the node has not closed: nothing to read on it yet
    (a readable idle socket is an EOF or bytes no request asked for)."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        return not select.select([sock], [], [], 0)[0]
    except (OSError, ValueError):
        return False


def raise_for(status: int, body: bytes) -> NoReturn:
    """Raise the node's error answer ``body`` (HTTP ``status``) as the error it names;
    :class:`TierUnavailable` where it is no error document."""
    try:
        exc = wire.error_from_dict(json.loads(body))
    except (ValueError, RecursionError, KvbankError):
        exc = TierUnavailable(f"server: answered {status} without an error document: {body[:200]!r}")
    raise exc


class Pool:
    """Keep-alive connections to the node at ``url`` (thread-safe), and the control calls
    made on them. ``auth``: headers sent on every request (a tenant token)."""

    def __init__(self, url: str, host: str, port: int, *, timeout_s: float, retry_s: float,
                 auth: dict[str, str]) -> None:
        self.url = url
        self._host, self._port = host, port
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.auth = auth
        self._lock = threading.Lock()
        self._conns: list[http.client.HTTPConnection] = []

    def call(self, method: str, path: str, *, body: Any = None, content: bytes | None = None,
             idempotent: bool = False, deadline: Deadline | None = None,
             wait_s: float | None = None) -> Any:
        """One control call; the node's JSON answer. ``deadline``: a call's ``timeout=``,
        bounding every wait and retry (:class:`Busy` once it passed); ``wait_s``: the node's
        own wait before it answers (a flush), added to the socket's limit."""
        payload = content if content is not None else (
            None if body is None else json.dumps(body, separators=(",", ":")).encode())
        headers = {**self.auth, "Content-Type": OCTETS if content is not None else JSON}
        retry_end = time.monotonic() + self.retry_s
        if deadline is not None:
            retry_end = min(retry_end, deadline.at)
        delay = 0.05
        while True:
            limit = self.limit(deadline, f"{method} {path} was not answered")
            try:
                conn = self.conn(limit if wait_s is None else limit + wait_s)
                try:
                    conn.request(method, path, body=payload, headers=headers)
                    resp = conn.getresponse()
                    status, data = resp.status, resp.read()
                except (OSError, http.client.HTTPException) as exc:
                    conn.close()
                    raise TierUnavailable(f"node: {self.url} unreachable: {exc}") from exc
            except TierUnavailable as exc:
                if deadline is not None and deadline.passed():
                    raise deadline.busy(f"{method} {path} was not answered") from exc
                if idempotent and time.monotonic() + delay < retry_end:
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                raise
            if resp.will_close:
                conn.close()
            else:
                self.give_back(conn)
            if status >= 400:
                raise_for(status, data)
            try:
                return json.loads(data)
            except ValueError as exc:
                raise TierUnavailable(f"node: {method} {path} answered {status} without JSON") from exc

    def limit(self, deadline: Deadline | None, what: str) -> float:
        """The socket timeout of the next wait: ``timeout_s``, or less where ``deadline``
        comes first (:class:`Busy` naming ``what`` where it passed already)."""
        if deadline is None:
            return self.timeout_s
        left = deadline.left()
        if left <= 0:
            raise deadline.busy(what)
        return min(left, self.timeout_s)

    def conn(self, timeout: float | None = None) -> http.client.HTTPConnection:
        """A pooled (or new) connection whose waits end after ``timeout`` (default ``timeout_s``)."""
        limit = self.timeout_s if timeout is None else timeout
        while True:
            with self._lock:
                conn = self._conns.pop() if self._conns else None
            if conn is None:
                break
            if _usable(conn):
                if conn.sock is not None:
                    conn.sock.settimeout(limit)
                return conn
            conn.close()  # the node closed it while idle (its keep-alive timeout)
        conn = _Connection(self._host, self._port, timeout=limit)
        try:
            conn.connect()
        except OSError as exc:
            raise TierUnavailable(f"node: {self.url} unreachable: {exc}") from exc
        if conn.sock is not None:  # requests are small: do not wait to coalesce them
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def give_back(self, conn: http.client.HTTPConnection) -> None:
        """Return ``conn``, its answer read whole, for the next request."""
        with self._lock:
            self._conns.append(conn)

    def close(self) -> None:
        """Close every idle connection. Idempotent."""
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.close()


__all__ = ["JSON", "OCTETS", "Pool", "raise_for"]
