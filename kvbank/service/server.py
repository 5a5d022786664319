"""``kvbank serve``: the uvicorn lifecycle around one node.

Lifecycle::

    serve(config)
      ├─ bind 127.0.0.1:port (0 = a free port) ── open the Bank (disk tier recovered)
      ├─ uvicorn (uvloop + httptools, with the connection limits of
      │  :mod:`kvbank.service.connections`) starts ──► one ready line on stdout:
      │     "kvbank serve: ready on http://127.0.0.1:7410 (data dir …, host tier …, …)"
      ├─ the data port (``data_port``, :mod:`kvbank.service.dataplane`) listens, its
      │  threads beside uvicorn's loop; the ready line names it
      ├─ the local channel (:mod:`kvbank.service.local`) listens on ``node.sock`` in the
      │  data dir, a thread per same-host worker; ``/v1/node`` names its path
      ├─ requests: blocking bank calls on the node's bounded pool, never on the loop
      └─ SIGTERM / SIGINT: stop accepting, let in-flight requests finish (at most
         ``shutdown_timeout_s``), end the data connections (a transfer in flight breaks
         off: nothing it carried is committed or acknowledged by the node), close the
         bank (host rows persisted to disk, as ``Bank.close`` does), exit 0. A stop that
         takes more than :data:`STOP_NOTICE_S` says on stderr what it is waiting for
         (:class:`_Stopping`); on a terminal, the host reservation and the close's
         write-back draw progress bars (:mod:`kvbank.progress`)

The socket is bound before the bank opens so that a taken port fails at once, and the
ready line is printed only once uvicorn accepts: a script may start the node and wait for
that line. Before anything opens, the process makes itself non-dumpable
(:func:`forbid_dumps`): another process of the same uid (a tenant's worker) can then
neither open its ``/proc/<pid>/fd`` entries (the host segment's descriptor among them),
nor read or write its memory through ``/proc/<pid>/mem``, nor attach a debugger.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import uvicorn

from kvbank import progress
from kvbank.bank.bank import Bank
from kvbank.errors import ConfigError, KvbankError, TierUnavailable
from kvbank.service.admin.routes import admin_of
from kvbank.service.app import create_app
from kvbank.service.config import DATA_PORT_OFF, ServiceConfig
from kvbank.service.connections import protocol
from kvbank.service.dataplane import DataPlane
from kvbank.service.launch import DIE_WITH_ENV
from kvbank.service.local import LocalChannel, socket_path
from kvbank.service.node import Node
from kvbank.service.sockets import listen
from kvbank.tiers.datadir import private_dir

logger = logging.getLogger(__name__)

READY = "kvbank serve: ready on"
STOP_NOTICE_S = 1.0  # a stop longer than this says what it waits for
STOP_REPEAT_S = 5.0  # and says it again this often while the wait lasts


PR_SET_DUMPABLE = 4  # <linux/prctl.h>
PR_GET_DUMPABLE = 3
PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    """libc's ``prctl`` (None off Linux or where libc has none)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
    prctl.restype = ctypes.c_int
    return prctl


def die_with_starter() -> None:
    """Where ``KVBANK_DIE_WITH_PID`` names this process's parent: SIGTERM when that
    parent ends (``PR_SET_PDEATHSIG``), so a node a test or a bench started stops with it
    however it ends (a hang guard's kill included) and frees its memory; a parent gone
    already ends the node at once."""
    want = os.environ.get(DIE_WITH_ENV)
    if not want:
        return
    prctl = _prctl()
    if prctl is None or prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        logger.warning("kvbank serve: cannot stop with the process that started it (no prctl)")
        return
    if str(os.getppid()) != want:  # the parent died before the prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def forbid_dumps() -> bool:
    """``prctl(PR_SET_DUMPABLE, 0)``: no core dumps, and ``/proc/<pid>/`` (fd, mem,
    environ, maps) and ``ptrace`` become root's only, so another process of this uid
    reaches none of this process's descriptors or memory. Whether it took effect (False
    off Linux or where libc has no prctl: the node then runs as before, and says so)."""
    prctl = _prctl()
    if prctl is None:
        return False
    if prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        logger.warning("kvbank serve: prctl(PR_SET_DUMPABLE, 0) failed (errno %d): processes "
                       "of this uid can open its /proc entries", ctypes.get_errno())
        return False
    return int(prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)) == 0


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _bind(config: ServiceConfig) -> socket.socket:
    sock = listen(config.bind, config.port, field="port", backlog=1024)
    sock.set_inheritable(True)
    return sock


