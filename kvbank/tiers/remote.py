"""The remote tier: Redis (one server or a Redis Cluster) as the coldest frame store.

Primitives:

- It is opened by :func:`kvbank.tiers.schemes.open_remote` for a ``redis://``,
  ``rediss://`` or ``unix://`` ``remote_url``, or Redis Cluster seeds
  ``host:port,host:port``. Clients and buckets come from :mod:`kvbank.tiers.redis_client`.
- :class:`RedisFrameStore` — the :class:`~kvbank.tiers.base.FrameStore` contract over
  Redis. A row is two keys in its bucket: ``<ns>{bNNN}f<name>`` holds the codec frame
  (``SET … PX ttl``) and the bucket hash ``<ns>{bNNN}m`` holds its metadata (frame and raw
  lengths, write clock, expiry, dtype, parent). Both are written by one script, so a row
  is whole or absent; an expired frame is a miss and its metadata is pruned.

Byte accounting: ``used_bytes`` is the sum of the frames this store's metadata lists
(recomputed at open from the bucket hashes, then kept exact by every write and delete).
The effective budget is the smaller of the configured budget and what Redis itself says
is left (``maxmemory - used_memory`` from ``INFO memory``, read at most once a second),
so a shared Redis near its limit refuses with ``TierFull`` before it starts evicting or
answering OOM (which also maps to ``TierFull``).

Faults: every ``redis.RedisError`` becomes ``TierUnavailable`` (``TierFull`` for OOM)
with the library's error chained; a failed write is counted in ``failed_writes`` and the
last error kept in ``last_error`` (health shows both), never silently dropped. A frame is
verified (lengths and checksum) by the codec on every decode, and ``read_frame`` checks
its header against the metadata: wrong bytes are ``CorruptPage``, never returned.

Visibility: a row held only here is read by ``get_into`` on a local miss, but
``TieredStore.locate`` (and so a match) does not ask this tier: a locate is a pure lookup
under the store lock. ``contains_many`` answers for many rows in one round trip, outside
that lock; ``bank.fleet.recall_remote`` uses it to bring a match's missing rows back, and the
served match calls that when it stops short. See docs/fleet.md.

Lifecycle: ``RedisFrameStore(client, budget)`` scans the bucket hashes → reads and
writes from any thread (writes serialised by a lock) → ``close()`` (idempotent; closes
the client only if it was made here from a URL).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvbank.codec import (
    DEFAULT_LEVEL,
    DTYPE_CODES,
    HEADER_SIZE,
    MAX_PAGE_BYTES,
    decode_into,
    encode,
    frame_info,
)
from kvbank.errors import (
    CorruptPage,
    InvalidInput,
    PageSizeMismatch,
    TierFull,
    TierUnavailable,
)
from kvbank.keys import ROW_NAME_BYTES
from kvbank.tiers.base import Buffer, FrameHealth, FrameRow, FrameStoreBase, check_name
from kvbank.tiers.redis_client import (
    BUCKETS,
    RedisClient,
    bucket_of,
    bucket_tag,
    connect,
    redis,  # redis-py, or the error naming kvbank[fleet]
)

__all__ = ["BUCKETS", "RedisClient", "RedisFrameStore", "bucket_of",
           "bucket_tag", "connect"]

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 24 * 3600.0
DEFAULT_NAMESPACE = b"kvb:"
_INFO_EVERY_S = 1.0  # INFO memory is read at most this often (it is cheap, not free)
_META = struct.Struct("<QQQQB")  # frame_len, raw_len, seq, expiry (unix ms), len(dtype)


# KEYS[1] frame key, KEYS[2] bucket meta hash; ARGV: name, frame, meta, ttl ms, replace,
# raw_len. Returns the old frame length (or -1) or an error naming the size mismatch.
_WRITE = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
local old_len = -1
if old then
  old_len = struct.unpack('<I8', string.sub(old, 1, 8))
  local old_raw = struct.unpack('<I8', string.sub(old, 9, 16))
  if ARGV[5] == '0' and old_raw ~= tonumber(ARGV[6]) and redis.call('EXISTS', KEYS[1]) == 1 then
    return redis.error_reply('SIZE ' .. old_raw)
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return old_len
"""


