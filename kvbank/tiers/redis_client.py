"""Redis clients for the remote tier and the fleet: how to connect, and how row names map
to hash-tag buckets.

- :func:`connect` — a redis-py client for ``redis://``/``rediss://`` URLs (username and
  password passed through) or a cluster seed list, with the retry settings measured to
  ride out a restart (``EqualJitterBackoff``: at least 5.6 s of retries at the default 24).
- :func:`bucket_tag` — the ``{bNNN}`` hash tag of a row name: a hash of the name modulo
  :data:`BUCKETS`. Every key of one row lives in one bucket, so one bucket is one cluster
  slot; 1,024 buckets spread evenly over any fleet-sized cluster and are a useful
  resharding unit (redis-fleet.md 2).
- The redis-py names the rest of kvbank needs (the error root, the errors worth retrying
  through a failover, the cluster test, the slot function, one script call with its
  reload), so nothing outside ``tiers/`` imports redis-py.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from kvbank.errors import InvalidInput, TierUnavailable
from kvbank.extras import missing

try:
    import redis
    import redis.cluster
    import redis.exceptions
    from redis.backoff import EqualJitterBackoff
    from redis.crc import key_slot
    from redis.retry import Retry
except ModuleNotFoundError as exc:
    raise missing("fleet", "the Redis remote tier and the fleet", exc) from exc

__all__ = ["BUCKETS", "TRANSIENT", "RedisClient", "RedisError", "bucket_of", "bucket_tag",
           "connect", "is_cluster", "key_slot", "redis", "run_script"]

BUCKETS = 1024  # hash-tag buckets: >= 16 x masters for an even spread (redis-fleet.md 2)
RedisClient = redis.Redis | redis.cluster.RedisCluster  # what every fleet call takes
RedisError = redis.RedisError  # the root of every redis-py error
# What a restart or a cluster failover raises for a while: worth retrying with a deadline.
# RedisClusterException (no node reachable) is not a RedisError in redis-py.
TRANSIENT: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError, redis.exceptions.SlotNotCoveredError,
    redis.exceptions.RedisClusterException)


def is_cluster(client: object) -> bool:
    return isinstance(client, redis.cluster.RedisCluster)


def run_script(client: Any, sha: str, source: str, node: Any, args: Sequence[Any]) -> Any:
    """One ``EVALSHA`` (no declared keys) on ``node`` (``None``: the one Redis), loading
    the script where it is missing (a promoted replica, a restarted server)."""
    kw = {} if node is None else {"target_nodes": node}
    run = client.execute_command
    try:
        return run("EVALSHA", sha, 0, *args, **kw)
    except redis.exceptions.NoScriptError:
        run("SCRIPT", "LOAD", source, **kw)
        return run("EVALSHA", sha, 0, *args, **kw)


def connect(url: str | None = None, *, cluster: Sequence[str] = (), timeout_s: float = 1.0,
            retries: int = 24, field: str | None = None) -> RedisClient:
    """A client for one Redis (``url``) or a cluster (``cluster``: ``host:port`` seeds).
    ``field``: the setting a refusal names (default ``redis`` / ``redis_cluster``)."""
    retry = Retry(EqualJitterBackoff(cap=0.5, base=0.05), retries)
    common: dict[str, Any] = dict(socket_connect_timeout=0.5, socket_timeout=timeout_s,
                                  socket_keepalive=True, health_check_interval=2)
    try:
        if cluster:
            nodes = []
            for seed in cluster:
                host, _, port = seed.rpartition(":")
                if not host or not port.isdigit():
                    raise InvalidInput(f"{field or 'redis_cluster'}: expected HOST:PORT, got {seed!r}",
                                       field=field or "redis_cluster")
                nodes.append(redis.cluster.ClusterNode(host, int(port)))  # type: ignore[no-untyped-call]
            return redis.cluster.RedisCluster(startup_nodes=nodes, retry=retry, **common)
        what = field or "redis"
        if not url:
            raise InvalidInput(f"{what}: a redis:// or rediss:// URL or cluster seeds are needed", field=what)
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidInput(f"{what}: expected a redis:// or rediss:// URL, got {url!r}", field=what)
        return redis.Redis.from_url(url, retry=retry,
                                    retry_on_error=[redis.ConnectionError, redis.TimeoutError],
                                    **common)
    except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
        raise TierUnavailable(f"redis: cannot connect: {exc}") from exc


_TAGS = [b"{b%03x}" % b for b in range(BUCKETS)]


def bucket_of(name: bytes) -> int:
    """The row's bucket number (a hash of its name)."""
    return zlib.crc32(name) % BUCKETS


def bucket_tag(name: bytes) -> bytes:
    """``{bNNN}``: the row's bucket (all of a row's keys share it, so one cluster slot)."""
    return _TAGS[zlib.crc32(name) % BUCKETS]