def serve(config: ServiceConfig, *, out: TextIO = sys.stdout) -> int:
    """Run the node until SIGTERM/SIGINT; 0 after a clean shutdown."""
    die_with_starter()
    if not forbid_dumps():
        logger.warning("kvbank serve: this process stays dumpable: a process of its uid can "
                       "read its memory and descriptors (docs/admin.md, trust model)")
    sock = _bind(config)
    port = sock.getsockname()[1]
    config = config.replace(port=port)
    if config.bank.data_dir is not None:
        try:
            private_dir(config.bank.data_dir)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"data_dir: cannot create {config.bank.data_dir}: {exc}") from exc
    bank = Bank(config.bank)
    _show_reservation(bank)
    node = Node(bank, config)
    stopping = _Stopping(sys.stderr)
    channel: LocalChannel | None = None
    try:
        if config.redis is not None or config.redis_cluster is not None:
            # only a node in a fleet loads it (and needs the fleet extra's redis)
            from kvbank.service.fleet.fleet import join_fleet

            node.fleet = join_fleet(bank, config)
        app = create_app(node)
        node.dataplane = _dataplane(node, app)
        channel = _channel(node, app)
        if admin_of(app).guard.tokens:
            # tenants share this host: the segment's name goes (the channel opened its
            # descriptor already), so no tenant's process can open it (admin.md, trust model)
            node.unlink_segment()
        # The protocol (httptools, with the node's header timeout, header-size and
        # connection limits) answers 503 to a connection over max_connections at accept,
        # so uvicorn's own limit_concurrency (checked only once headers arrive) is not used.
        uv = uvicorn.Config(
            # proxy_headers off: the node binds loopback and trusts no forwarder's headers
            app, loop="uvloop", http=protocol(config), lifespan="off", access_log=False, proxy_headers=False,
            log_level="warning", timeout_keep_alive=int(max(1, config.idle_timeout_s)),
            timeout_graceful_shutdown=int(max(1, config.shutdown_timeout_s)),
        )
        admin = admin_of(app)
        fleet = node.fleet
        if fleet is not None:  # a node whose Redis does not answer says so in its health
            from kvbank.service.fleet.fleet import health_reasons

            admin.state.add_health_reasons(lambda: health_reasons(fleet))
        data_port = None if node.dataplane is None else node.dataplane.port
        server = _Server(uv, lambda: _ready(config, out, admin.state.token_file, data_port),
                         on_exit=lambda: stopping.start(
                             lambda: f"{admin.state.in_flight} requests in flight to finish "
                                     f"(at most {config.shutdown_timeout_s:g} s)"))
        server.run(sockets=[sock])
    finally:
        sock.close()
        stopping.start()
        try:
            if channel is not None:  # before the bank closes: its threads call the bank
                stopping.now("the local channel's connections to end")
                channel.stop()
            if node.dataplane is not None:  # before the bank closes: its threads hold slot views
                stopping.now("the data port's connections to end")
                node.dataplane.stop(config.shutdown_timeout_s)
            stopping.now("the bank's calls in progress to return" +
                         (" and the fleet to leave Redis" if node.fleet is not None else ""))
            node.close()
            stopping.now("the bank to close (memory rows written to disk)" if config.bank.data_dir is not None
                         else "the bank to close")
            _close_bank(bank, config.shutdown_timeout_s)
        finally:
            stopping.stop()
    logger.debug("kvbank serve: stopped")
    return 0


def _dataplane(node: Node, app: object) -> DataPlane | None:
    """The node's data port, listening (None when ``data_port`` is off, or when the node
    has no host tier: the data plane moves bodies through host slots only)."""
    config = node.config
    if config.data_port == DATA_PORT_OFF:
        return None
    if node.segment is None:  # asked for, and not possible: say so, not only "off"
        logger.warning("data port off: the host tier (%s) has no shared segment to move page "
                       "bodies through; remote page bodies go over HTTP", _size(config.bank.host_bytes))
        return None
    metrics = admin_of(app).metrics
    dp = DataPlane(node.bank, bind=config.bind, port=config.data_port, max_connections=config.data_connections,
                   idle_timeout_s=config.idle_timeout_s, body_timeout_s=config.body_timeout_s,
                   moved=None if metrics is None else lambda d, n: metrics.add_moved(d, "data", n))
    dp.start()
    return dp


