"""A client's side of the node's data port: :class:`DataLink`, pooled connections that
present a ticket from an HTTP control call and move page bytes straight between the
caller's buffers and the lease's slots (the wire form: :mod:`kvbank.wire.dataport`)."""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Sequence

from kvbank import wire
from kvbank.errors import Busy, KvbankError, TierUnavailable
from kvbank.wire.dataport import (
    GO,
    MAX_ERROR_BYTES,
    REFUSED,
    REPLY,
    REPLY_MAGIC,
    REQUEST,
    REQUEST_MAGIC,
    TICKET_BYTES,
    VERSION,
    Broken,
    Op,
    recv_exact,
    set_timeouts,
)


class DataPortUnreachable(TierUnavailable):
    """The node advertises a data port this client cannot connect to."""


class DataLink:
    """One client's pooled connections to a node's data port (thread-safe)."""

    def __init__(self, host: str, timeout_s: float) -> None:
        self._host = host
        self._timeout = timeout_s
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self.port: int | None = None

    def _connect(self) -> socket.socket:
        if self.port is None:
            raise DataPortUnreachable("data_port: the node advertises none")
        try:
            sock = socket.create_connection((self._host, self.port), timeout=self._timeout)
        except OSError as exc:
            raise DataPortUnreachable(f"data_port: {self._host}:{self.port} unreachable: {exc}") from exc
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_timeouts(sock, self._timeout)
        return sock

    def _take(self) -> tuple[socket.socket, bool]:
        """A connection, and whether it was pooled (the node may have closed it since)."""
        while True:
            with self._lock:
                sock = self._idle.pop() if self._idle else None
            if sock is None:
                return self._connect(), False
            try:
                if not select.select([sock], [], [], 0)[0]:
                    return sock, True
            except (OSError, ValueError):
                pass
            sock.close()  # readable while idle: the node closed it (idle_timeout_s)

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)

    def _start(self, op: Op, ticket: str, want: int) -> socket.socket:
        """Present ``ticket``; the connection, once the node answered go for ``want`` bytes."""
        try:
            raw = bytes.fromhex(ticket)
        except (TypeError, ValueError):
            raise TierUnavailable(f"node: a ticket that is not hex: {ticket!r}"[:200]) from None
        if len(raw) != TICKET_BYTES:
            raise TierUnavailable(f"node: a ticket of {len(raw)} bytes, expected {TICKET_BYTES}")
        attempt = 0
        while True:
            attempt += 1
            sock, pooled = self._take()
            try:
                sock.sendall(REQUEST.pack(REQUEST_MAGIC, VERSION, op, raw))
                head = bytearray(REPLY.size)
                recv_exact(sock, memoryview(head))
            except (OSError, Broken) as exc:
                sock.close()
                # A pooled connection the node closed just now never read the request, so
                # the ticket is unused: once more on a fresh one.
                if pooled and attempt == 1:
                    continue
                raise TierUnavailable(f"data port: {self._host}:{self.port}: {exc}") from exc
            try:
                self._check_reply(sock, head, want)
            except BaseException:
                sock.close()
                raise
            return sock

    def _check_reply(self, sock: socket.socket, head: bytearray, want: int) -> None:
        magic, status, err_len, count = REPLY.unpack(head)
        if magic != REPLY_MAGIC:
            raise TierUnavailable(f"data port: a reply with magic {bytes(magic)!r}, expected {REPLY_MAGIC!r}")
        if status == REFUSED:
            doc = bytearray(min(err_len, MAX_ERROR_BYTES))
            try:
                recv_exact(sock, memoryview(doc))
                exc: KvbankError = wire.error_from_dict(json.loads(doc))
            except (OSError, Broken, ValueError, RecursionError, KvbankError) as bad:
                exc = TierUnavailable(f"data port: refused, without a readable reason: {bad}")
            raise exc
        if status != GO or count != want:
            raise TierUnavailable(f"data port: status {status} for {count} bytes, expected go for {want}")

    def put(self, ticket: str, bufs: Sequence[memoryview]) -> None:
        """Send ``bufs`` (the slots' bytes, in the ticket's order); returns once the node
        has every byte. Raises the node's typed refusal, or :class:`TierUnavailable`."""
        total = sum(len(b) for b in bufs)
        sock = self._start(Op.PUT, ticket, total)
        try:
            for b in bufs:
                sock.sendall(b)
            head = bytearray(REPLY.size)
            recv_exact(sock, memoryview(head))
            self._check_reply(sock, head, total)
        except (OSError, Broken) as exc:
            sock.close()
            raise TierUnavailable(f"data port: put broke off: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        self._give_back(sock)

    def fetch(self, ticket: str, bufs: Sequence[memoryview]) -> tuple[int, BaseException | None]:
        """Receive the ticket's slots into ``bufs`` (each exactly its slot's size): how many
        arrived whole (a prefix), and what ended the transfer early (None: nothing).
        Raises where it never began: :class:`DataPortUnreachable`, :class:`Busy`."""
        try:
            sock = self._start(Op.FETCH, ticket, sum(len(b) for b in bufs))
        except (DataPortUnreachable, Busy):
            raise  # the transfer never began: the caller may take HTTP instead
        except KvbankError as exc:
            return 0, exc
        got = 0
        try:
            for b in bufs:
                recv_exact(sock, b)
                got += 1
        except (OSError, Broken) as exc:
            sock.close()
            return got, TierUnavailable(f"data port: fetch broke off after {got} rows: {exc}")
        self._give_back(sock)
        return got, None

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


__all__ = ["DataLink", "DataPortUnreachable"]
