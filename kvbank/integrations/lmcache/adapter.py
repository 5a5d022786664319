"""kvbank as an LMCache L2 adapter (LMCache 0.5.6, ``L2AdapterInterface``, loaded as a plugin).

Start LMCache's server with::

    lmcache server --l1-size-gb 4 --eviction-policy LRU --l2-adapter '{"type": "plugin",
      "module_path": "kvbank.integrations.lmcache", "class_name": "KvbankL2Adapter",
      "adapter_params": {"url": "http://127.0.0.1:7410"}}'

``adapter_params`` (all optional; unknown keys are refused):

| key | default | meaning |
| --- | --- | --- |
| ``url`` (or ``kvbank_url``) | ``http://127.0.0.1:7410`` | the ``kvbank serve`` node of this host |
| ``tenant`` | ``""`` | goes into the scope: tenants never share objects |
| ``token`` | none | a tenant token, when the node requires one |
| ``timeout_s`` | 30 | one kvbank call's socket timeout (a task waits, LMCache does not) |
| ``retry_s`` | 0.5 | how long idempotent calls are retried |
| ``breaker_s`` | 10 | after the node was unreachable, every task fails (misses) this long |
| ``lock_ttl_s`` | 300 | the READ lease a lookup takes (LMCache's own read lock is 300 s) |
| ``workers`` | 4 | the adapter's threads: tasks of different kinds run at once |

Lifecycle (LMCache's store and prefetch controllers call from their threads; every call
returns at once and the work runs on the adapter's own threads, each with its own
:class:`~kvbank.Client`; completion is signalled on the kind's event fd):

- ``submit_store_task`` — the objects' bytes are put as rows (same host: copied straight
  into the node's shared memory under a WRITE lease, then committed), so LMCache may
  reuse the buffers once the store event fires. Rows already stored are skipped.
- ``submit_lookup_and_lock_task`` — one READ lease on the keys' rows: the bit of every row
  present is set, and the node keeps those rows in place (never evicted, moved or
  overwritten) until ``submit_unlock`` or the lease's ``lock_ttl_s``.
- ``submit_load_task`` — each row is copied from the node's memory into LMCache's buffer
  under the lookup's lease (a key with none gets a lease of its own for the copy), and
  counts only if the lease was live when the copy ended. Off the node's host, rows are
  fetched over the node's data path instead.
- ``submit_unlock`` — the lease ends once every key it locked is unlocked; a release the
  node cannot take now is retried, and the lease's TTL ends it in any case.

Which row an ``ObjectKey`` is: :mod:`.layout` (the object's shapes and dtypes are part of
its name, so another layout is a miss). Every kvbank error, a dead node or a timeout
becomes a failed store task or a zero bit (:class:`~kvbank.integrations.guard.Guard`),
never an exception in LMCache.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from kvbank import Client, PageLayout, Scope
from kvbank.client.shm import Borrower
from kvbank.errors import InvalidInput, KvbankError, LeaseExpired, TierUnavailable
from kvbank.integrations.guard import Guard, registered, safe
from kvbank.integrations.lmcache.layout import ObjectShape, object_layout, scope_of
from kvbank.integrations.settings import (
    CONNECTION_KEYS,
    DEFAULT_BREAKER_S,
    DEFAULT_RETRY_S,
    DEFAULT_URL,
    Reader,
)
from kvbank.lender.base import HostLocation, Lease, LeaseMode, MemoryKind

__all__ = ["KvbankL2Adapter", "KvbankL2AdapterConfig"]

logger = logging.getLogger(__name__)

# Every call runs on the adapter's threads, never on LMCache's: a slow node delays a task,
# not LMCache. A store of 64 chunks is 150 MB (the node checksums it as it commits).
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_LOCK_TTL_S = 300.0  # LMCache's own L1 read lock; the node's max_lease_ttl_s is 600
DEFAULT_WORKERS = 4
UNLOCK_TRIES = 5  # a release the node cannot take now: then the lease's TTL ends it
PRUNE_S = 60.0  # how often the lock table drops locks whose lease has ended


class KvbankL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc,unused-ignore]
    """``adapter_params``, validated (see the module docstring)."""

    KNOWN = (*CONNECTION_KEYS, "lock_ttl_s", "workers")

    def __init__(self, url: str = DEFAULT_URL, tenant: str = "", token: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, retry_s: float = DEFAULT_RETRY_S,
                 breaker_s: float = DEFAULT_BREAKER_S, lock_ttl_s: float = DEFAULT_LOCK_TTL_S,
                 workers: int = DEFAULT_WORKERS) -> None:
        self.url, self.tenant, self.token = url, tenant, token
        self.timeout_s, self.retry_s, self.breaker_s = timeout_s, retry_s, breaker_s
        self.lock_ttl_s, self.workers = lock_ttl_s, workers

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KvbankL2AdapterConfig:
        r = Reader(d, "adapter_params")
        r.refuse_unknown(cls.KNOWN)
        return cls(url=r.url(), tenant=r.text("tenant", ""), token=r.token(),
                   timeout_s=r.seconds("timeout_s", DEFAULT_TIMEOUT_S),
                   retry_s=r.seconds("retry_s", DEFAULT_RETRY_S),
                   breaker_s=r.seconds("breaker_s", DEFAULT_BREAKER_S),
                   lock_ttl_s=r.seconds("lock_ttl_s", DEFAULT_LOCK_TTL_S),
                   workers=r.count("workers", DEFAULT_WORKERS))

    @classmethod
    def help(cls) -> str:
        return __doc__ or ""


@dataclass(frozen=True, slots=True)
class _Row:
    """Where an ``ObjectKey`` of a given shape lives in kvbank."""

    layout: PageLayout
    scope: Scope
    name: bytes


@dataclass
class _Lock:
    """A lookup's READ lease and the names it still holds for LMCache."""

    lease: Lease
    until: float  # time.monotonic() past which the node has ended it (its TTL)
    left: dict[bytes, int] = field(default_factory=dict)  # name -> keys not yet unlocked


