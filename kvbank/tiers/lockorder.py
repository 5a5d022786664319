"""The node's lock order, written once, and a debug mode that checks it on every acquire.

The locks of one node, outermost first (a thread holding one may take only those below it)::

    LENDER      Lender._lock        the lease tables (re-entrant)
    MOVER_DISK  Mover.disk_lock     serialises every disk mutation of the store
    STORE       TieredStore lock    the row index, slot ledger, page locks, pins, events
    DISK_TIER   DiskTier._lock      one LMDB writer at a time, the tier's counters

:func:`make_lock` returns a plain :class:`threading.Lock` (or ``RLock``) unless checking
is on; then an :class:`OrderedLock` that raises :class:`LockOrderError` when a thread
takes a lock while holding one of the same or a lower rank (re-entry of a re-entrant lock
excepted). The test suite turns checking on (:func:`enable`, or ``KVBANK_CHECK_LOCKS=1``
before the locks are made); production pays nothing for it.
"""

from __future__ import annotations

import _thread
import enum
import os
import threading


class Rank(enum.IntEnum):
    """Where a lock sits in the order: lower ranks are taken first."""

    LENDER = 10
    MOVER_DISK = 20
    STORE = 30
    DISK_TIER = 40


class LockOrderError(AssertionError):
    """A thread took locks against the order in this module's docstring."""


_check = os.environ.get("KVBANK_CHECK_LOCKS") == "1"
_held = threading.local()  # .stack: list[OrderedLock] held by this thread, in order


def enable(on: bool = True) -> None:
    """Check the order of every lock made from now on."""
    global _check
    _check = on


def checking() -> bool:
    return _check


def _stack() -> list[OrderedLock]:
    stack: list[OrderedLock] | None = getattr(_held, "stack", None)
    if stack is None:
        stack = _held.stack = []
    return stack


class OrderedLock:
    """A lock that checks, on acquire, that the thread holds nothing of its rank or below."""

    def __init__(self, rank: Rank, name: str, *, reentrant: bool = False) -> None:
        self.rank = rank
        self.name = name
        self._reentrant = reentrant
        self._lock: threading.Lock | threading.RLock = (
            threading.RLock() if reentrant else threading.Lock())
        self._owner: int | None = None
        self._depth = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        stack = _stack()
        mine = self._owner == threading.get_ident()
        if not (mine and self._reentrant):
            for other in stack:
                if other.rank >= self.rank:
                    raise LockOrderError(
                        f"lock order: taking {self.name} (rank {self.rank.name}) while "
                        f"holding {other.name} (rank {other.rank.name})")
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._owner = threading.get_ident()
            self._depth += 1
            stack.append(self)
        return got

    def release(self) -> None:
        stack = _stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self:
                del stack[i]
                break
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lock.release()

    def _is_owned(self) -> bool:  # threading.Condition asks this instead of probing
        return self._owner == threading.get_ident()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def make_lock(rank: Rank, name: str, *,
              reentrant: bool = False) -> OrderedLock | threading.RLock | _thread.LockType:
    """The lock for ``rank``: checked when checking is on, a plain one otherwise."""
    if _check:
        return OrderedLock(rank, name, reentrant=reentrant)
    return threading.RLock() if reentrant else threading.Lock()