def _pack_meta(frame_len: int, raw_len: int, seq: int, expiry_ms: int, dtype: str,
               parent: bytes | None) -> bytes:
    d = dtype.encode()
    return _META.pack(frame_len, raw_len, seq, expiry_ms, len(d)) + d + (parent or b"")


def _unpack_meta(name: bytes, value: bytes) -> tuple[FrameRow, int]:
    """A meta record and its expiry (unix ms); ``CorruptPage`` if it is malformed."""
    what = f"remote meta of {name.hex()[:16]}…"
    if len(value) < _META.size:
        raise CorruptPage(f"{what}: {len(value)} bytes, need {_META.size}")
    frame_len, raw_len, seq, expiry, dlen = _META.unpack_from(value)
    rest = value[_META.size:]
    if len(rest) not in (dlen, dlen + ROW_NAME_BYTES):
        raise CorruptPage(f"{what}: {len(rest)} trailing bytes for a {dlen}-byte dtype")
    dtype = rest[:dlen].decode("ascii", "replace")
    if dtype not in DTYPE_CODES or not 1 <= raw_len <= MAX_PAGE_BYTES \
            or not HEADER_SIZE <= frame_len <= HEADER_SIZE + raw_len:
        raise CorruptPage(f"{what}: dtype {dtype!r}, raw {raw_len}, frame {frame_len} "
                          "outside what this tier writes")
    return FrameRow(name, raw_len, frame_len, seq, dtype, rest[dlen:] or None), expiry