def _channel(node: Node, app: object) -> LocalChannel | None:
    """The node's local channel (a Unix socket for same-host workers), listening; None
    (and a warning: same-host workers then call over HTTP) where it cannot be opened."""
    path = socket_path(node.config.bank.data_dir)
    channel = LocalChannel(node, admin_of(app), path)
    try:
        channel.start()
    except (OSError, KvbankError) as exc:
        logger.warning("local channel off: cannot listen on %s (%s); same-host workers call over HTTP",
                       path, exc)
        return None
    node.channel_path = str(path)
    return channel


def _ready(config: ServiceConfig, out: TextIO, token_file: Path | None, data_port: int | None = None) -> None:
    b = config.bank
    disk = "off" if b.data_dir is None else f"{_size(b.disk_bytes)} in {b.data_dir}"
    # The ready line names the admin token's file, never the token.
    admin = "admin token as configured" if token_file is None else f"admin token in {token_file}"
    data = "data port off" if data_port is None else f"data port {data_port}"
    fleet = ""
    if config.redis is not None or config.redis_cluster is not None:
        from kvbank.service.fleet.fleet import where_redis

        seeds = [s.strip() for s in (config.redis_cluster or "").split(",") if s.strip()]
        fleet = f", fleet through {where_redis(config.redis, seeds)} (health says once it joined)"
    print(f"{READY} {config.url} (data dir {b.data_dir}, host tier {_size(b.host_bytes)}, "
          f"disk tier {disk}, {data}{fleet}; {admin})", file=out, flush=True)


def _show_reservation(bank: Bank) -> None:
    """With ``reserve_host``, on a terminal: a bar of the host budget pre-faulted so far."""
    r = bank.reservation
    if r is None:
        return
    shown = progress.bar(r.target_bytes, "host tier: reserving memory", unit="B", unit_scale=True)
    if isinstance(shown, progress.Quiet):
        return

    def run() -> None:
        try:
            while not r.wait(0.25):
                shown.update(r.done_bytes - shown.n)
        finally:
            shown.close()

    threading.Thread(target=run, name="kvbank-reserve-progress", daemon=True).start()


class _Stopping:
    """What a stop is waiting for, said on ``err`` once the stop has lasted
    :data:`STOP_NOTICE_S`, again when the wait changes, and every :data:`STOP_REPEAT_S`
    while it lasts. A wait is a text or a callable giving one (a count that changes)."""

    def __init__(self, err: TextIO) -> None:
        self._err = err
        # re-entrant: a second SIGTERM or SIGINT runs the server's exit handler, and so
        # start(), in the main thread while it is inside start() or now() (a plain lock
        # deadlocked the node's stop there: it then ignored every signal but SIGKILL)
        self._lock = threading.RLock()
        self._what: str | Callable[[], str] = "the server to stop"
        self._began: float | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, what: str | Callable[[], str] | None = None) -> None:
        """The stop began (idempotent), waiting for ``what``."""
        with self._lock:
            if what is not None:
                self._what = what
            if self._thread is not None:
                return
            self._began = time.monotonic()
            self._thread = thread = threading.Thread(target=self._run, name="kvbank-stopping", daemon=True)
        thread.start()  # outside the lock: its wait for the thread is where a signal lands

    def now(self, what: str | Callable[[], str]) -> None:
        with self._lock:
            self._what = what

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        said, said_at = None, 0.0
        while not self._done.wait(0.1):
            with self._lock:
                what, began = self._what, self._began
            assert began is not None  # set with the thread
            now = time.monotonic()
            if now - began < STOP_NOTICE_S:
                continue
            if what is not said or now - said_at >= STOP_REPEAT_S:
                text = what() if callable(what) else what
                print(f"kvbank serve: stopping ({now - began:.0f} s): waiting for {text}",
                      file=self._err, flush=True)
                said, said_at = what, now


def _close_bank(bank: Bank, deadline_s: float) -> None:
    """``bank.close()`` within a deadline (it persists host rows to disk)."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            bank.close()
        except BaseException as exc:  # reported below, on the serving thread
            err.append(exc)

    t = threading.Thread(target=run, name="kvbank-close", daemon=True)
    t.start()
    t.join(max(deadline_s, 1.0) * 3)  # the store's own persist deadline comes first
    if t.is_alive():
        raise TierUnavailable(f"shutdown: the bank did not close within {deadline_s * 3:.0f}s")
    if err:
        raise err[0]


class _Server(uvicorn.Server):
    """uvicorn's server, printing the ready line once it accepts connections."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None],
                 on_exit: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._on_ready = on_ready
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._on_exit is not None:
            self._on_exit()
        # uvicorn re-raises a captured signal once it has stopped, which would kill the
        # process before the bank closes (host rows unpersisted) and exit -15. The node
        # closes its bank and exits 0 instead.
        self._captured_signals.clear()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_ready()
