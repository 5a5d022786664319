"""The data plane: page bodies of remote puts and fetches over a plain TCP socket, with
every decision left to the HTTP control plane.

A remote put or fetch makes the same control call the same-host path makes (``POST
/v1/put/lease`` → a WRITE HOST lease with RESERVED slots; ``POST /v1/fetch`` → a READ HOST
lease on the rows), through every middleware of the node (limits, tenant guard, drain
gate, counters). Asked with ``via=data``, the answer also carries a **ticket**: 128
random bits, good for one transfer, bound to that lease, its slots in order and the
transfer's direction, and expiring with the lease. The page bytes then travel over the
node's data port, and the client ends the transfer over HTTP exactly as on the same-host
path: it commits the rows that arrived whole, or acknowledges the fetch with the lease id
(the node's completion check: rows read after the lease expired do not count).

Primitives:

- :class:`Tickets` — the registry: ``issue`` (after a control call lends the lease) and
  ``redeem`` (single use: a ticket is gone once presented, whatever follows).
- :class:`DataPlane` — the node's listener: a thread accepts, a thread per connection
  (at most ``data_connections``) serves transfers one after another on it.
- the client's side is :class:`kvbank.client.dataport.DataLink`; the wire form
  :mod:`kvbank.wire.dataport`.

The wire, per transfer (little-endian; the server speaks only after a whole request)::

    client → REQUEST  magic "KVDP", version, op (1 = put, 2 = fetch), ticket (16 bytes)
    server → REPLY    magic "KVDR", status (0 = go, 1 = refused), error length, byte count
                      refused: a JSON error document {type, field, message} follows, and
                      the server closes the connection
    fetch:  server → the slots' bytes, back to back, in the ticket's slot order
    put:    client → the slots' bytes, in the ticket's slot order
            server → REPLY (status 0, the byte count received) once every slot is full

A fetch's slots are sent from memoryviews of the host segment (``sendall``: the kernel
has the bytes when it returns); a put's land straight in the reserved slots
(``recv_into`` with ``MSG_WAITALL``, one call per slot). Bytes beyond the slots are never
read into anything: after a transfer the next bytes must be another request.

Failure: the server never commits or acknowledges. A connection dropped mid-put leaves
the WRITE lease uncommitted (the client releases it, or it expires): nothing becomes
visible. A connection dropped mid-fetch leaves the client the slots it received whole,
which it acknowledges, and the fetch id resumes from the first row not recorded. A slot
is never received into past its lease's deadline: each ``recv_into`` is bounded by the
time the lease has left. Bounded: the connections (``data_connections``; one more
closes the connection idle longest, or is answered ``Busy`` and closed when none is
idle), the wait for a request (``idle_timeout_s``), a transfer (``body_timeout_s``),
the request (a fixed 24 bytes), the tickets remembered.

Lifecycle (server): ``DataPlane(bank, config)`` → ``start()`` (binds; the port) →
``issue(...)`` from the control routes → ``stop()`` (closes the listener and every
connection, joins their threads) before the bank closes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import select
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvbank import wire
from kvbank.errors import (
    Busy,
    InvalidInput,
    KvbankError,
    LeaseExpired,
    TierUnavailable,
)
from kvbank.lender.base import Lease
from kvbank.service.sockets import listen
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

if TYPE_CHECKING:
    from kvbank.bank.bank import Bank

logger = logging.getLogger(__name__)

_TICKETS = 8192  # unredeemed tickets remembered (the oldest go first; each expires anyway)
_SERVED = 4096  # fetch leases remembered as data-plane ones, for the byte counters

Moved = Callable[[str, int], None]  # (direction "in" / "out", bytes): the node's counters


@dataclass(frozen=True, slots=True)
class Ticket:
    """What a redeemed ticket allows: one transfer of ``slots`` under ``lease_id``."""

    op: Op
    lease_id: str
    slots: tuple[tuple[bytes, int], ...]  # (row name, size) in the order the bytes travel
    expires_at: float  # the lease's deadline, on the bank's clock


def slot_names(doc: dict[str, Any], names: Sequence[bytes]) -> list[tuple[bytes, int]]:
    """A lease's slots form (``kvbank.service.node.slots_doc``) → ``(name, size)`` of each
    slot, in the order the client sends or receives them."""
    return [(names[i], size) for i, _, _, size in doc["slots"]]


class Tickets:
    """Single-use tickets, by their 16 random bytes (thread-safe)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._live: OrderedDict[bytes, Ticket] = OrderedDict()

    def issue(self, op: Op, lease: Lease, slots: Sequence[tuple[bytes, int]]) -> str:
        """A new ticket for one transfer of ``slots`` under ``lease``; its hex form."""
        raw = secrets.token_bytes(TICKET_BYTES)
        ticket = Ticket(op, lease.id, tuple(slots), lease.expires_at)
        with self._lock:
            self._live[raw] = ticket
            while len(self._live) > _TICKETS:
                self._live.popitem(last=False)
        return raw.hex()

    def redeem(self, raw: bytes, op: Op) -> Ticket:
        """The ticket ``raw`` stands for, taken out (single use): :class:`InvalidInput`
        for one never issued, already used or for the other direction,
        :class:`LeaseExpired` for one whose lease's deadline has passed."""
        with self._lock:
            ticket = self._live.pop(raw, None)
            now = self._clock()
            # forget the expired ones at the old end while here
            while self._live:
                first = next(iter(self._live.values()))
                if first.expires_at > now:
                    break
                self._live.popitem(last=False)
        if ticket is None:
            raise InvalidInput("ticket: not issued by this node, or already used")
        if ticket.op is not op:
            raise InvalidInput(f"ticket: issued for a {ticket.op.name.lower()}, presented for a {op.name.lower()}")
        if now >= ticket.expires_at:
            raise LeaseExpired(f"ticket: its lease {ticket.lease_id} expired {now - ticket.expires_at:.3f}s ago")
        return ticket

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)