class KvbankL2Adapter(L2AdapterInterface):  # type: ignore[misc,unused-ignore]
    """See the module docstring."""

    config_class_name = "KvbankL2AdapterConfig"

    def __init__(self, config: KvbankL2AdapterConfig | Mapping[str, Any] | None = None,
                 l1_memory_desc: object | None = None, **_: object) -> None:
        super().__init__(max_capacity_bytes=0)  # kvbank's node keeps its own budgets
        cfg = config if isinstance(config, KvbankL2AdapterConfig) else \
            KvbankL2AdapterConfig.from_dict(config or {})
        self.cfg = cfg
        self._guard = Guard(cfg.breaker_s)
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stores: dict[int, L2StoreResult] = {}
        self._lookups: dict[int, Bitmap] = {}
        self._loads: dict[int, Bitmap] = {}
        self._locks: dict[Any, deque[tuple[_Lock, bytes]]] = defaultdict(deque)  # key -> (lock, row)
        self._pruned = time.monotonic()
        self._shapes: dict[tuple[str, int], ObjectShape] = {}  # (model, group) -> last seen
        self._local = threading.local()
        self._clients: list[Client] = []
        self._known: set[tuple[int, bytes, bytes]] = set()  # (client, layout id, scope digest)
        self._borrower = Borrower()  # the node's segments, mapped once (see _copy_rows)
        self._map_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(cfg.workers, thread_name_prefix="kvbank-lmcache")
        self._closed = False

    # ---- event fds -------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_efd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_efd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_efd.fileno())

    # ---- tasks -----------------------------------------------------------------------

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        task = next(self._ids)
        self._submit(lambda: self._store(task, list(keys), list(objects)))
        return task

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Mapping[int, Any]) -> int:
        task = next(self._ids)
        descs = dict(group_layout_descs or {})
        self._submit(lambda: self._lookup(task, list(keys), descs))
        return task

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._lookups.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        ended = self._unlock(list(keys))
        if ended:
            self._submit(lambda: self._release(ended))

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        task = next(self._ids)
        self._submit(lambda: self._load(task, list(keys), list(objects)))
        return task

    def query_load_result(self, task_id: int) -> Bitmap | None:
        with self._lock:
            return self._loads.pop(task_id, None)

    def report_status(self) -> dict[str, Any]:
        with self._lock:
            held = sum(len(q) for q in self._locks.values())
        return {"is_healthy": not self._guard.down, "type": "KvbankL2Adapter", "url": self.cfg.url,
                "locked_keys": held}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            leases = {id(lk): lk.lease for q in self._locks.values() for lk, _ in q}
            self._locks.clear()
        if leases:
            self._release(list(leases.values()), tries=1)
        for c in self._clients:
            safe("close", c.close, None)
        with self._map_lock:
            self._borrower.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()

    # ---- the work, on the adapter's threads ------------------------------------------

    def _submit(self, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException:  # a bug here must still answer LMCache (fn signals itself)
                logger.exception("kvbank: an LMCache task failed")
        self._pool.submit(run)

    def _client(self) -> Client:
        c: Client | None = getattr(self._local, "client", None)
        if c is None:
            c = Client(self.cfg.url, timeout_s=self.cfg.timeout_s or 5.0, retry_s=self.cfg.retry_s,
                       token=self.cfg.token)
            self._local.client = c
            with self._lock:
                self._clients.append(c)
        return c

    def _ensure(self, client: Client, layout: PageLayout, scope: Scope) -> None:
        """The layout and scope known to the node (once a client; again after a restart)."""
        mark = (id(client), layout.layout_id, scope.digest)
        if mark in self._known:
            return
        lid = client.register(layout)
        client.register_scope(lid, scope)
        self._known.add(mark)

    def _forget(self, client: Client) -> None:
        self._known = {m for m in self._known if m[0] != id(client)}

    @staticmethod
    def _shape_of(obj: Any) -> ObjectShape:
        meta = obj.metadata
        shapes = meta.shapes if meta.shapes else [meta.shape]
        dtypes = meta.dtypes if meta.dtypes else [meta.dtype]
        shape = ObjectShape.of([tuple(s) for s in shapes], list(dtypes))
        size = int(obj.get_size())
        if shape.nbytes != size:  # a narrowed (binary) object: its bytes as they are
            shape = ObjectShape.of([(size,)], ["uint8"])
        return shape

    def _rows(self, keys: Sequence[Any], shapes: Sequence[ObjectShape | None]) -> list[_Row | None]:
        """Each key's row (None where its shape is unknown), names computed in batches."""
        out: list[_Row | None] = [None] * len(keys)
        # keyed by id, shard and scope: hashing a PageLayout itself costs ~60 µs
        batches: dict[tuple[bytes, int, Scope], tuple[PageLayout, list[int]]] = {}
        for i, (key, shape) in enumerate(zip(keys, shapes, strict=True)):
            if shape is None:
                continue
            layout = object_layout(key.model_name, key.object_group_id, key.kv_rank, shape)
            scope = scope_of(self.cfg.tenant, key.cache_salt)
            batches.setdefault((layout.layout_id, layout.shard_index, scope), (layout, []))[1].append(i)
        client = self._client()
        for (_, _, scope), (layout, idx) in batches.items():
            self._ensure(client, layout, scope)
            names = client.row_names(layout.layout_id, keys=[bytes(keys[i].chunk_hash) for i in idx],
                                     group=0, scope=scope, shard=layout.shard_index)
            for i, name in zip(idx, names, strict=True):
                out[i] = _Row(layout, scope, name)
        return out

    def _guarded(self, what: str, fn: Callable[[], Any], fallback: Any) -> Any:
        client = self._client()

        def attempt() -> Any:
            try:
                return fn()
            except TierUnavailable:
                raise  # the node is gone: no second wait on it
            except KvbankError:
                # a node restarted on an empty data dir forgets layouts and scopes: once more
                self._forget(client)
                if self._guard.down:
                    raise
                return fn()
        return self._guard.call(what, attempt, fallback)

    # ---- the same work, synchronous: what each task runs (and the in-process plugin calls)

    def store_objects(self, keys: list[Any], objects: list[Any]) -> int:
        """Put the objects; the bytes stored, or -1 where the store failed."""
        return int(self._guarded("an LMCache store", lambda: self._put(keys, objects), -1))

    def lock_objects(self, keys: list[Any], descs: Mapping[int, Any]) -> list[int]:
        """Lock the keys' rows under one READ lease; the indices present (and locked)."""
        got: list[int] = self._guarded("an LMCache lookup", lambda: self._lend(keys, dict(descs)), [])
        return got

    def unlock_objects(self, keys: list[Any]) -> None:
        """Drop one lock a key, releasing the leases no key holds any more, now."""
        ended = self._unlock(keys)
        if ended:
            self._release(ended)

    def load_objects(self, keys: list[Any], objects: list[Any]) -> list[int]:
        """Copy the keys' rows into the objects; the indices loaded."""
        got: list[int] = self._guarded("an LMCache load", lambda: self._copy_in(keys, objects), [])
        return got

    def _store(self, task: int, keys: list[Any], objects: list[Any]) -> None:
        stored = 0
        try:
            stored = self.store_objects(keys, objects)
        finally:
            with self._lock:
                self._stores[task] = L2StoreResult(stored >= 0, max(stored, 0))
            self._store_efd.notify()

    def _put(self, keys: list[Any], objects: list[Any]) -> int:
        if len(keys) != len(objects):
            raise InvalidInput(f"objects: {len(objects)} for {len(keys)} keys")
        shapes = [self._shape_of(o) for o in objects]
        for key, shape in zip(keys, shapes, strict=True):
            self._shapes[(key.model_name, key.object_group_id)] = shape
        rows = self._rows(keys, shapes)
        client = self._client()
        batches: dict[tuple[bytes, int, Scope], tuple[PageLayout, list[int]]] = {}
        for i, row in enumerate(rows):
            assert row is not None  # every shape is known on a store
            batches.setdefault((row.layout.layout_id, row.layout.shard_index, row.scope),
                               (row.layout, []))[1].append(i)
        total = 0
        for (_, _, scope), (layout, idx) in batches.items():
            size = layout.group_page_bytes[0]
            pages = [_page(objects[i], size) for i in idx]
            registered(client, layout, partial(
                client.put, layout.layout_id, keys=[bytes(keys[i].chunk_hash) for i in idx], group=0,
                pages=pages, scope=scope, shard=layout.shard_index))
            total += sum(int(objects[i].get_size()) for i in idx)
        self._notify_keys_stored(keys, [int(o.get_size()) for o in objects])
        return total

    def _lookup(self, task: int, keys: list[Any], descs: dict[int, Any]) -> None:
        bits = Bitmap(len(keys))
        try:
            for i in self.lock_objects(keys, descs):
                bits.set(i)
        finally:
            with self._lock:
                self._lookups[task] = bits
            self._lookup_efd.notify()

    def _desc_shape(self, key: Any, descs: dict[int, Any]) -> ObjectShape | None:
        desc = descs.get(key.object_group_id)
        if desc is not None:
            return ObjectShape.of([tuple(s) for s in desc.shapes], list(desc.dtypes))
        # LMCache's server always names the layout; its checks do not: the last one seen
        return self._shapes.get((key.model_name, key.object_group_id))

    def _lend(self, keys: list[Any], descs: dict[int, Any]) -> list[int]:
        """A READ lease on the keys' rows; the indices present (now locked for LMCache)."""
        rows = self._rows(keys, [self._desc_shape(k, descs) for k in keys])
        names = list(dict.fromkeys(r.name for r in rows if r is not None))
        if not names:
            return []
        lease = self._client().lend(names, mode=LeaseMode.READ, kind=MemoryKind.HOST,
                                    ttl_s=self.cfg.lock_ttl_s)
        present = {r.name for r in lease.rows if r.present}
        hit = [i for i, r in enumerate(rows) if r is not None and r.name in present]
        lk = _Lock(lease, time.monotonic() + self.cfg.lock_ttl_s)
        with self._lock:
            self._prune_locked()
            for i in hit:
                name = rows[i].name  # type: ignore[union-attr]
                lk.left[name] = lk.left.get(name, 0) + 1
                self._locks[keys[i]].append((lk, name))
        if not hit:
            self._submit(lambda: self._release([lease]))
        return hit

    def _prune_locked(self) -> None:
        """Forget locks whose lease ended at its TTL (LMCache never unlocked them), at most
        once every ``PRUNE_S``: the table would otherwise only grow."""
        now = time.monotonic()
        if now - self._pruned < PRUNE_S:
            return
        self._pruned = now
        for key in list(self._locks):
            q = deque((lk, name) for lk, name in self._locks[key] if lk.until > now)
            if q:
                self._locks[key] = q
            else:
                del self._locks[key]

    def _unlock(self, keys: list[Any]) -> list[Lease]:
        """Drop one lock per key; the leases no key holds any more (to release)."""
        ended: list[Lease] = []
        with self._lock:
            for key in keys:
                q = self._locks.get(key)
                if not q:
                    continue  # never locked (a miss), or already unlocked
                lk, name = q.popleft()
                if not q:
                    del self._locks[key]
                lk.left[name] -= 1
                if lk.left[name] == 0:
                    del lk.left[name]
                if not lk.left:
                    ended.append(lk.lease)
        return ended

    def _release(self, leases: list[Lease], tries: int = UNLOCK_TRIES) -> None:
        """End leases; retried (LMCache never retries an unlock), then left to their TTL."""
        client = self._client()
        for lease in leases:
            for attempt in range(tries):
                try:
                    client.release(lease.id)
                    break
                except KvbankError as exc:
                    if attempt == tries - 1:
                        logger.warning("kvbank: could not release lease %s (it ends at its ttl): %s",
                                       lease.id, exc)
                    else:
                        time.sleep(min(0.05 * 2**attempt, 1.0))

    def _load(self, task: int, keys: list[Any], objects: list[Any]) -> None:
        bits = Bitmap(len(keys))
        try:
            for i in self.load_objects(keys, objects):
                bits.set(i)
        finally:
            with self._lock:
                self._loads[task] = bits
            self._load_efd.notify()

    def _copy_in(self, keys: list[Any], objects: list[Any]) -> list[int]:
        """Copy each key's row into its object; the indices loaded."""
        if len(keys) != len(objects):
            raise InvalidInput(f"objects: {len(objects)} for {len(keys)} keys")
        rows = self._rows(keys, [self._shape_of(o) for o in objects])
        client = self._client()
        if not client.same_host:
            return self._fetch_in(keys, objects, rows)
        held: dict[str, tuple[Lease, list[int]]] = {}
        loose: list[int] = []
        with self._lock:
            for i, row in enumerate(rows):
                assert row is not None
                q = self._locks.get(keys[i])
                if q and q[0][1] == row.name:
                    lease = q[0][0].lease
                    held.setdefault(lease.id, (lease, []))[1].append(i)
                else:
                    loose.append(i)
        done: list[int] = []
        for lease, idx in held.values():
            done += self._copy_lent(lease, idx, rows, objects)
        if loose:  # loaded without a lookup's lock (or after its unlock): a lease of its own
            names = list(dict.fromkeys(rows[i].name for i in loose))  # type: ignore[union-attr]
            lease = client.lend(names, mode=LeaseMode.READ, kind=MemoryKind.HOST)
            try:
                done += self._copy_lent(lease, loose, rows, objects)
            finally:
                safe("release", lambda: client.release(lease.id), False)
        accessed = [keys[i] for i in done]
        if accessed:
            self._notify_keys_accessed(accessed)
        return sorted(done)

    def _copy_lent(self, lease: Lease, idx: list[int], rows: list[_Row | None],
                   objects: list[Any]) -> list[int]:
        """Rows of a live HOST lease into their objects (the lease checked after the copies)."""
        where = {r.name: r for r in lease.rows}
        pairs: list[tuple[bytes, memoryview]] = []
        staged: list[tuple[int, bytearray]] = []
        got: list[int] = []
        name_at: dict[int, bytes] = {}
        for i in idx:
            row = rows[i]
            assert row is not None
            lr = where.get(row.name)
            if lr is None or not lr.present or not isinstance(lr.location, HostLocation):
                continue
            dst = objects[i].byte_array
            if lr.location.size != row.layout.group_page_bytes[0] or len(dst) > lr.location.size:
                continue
            if len(dst) == lr.location.size:
                pairs.append((row.name, memoryview(dst).cast("B")))
            else:  # the page is padded past the object's bytes
                buf = bytearray(lr.location.size)
                staged.append((i, buf))
                pairs.append((row.name, memoryview(buf)))
            got.append(i)
            name_at[i] = row.name
        if not pairs:
            return []
        try:
            changed = self._copy_rows(lease, pairs)
        except LeaseExpired:
            logger.warning("kvbank: lease %s ended before its rows were copied: %d misses",
                           lease.id, len(pairs))
            return []
        if changed:  # a miss, never wrong bytes into LMCache
            logger.warning("kvbank: %d of %d rows did not match their checksums (changed in the "
                           "node's memory since commit): misses", len(changed), len(pairs))
            got = [i for i in got if name_at[i] not in changed]
            staged = [(i, buf) for i, buf in staged if name_at[i] not in changed]
        for i, buf in staged:
            dst = memoryview(objects[i].byte_array).cast("B")
            dst[:] = memoryview(buf)[: len(dst)]
        return got

    def _copy_rows(self, lease: Lease, pairs: list[tuple[bytes, memoryview]]) -> set[bytes]:
        """Copy a live READ lease's rows into their buffers, then check the lease outlived
        the copies; the names whose copy does not hash to the checksum the node sent with
        the lease (``Lease.sums``: bytes changed in the node's memory since commit), which
        must not be loaded. One mapping of the node's segments for the adapter (mapped
        under a lock, then only read). The borrower copies on its two lanes: a verified
        batch hashed as it is copied, a lease without sums (a node before them) copied
        only."""
        slots: list[tuple[str, int, int, memoryview]] = []
        with self._map_lock:
            for name, buf in pairs:
                loc = lease.row(name).location
                if not isinstance(loc, HostLocation):
                    raise InvalidInput(f"lease: row {name.hex()[:16]}… has no host memory")
                seg = self._borrower.segment(loc.segment)
                if loc.offset < 0 or loc.offset + loc.size > len(seg) or len(buf) < loc.size:
                    raise InvalidInput(f"lease: row at {loc.offset}+{loc.size} does not fit segment "
                                       f"{loc.segment} ({len(seg)} bytes) or its buffer ({len(buf)})")
                slots.append((loc.segment, loc.offset, loc.size, buf))
        want = lease.checksums()
        changed: set[bytes] = set()
        if want:
            got = self._borrower.copy_slots_summed(slots)
            changed = {name for (name, _), g in zip(pairs, got, strict=True) if want.get(name, g) != g}
        else:
            self._borrower.copy_slots(slots, into_slots=False)
        self._borrower.check(lease)  # bytes copied after the lease ended are not used
        return changed

    def _fetch_in(self, keys: list[Any], objects: list[Any], rows: list[_Row | None]) -> list[int]:
        """Off the node's host: each row fetched by its key (the node's data path)."""
        client = self._client()
        done: list[int] = []
        for i, row in enumerate(rows):
            assert row is not None
            size = row.layout.group_page_bytes[0]
            out = np.empty((1, size), dtype=np.uint8)
            got = client.fetch_prefix(row.layout.layout_id, keys=[bytes(keys[i].chunk_hash)],
                                      prompt_tokens=row.layout.tokens_per_page + 1, scope=row.scope,
                                      shard=row.layout.shard_index, out={0: [memoryview(out[0])]})
            if got.result is None or not got.result.delivered or not got.result.delivered[0]:
                continue
            dst = memoryview(objects[i].byte_array).cast("B")
            dst[:] = memoryview(out[0])[: len(dst)]
            done.append(i)
        return done


def _page(obj: Any, size: int) -> memoryview:
    """The object's bytes as one page of ``size`` (zero-padded where the page is longer)."""
    src = memoryview(obj.byte_array).cast("B")
    if len(src) == size:
        return src
    if len(src) > size:
        raise InvalidInput(f"object: {len(src)} bytes, more than its page's {size}")
    buf = bytearray(size)
    buf[: len(src)] = src
    return memoryview(buf)
