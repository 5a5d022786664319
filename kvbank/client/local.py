"""The worker's end of the node's local channel (:mod:`kvbank.service.local`).

:class:`LocalLink` holds one Unix-socket connection per calling thread (a call is one
frame out, one frame back: :mod:`kvbank.wire.local`). The first frame on each is HELLO
with the client's tenant token; the node answers with the host tier's memory as a file
descriptor where it lends memory to this caller (a node without tenant tokens), which
the link maps once (``mmap`` of the passed descriptor, never a segment name) for every
connection of the client.

- :meth:`match` / :meth:`presence` — a prompt by its tokens (int32 column) or its
  32-byte engine keys (one blob), answered as columns.
- :meth:`fetch_prefix`, :meth:`fetch` and :meth:`put` — the calls that move page bytes
  through the passed memory (:mod:`kvbank.client.localdata`).
- :meth:`lend` / :meth:`check_live` / :meth:`release` / :meth:`commit`.
- :meth:`load` / :meth:`loaded` — a paged engine's ``fetch_into`` on the node's host: the
  plan and READ lease, then its release with what arrived, as the HTTP routes' JSON
  (where the node's HELLO offers them; an older node's go over HTTP).

A link that cannot connect raises :class:`TierUnavailable` from :meth:`open`; the client
then logs why and falls back to HTTP.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import select
import socket
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbank import wire
from kvbank.client.localdata import SEGMENT, DataCalls
from kvbank.client.shm import Borrower
from kvbank.errors import InvalidInput, KvbankError, TierUnavailable
from kvbank.keys import Scope
from kvbank.lender.base import CommitResult, Lease, LeaseMode, MemoryKind
from kvbank.results import Match, Presence
from kvbank.wire import local as fr

if TYPE_CHECKING:
    from kvbank.client.io import Deadline

logger = logging.getLogger(__name__)


class ChannelBroken(TierUnavailable):
    """The local channel's connection broke off (the node stopped, or restarted): the
    call's answer never came. An idempotent call may be made again over HTTP."""

    before_answer = False  # no byte of the answer had come (the call may be made again)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ChannelBroken("node: the local channel closed mid-answer", field="socket")
        got += k


CLOSE_SYNC_S = 2.0  # at most this long a close waits for the node to apply a connection's ACKs


def _sync(sock: socket.socket, timeout_s: float) -> None:
    """A SYNC on ``sock`` and its answer read (discarded): the node applied every earlier
    frame of the connection."""
    sock.settimeout(timeout_s)
    sock.sendmsg(fr.encode(fr.Kind.REQUEST, fr.Op.SYNC, []))
    head = bytearray(fr.HEADER.size)
    _recv_exact(sock, memoryview(head))
    _, _, _, nbody = fr.decode_header(head)
    if nbody:
        _recv_exact(sock, memoryview(bytearray(nbody)))


def _alive(sock: socket.socket) -> bool:
    """Whether an idle connection is still open at the node's end (as a pooled HTTP
    connection is checked before it is used): no bytes wait on it, and no end of file."""
    # (a poll, not a recv: a socket with a timeout waits that long in recv before it looks)
    p = select.poll()
    p.register(sock, select.POLLIN)
    return not p.poll(0)  # readable: the node closed it, or bytes no call waits for


# The calls made once more on a new connection where the one they went on broke off before
# any answer: those that change nothing (a match, presence, a lease's check) and those whose
# lease the node ends when the broken connection closes (a lent fetch, a put's reserve). A
# restarted node answers them as the first call of a fresh client would.
RETRY = frozenset({fr.Op.MATCH, fr.Op.PRESENCE, fr.Op.CHECK, fr.Op.FETCH_PREFIX, fr.Op.FETCH,
                   fr.Op.PUT_RESERVE, fr.Op.LOAD})