class RedisFrameStore(FrameStoreBase):
    """Rows as codec frames in Redis with a TTL; see the module docstring. ``write_frames``
    is :class:`~kvbank.tiers.base.FrameStoreBase`'s loop (a script call per frame)."""

    def __init__(self, client: RedisClient | str, budget: int, *,
                 ttl_s: float = DEFAULT_TTL_S, namespace: bytes = DEFAULT_NAMESPACE,
                 level: int = DEFAULT_LEVEL, own_client: bool = False) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise InvalidInput(f"remote_bytes: expected an integer >= 1, got {budget!r}")
        if not ttl_s > 0:
            raise InvalidInput(f"remote_ttl_s: expected seconds > 0, got {ttl_s!r}")
        self._own = own_client or isinstance(client, str)
        self.client: RedisClient = connect(client) if isinstance(client, str) else client
        self._budget = budget
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.ns = namespace
        self._level = level
        self._lock = threading.Lock()  # one writer; the counters
        self._closed = False
        self.corrupt_rows = 0
        self.failed_writes = 0  # writes that raised (counted, never dropped silently)
        self.last_error: str | None = None
        self._headroom: tuple[float, int | None] = (-1e9, None)
        self._write = self._call(lambda: self.client.register_script(_WRITE), "registering")
        rows = self._load_rows()
        self._used = sum(r.frame_len for r in rows)
        self.seq = max((r.seq for r in rows), default=0)

    # -- keys and errors ---------------------------------------------------------------

    def frame_key(self, name: bytes) -> bytes:
        return self.ns + bucket_tag(name) + b"f" + name

    def _meta_key(self, bucket: int) -> bytes:
        return self.ns + b"{b%03x}m" % bucket

    def _meta_key_of(self, name: bytes) -> bytes:
        return self.ns + bucket_tag(name) + b"m"

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("remote tier: closed")

    def _call(self, fn: Any, what: str) -> Any:
        """Run one Redis call, mapping its errors at the boundary."""
        try:
            return fn()
        except redis.ResponseError as exc:
            if str(exc).startswith("OOM"):
                raise TierFull(f"remote tier: {what}: Redis is out of memory: {exc}") from exc
            raise TierUnavailable(f"remote tier: {what}: {exc}") from exc
        except redis.RedisError as exc:
            raise TierUnavailable(f"remote tier: {what}: {exc}") from exc

    # -- accounting --------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def budget_bytes(self) -> int:
        return self._budget

    def headroom(self) -> int | None:
        """Bytes Redis says it can still take (``maxmemory - used_memory``), or ``None``
        when it has no limit; read at most once a second."""
        at, room = self._headroom
        now = time.monotonic()
        if now - at < _INFO_EVERY_S:
            return room
        info = self._call(lambda: self.client.info("memory"), "reading INFO memory")
        if isinstance(self.client, redis.cluster.RedisCluster):  # one entry per node
            figures = [v for v in info.values() if isinstance(v, dict)] or [info]
        else:
            figures = [info]
        rooms = [int(f.get("maxmemory", 0)) - int(f.get("used_memory", 0))
                 for f in figures if int(f.get("maxmemory", 0)) > 0]
        room = min(rooms) if rooms else None
        self._headroom = (now, room)
        return room

    def _load_rows(self) -> list[FrameRow]:
        """Every listed row whose frame still lives; expired or malformed ones pruned."""
        keys = [self._meta_key(b) for b in range(BUCKETS)]

        def fetch() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            return list(pipe.execute())

        hashes = self._call(fetch, "scanning metadata")
        now_ms = int(time.time() * 1000)
        rows: list[FrameRow] = []
        stale: list[tuple[bytes, bytes]] = []
        for key, entries in zip(keys, hashes, strict=True):
            for name, value in entries.items():
                try:
                    row, expiry = _unpack_meta(bytes(name), bytes(value))
                except CorruptPage:
                    self.corrupt_rows += 1
                    stale.append((key, name))
                    continue
                if expiry <= now_ms or len(name) != ROW_NAME_BYTES:
                    stale.append((key, name))
                else:
                    rows.append(row)
        if stale:
            def prune() -> None:
                pipe = self.client.pipeline(transaction=False)
                for k, n in stale:
                    pipe.hdel(k, n)
                pipe.execute()
            self._call(prune, "pruning expired metadata")
        return rows

    # -- the FrameStore primitives -----------------------------------------------------

    def frame(self, data: Buffer, dtype: str) -> bytes:
        """Encode page bytes into one frame (thread-safe, no lock taken)."""
        return encode(data, dtype, level=self._level)

    def write_frame(self, name: bytes, frame: bytes, *, raw_len: int, dtype: str,
                    parent: bytes | None = None, seq: int | None = None,
                    replace: bool = False) -> None:
        """Write a frame and its metadata in one script call, with the tier's TTL."""
        check_name(name)
        flen = len(frame)
        with self._lock:
            self._check_open()
            try:
                room = self.headroom()
                if self._used + flen > self._budget or (room is not None and flen > room):
                    raise TierFull(f"remote tier: a {flen}-byte frame exceeds the budget (used "
                                   f"{self._used} of {self._budget}, Redis headroom {room})")
                seq = self.seq + 1 if seq is None else seq
                expiry = int(time.time() * 1000) + self.ttl_ms
                meta = _pack_meta(flen, raw_len, seq, expiry, dtype, parent)
                try:
                    old = self._write(keys=[self.frame_key(name), self._meta_key_of(name)],
                                      args=[name, frame, meta, self.ttl_ms,
                                            "1" if replace else "0", raw_len])
                except redis.ResponseError as exc:
                    if str(exc).startswith("SIZE"):
                        raise PageSizeMismatch(f"data: {raw_len} bytes, but row "
                                               f"{name.hex()[:16]}… holds {str(exc)[5:]}") from exc
                    raise
            except (TierFull, TierUnavailable) as exc:
                self._failed(str(exc))
                raise
            except redis.RedisError as exc:
                mapped = (TierFull if str(exc).startswith("OOM") else TierUnavailable)(
                    f"remote tier: writing {name.hex()[:16]}…: {exc}")
                self._failed(str(mapped))
                raise mapped from exc
            # A listed row was counted (at open or at its write), expired or not.
            self._used += flen - max(0, int(old))
            self.seq = max(self.seq, seq)

    def _failed(self, msg: str) -> None:
        self.failed_writes += 1
        if self.last_error is None:
            logger.warning("remote tier: a write failed: %s", msg)
        self.last_error = msg

    def _get(self, name: bytes) -> bytes | None:
        self._check_open()
        check_name(name)
        value = self._call(lambda: self.client.get(self.frame_key(name)),
                           f"reading {name.hex()[:16]}…")
        if value is None:
            self._forget_expired(name)
            return None
        return value if type(value) is bytes else bytes(value)  # no copy of a 2 MiB reply

    def _forget_expired(self, name: bytes) -> None:
        """A frame gone by TTL: drop its metadata and its bytes from ``used_bytes``."""
        def drop() -> Any:
            pipe = self.client.pipeline(transaction=False)
            pipe.hget(self._meta_key_of(name), name)
            pipe.hdel(self._meta_key_of(name), name)
            return pipe.execute()

        with self._lock:
            meta, _ = self._call(drop, "pruning an expired row")
            if meta is not None:
                try:
                    self._used -= _unpack_meta(name, bytes(meta))[0].frame_len
                except CorruptPage:
                    self.corrupt_rows += 1

    def contains_many(self, names: Sequence[bytes]) -> list[bool]:
        """Whether each row's frame lives here, in one pipelined round trip (one per
        master on a cluster). Touches nothing: no TTL refresh, no read."""
        names = [check_name(n) for n in names]
        self._check_open()
        if not names:
            return []

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.exists(self.frame_key(n))
            return list(pipe.execute())

        return [bool(x) for x in self._call(run, f"looking up {len(names)} rows")]

    def read_frame(self, name: bytes) -> bytes | None:
        """The frame as stored, after its header is checked; ``None`` if absent."""
        frame = self._get(name)
        if frame is not None:
            frame_info(frame)  # CorruptPage on a damaged header
        return frame

    def read_into(self, name: bytes, out: memoryview | bytearray, *,
                  expect: int | None = None) -> int | None:
        """Decode the row into ``out`` (the codec verifies lengths and checksum)."""
        frame = self._get(name)
        if frame is None:
            return None
        if expect is not None and frame_info(frame).raw_len != expect:
            return None
        return decode_into(frame, out)

    def delete_many(self, names: Sequence[bytes]) -> list[bool]:
        names = [check_name(n) for n in names]
        with self._lock:
            self._check_open()

            def run() -> list[Any]:
                pipe = self.client.pipeline(transaction=False)
                for n in names:
                    pipe.hget(self._meta_key_of(n), n)
                    pipe.hdel(self._meta_key_of(n), n)
                    pipe.delete(self.frame_key(n))
                return list(pipe.execute())

            res = self._call(run, "deleting rows")
            found: list[bool] = []
            for i, n in enumerate(names):
                meta, _, gone = res[3 * i: 3 * i + 3]
                if meta is not None and gone:
                    try:
                        self._used -= _unpack_meta(n, bytes(meta))[0].frame_len
                    except CorruptPage:
                        self.corrupt_rows += 1
                found.append(bool(gone))
            return found

    def drop_corrupt(self, name: bytes) -> None:
        self.delete_many([name])
        with self._lock:
            self.corrupt_rows += 1
        logger.warning("remote tier: row %s… failed its checks; deleted", name.hex()[:16])

    def scan(self, prefix: bytes = b"") -> Iterator[FrameRow]:
        self._check_open()
        if not isinstance(prefix, bytes) or len(prefix) > ROW_NAME_BYTES:
            raise InvalidInput(f"prefix: expected at most {ROW_NAME_BYTES} bytes, got {prefix!r}")
        rows = sorted(self._load_rows(), key=lambda r: r.seq)
        return iter([r for r in rows if r.name.startswith(prefix)])

    def names(self) -> list[bytes]:
        return [r.name for r in self.scan()]

    def check(self) -> None:
        """Every listed row has its frame, of the listed length; ``used_bytes`` is their sum."""
        self._check_open()
        with self._lock:
            rows = self._load_rows()
            lens = self._call(lambda: [self.client.strlen(self.frame_key(r.name)) for r in rows],
                              "checking")
            for row, n in zip(rows, lens, strict=True):
                if n != row.frame_len:
                    raise AssertionError(f"remote tier: {row.name.hex()[:16]}… frame is {n} "
                                         f"bytes, meta says {row.frame_len}")
            total = sum(r.frame_len for r in rows)
            if total != self._used:
                raise AssertionError(f"remote tier: used_bytes {self._used} != frames {total}")
            if total > self._budget:
                raise AssertionError(f"remote tier: {total} bytes over the budget {self._budget}")

    def health(self) -> FrameHealth:
        """What health shows for this tier, failed writes included."""
        return FrameHealth(self._used, self._budget, self.corrupt_rows, self.failed_writes,
                           self.last_error)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._own:
            self.client.close()
