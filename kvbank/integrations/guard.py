"""What every engine adapter wraps its kvbank calls in: nothing may escape into the engine.

Primitives:

- :class:`Guard` — runs a kvbank call and answers the caller's fallback (a miss) when it
  raises, logging at warning; a node that cannot be reached trips a circuit breaker, and
  for ``breaker_s`` every guarded call answers its fallback at once.
- :func:`safe` — the same without the breaker, for bookkeeping that must run whether or
  not the node is up (releases, closes).
- :func:`registered` — a call retried once after registering its layout again, for a node
  restarted on an empty data dir (it forgot its layouts).
- :class:`ThreadClients` — one :class:`~kvbank.Client` a thread: an engine calls from
  several threads at once (a scheduler, loaders, savers), each gets its own connection
  pool, and every client registers the adapter's layouts when it is made.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvbank.errors import TierUnavailable, UnknownLayout
from kvbank.layout import PageLayout

__all__ = ["Guard", "ThreadClients", "registered", "safe"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def registered(client: Any, layout: PageLayout, fn: Callable[[], T]) -> T:
    """``fn()``, registering ``layout`` once more if the node does not know it (a node
    restarted on an empty data dir forgets its layouts)."""
    try:
        return fn()
    except UnknownLayout:
        client.register(layout)
        return fn()


def safe(what: str, fn: Callable[[], T], fallback: T) -> T:
    """``fn()``, or ``fallback`` with a warning if it raises: for an adapter's own
    bookkeeping, which must run whether or not the node is up (no breaker here)."""
    try:
        return fn()
    except Exception as exc:  # never into the engine
        logger.warning("kvbank: %s failed: %s: %s", what, type(exc).__name__, exc)
        return fallback


class Guard:
    """Runs kvbank calls so that nothing escapes into the engine, with a circuit breaker."""

    def __init__(self, breaker_s: float) -> None:
        self._breaker_s = breaker_s
        self._down_until = 0.0
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def call(self, what: str, fn: Callable[[], T], fallback: T) -> T:
        if self.down:
            return fallback
        try:
            return fn()
        except TierUnavailable as exc:
            with self._lock:
                self._down_until = time.monotonic() + self._breaker_s
            logger.warning("kvbank: %s failed, node unreachable; kvbank skipped for %.0f s: %s",
                           what, self._breaker_s, exc)
        except Exception as exc:  # never into the engine: every kvbank failure is a miss
            logger.warning("kvbank: %s failed (a miss): %s: %s", what, type(exc).__name__, exc)
        return fallback


class ThreadClients:
    """One Client a thread, made on first use, registering ``layouts()`` then."""

    def __init__(self, url: str, *, timeout_s: float, retry_s: float, token: str | None,
                 layouts: Callable[[], Sequence[PageLayout]]) -> None:
        self._url, self._timeout_s, self._retry_s, self._token = url, timeout_s, retry_s, token
        self._layouts = layouts
        self._local = threading.local()
        self._all: list[Any] = []
        self._lock = threading.Lock()

    def get(self) -> Any:
        from kvbank.client import Client

        c: Client | None = getattr(self._local, "client", None)
        if c is None:
            c = Client(self._url, timeout_s=self._timeout_s, retry_s=self._retry_s, token=self._token)
            try:
                for layout in self._layouts():
                    c.register(layout)
            except BaseException:
                c.close()
                raise
            self._local.client = c
            with self._lock:
                self._all.append(c)
        return c

    def close(self) -> None:
        with self._lock:
            clients, self._all = self._all, []
        for c in clients:
            safe("close", c.close, None)
