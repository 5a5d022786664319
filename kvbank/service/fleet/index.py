"""The fleet's state in Redis: the node registry and the prefix index.

Primitives (:class:`FleetIndex`, one per node, over one redis-py client — a single Redis
or a Redis Cluster, the same code):

- **Registry.** ``<ns>{reg}n:<id>`` is a hash (name, data address, version, layouts,
  rows published); ``<ns>{reg}hb`` a sorted set of node id → last heartbeat (unix s). A
  node is live while its heartbeat is younger than the deadline: liveness is read by
  score (``ZRANGEBYSCORE``), never from keyspace-expiry events (they arrive late or never
  when many keys carry TTLs, see redis-fleet.md 3). Ids are small integers from
  ``INCR <ns>{reg}ids``; ``<ns>{reg}names`` maps a node's name to its id, so a node that
  re-registers after a Redis restart gets a fresh id and republishes.
- **Prefix index.** One string per row, ``<ns>{bNNN}i<row name>``: the packed holder ids
  (``uint16`` little-endian, sorted, no repeats), with a TTL the holders refresh by
  republishing. Publish and withdraw run one script per Redis node (keys in ARGV,
  ``allow-cross-slot-keys``; atomic on that node), so two nodes storing the same prefix
  at once always leave one holder set with both; a withdrawal that empties an entry
  deletes it.
- **Chain lookup** (:meth:`FleetIndex.lookup`, what a match uses): which peers hold how
  much of a chain, from a fixed probe of at most :data:`PROBES` of its rows — the first
  and the last, rows 2^k - 1 (short runs are told apart) and evenly spaced ones — in one
  multi-key read per Redis node. Each probed entry stands for the rows up to the next
  probe. The cost does not grow with the chain (1,000 keys in one ``MGET`` cost ~10 PING
  round trips here; sending 1,000 names to a bisecting script still ~4: the argument
  bytes dominate). Why a probe suffices: a holder's rows of one chain are prefix-closed
  (a chain is stored in order and the prefix-aware LRU evicts it from its tail), so the
  probe finds every holder of the chain's first missing row — all a full-attention
  resume can use — and ranks holders by their extent to within one probe gap; the rows
  fetched are then decided by the peer's own match, which is exact. What it gives up: a
  holder whose rows lie only between probes (a set that is not prefix-closed) is not
  seen, and two holders whose extents end in the same gap rank equal (the fleet then
  fetches from the next holder too, see :meth:`kvbank.service.fleet.fleet.Fleet.complete`).
  Chains shorter than the probe are read whole: exact.
- **Exact lookup** (:meth:`FleetIndex.holders`): per row, in one ``MGET`` on a single
  Redis or one read-only script per master on a cluster (keys grouped by the master
  owning their bucket's slot, keys in ARGV, ``allow-cross-slot-keys``).
- A malformed entry (odd length, too long) or one naming a node that is not live is
  ignored and counted in ``forged``, never fetched from.

Faults: every Redis error becomes :class:`~kvbank.errors.TierUnavailable`; on a
cluster, calls are retried with a deadline (a failover takes ~2x the cluster node
timeout and redis-py does not wait it out) and the retries are counted.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvbank.errors import InvalidInput, TierUnavailable
from kvbank.tiers.redis_client import (
    BUCKETS,
    TRANSIENT,
    RedisClient,
    RedisError,
    bucket_of,
    bucket_tag,
    is_cluster,
    key_slot,
    run_script,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_U16 = [struct.Struct(f"<{n}H") for n in range(9)]  # the common short holder lists
_ENTRY_TAGS = [b"{b%03x}i" % b for b in range(BUCKETS)]  # what entry_key puts before a name
_SLOTS = [key_slot(b"{b%03x}" % b) for b in range(BUCKETS)]  # bucket -> cluster slot

DEFAULT_NAMESPACE = b"kvb:"
DEFAULT_ENTRY_TTL_S = 120.0  # holders refresh well within it (every ttl / 4)
DEFAULT_DEADLINE_S = 10.0  # a node whose heartbeat is older is dead
MAX_HOLDERS = 256  # an entry longer than this many ids is damage, not a fleet
DEFAULT_FAILOVER_S = 10.0  # retry window for cluster calls (>= 2 x node timeout)
_TOPOLOGY_S = 5.0  # the bucket -> master table is rebuilt this often (and on any error)

Holders = tuple[int, ...]  # the node ids an entry lists, sorted
Counts = dict[int, int]  # node id -> rows of the chains it holds

# ARGV[1] holder id (2 bytes), ARGV[2] ttl ms, ARGV[3] '1' publish / '0' withdraw, then
# the index keys (all on the Redis node running it: one call per master on a cluster, so
# each edit is atomic there). Entries are kept sorted, so equal sets are equal strings.
_EDIT = """#!lua flags=allow-cross-slot-keys
local id, ttl, add = ARGV[1], ARGV[2], ARGV[3] == '1'
for i = 4, #ARGV do
  local k = ARGV[i]
  local v = redis.call('GET', k) or ''
  local out, found = {}, false
  for j = 1, #v - 1, 2 do
    local h = string.sub(v, j, j + 1)
    if h == id then found = true
      if add then table.insert(out, h) end
    else table.insert(out, h) end
  end
  if add and not found then table.insert(out, id) end
  table.sort(out)
  if #out == 0 then redis.call('DEL', k)
  else redis.call('SET', k, table.concat(out), 'PX', ttl) end
