"""The data port's wire form, shared by the node's listener
(:mod:`kvbank.service.dataplane`) and a client's link (:mod:`kvbank.client.dataport`).

Per transfer (little-endian; the server speaks only after a whole request)::

    client → REQUEST  magic "KVDP", version, op (1 = put, 2 = fetch), ticket (16 bytes)
    server → REPLY    magic "KVDR", status (0 = go, 1 = refused), error length, byte count
                      refused: a JSON error document {type, field, message} follows
    fetch:  server → the slots' bytes, back to back, in the ticket's slot order
    put:    client → the slots' bytes, in the ticket's slot order
            server → REPLY (status 0, the byte count received) once every slot is full
"""

from __future__ import annotations

import socket
import struct
from enum import IntEnum

VERSION = 1
REQUEST_MAGIC = b"KVDP"
REPLY_MAGIC = b"KVDR"
REQUEST = struct.Struct("<4sBB2x16s")  # magic, version, op, ticket
REPLY = struct.Struct("<4sBxHQ")  # magic, status, error document length, byte count
TICKET_BYTES = 16
MAX_ERROR_BYTES = 4096  # an error document longer than this is cut (a client reads at most this)
GO, REFUSED = 0, 1  # a reply's status


class Op(IntEnum):
    """A transfer's direction."""

    PUT = 1
    FETCH = 2


class Broken(Exception):
    """The peer went away, or a transfer ran out of time (the connection is closed)."""


def set_timeouts(sock: socket.socket, seconds: float) -> None:
    # Kernel timeouts on a blocking socket, so recv_into(MSG_WAITALL) still waits for a
    # whole slot in one call (a Python-level timeout makes the socket non-blocking, and
    # MSG_WAITALL then returns whatever has arrived: a Python loop per packet).
    s = max(seconds, 0.001)
    tv = struct.pack("ll", int(s), int((s - int(s)) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        except (BlockingIOError, TimeoutError) as exc:
            raise Broken(f"no bytes for {n - got} more within the time left") from exc
        if not k:
            raise Broken(f"the peer closed {n - got} bytes short")
        got += k
