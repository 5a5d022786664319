"""The node's local channel: a Unix socket beside the HTTP port, for the workers of its host.

A worker asks its node on every scheduling step; over HTTP each of those calls paid JSON,
HTTP framing and a hop to the event loop and back. This socket carries the per-request
calls (match by tokens or engine keys, fetch_prefix and its acknowledgement, lend /
check / release, a put's reserve and commit, presence, a paged engine's load and its
acknowledgement) as binary frames of numpy columns
(:mod:`kvbank.wire.local`), and hands the host tier's memory to the worker as a file
descriptor (``SCM_RIGHTS``), never as a name it could open itself.

Access, checked once per connection:

- the socket file is ``node.sock`` in the data dir (mode 0600; a dir whose path is too
  long for a socket address, or no data dir, gets a private 0700 temp dir instead);
- the peer's uid (``SO_PEERCRED``) must be the node's own: another uid is refused;
- the first frame is HELLO with the caller's tenant token ("" for none): on a node with
  tenant tokens it binds the connection to that tenant exactly as the HTTP middleware
  binds a request (401/403 as :class:`Unauthorized` / :class:`Forbidden`), and every call
  on it goes through the same :class:`~kvbank.service.admin.tenants.TenantGuard` checks;
- the host segment's descriptor is passed only to a connection bound to no tenant (a node
  without tenant tokens: one trust domain; a node with them opens no descriptor of it,
  and unlinks its name at start: :meth:`~kvbank.service.node.Node.unlink_segment`). A
  tenant's worker gets the control calls here and moves its page bodies over HTTP or
  the data port, through the node's own copies: a mapping of the segment would reach
  every tenant's rows (docs/admin.md).

The calls themselves are :mod:`kvbank.service.local_calls`'s (mixed in).

Serving: a thread per connection (at most ``MAX_CONNECTIONS``), each calling the bank
directly, so eight workers are not queued behind one thread; the bank's calls release
the GIL in their copies and locks. The leases a connection's fetches, loads and puts
opened are released when it closes (a worker killed mid-copy leaves none held until its TTL); a lease
taken by ``lend`` is not: its holder may have handed it to another process (``Lease.to_json``
and a ``Borrower``), so it ends at its release or its TTL, as over HTTP. A frame the node cannot
read answers a typed error; one it cannot even frame (bad header, over the size limit)
answers the error and closes that connection; the node keeps serving the others.

A lent fetch's acknowledgement comes as a ONEWAY frame (the client does not wait: it
built its result from its own copies and its own lease deadline, docs/wire.md): it is
applied as any call is — the rows count only if the lease is still live when the node
applies it, a lease already ended counts nothing — and a failure in it, having no one
to answer, is logged here (warning). A connection's frames are applied in order, each
before the next is read, and all of them before its end is handled: an acknowledgement
sent just before a worker closed its connection is still applied, and any later call on
that connection (SYNC, which does nothing else, included) is answered after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbank.errors import Forbidden, InvalidInput, KvbankError, TierUnavailable
from kvbank.service.local_calls import LocalCalls, _Conn
from kvbank.wire import local as fr

if TYPE_CHECKING:
    from kvbank.service.node import Node

logger = logging.getLogger(__name__)

SOCKET_NAME = "node.sock"
MAX_CONNECTIONS = 256
_UCRED = struct.Struct("3i")  # pid, uid, gid
_SUN_PATH_MAX = 107


def socket_path(data_dir: Path | None) -> Path:
    """Where the node's socket goes: ``node.sock`` in the data dir where that path fits a
    socket address, else in a new private temp dir."""
    if data_dir is not None:
        p = Path(data_dir) / SOCKET_NAME
        if len(os.fsencode(str(p))) <= _SUN_PATH_MAX:
            return p
    return Path(tempfile.mkdtemp(prefix="kvbank-")) / SOCKET_NAME


def _op_name(op: int) -> str:
    try:
        return fr.Op(op).name
    except ValueError:
        return f"op {op}"


def peer_uid(conn: socket.socket) -> int:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return int(_UCRED.unpack(raw)[1])


def recv_exact(conn: socket.socket, n: int) -> bytearray | None:
    """``n`` bytes, or None at a clean end of stream before the first byte."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise InvalidInput(f"frame: the stream ended {n - got} bytes short", field="frame")
        got += k
    return buf


