"""What every engine adapter wraps its kvbank calls in: nothing escapes into the engine.

- :class:`Guard` — runs a call and answers the caller's fallback (a miss, a failed task)
  on any kvbank error, logged at warning; a transport failure (the node unreachable)
  trips a circuit breaker, and every call is the fallback without a network call until
  ``breaker_s`` has passed.
- :func:`registered` — a call retried once after registering the layout again (a node
  restarted on an empty data dir forgets its layouts).
- :func:`safe` — the adapter's own bookkeeping, whether or not the node is up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvbank.errors import TierUnavailable, UnknownLayout
from kvbank.layout import PageLayout

__all__ = ["Guard", "registered", "safe"]

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
    """``fn()``, or ``fallback`` with a warning if it raises: for the connector's own
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
