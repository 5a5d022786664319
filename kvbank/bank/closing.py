"""One rule for a closed bank, held by :class:`~kvbank.bank.bank.Bank`, ``bank.admin`` and
``bank.fleet`` alike: once the bank is closed, every public call raises
:class:`~kvbank.errors.TierUnavailable` naming the bank (``field="bank"``), queries and
``stats`` included; only :data:`OPEN_ANYTIME` is exempt.

:func:`refused_once_closed` applies it to a class: each public method, its own and
inherited, reads the instance's ``_closed`` before looking at any argument, so a method
added later cannot forget it. Properties (``clock``, ``reservation``, ``has_remote``) are
values, not calls, and stay readable.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from kvbank.errors import TierUnavailable

if TYPE_CHECKING:
    from kvbank.bank.catalog import Catalog
    from kvbank.tiers.store.store import TieredStore

B = TypeVar("B", bound=type)
R = TypeVar("R")
OPEN_ANYTIME = frozenset({"close", "open"})  # public methods a closed bank still answers


class Closable(Protocol):
    @property
    def _closed(self) -> bool: ...


def closed_error(call: str) -> TierUnavailable:
    """The error of ``call`` (``bank.admin.rows``) on a closed bank."""
    return TierUnavailable(f"bank: closed; {call} needs an open bank", field="bank")


def _refusing(fn: Callable[..., R], call: str) -> Callable[..., R]:
    @functools.wraps(fn)
    def checked(self: Closable, *args: object, **kw: object) -> R:
        if self._closed:
            raise closed_error(call)
        return fn(self, *args, **kw)
    return checked


def refused_once_closed(label: str) -> Callable[[B], B]:
    """A class decorator: every public method of the class (but :data:`OPEN_ANYTIME`)
    raises :func:`closed_error` once ``self._closed``; ``label`` is how callers reach the
    instance (``bank``, ``bank.admin``), for the message."""
    def apply(cls: B) -> B:
        for name in dir(cls):
            if name.startswith("_") or name in OPEN_ANYTIME:
                continue
            attr = inspect.getattr_static(cls, name)
            if inspect.isfunction(attr):
                setattr(cls, name, _refusing(attr, f"{label}.{name}"))
        return cls
    return apply


class BankPart:
    """What ``bank.admin`` and ``bank.fleet`` are built from: the bank's store and catalog,
    and the bank's own closed flag (every public call checks it first)."""

    def __init__(self, store: TieredStore, catalog: Catalog, *, closed: Callable[[], bool]) -> None:
        self._store = store
        self._catalog = catalog
        self._is_closed = closed

    @property
    def _closed(self) -> bool:
        return self._is_closed()
