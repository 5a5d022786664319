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
import json
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

import numpy as np

from kvbank import wire
from kvbank.errors import Forbidden, InvalidInput, KvbankError, TierUnavailable
from kvbank.keys import Scope as KeyScope
from kvbank.lender.base import Delivery, HostLocation, Lease, LeaseMode, MemoryKind
from kvbank.service.engine_routes import LoadBody, LoadedBody
from kvbank.service.fast_routes import validate_body
from kvbank.wire import local as fr
from kvbank.wire.framing import PREFIX, PUT_MAGIC, decode_prefix, decode_put_header

if TYPE_CHECKING:
    from kvbank.service.engine_routes import Loads
    from kvbank.service.node import Node, OpenFetch

logger = logging.getLogger(__name__)

SOCKET_NAME = "node.sock"
MAX_CONNECTIONS = 256
_UCRED = struct.Struct("3i")  # pid, uid, gid
_SUN_PATH_MAX = 107


class _Caller:
    """What :class:`TenantGuard` reads of a request: the tenant bound to it."""

    __slots__ = ("scope",)

    def __init__(self, tenant: str | None) -> None:
        self.scope: dict[str, Any] = {"state": {"tenant": tenant}} if tenant is not None else {}


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


class _Conn:
    """One worker's connection: its tenant and the leases it holds."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tenant: str | None = None
        self.hello = False
        self.caller = _Caller(None)
        self.leases: set[str] = set()


class LocalChannel:
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

    # ---- the calls ---------------------------------------------------------------------

    def _hello(self, c: _Conn, cols: list[fr.Column]) -> tuple[list[fr.Column], list[int]]:
        token = fr.take(cols, 0, str, "token")
        tokens = self.guard.tokens
        if tokens:
            c.tenant = tokens.tenant_of(f"Bearer {token}" if token else None)
            c.caller = _Caller(c.tenant)
        c.hello = True
        fd = self._fd if c.tenant is None else None
        seg = self.node.segment
        size = 0 if seg is None else seg.size
        resident = int(seg is not None and self.node.bank.reservation is not None)
        # column 1: what this node takes beyond the first version's calls (an older client
        # reads column 0 alone)
        features = fr.FEATURE_ONEWAY_ACK | fr.FEATURE_COMMIT_SUMS
        if self.node.loads is not None:
            features |= fr.FEATURE_ENGINE_LOAD | fr.FEATURE_ONEWAY_LOADED | fr.FEATURE_LOAD_KEYS
        return [np.array([int(fd is not None), size, resident, os.getpid()], dtype="<i8"),
                np.array([features], dtype="<i8")], ([] if fd is None else [fd])

    def _sync(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        """Nothing: answered after every earlier frame of ``c`` was applied (the frames of
        one connection are applied in order), which is what a client waits for."""
        return []

    def _prompt(self, c: _Conn, cols: list[fr.Column], what: str = "prompt") -> tuple[bytes, dict[str, Any]]:
        """``(layout id, Bank.match keyword arguments)`` of a prompt's 6 columns:
        layout id, tenant, cache salt, lora, [shard, prompt_tokens, by_keys], data."""
        lid = fr.take(cols, 0, bytes, "layout_id")
        if len(lid) != 32:
            raise InvalidInput(f"layout_id: expected 32 bytes, got {len(lid)}", field="layout_id")
        scope = KeyScope(fr.take(cols, 1, str, "scope.tenant"), fr.take(cols, 2, str, "scope.cache_salt"),
                         fr.take(cols, 3, str, "scope.lora"))
        scope = self.guard.scope(c.caller, lid, scope)
        shard, prompt_tokens, by_keys = fr.ints(cols, 4, "args", 3).tolist()
        tokens: Any = None
        keys: list[bytes] | None = None
        if by_keys:
            keys = list(fr.names_of(fr.take(cols, 5, bytes, "keys"), "keys", fr.KEY_BYTES))
        else:
            arr = fr.take(cols, 5, np.ndarray, "tokens")
            if arr.dtype != np.dtype("<i4"):
                raise InvalidInput(f"tokens: expected int32, got {arr.dtype}", field="tokens")
            tokens = arr
        return lid, dict(tokens=tokens, scope=scope, shard=None if shard < 0 else shard, keys=keys,
                         prompt_tokens=None if prompt_tokens < 0 else prompt_tokens)

    def _match(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        lid, args = self._prompt(c, cols)
        return fr.match_columns(self.node.match(lid, args))

    def _slots(self, lease: Lease, names: Sequence[bytes], delivery: Delivery,
               checksums: dict[bytes, int] | None = None) -> list[fr.Column]:
        """The lease's id, seconds left, and for each entry ``i`` of ``names`` whose row is
        in the passed segment with ``delivery``: ``i``, offset, size (three arrays); with
        ``checksums`` (a READ lease's) a fourth, each slot's xxh3-64 as uint64 (0: none
        recorded, the copy is not checked)."""
        idx: list[int] = []
        off: list[int] = []
        size: list[int] = []
        seg = self._segment
        for i, name in enumerate(names):
            try:
                row = lease.row(name)
            except KeyError:
                continue
            loc = row.location
            if row.delivery is delivery and isinstance(loc, HostLocation) and loc.segment == seg:
                idx.append(i)
                off.append(loc.offset)
                size.append(loc.size)
        ttl = lease.expires_at - self.node.bank.clock()
        out: list[fr.Column] = [lease.id, np.array([ttl], dtype="<f8"), np.array(idx, dtype="<i8"),
                                np.array(off, dtype="<i8"), np.array(size, dtype="<i8")]
        if checksums is not None:
            out.append(np.fromiter((checksums.get(names[i], 0) for i in idx), dtype="<u8", count=len(idx)))
        return out

    def _own(self, c: _Conn, lease: Lease | None, *, tied: bool = True) -> None:
        """``lease`` is ``c``'s caller's; ``tied``: the call's own lease (a fetch's, a
        put's), released when the connection closes before its acknowledgement or commit."""
        if lease is not None:
            self.guard.own_lease(c.caller, lease)
            if tied:
                c.leases.add(lease.id)

    def _fetch_prefix(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        if c.tenant is not None or self._fd is None:
            raise InvalidInput("socket: this connection was passed no host memory; fetch over HTTP",
                               field="socket")
        lid, args = self._prompt(c, cols)
        max_rows = int(fr.ints(cols, 6, "max_rows", 1)[0])
        m, opened, lease = self.node.match_lend(lid, args, None, None if max_rows < 0 else max_rows)
        return [*fr.match_columns(m), *self._lent(c, opened, lease)]

    def _fetch(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        """A fetch of a Match the caller holds (``Client.fetch``): lent as fetch_prefix's."""
        if c.tenant is not None or self._fd is None:
            raise InvalidInput("socket: this connection was passed no host memory; fetch over HTTP",
                               field="socket")
        m = self.guard.match(c.caller, fr.match_from(cols))
        max_rows = int(fr.ints(cols, fr.MATCH_COLUMNS, "max_rows", 1)[0])
        opened, lease = self.node.lend_fetch(m, None, None if max_rows < 0 else max_rows)
        return self._lent(c, opened, lease)

    def _lent(self, c: _Conn, opened: OpenFetch | None, lease: Lease | None) -> list[fr.Column]:
        """A lent fetch's 10 columns: fetch id ("" when none was opened), each planned
        row's position, group and slot, then the lease's id, seconds left, slots and each
        slot's checksum (the client verifies its copies: docs/reliability.md)."""
        none = np.zeros(0, "<i8")
        sums = np.zeros(0, "<u8")
        if opened is None:
            return ["", none, none, none, "", np.zeros(1, "<f8"), none, none, none, sums]
        self.guard.own_fetch(c.caller, opened.fetch_id)
        rows = opened.rows
        pos = np.fromiter((r.position for r in rows), dtype="<i8", count=len(rows))
        grp = np.fromiter((r.group for r in rows), dtype="<i8", count=len(rows))
        slot = np.fromiter((r.slot for r in rows), dtype="<i8", count=len(rows))
        if lease is None:
            return [opened.fetch_id, pos, grp, slot, "", np.zeros(1, "<f8"), none, none, none, sums]
        self._own(c, lease)
        checksums = self.node.bank.checksums(lease.id)
        return [opened.fetch_id, pos, grp, slot, *self._slots(lease, opened.names, Delivery.READY, checksums)]

    def _ack(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        fetch_id = fr.take(cols, 0, str, "fetch_id")
        lease_id = fr.take(cols, 1, str, "lease_id") or None
        positions = fr.ints(cols, 2, "rows").tolist()
        # lent rows whose copies failed their checksum: the node checks them and drops
        # the host copies that fail, as on the HTTP path (an older client sends none)
        changed = fr.ints(cols, 3, "changed").tolist() if len(cols) > 3 else []
        self.guard.fetch(c.caller, fetch_id)
        if lease_id is not None:
            self.guard.lease(c.caller, lease_id)
        result = self.node.acknowledge(fetch_id, positions, lease_id, None, changed=changed)
        if lease_id is not None:
            c.leases.discard(lease_id)
        metrics = self.admin.metrics
        if metrics is not None and lease_id is not None:
            metrics.add_moved("out", "shm", result.nbytes)
        return fr.result_columns(result)

    def _loads(self) -> Loads:
        loads = self.node.loads
        if loads is None:  # a node without the engine routes (its HELLO did not offer LOAD)
            raise InvalidInput("op: this node serves no engine loads", field="op")
        return loads

    def _load(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        """``POST /v1/engine/load`` with ``via="lease"``, its body and answer the same JSON
        (:class:`~kvbank.service.engine_routes.Loads`: one implementation, the same tenant
        checks). The load's lease is the connection's until LOADED: a worker gone before
        it leaves none held until its ttl."""
        body = validate_body(LoadBody, fr.take(cols, 0, str, "load"))
        if body.via != "lease":
            raise InvalidInput("via: LOAD lends the rows (\"lease\"); a match goes over HTTP", field="via")
        doc = self._loads().lend(c.caller, body)
        lease = doc["lease"]
        if lease is not None:
            c.leases.add(lease["id"])
        return [json.dumps(doc, separators=(",", ":"))]

    def _load_keys(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        """A hit query and its load's lease in one call (``Client.prepare_load``): the
        prompt's Match (16 columns), then its load's plan from page 0 — [start page], each
        row's group, page and size — and the READ lease on them as LOAD answers it in
        slots form: its id ("" when none), [seconds left], each slot's plan entry, offset,
        size and checksum, and the segment's name. The lease is the connection's until
        LOADED, as LOAD's."""
        lid, args = self._prompt(c, cols)
        ttl = _ttl(cols, 6)
        loads = self._loads()
        m = self.node.match(lid, args)
        plan, lease = loads.lend_plan(c.caller, m, args["shard"], 0, ttl)
        layout = self.node.bank.layout(m.layout_id)
        grp = np.fromiter((g for g, _, _ in plan.rows), dtype="<i8", count=len(plan.rows))
        page = np.fromiter((j for _, j, _ in plan.rows), dtype="<i8", count=len(plan.rows))
        size = np.array([layout.group_page_bytes[g] for g, _, _ in plan.rows], dtype="<i8")
        out: list[fr.Column] = [*fr.match_columns(m), np.array([plan.start_page], dtype="<i8"), grp, page, size]
        if lease is None:
            none = np.zeros(0, "<i8")
            return [*out, "", np.zeros(1, "<f8"), none, none, none, np.zeros(0, "<u8"), ""]
        c.leases.add(lease.id)
        names = [n for _, _, n in plan.rows]
        return [*out, *self._slots(lease, names, Delivery.READY, self.node.bank.checksums(lease.id)),
                self._segment or ""]

    def _loaded(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        """``POST /v1/engine/loaded``: the load's lease released, its FetchResult (JSON)."""
        body = validate_body(LoadedBody, fr.take(cols, 0, str, "loaded"))
        doc = self._loads().loaded(c.caller, body)
        c.leases.discard(body.lease_id)
        return [json.dumps(doc, separators=(",", ":"))]

    def _loaded_oneway(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        """LOADED as a ONEWAY frame: the same release and checks; no result built (its
        client built it)."""
        body = validate_body(LoadedBody, fr.take(cols, 0, str, "loaded"))
        self._loads().loaded(c.caller, body, answer=False)
        c.leases.discard(body.lease_id)
        return []

    def _lend(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        names = list(fr.names_of(fr.take(cols, 0, bytes, "names"), "names"))
        mode_i, kind_i = fr.ints(cols, 1, "mode", 2).tolist()
        ttl = _ttl(cols, 2) if len(cols) > 2 else None
        modes, kinds = list(LeaseMode), list(MemoryKind)
        if not (0 <= mode_i < len(modes) and 0 <= kind_i < len(kinds)):
            raise InvalidInput(f"mode: unknown mode {mode_i} or kind {kind_i}", field="mode")
        mode, kind = modes[mode_i], kinds[kind_i]
        if mode is LeaseMode.WRITE:
            self.admin.state.check_writable()
        self.guard.names(c.caller, names)
        bank = self.node.bank
        lease = bank.lend(names, mode=mode, kind=kind, ttl_s=ttl)
        self._own(c, lease, tied=False)  # it may be handed on: it ends at release or TTL
        if mode is LeaseMode.READ and kind is MemoryKind.HOST:  # the reader verifies its copies
            lease = lease.with_sums(bank.checksums(lease.id))
        # a lease's full form (regions, locations) stays the JSON one: lend by name is not
        # a per-request call of a worker (fetch_prefix and put carry slots as columns)
        return [wire.to_json(lease, now=bank.clock())]

    def _lease_id(self, c: _Conn, cols: list[fr.Column]) -> str:
        lease_id: str = fr.take(cols, 0, str, "lease_id")
        self.guard.lease(c.caller, lease_id)
        return lease_id

    def _check(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        self.node.bank.check_live(self._lease_id(c, cols))
        return []

    def _release(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        lease_id = self._lease_id(c, cols)
        c.leases.discard(lease_id)
        return [np.array([int(self.node.bank.release(lease_id))], dtype="<i8")]

    def _put_reserve(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        from kvbank.service.stream import lend_put

        head = fr.take(cols, 0, bytes, "head")
        header_len = decode_prefix(head[: PREFIX.size], PUT_MAGIC)
        header = self.guard.header(c.tenant, decode_put_header(head[PREFIX.size : PREFIX.size + header_len]))
        key_bytes = head[PREFIX.size + header_len :]
        if len(key_bytes) != header.key_bytes:
            raise InvalidInput(f"head: {len(key_bytes)} bytes of tokens or keys, the header declares "
                               f"{header.key_bytes}", field="head")
        self.admin.state.check_writable()
        if c.tenant is not None or self._fd is None:
            raise InvalidInput("socket: this connection was passed no host memory; put over HTTP",
                               field="socket")
        names, lease, fallback = lend_put(self.node, header, key_bytes, ttl_s=None)
        blob = b"".join(names)
        if lease is None:
            return [blob, np.array([int(fallback)], dtype="<i8"), "", np.zeros(1, "<f8"),
                    np.zeros(0, "<i8"), np.zeros(0, "<i8"), np.zeros(0, "<i8")]
        self._own(c, lease)
        return [blob, np.array([0], dtype="<i8"), *self._slots(lease, names, Delivery.RESERVED)]

    def _commit(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        lease_id = self._lease_id(c, cols)
        arrived = list(fr.names_of(fr.take(cols, 1, bytes, "arrived"), "arrived"))
        if len(cols) > 2:  # each row's checksum as the writer hashed its copy (0: none)
            sums = fr.ints(cols, 2, "sums", len(arrived)).astype("<u8").tolist()
            result = self.node.bank.commit_summed(lease_id, arrived,
                                                  {n: v for n, v in zip(arrived, sums, strict=True) if v})
        else:
            result = self.node.bank.commit(lease_id, arrived)
        c.leases.discard(lease_id)
        return fr.commit_columns(result)

    def _presence(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        lid, args = self._prompt(c, cols)
        del args["shard"]
        shards = fr.ints(cols, 6, "shards").tolist()
        got = self.node.bank.presence(lid, shards=shards or None, **args)
        return fr.presence_columns(got)


__all__ = ["SOCKET_NAME", "LocalChannel", "peer_uid", "socket_path"]


def _ttl(cols: list[fr.Column], at: int) -> float | None:
    """A lease ttl column ``[ttl_s]``: positive seconds, or NaN for the node's default (None)."""
    ttls = fr.take(cols, at, np.ndarray, "ttl_s")
    if len(ttls) != 1 or ttls.dtype.kind != "f" or not (np.isnan(ttls[0]) or ttls[0] > 0):
        raise InvalidInput("ttl_s: expected one positive number of seconds (NaN: the default)", field="ttl_s")
    return None if np.isnan(ttls[0]) else float(ttls[0])
