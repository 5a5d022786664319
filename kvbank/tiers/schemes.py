"""Frame stores below the disk, chosen by ``remote_url``'s scheme.

A table of factories: ``redis://``, ``rediss://``, ``unix://`` and Redis Cluster seeds
``host:port,host:port`` (no scheme) open :class:`~kvbank.tiers.remote.RedisFrameStore`;
:func:`register_remote` adds a scheme (``kvbank.testing.dirstore`` adds ``dir://``);
:func:`open_remote` is what the store calls at open. Redis (the ``fleet`` extra) loads
only when a Redis URL is opened, so a store with another remote tier, or none, never
needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvbank.config import BankConfig
from kvbank.errors import ConfigError, InvalidInput, TierError
from kvbank.tiers.base import FrameStore

logger = logging.getLogger(__name__)

__all__ = ["SEEDS", "RemoteFactory", "open_remote", "register_remote", "remote_schemes",
           "scheme_of"]

RemoteFactory = Callable[[str, int], FrameStore]  # (remote_url, remote_bytes) -> open store
SEEDS = ""  # the table's key for a URL with no scheme: Redis Cluster seeds host:port,...


def _open_redis(url: str, budget: int) -> FrameStore:
    from kvbank.tiers.redis_client import connect
    from kvbank.tiers.remote import RedisFrameStore

    seeds = [s.strip() for s in url.split(",") if s.strip()] if "://" not in url else []
    # Few retries: a read that misses locally must not wait out a Redis outage (the
    # reference retry policy hides ~6 s); a miss is the right answer then.
    return RedisFrameStore(connect(None if seeds else url, cluster=seeds, retries=2, field="remote_url"),
                           budget, own_client=True)


_FACTORIES: dict[str, RemoteFactory] = {
    "redis": _open_redis, "rediss": _open_redis, "unix": _open_redis, SEEDS: _open_redis}


def register_remote(scheme: str, factory: RemoteFactory) -> None:
    """Open ``scheme://…`` remote URLs with ``factory(url, budget)`` (replacing any)."""
    if not isinstance(scheme, str) or not scheme.isascii() or not scheme.isidentifier() \
            or scheme != scheme.lower():
        raise InvalidInput(f"scheme: expected a lower-case name like 'redis', got {scheme!r}")
    _FACTORIES[scheme] = factory


def remote_schemes() -> list[str]:
    """The schemes a ``remote_url`` may have, sorted."""
    return sorted(s for s in _FACTORIES if s)


def scheme_of(url: str) -> str:
    """The URL's scheme, lower case; :data:`SEEDS` when it has none."""
    return url.split("://", 1)[0].lower() if "://" in url else SEEDS


def open_remote(config: BankConfig, notes: list[str]) -> FrameStore | None:
    """The remote tier when configured, by its URL's scheme; unreachable at open = off,
    with a note (the node serves its own tiers; a remote tier is an extra, never a
    dependency). ``ConfigError`` for a scheme no factory is registered for."""
    if not config.remote_url or config.remote_bytes <= 0:
        return None
    url = config.remote_url
    factory = _FACTORIES.get(scheme_of(url))
    if factory is None:
        raise ConfigError(f"remote_url: no remote tier for the scheme {scheme_of(url)!r} of "
                          f"{url!r}; known schemes: {remote_schemes()} (or Redis Cluster "
                          "seeds host:port,host:port)", field="remote_url")
    try:
        return factory(url, config.remote_bytes)
    except TierError as exc:
        notes.append(f"remote tier off: {exc}")
        logger.warning("remote tier off: %s", exc)
        return None