class LocalLink(DataCalls):
    """Connections to the node's socket ``path``. See the module docstring."""

    def __init__(self, path: str, token: str | None, timeout_s: float) -> None:
        self.path = path
        self.token = token or ""
        self.timeout_s = timeout_s
        self._tls = threading.local()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._unsettled: set[socket.socket] = set()  # sent a one-way frame since their last answer
        self.memory = False  # the node passed its host memory: page bodies go through it
        self.resident = False
        self._mm: mmap.mmap | None = None
        self._pid = 0  # the node process whose memory is mapped
        self.oneway = False  # the node takes acknowledgements one-way (and SYNC)
        self.loads = False  # the node takes LOAD and LOADED (an older one: fetch_into's over HTTP)
        self.oneway_loaded = False  # the node takes LOADED one-way too
        self.load_keys_op = False  # the node takes LOAD_KEYS (a hit query with its load's lease)
        self.commit_sums = False  # the node keeps the checksums a COMMIT carries
        self._borrower: Borrower | None = None
        self._closed = False

    # ---- connections -------------------------------------------------------------------

    def open(self) -> None:
        """Connect this thread (HELLO); :class:`TierUnavailable` where it cannot."""
        self._sock()

    def _sock(self) -> socket.socket:
        sock: socket.socket | None = getattr(self._tls, "sock", None)
        if sock is not None and self._tls.pid == os.getpid():
            if _alive(sock):
                return sock  # (a forked child opens its own: frames of two processes never mix)
            self._drop(sock)  # the node closed it while idle (it stopped, or restarted): a new one
        if self._closed:
            raise TierUnavailable("client: closed", field="client")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.path)
            sock.sendmsg(fr.encode(fr.Kind.REQUEST, fr.Op.HELLO, [self.token]))
            msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
            if not msg:
                raise TierUnavailable("node: the local channel closed at HELLO", field="socket")
            cols = self._read_rest(sock, bytearray(msg))
        except OSError as exc:
            sock.close()
            raise TierUnavailable(f"node: cannot connect to {self.path}: {exc}", field="socket") from exc
        except BaseException:
            sock.close()
            raise
        info = fr.ints(cols, 0, "hello", 4).tolist()
        # what the node takes beyond the first version (an older node sends no column 1)
        features = int(fr.ints(cols, 1, "hello.features", 1)[0]) if len(cols) > 1 else 0
        self.oneway = bool(features & fr.FEATURE_ONEWAY_ACK)
        self.loads = bool(features & fr.FEATURE_ENGINE_LOAD)
        self.oneway_loaded = self.loads and bool(features & fr.FEATURE_ONEWAY_LOADED)
        self.load_keys_op = self.loads and bool(features & fr.FEATURE_LOAD_KEYS)
        self.commit_sums = bool(features & fr.FEATURE_COMMIT_SUMS)
        try:
            self._adopt(fds[0] if info[0] and fds else None, info[1], bool(info[2]), info[3])
        finally:
            for fd in fds:
                os.close(fd)
        self._tls.sock, self._tls.pid, self._tls.unsettled = sock, os.getpid(), False
        with self._lock:
            self._socks.append(sock)
        return sock

    def _read_rest(self, sock: socket.socket, got: bytearray) -> list[fr.Column]:
        """The frame whose first bytes are ``got``; its columns (an ERROR raised)."""
        if len(got) < fr.HEADER.size:
            more = bytearray(fr.HEADER.size - len(got))
            _recv_exact(sock, memoryview(more))
            got += more
        kind, _, ncols, nbody = fr.decode_header(got[: fr.HEADER.size])
        body = got[fr.HEADER.size :]
        if len(body) < nbody:
            more = bytearray(nbody - len(body))
            _recv_exact(sock, memoryview(more))
            body += more
        cols = fr.decode_body(body, ncols)
        if kind is fr.Kind.ERROR:
            raise fr.raise_error(cols)
        return cols

    def _adopt(self, fd: int | None, size: int, resident: bool, pid: int) -> None:
        """Map the memory a HELLO passed (once per node process: a node that restarted —
        another pid — passes a new segment, and the old mapping is dropped, never read)."""
        with self._lock:
            if self._mm is not None and pid == self._pid:
                return
            old_b, old_mm = self._borrower, self._mm
            self._borrower = self._mm = None
            self.memory = False
            self._pid = pid
            if fd is not None:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                b = Borrower(writable=True, populate=resident)
                b.adopt(SEGMENT, mm)
                self._mm, self._borrower = mm, b
                self.memory, self.resident = True, resident
        with contextlib.suppress(BufferError):  # a copy elsewhere still holds a view: left mapped
            if old_b is not None:
                old_b.close()
            if old_mm is not None:
                old_mm.close()

    def call(self, op: fr.Op, cols: Sequence[fr.Column], deadline: Deadline | None = None) -> list[fr.Column]:
        """One call: a REQUEST frame out, its answer's columns back (an ERROR raised as the
        typed error it names). A broken connection is dropped (the next call opens one,
        and maps the memory of a node that restarted); a call of :data:`RETRY` whose
        connection broke before any answer is made once more on a new one.

        ``deadline`` (a call's ``timeout=``, kvbank.api difference 3): :class:`Busy` before
        anything is sent where it passed already, else the wait for the answer ends with
        it (:class:`Busy`, the connection dropped: an answer may still be on its way)."""
        try:
            return self._call_once(op, cols, deadline)
        except ChannelBroken as exc:
            if op not in RETRY or not exc.before_answer:
                raise
            logger.info("client: the local channel broke off (%s); calling again on a new connection", exc)
        return self._call_once(op, cols, deadline)

    def _call_once(self, op: fr.Op, cols: Sequence[fr.Column], deadline: Deadline | None) -> list[fr.Column]:
        sock = self._sock()
        what = f"the local channel's {op.name} was not answered"
        if deadline is not None:
            left = deadline.left()
            if left <= 0:
                raise deadline.busy(what)
            sock.settimeout(min(self.timeout_s, left))
        answered = False
        try:
            sock.sendmsg(fr.encode(fr.Kind.REQUEST, op, cols))
            head = bytearray(fr.HEADER.size)
            k = sock.recv_into(head)
            if k == 0:
                raise ChannelBroken("node: the local channel closed before the answer", field="socket")
            answered = True
            _recv_exact(sock, memoryview(head)[k:])
            kind, _, ncols, nbody = fr.decode_header(head)
            body = bytearray(nbody)
            if nbody:
                _recv_exact(sock, memoryview(body))
        except (OSError, ChannelBroken) as exc:
            self._drop(sock)
            if deadline is not None and isinstance(exc, TimeoutError) and deadline.passed():
                raise deadline.busy(what) from exc
            broken = ChannelBroken(f"node: the local channel broke off: {exc}", field="socket")
            broken.before_answer = not answered and not isinstance(exc, TimeoutError)  # slow: not again
            raise broken from exc
        except KvbankError:
            self._drop(sock)
            raise
        if deadline is not None:
            sock.settimeout(self.timeout_s)
        self._tls.unsettled = False  # answered: the node applied every earlier frame of sock
        if self._unsettled:
            with self._lock:
                self._unsettled.discard(sock)
        out = fr.decode_body(body, ncols)
        if kind is fr.Kind.ERROR:
            raise fr.raise_error(out)
        return out

    def send_oneway(self, op: fr.Op, cols: Sequence[fr.Column]) -> None:
        """A ONEWAY frame on this thread's connection: sent, no answer awaited (the node
        applies it before any later frame of the connection; an error in it is logged
        there). :class:`ChannelBroken` where it could not be sent whole."""
        sock = self._sock()
        try:
            sock.sendall(b"".join(fr.encode(fr.Kind.ONEWAY, op, cols)))
        except OSError as exc:
            self._drop(sock)
            raise ChannelBroken(f"node: the local channel broke off: {exc}", field="socket") from exc
        self._tls.unsettled = True
        with self._lock:
            self._unsettled.add(sock)

    def settle(self) -> None:
        """Wait until the node applied this thread's one-way frames (one SYNC round trip,
        only where one was sent since the last call that waited for an answer): what this
        thread asks the node next, on any connection, sees them. A connection that broke
        meanwhile is left alone (the node applied what reached it before the end)."""
        if not getattr(self._tls, "unsettled", False):
            return
        sock = getattr(self._tls, "sock", None)
        if sock is None or self._tls.pid != os.getpid():
            self._tls.unsettled = False
            return
        with contextlib.suppress(KvbankError):
            self._call_once(fr.Op.SYNC, [], None)

    def _drop(self, sock: socket.socket) -> None:
        self._tls.sock = None
        self._tls.unsettled = False
        with self._lock:
            if sock in self._socks:
                self._socks.remove(sock)
            self._unsettled.discard(sock)
        sock.close()

    def close(self) -> None:
        """Close every connection, each after the node applied its one-way frames (a SYNC
        round trip on those that sent one since their last answer): what anyone asks the
        node after a client closed sees every fetch it made."""
        self._closed = True
        with self._lock:
            socks, self._socks = self._socks, []
            unsettled, self._unsettled = self._unsettled, set()
            b, self._borrower = self._borrower, None
            mm, self._mm = self._mm, None
        for s in unsettled:
            with contextlib.suppress(OSError, KvbankError):
                _sync(s, min(self.timeout_s, CLOSE_SYNC_S))
        for s in socks:
            s.close()
        if b is not None:
            b.close()
        if mm is not None:
            mm.close()
        self.memory = False

    def borrower(self) -> Borrower:
        b = self._borrower
        if b is None:
            raise TierUnavailable("node: no host memory was passed on the local channel", field="socket")
        return b

    def wait_populated(self, timeout: float | None) -> bool:
        self._sock()
        return self.borrower().wait_populated(SEGMENT, timeout)

    # ---- calls -------------------------------------------------------------------------

    @staticmethod
    def prompt_columns(layout_id: bytes, scope: Scope, shard: int | None, tokens_raw: bytes | None,
                       keys: Sequence[bytes] | None, prompt_tokens: int | None) -> list[fr.Column] | None:
        """A prompt's 6 columns; None where it has no form here (keys not all 32 bytes).
        ``keys``: bytes each (``Client._prompt_columns`` refused any other first)."""
        if keys is not None:
            if keys and set(map(len, keys)) != {fr.KEY_BYTES}:
                return None
            data: fr.Column = b"".join(keys)
        else:
            assert tokens_raw is not None
            data = np.frombuffer(tokens_raw, dtype="<i4")
        args = np.array([-1 if shard is None else shard, -1 if prompt_tokens is None else prompt_tokens,
                         int(keys is not None)], dtype="<i8")
        return [layout_id, scope.tenant, scope.cache_salt, scope.lora, args, data]

    def match(self, prompt: list[fr.Column]) -> Match:
        return fr.match_from(self.call(fr.Op.MATCH, prompt))

    def presence(self, prompt: list[fr.Column], shards: Sequence[int] | None) -> Presence:
        return fr.presence_from(self.call(fr.Op.PRESENCE, [*prompt, np.asarray(list(shards or ()), dtype="<i8")]))

    def lend(self, names: Sequence[bytes], mode: LeaseMode, kind: MemoryKind, ttl_s: float | None,
             deadline: Deadline | None = None) -> Lease:
        if any(type(n) is not bytes or len(n) != fr.NAME_BYTES for n in names):
            for i, n in enumerate(names):
                if type(n) is not bytes:
                    raise InvalidInput(f"names[{i}]: expected a row name (bytes), got {type(n).__name__}")
            raise InvalidInput(f"names: a row name is {fr.NAME_BYTES} bytes", field="names")
        cols = self.call(fr.Op.LEND, [b"".join(names), np.array([list(LeaseMode).index(mode),
                                                                  list(MemoryKind).index(kind)], dtype="<i8"),
                                      np.array([float("nan") if ttl_s is None else ttl_s], dtype="<f8")],
                         deadline)
        return wire.from_json(Lease, fr.take(cols, 0, str, "lease"))

    def check_live(self, lease_id: str) -> None:
        self.call(fr.Op.CHECK, [lease_id])

    def release(self, lease_id: str) -> bool:
        return bool(fr.ints(self.call(fr.Op.RELEASE, [lease_id]), 0, "released", 1)[0])

    def commit(self, lease_id: str, arrived: Sequence[bytes], deadline: Deadline | None = None,
               sums: Sequence[int] | None = None) -> CommitResult:
        """COMMIT; ``sums``: each arrived row's checksum as this process hashed its copy
        (sent where the node keeps them: it then does not read the slots to hash them)."""
        cols: list[fr.Column] = [lease_id, b"".join(arrived)]
        if sums is not None and self.commit_sums:
            cols.append(np.asarray(sums, dtype="<u8"))
        return fr.commit_from(self.call(fr.Op.COMMIT, cols, deadline))

    def load(self, body: dict[str, Any], deadline: Deadline | None = None) -> dict[str, Any]:
        """``POST /v1/engine/load`` (``via="lease"``) on the channel: the same JSON body
        and answer, one frame each way; the lease is this connection's until :meth:`loaded`."""
        return self._json(fr.Op.LOAD, body, deadline)

    def loaded(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/engine/loaded`` on the channel: the lease released, the FetchResult's JSON."""
        return self._json(fr.Op.LOADED, body, None)

    def load_keys(self, prompt: list[fr.Column], ttl_s: float | None) -> tuple[Match, dict[str, Any] | None]:
        """LOAD_KEYS: the prompt's Match, and its load's plan and READ lease in the form
        LOAD answers them, its tables (rows, slots, sums) as arrays (None where no row is
        lent), for ``Client.prepare_load``."""
        cols = self.call(fr.Op.LOAD_KEYS, [*prompt, np.array([float("nan") if ttl_s is None else ttl_s],
                                                             dtype="<f8")])
        m = fr.match_from(cols)
        at = fr.MATCH_COLUMNS
        start = int(fr.ints(cols, at, "start_page", 1)[0])
        grp, page, size = (fr.ints(cols, at + i, w) for i, w in ((1, "rows.group"), (2, "rows.page"),
                                                                 (3, "rows.size")))
        lease_id = fr.take(cols, at + 4, str, "lease_id")
        if not lease_id:
            return m, None
        ttl = float(fr.take(cols, at + 5, np.ndarray, "ttl_s")[0])
        idx, off, sz = (fr.ints(cols, at + i, w) for i, w in ((6, "slots.index"), (7, "slots.offset"),
                                                               (8, "slots.size")))
        sums = fr.ints(cols, at + 9, "slots.sums", len(idx))
        segment = fr.take(cols, at + 10, str, "segment")
        if len(page) != len(grp) or len(size) != len(grp) or len(off) != len(idx) or len(sz) != len(idx) \
                or (len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(grp))):
            raise TierUnavailable("node: a LOAD_KEYS answer of an unexpected shape", field="socket")
        # LOAD's answer, its tables as arrays (the load reads them as arrays: no lists, no hex)
        rows = np.stack([grp, page, size], axis=1)
        slots = np.stack([idx, np.zeros(len(idx), dtype="<i8"), off, sz], axis=1)
        doc = {"layout_id": m.layout_id.hex(), "start_page": start, "rows": rows,
               "lease": {"id": lease_id, "ttl_s": ttl, "segments": [segment], "slots": slots,
                         "sums": sums.astype("<u8")}}  # 0: none recorded
        return m, doc

    def loaded_oneway(self, body: dict[str, Any]) -> None:
        """LOADED as a ONEWAY frame (the node took it at HELLO: ``oneway_loaded``): the
        caller builds the FetchResult itself, as the node would (``load_result``)."""
        self.send_oneway(fr.Op.LOADED, [json.dumps(body, separators=(",", ":"))])

    def _json(self, op: fr.Op, body: dict[str, Any], deadline: Deadline | None) -> dict[str, Any]:
        text = fr.take(self.call(op, [json.dumps(body, separators=(",", ":"))], deadline), 0, str, op.name.lower())
        try:
            doc = json.loads(text)
        except ValueError:
            raise InvalidInput(f"{op.name.lower()}: the node's answer is not JSON", field=op.name.lower()) from None
        if not isinstance(doc, dict):
            raise InvalidInput(f"{op.name.lower()}: the node's answer is not a JSON object", field=op.name.lower())
        return doc


__all__ = ["ChannelBroken", "LocalLink"]
