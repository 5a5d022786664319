"""Start a ``kvbank serve`` child process and wait for its ready line.

:class:`NodeProcess` is what ``kvbank demo``, ``kvbank bench service`` and the service
tests use: ``NodeProcess.start(["--data-dir", d, ...])`` runs ``python -m kvbank.cli serve
--port 0 ...`` (a free port, chosen by the kernel: no race between picking and binding),
reads the URL from the ready line and returns; ``stop()`` sends SIGTERM to that pid and
waits (SIGKILL after a deadline); ``kill()`` is SIGKILL, for crash tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbank.errors import TierUnavailable

# set in a node's environment by the process that starts it for itself (its pid): the node
# then ends with it (kvbank.service.server.die_with_starter)
DIE_WITH_ENV = "KVBANK_DIE_WITH_PID"

_READY = re.compile(r"kvbank serve: ready on (http://\S+)")


@dataclass
class NodeProcess:
    """A running node child process."""

    url: str
    pid: int
    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)  # its output so far (stdout and stderr)
    pump: threading.Thread | None = None

    @classmethod
    def start(cls, args: Sequence[str] = (), *, timeout_s: float = 240.0,
              env: dict[str, str] | None = None) -> NodeProcess:
        # timeout_s is a hang bound: a start (torch's import, the bank's open) took over
        # 40 s on a loaded machine, so a tighter bound failed tests for a slow machine
        cmd = [sys.executable, "-m", "kvbank.cli", "serve", "--port", "0", *args]
        if threading.current_thread() is threading.main_thread():
            # the node stops when this process ends, however it ends (a killed test run
            # left nodes holding GiBs). Only from the main thread: the kernel sends the
            # parent-death signal when the thread that forked ends, and only the main
            # thread lasts as long as the process
            env = {**(os.environ if env is None else env), DIE_WITH_ENV: str(os.getpid())}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, bufsize=1)
        lines: list[str] = []
        found: list[str] = []
        ready = threading.Event()

        def pump() -> None:  # keep reading so the child never blocks on a full pipe
            assert proc.stdout is not None  # PIPE was asked for
            for line in proc.stdout:
                lines.append(line)
                m = _READY.search(line)
                if m and not found:
                    found.append(m.group(1))
                    ready.set()
            ready.set()

        reader = threading.Thread(target=pump, name=f"kvbank-node-{proc.pid}", daemon=True)
        reader.start()
        if not ready.wait(timeout_s) or not found:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(5)
            if proc.stdout is not None:
                proc.stdout.close()
            raise TierUnavailable(f"node: kvbank serve did not become ready: {''.join(lines)[-2000:]}")
        return cls(found[0], proc.pid, proc, lines, reader)

    def _reap(self) -> int:
        code = self.proc.wait()
        if self.pump is not None:
            self.pump.join(5)  # the child is gone: its pipe is at EOF
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait for a clean exit; its exit code (SIGKILL after ``timeout_s``)."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
        return self._reap()

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self._reap()
