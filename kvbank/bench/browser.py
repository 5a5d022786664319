"""A headless Chromium driven over the DevTools protocol: the status page's bench case
opens the page in it, and its browser test checks what a person would see.

Primitives:

- :func:`chromium_binary` — Debian's ``chromium`` (or ``KVBANK_CHROMIUM``), None if absent.
- :class:`Chromium` — one browser process with a fresh profile, started headless with
  everything that would reach outside off (no sync, no component updates, no background
  networking, no QUIC), on a DevTools port the kernel picks; stopped by pid.
  :meth:`Chromium.page` opens a tab.
- :class:`Tab` — one tab's DevTools socket: :meth:`~Tab.call` a method,
  :meth:`~Tab.evaluate` an expression, :meth:`~Tab.wait` for an expression to be true;
  console messages, uncaught exceptions and log entries of level error are collected in
  :attr:`~Tab.errors` as they come.

Nothing here downloads a browser: without the binary, the caller skips (or, under CI,
fails).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0")
INSTALL_HINT = "the browser tests need Debian's chromium: apt-get install -y chromium"


def chromium_binary() -> str | None:
    given = os.environ.get("KVBANK_CHROMIUM")
    if given:
        return given
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Tab:
    """One tab's DevTools connection. See the module docstring."""

    def __init__(self, ws_url: str) -> None:
        self._stack = contextlib.ExitStack()
        self._ws: ClientConnection = self._stack.enter_context(connect(ws_url, max_size=64 << 20, open_timeout=10))
        self._id = 0
        self.errors: list[str] = []  # console errors, exceptions, error log entries
        self.events: list[dict[str, Any]] = []
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def _note(self, msg: dict[str, Any]) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description", "")))
                                                      for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            d = params.get("exceptionDetails", {})
            self.errors.append("exception: " + str(d.get("exception", {}).get("description", d.get("text"))))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            e = params["entry"]
            self.errors.append(f"log ({e.get('source')}): {e.get('text')} {e.get('url', '')}".strip())
        self.events.append(msg)

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        self._id += 1
        me = self._id
        self._ws.send(json.dumps({"id": me, "method": method, "params": params}))
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"devtools: {method} did not answer within {timeout_s} s")
            msg = json.loads(self._ws.recv(timeout=left))
            if msg.get("id") == me:
                if "error" in msg:
                    raise RuntimeError(f"devtools: {method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result
            self._note(msg)

    def evaluate(self, expression: str) -> Any:
        got = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in got:
            raise RuntimeError(f"page: {expression!r} raised {got['exceptionDetails']}")
        return got.get("result", {}).get("value")

    def wait(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll ``expression`` until it is truthy; its value (TimeoutError past the deadline)."""
        end = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > end:
                raise TimeoutError(f"page: {expression!r} still false after {timeout_s} s")
            time.sleep(0.1)

    def open(self, url: str, timeout_s: float = 30.0) -> None:
        """Navigate and wait for the load event."""
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete'", timeout_s)

    def type(self, text: str) -> None:
        """Type into the focused element, then press Enter."""
        self.call("Input.insertText", text=text)
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                      windowsVirtualKeyCode=13, text="\r" if kind == "keyDown" else "")

    def screenshot(self, path: Path, width: int = 1400, height: int = 1200) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)
        got = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(got["data"]))

    def close(self) -> None:
        self._stack.close()


class Chromium:
    """A headless Chromium with a fresh profile. See the module docstring."""

    def __init__(self, binary: str, timeout_s: float = 30.0) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="kvbank-chromium-")
        profile = Path(self._profile.name)
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        port_file = profile / "DevToolsActivePort"
        end = time.monotonic() + timeout_s
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.close()
                raise RuntimeError(f"chromium: no DevTools port after {timeout_s} s")
            time.sleep(0.05)
        self.port = int(port_file.read_text().splitlines()[0])

    def page(self) -> Tab:
        """A new tab."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(req, timeout=10) as r:
            target = json.load(r)
        return Tab(target["webSocketDebuggerUrl"])

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the renderers go too
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._profile.cleanup()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