def _reply(status: int, count: int, error: bytes = b"") -> bytes:
    return REPLY.pack(REPLY_MAGIC, status, len(error), count) + error


def _refuse(conn: socket.socket, exc: KvbankError) -> None:
    """Answer ``exc`` and end the sending side; the caller closes the connection."""
    doc = json.dumps(wire.error_to_dict(exc), separators=(",", ":")).encode()[:MAX_ERROR_BYTES]
    conn.sendall(_reply(REFUSED, 0, doc))
    conn.shutdown(socket.SHUT_WR)
    # Take what the client sent meanwhile (a request on connecting, a request's tail)
    # before closing: a close with bytes unread answers a reset, which can overtake the
    # refusal. What is taken is dropped, never used.
    if select.select([conn], [], [], 0.05)[0]:
        conn.recv(1 << 16)


class DataPlane:
    """The node's data port (see the module docstring)."""

    def __init__(self, bank: Bank, *, bind: str, port: int, max_connections: int,
                 idle_timeout_s: float, body_timeout_s: float, moved: Moved | None = None) -> None:
        self._bank = bank
        self._bind, self._want_port = bind, port
        self._max = max_connections
        self._idle = idle_timeout_s
        self._body = body_timeout_s
        self.moved = moved
        self.tickets = Tickets(bank.clock)
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        # monotonic time each connection began waiting for its next request (None: busy)
        self._waiting: dict[socket.socket, float | None] = {}
        self._picked: set[socket.socket] = set()  # closed to make room for a newcomer
        self._served: OrderedDict[str, None] = OrderedDict()  # fetch leases sent over this port
        self._sock: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._stopping = threading.Event()
        self.port: int | None = None

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> int:
        """Bind and listen (port 0: a free one); the port."""
        sock = listen(self._bind, self._want_port, field="data_port", backlog=256)
        sock.settimeout(0.25)  # the acceptor looks at the stop flag this often
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept, name="kvbank-data-accept", daemon=True)
        self._acceptor.start()
        logger.debug("data plane: listening on %s:%d", self._bind, self.port)
        return self.port

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, end every connection (a transfer in flight breaks off: its
        client commits nothing, or acknowledges what it has), join the threads."""
        self._stopping.set()
        if self._acceptor is not None:
            self._acceptor.join(timeout_s)
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            conns = list(self._conns.items())
        for sock, _ in conns:
            with contextlib.suppress(OSError):  # already gone
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout_s
        for _, t in conns:
            t.join(max(0.0, deadline - time.monotonic()))

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # ---- the control plane's side ------------------------------------------------------

    def issue(self, op: Op, lease: Lease, slots: Sequence[tuple[bytes, int]]) -> str:
        """A ticket for one transfer of ``slots`` under ``lease`` (hex)."""
        if op is Op.FETCH:
            with self._lock:
                self._served[lease.id] = None
                while len(self._served) > _SERVED:
                    self._served.popitem(last=False)
        return self.tickets.issue(op, lease, slots)

    def took(self, lease_id: str) -> bool:
        """Whether ``lease_id`` was a fetch lease ticketed here (forgotten once asked)."""
        with self._lock:
            return self._served.pop(lease_id, False) is None

    # ---- serving -----------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._sock is not None  # started
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._stopping.is_set():
                    logger.warning("data plane: accept failed: %s", exc)
                    time.sleep(0.05)
                continue
            conn.setblocking(True)
            victim: socket.socket | None = None
            with self._lock:
                full = len(self._conns) >= self._max
                if full:  # the connection idle longest makes room (served-node review D9)
                    idle = [(t, s) for s, t in self._waiting.items()
                            if t is not None and s not in self._picked]
                    if idle:
                        victim = min(idle, key=lambda x: x[0])[1]
                        self._picked.add(victim)
                        full = False
                if not full:
                    t = threading.Thread(target=self._serve, args=(conn,), name="kvbank-data", daemon=True)
                    self._conns[conn] = t
                    self._waiting[conn] = time.monotonic()
            if victim is not None:
                with contextlib.suppress(OSError):  # gone already
                    victim.shutdown(socket.SHUT_RDWR)  # its thread sees the end and closes it
            if full:
                self._turn_away(conn)
                continue
            t.start()

    def _turn_away(self, conn: socket.socket) -> None:
        try:
            set_timeouts(conn, 1.0)
            _refuse(conn, Busy(f"data_connections: the node serves {self._max} data "
                               "connections at once; try again or use HTTP"))
        except OSError:
            pass  # it left already
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = bytearray(REQUEST.size)
            while not self._stopping.is_set():
                set_timeouts(conn, self._idle)
                with self._lock:
                    self._waiting[conn] = time.monotonic()
                try:
                    k = conn.recv_into(head, REQUEST.size, socket.MSG_WAITALL)
                except (BlockingIOError, TimeoutError):
                    return  # idle past idle_timeout_s: close
                if k == 0:
                    return  # the client closed between transfers (or it made room)
                with self._lock:
                    if conn in self._picked:
                        return  # picked to make room as its request came: the client retries
                    self._waiting[conn] = None
                if k != REQUEST.size:
                    raise Broken(f"a request of {k} bytes, expected {REQUEST.size}")
                try:
                    op, ticket = self._redeem(head)
                except KvbankError as exc:
                    _refuse(conn, exc)
                    return
                if op is Op.FETCH:
                    self._send(conn, ticket)
                else:
                    self._receive(conn, ticket)
        except (Broken, OSError) as exc:
            logger.debug("data plane: connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
                self._waiting.pop(conn, None)
                self._picked.discard(conn)
            conn.close()

    def _redeem(self, head: bytearray) -> tuple[Op, Ticket]:
        magic, version, op, raw = REQUEST.unpack(head)
        if magic != REQUEST_MAGIC:
            raise InvalidInput(f"request.magic: expected {REQUEST_MAGIC!r}, got {bytes(magic)!r}")
        if version != VERSION:
            raise InvalidInput(f"request.version: this node speaks {VERSION}, got {version}")
        if op not in (Op.PUT, Op.FETCH):
            raise InvalidInput(f"request.op: expected 1 (put) or 2 (fetch), got {op}")
        return Op(op), self.tickets.redeem(bytes(raw), Op(op))

    def _views(self, ticket: Ticket) -> list[memoryview]:
        views: list[memoryview] = []
        try:
            for name, size in ticket.slots:
                v = self._bank.view(ticket.lease_id, name)
                views.append(v)
                if len(v) != size:
                    raise TierUnavailable(f"lease: slot of {len(v)} bytes, the ticket says {size}")
        except BaseException:
            for v in views:
                v.release()
            raise
        return views

    def _left(self, ticket: Ticket, deadline: float) -> float:
        """Seconds this transfer may still take: to its own deadline and the lease's."""
        left = min(deadline - time.monotonic(), ticket.expires_at - self._bank.clock())
        if left <= 0:
            raise Broken(f"lease {ticket.lease_id} or the transfer's {self._body}s ran out")
        return left

    def _send(self, conn: socket.socket, ticket: Ticket) -> None:
        try:
            views = self._views(ticket)
        except KvbankError as exc:  # released or reaped since the ticket was issued
            _refuse(conn, exc)
            raise Broken(f"refused: {exc}") from exc
        total = sum(len(v) for v in views)
        deadline = time.monotonic() + self._body
        try:
            set_timeouts(conn, self._left(ticket, deadline))
            conn.sendall(_reply(GO, total))
            for v in views:
                # bytes sent after the lease ended do not count (the acknowledgement checks)
                set_timeouts(conn, self._left(ticket, deadline))
                conn.sendall(v)
        finally:
            for v in views:
                v.release()  # the kernel holds its own copy of whatever sendall returned on

    def _receive(self, conn: socket.socket, ticket: Ticket) -> None:
        try:
            views = self._views(ticket)
        except KvbankError as exc:
            _refuse(conn, exc)
            raise Broken(f"refused: {exc}") from exc
        total = sum(len(v) for v in views)
        deadline = time.monotonic() + self._body
        try:
            conn.sendall(_reply(GO, total))
            for v in views:
                # never into a slot past its lease's deadline: it may be another row's by then
                set_timeouts(conn, self._left(ticket, deadline))
                recv_exact(conn, v)
            self._left(ticket, deadline)  # the last slot filled while the lease lived
        finally:
            for v in views:
                v.release()  # before the client's commit: the slab must never outlive an export
        # counted before the reply: a client that reads the node's counters once its put
        # returned must find these bytes there (under load the reply could win the race)
        if self.moved is not None:
            self.moved("in", total)
        conn.sendall(_reply(GO, total))


__all__ = ["DataPlane", "Op", "Ticket", "Tickets", "slot_names"]