end
return #ARGV - 3
"""

_READ = """#!lua flags=no-writes,allow-cross-slot-keys
local out = {}
for i, k in ipairs(ARGV) do out[i] = redis.call('GET', k) or false end
return out
"""

@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One registered node as the registry says."""

    node_id: int
    name: str
    address: str  # the data API's base URL
    version: str
    layouts: tuple[str, ...]  # layout ids (hex) the node has registered
    rows: int  # rows it published
    heartbeat_age_s: float


class FleetIndex:
    """Registry and prefix index of one node; see the module docstring."""

    def __init__(self, client: RedisClient | None, *, namespace: bytes = DEFAULT_NAMESPACE,
                 entry_ttl_s: float = DEFAULT_ENTRY_TTL_S, deadline_s: float = DEFAULT_DEADLINE_S,
                 failover_s: float = DEFAULT_FAILOVER_S,
                 clock: Callable[[], float] = time.time,
                 connect: Callable[[], RedisClient] | None = None) -> None:
        if client is None and connect is None:
            raise InvalidInput("client: give a Redis client or a connect function")
        self._client: Any = client  # redis-py's stubs type replies as unions; checked here
        self._connect = connect  # called until it answers: a node may start before Redis
        self.ns = namespace
        self.ttl_ms = int(entry_ttl_s * 1000)
        self.deadline_s = deadline_s
        self.failover_s = failover_s
        self.clock = clock
        self.cluster = is_cluster(client)
        self.forged = 0  # entries ignored: malformed, or naming a node that is not live
        self.retries = 0  # cluster calls retried while a failover settled
        self._masters: tuple[float, list[Any], np.ndarray] | None = None  # see _topology

    @property
    def client(self) -> Any:
        """The client, connecting first if needed (``TierUnavailable`` while no Redis or
        no cluster seed answers)."""
        if self._client is None:
            assert self._connect is not None
            self._client = self._connect()
            self.cluster = is_cluster(self._client)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    # -- plumbing ----------------------------------------------------------------------

    def _reg(self, what: bytes) -> bytes:
        return self.ns + b"{reg}" + what

    def entry_key(self, name: bytes) -> bytes:
        return self.ns + bucket_tag(name) + b"i" + name

    def call(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn``; map Redis errors; on a cluster retry them until ``failover_s``."""
        self.client  # noqa: B018 -- connects first (TierUnavailable while nothing answers)
        deadline = time.monotonic() + (self.failover_s if self.cluster else 0.0)
        while True:
            try:
                return fn()
            except TRANSIENT as exc:
                self._masters = None  # the topology may have changed: read it again
                if time.monotonic() >= deadline:
                    raise TierUnavailable(f"fleet: {what}: {exc}") from exc
                self.retries += 1
                time.sleep(0.1)
            except RedisError as exc:
                self._masters = None
                raise TierUnavailable(f"fleet: {what}: {exc}") from exc

    # -- registry ----------------------------------------------------------------------

    def register(self, name: str, address: str, version: str, layouts: Sequence[str]) -> int:
        """Register (or re-register) this node; its integer id."""
        def run() -> int:
            c = self.client
            got = c.hget(self._reg(b"names"), name)
            if got is None:
                nid = int(c.incr(self._reg(b"ids")))
                if nid >= 1 << 16:
                    raise TierUnavailable(f"fleet: node ids exhausted ({nid})")
                if not c.hsetnx(self._reg(b"names"), name, nid):
                    got = c.hget(self._reg(b"names"), name)  # a twin registered first
            nid = int(got) if got is not None else nid
            c.hset(self._reg(b"n:%d" % nid), mapping={
                "name": name, "address": address, "version": version,
                "layouts": ",".join(layouts), "rows": 0})
            c.zadd(self._reg(b"hb"), {str(nid): self.clock()})
            return nid

        return self.call(run, "registering")

    def heartbeat(self, node_id: int, name: str, rows: int, layouts: Sequence[str]) -> bool:
        """Refresh this node's heartbeat; ``False`` when its registration is gone or names
        another node (Redis restarted empty and ids were handed out again): re-register
        and republish."""
        def run() -> bool:
            key = self._reg(b"n:%d" % node_id)
            got = self.client.hget(key, "name")
            if got is None or bytes(got).decode() != name:
                return False
            self.client.hset(key, mapping={"rows": rows, "layouts": ",".join(layouts)})
            self.client.zadd(self._reg(b"hb"), {str(node_id): self.clock()})
            return True

        return self.call(run, "heartbeat")

    def live(self) -> set[int]:
        """Ids whose heartbeat is within the deadline (dead ones are swept)."""
        def run() -> set[int]:
            now = self.clock()
            hb = self._reg(b"hb")
            self.client.zremrangebyscore(hb, "-inf", now - 3 * self.deadline_s)
            return {int(x) for x in self.client.zrangebyscore(hb, now - self.deadline_s, "+inf")}

        return self.call(run, "reading the registry")

    def nodes(self) -> list[NodeInfo]:
        """Every registered node with a heartbeat in the set (live or not yet swept)."""
        def run() -> list[NodeInfo]:
            now = self.clock()
            beats = self.client.zrange(self._reg(b"hb"), 0, -1, withscores=True)
            out: list[NodeInfo] = []
            for raw_id, ts in beats:
                nid = int(raw_id)
                h = {k.decode(): v.decode() for k, v in
                     self.client.hgetall(self._reg(b"n:%d" % nid)).items()}
                if not h:
                    continue
                out.append(NodeInfo(nid, h.get("name", ""), h.get("address", ""),
                                    h.get("version", ""),
                                    tuple(x for x in h.get("layouts", "").split(",") if x),
                                    int(h.get("rows", "0") or 0), max(0.0, now - float(ts))))
            return out

        return self.call(run, "listing nodes")

    def address(self, node_id: int) -> str | None:
        got = self.call(lambda: self.client.hget(self._reg(b"n:%d" % node_id), "address"),
                        "reading a node")
        return None if got is None else bytes(got).decode()

    # -- index -------------------------------------------------------------------------

    def _topology(self) -> tuple[list[Any], np.ndarray]:
        """The masters and, per bucket, the index of the one owning its slot; read from
        redis-py's slot table at most every few seconds and after any error (1,024
        look-ups cost ~0.3 ms, more than a lookup may)."""
        now = time.monotonic()
        if self._masters is None or now - self._masters[0] > _TOPOLOGY_S:
            nm = self.client.nodes_manager
            nodes: dict[str, int] = {}
            masters: list[Any] = []
            owner = np.empty(BUCKETS, dtype=np.int32)
            for b in range(BUCKETS):
                node = nm.get_node_from_slot(_SLOTS[b])
                if node.name not in nodes:
                    nodes[node.name] = len(masters)
                    masters.append(node)
                owner[b] = nodes[node.name]
            self._masters = (now, masters, owner)
        return self._masters[1], self._masters[2]

    def _by_node(self, names: Sequence[bytes]) -> list[tuple[Any, list[int]]]:
        """Row positions grouped by the Redis node owning their entries (one group on one
        Redis). A bucket is one slot, so the slot -> node table is read once per bucket,
        not once per key (per-key routing in Python is what makes a plain cluster
        pipeline ~10x slower, redis-fleet.md 2)."""
        if not self.cluster:
            return [(None, list(range(len(names))))]
        masters, owner = self._topology()
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(names):
            groups.setdefault(int(owner[bucket_of(n)]), []).append(i)
        return [(masters[m], idx) for m, idx in groups.items()]

    def _script(self, source: str, node: Any, args: list[Any]) -> Any:
        return run_script(self.client, _SHA[source], source, node, args)

    def _edit_all(self, names: Sequence[bytes], node_id: int, add: bool) -> None:
        keys = [self.entry_key(n) for n in names]
        head = [struct.pack("<H", node_id), self.ttl_ms, "1" if add else "0"]

        def run() -> None:
            for node, idx in self._by_node(names):
                self._script(_EDIT, node, [*head, *(keys[i] for i in idx)])

        if keys:
            self.call(run, "publishing" if add else "withdrawing")

    def publish(self, names: Sequence[bytes], node_id: int) -> None:
        """Add ``node_id`` to the holders of each row (and refresh their TTL)."""
        self._edit_all(names, node_id, True)

    def withdraw(self, names: Sequence[bytes], node_id: int) -> None:
        """Remove ``node_id`` from the holders of each row."""
        self._edit_all(names, node_id, False)

    def _raw(self, names: Sequence[bytes], keys: list[bytes]) -> list[Any]:
        if not self.cluster:
            return list(self.client.mget(keys))
        out: list[Any] = [None] * len(keys)
        for node, idx in self._by_node(names):
            got = self._script(_READ, node, [keys[i] for i in idx])
            for i, v in zip(idx, got, strict=True):
                out[i] = v or None
        return out

    def _decode(self, raw: bytes | None) -> Holders | None:
        """An entry's holder ids; ``None`` for a malformed one (counted in ``forged``)."""
        if not raw:
            return ()
        if len(raw) % 2 or len(raw) > 2 * MAX_HOLDERS:
            self.forged += 1
            return None
        return _U16[len(raw) // 2].unpack(raw) if len(raw) <= 16 else \
            struct.unpack(f"<{len(raw) // 2}H", raw)

    def holders(self, names: Sequence[bytes], live: set[int] | None = None,
                ) -> list[Holders]:
        """Per row, exactly, the live nodes holding it (``()`` = none), in one multi-key
        round trip per Redis node. Entries that are malformed or name a node not in
        ``live`` are ignored and counted in ``forged``."""
        if not names:
            return []
        keys = [self.entry_key(n) for n in names]
        values = self.call(lambda: self._raw(names, keys), "looking up rows")
        out: list[Holders] = []
        for v in values:
            ids = self._decode(None if v is None else bytes(v))
            good = tuple(i for i in ids or () if live is None or i in live)
            if ids is not None and len(good) != len(ids):
                self.forged += 1
            out.append(good)
        return out

    # -- the chain lookup --------------------------------------------------------------

    def lookup(self, chains: Sequence[Sequence[bytes]]) -> Counts:
        """Per listed node, about how many rows of the chains it holds, from a probe of
        each chain (see the module docstring) in one multi-key read per Redis node. A
        chain is rows in chain order. Ids are not checked for liveness (the caller knows
        who is live); malformed entries are ignored and counted in ``forged``."""
        probed: list[bytes] = []
        spans: list[int] = []  # rows each probed entry stands for
        for chain in chains:
            at, stand = _plan(len(chain))
            probed += [chain[p] for p in at]
            spans += stand
        if not probed:
            return {}
        ns, tags, crc = self.ns, _ENTRY_TAGS, zlib.crc32  # entry_key, inlined
        keys = [ns + tags[crc(n) % BUCKETS] + n for n in probed]
        values = self.call(lambda: self._raw(probed, keys), "looking up a chain")
        counts: Counts = {}
        decoded: dict[bytes, Holders | None] = {}
        for v, span in zip(values, spans, strict=True):
            if v is None:
                continue
            raw = bytes(v)
            if raw not in decoded:
                decoded[raw] = self._decode(raw)
            for h in decoded[raw] or ():
                counts[h] = counts.get(h, 0) + span
        return counts


PROBES = 32  # rows a chain lookup reads at most: ~2 PING round trips on one Redis


@functools.lru_cache(maxsize=4096)
def _plan(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The probe of an ``n``-row chain and the rows each probed entry stands for."""
    at = probes(n)
    ends = [*at[1:], n] if at else []
    return tuple(at), tuple(b - a for a, b in zip(at, ends, strict=True))


def probes(n: int, k: int = PROBES) -> list[int]:
    """The positions a lookup reads of an ``n``-row chain, sorted: all of them when
    ``n <= k``; else the first and the last, ``2^j - 1`` and evenly spaced ones."""
    if n <= k:
        return list(range(n))
    out = {0, n - 1}
    j = 2
    while j - 1 < n and len(out) < k // 3:
        out.add(j - 1)
        j *= 2
    step = (n - 1) / (k - len(out) + 1)
    out.update(int(step * i) for i in range(1, k - len(out) + 1))
    return sorted(out)


_SHA = {src: hashlib.sha1(src.encode()).hexdigest() for src in (_EDIT, _READ)}