class LocalChannel(LocalCalls):
    """The node's Unix socket server. See the module docstring."""

    def __init__(self, node: Node, admin: Any, path: Path) -> None:
        self.node = node
        self.admin = admin
        self.guard = admin.guard
        self.path = path
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._threads: list[threading.Thread] = []
        self._stopping = False
        seg = node.segment
        self._segment = None if seg is None else seg.segment
        self._fd: int | None = None
        self._ops: dict[int, Callable[[_Conn, list[fr.Column]], list[fr.Column]]] = {
            fr.Op.MATCH: self._match, fr.Op.FETCH_PREFIX: self._fetch_prefix, fr.Op.ACK: self._ack,
            fr.Op.LEND: self._lend, fr.Op.CHECK: self._check, fr.Op.RELEASE: self._release,
            fr.Op.PUT_RESERVE: self._put_reserve, fr.Op.COMMIT: self._commit, fr.Op.PRESENCE: self._presence,
            fr.Op.FETCH: self._fetch, fr.Op.SYNC: self._sync, fr.Op.LOAD: self._load, fr.Op.LOADED: self._loaded,
            fr.Op.LOAD_KEYS: self._load_keys,
        }

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        path = self.path
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        else:  # a socket a previous node left: replace it; anything else is not ours
            if not stat.S_ISSOCK(st.st_mode):
                raise TierUnavailable(f"local channel: {path} exists and is not a socket", field="socket")
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600, whatever the umask: no window at a wider mode
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(128)
        self._sock = sock
        if self._segment is not None and not self.guard.tokens:  # a tenant node passes it to no one
            from kvbank.tiers.host import SHM_DIR

            try:
                self._fd = os.open(SHM_DIR / self._segment, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                logger.warning("local channel: cannot open the host segment (%s): workers copy "
                               "page bodies over HTTP", exc)
        t = threading.Thread(target=self._accept, name="kvbank-local-accept", daemon=True)
        t.start()
        self._threads.append(t)
        logger.debug("local channel on %s", path)

    def stop(self) -> None:
        self._stopping = True
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=5.0)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _accept(self) -> None:
        while not self._stopping:
            sock = self._sock
            if sock is None:
                return
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
            if full:
                self._refuse(conn, TierUnavailable(f"local channel: {MAX_CONNECTIONS} connections open",
                                                   field="socket"))
                continue
            t = threading.Thread(target=self._serve, args=(conn,), name="kvbank-local", daemon=True)
            t.start()
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()]
                self._threads.append(t)

    def _refuse(self, conn: socket.socket, exc: KvbankError) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(fr.encode_bytes(fr.Kind.ERROR, 0, fr.error_columns(exc)))
        conn.close()

    # ---- one connection ----------------------------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        try:
            uid = peer_uid(sock)
        except OSError:
            sock.close()
            return
        if uid != os.getuid():
            self._refuse(sock, Forbidden(f"socket: uid {uid} is not the node's ({os.getuid()})", field="socket"))
            return
        c = _Conn(sock)
        with self._lock:
            self._conns[id(c)] = c
        try:
            while not self._stopping:
                try:
                    head = recv_exact(sock, fr.HEADER.size)
                    if head is None:
                        return
                    kind, op, ncols, nbody = fr.decode_header(head)
                    body = recv_exact(sock, nbody) if nbody else bytearray()
                    if body is None:
                        raise InvalidInput("frame: the stream ended before the body", field="frame")
                except KvbankError as exc:  # unframeable: answer, then drop this connection
                    self._send(c, fr.Kind.ERROR, 0, fr.error_columns(exc))
                    return
                self._one(c, kind, op, ncols, body)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.pop(id(c), None)
            self._drop_leases(c)
            sock.close()

    def _one(self, c: _Conn, kind: fr.Kind, op: int, ncols: int, body: bytearray) -> None:
        if kind is fr.Kind.ONEWAY:
            self._oneway(c, op, ncols, body)
            return
        fds: list[int] = []
        try:
            if kind is not fr.Kind.REQUEST:
                raise InvalidInput(f"frame: a {kind.name} frame where a request was expected", field="frame")
            cols = fr.decode_body(body, ncols)
            if op == fr.Op.HELLO:
                out, fds = self._hello(c, cols)
            elif not c.hello:
                raise InvalidInput("frame: the first call on a connection is HELLO", field="frame")
            else:
                handler = self._ops.get(op)
                if handler is None:
                    raise InvalidInput(f"frame: unknown op {op}", field="op")
                out = handler(c, cols)
        except KvbankError as exc:
            self._send(c, fr.Kind.ERROR, op, fr.error_columns(exc))
            return
        except Exception as exc:  # a bug: say so, as HTTP answers 500, and keep serving
            logger.exception("local channel: op %d failed", op)
            self._send(c, fr.Kind.ERROR, op, ["KvbankError", "", f"node: internal error: {exc!r}"])
            return
        self._send(c, fr.Kind.OK, op, out, fds)

    def _oneway(self, c: _Conn, op: int, ncols: int, body: bytearray) -> None:
        """A frame no answer follows: applied as a request is; its error only logged
        (the caller goes on without waiting, and its next answer must be its own)."""
        try:
            if not c.hello:
                raise InvalidInput("frame: the first call on a connection is HELLO", field="frame")
            if op not in fr.ONEWAY_OPS:
                raise InvalidInput(f"frame: op {op} is not taken one-way", field="op")
            handler = self._loaded_oneway if op == fr.Op.LOADED else self._ops[op]
            handler(c, fr.decode_body(body, ncols))
        except KvbankError as exc:  # e.g. a lease that ended before it was applied: nothing counted
            logger.warning("local channel: a one-way %s was not applied: %s: %s",
                           _op_name(op), type(exc).__name__, exc)
        except Exception:  # a bug: said, and the connection served on
            logger.exception("local channel: a one-way %s failed", _op_name(op))

    def _send(self, c: _Conn, kind: fr.Kind, op: int, cols: Sequence[fr.Column], fds: Sequence[int] = ()) -> None:
        parts = fr.encode(kind, op, cols)
        if fds:
            socket.send_fds(c.sock, [b"".join(parts)], list(fds))
        else:
            c.sock.sendmsg(parts)

    def _drop_leases(self, c: _Conn) -> None:
        bank = self.node.bank
        for lease_id in c.leases:
            with contextlib.suppress(KvbankError):
                bank.release(lease_id)
        c.leases.clear()


__all__ = ["SOCKET_NAME", "LocalChannel", "peer_uid", "socket_path"]
