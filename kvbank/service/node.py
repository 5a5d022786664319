"""The served node's state: one bank, the bounded pool its blocking calls run on, the
remote fetch ledger, and what identifies the node's host.

Primitives:

- :class:`Node` — ``await node.call(fn, ...)`` runs a blocking bank call on the node's
  thread pool (never on the event loop; at most ``config.threads`` at once).
- :meth:`Node.open_fetch` / :meth:`Node.acknowledge` — a remote fetch's lifecycle. The
  server cannot know which streamed rows reached the client whole, so a fetch is two
  calls: the stream (or, on the same host, a READ lease) and then the client's
  acknowledgement of the rows that arrived whole. Every stream has its own id (in its
  header); its READ leases are held until *that stream's* acknowledgement, because the
  transport may still be sending from their slots after the last ``write()`` returned
  (uvloop keeps a pointer, not a copy). An acknowledgement of stream S counts a row only
  if S sent it under a lease still live at the acknowledgement (the completion check:
  the client has every byte by then) or from a private copy. A resume (the same fetch id)
  opens a new stream and never ends another stream's leases: a stream that is never
  acknowledged (its client died) keeps them until their TTL. A fetch id resumes from the
  first row not recorded.
- :meth:`Node.lend_rows` — a fetch's READ lease; each row it serves counts once in the
  bank's hits, gets and misses (a streamed row copied out privately is counted by
  ``Bank.get_into`` itself), so a node's counters say what its clients received.
- :meth:`Node.match` — ``Bank.match`` completed from the remote tier and the fleet, in one
  pool hop; :meth:`Node.match_lend` — that, then the same-host lease of its rows (a
  fetch by prompt: one control call where match and lease were two).
- :func:`host_identity` — boot id, shared-memory dir, uid: a client whose host answers
  the same (and that can map the node's segment) takes the shared-memory path.

The remote ledger is the service's own :class:`~kvbank.lender.ledger.FetchLedger`, apart
from the bank's, because a streamed fetch never copies into caller buffers in this
process (``Bank.fetch`` does); ``Bank.stats().open_fetches`` counts only in-process ones,
and ``/v1/stats`` reports this ledger's open entries beside it as ``served_fetches``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvbank import fastrows as columns
from kvbank._version import __version__
from kvbank.bank.bank import Bank
from kvbank.errors import Busy, CorruptPage, InvalidInput, KvbankError, TierUnavailable
from kvbank.lender.base import Delivery, HostLocation, Lease, LeaseMode, MemoryKind
from kvbank.lender.ledger import FetchLedger, PlannedRow
from kvbank.results import FetchResult, Match
from kvbank.service.admin.timeseries import Traffic
from kvbank.service.config import ServiceConfig
from kvbank.service.dataplane import DataPlane
from kvbank.tiers.base import HostSlot, TierKind
from kvbank.tiers.host import SHM_DIR
from kvbank.wire.framing import StreamRow

if TYPE_CHECKING:  # the fleet (and the fleet extra's redis) loads only in a node in a fleet
    from kvbank.service.engine_routes import Loads
    from kvbank.service.fleet.fleet import Fleet

T = TypeVar("T")

_name_of = attrgetter("name")
_FETCHES = 4096  # open remote fetches the node remembers
_STREAMS = 64  # unacknowledged streams remembered per fetch (older ones keep to their TTL)


def host_identity() -> dict[str, Any]:
    """What a client compares to decide it runs on this node's host."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return {"boot_id": boot_id, "shm_dir": str(SHM_DIR), "uid": os.getuid()}


def slots_doc(lease: Lease, names: list[bytes], delivery: Delivery, now: float,
              checksums: dict[bytes, int] | None = None, *, named: bool = True) -> dict[str, Any]:
    """A HOST lease in the form a same-host client copies by: its id, the seconds it has
    left at ``now`` (on the bank's clock), the segments, and ``slots`` — for each entry
    ``i`` of ``names`` whose row has ``delivery`` (READY to read, RESERVED to fill)
    ``[i, segment index, offset, size]``. A 64-row lease's full wire form lists every
    row's buffer regions, which neither side needs to copy. With ``checksums`` (a READ
    lease's), ``sums`` holds each slot's checksum (16 hex digits of the xxh3-64, or null
    where none is recorded): the client verifies its copy of each row against it. Not
    ``named`` (a node whose segment's name is unlinked): each segment's name is empty."""
    segments: dict[str, int] = {}
    slots: list[list[int]] = []
    for i, name in enumerate(names):
        try:
            row = lease.row(name)
        except KeyError:
            continue
        loc = row.location
        if row.delivery is delivery and isinstance(loc, HostLocation):
            seg = segments.setdefault(loc.segment, len(segments))
            slots.append([i, seg, loc.offset, loc.size])
    doc = {"id": lease.id, "ttl_s": lease.expires_at - now,
           "segments": list(segments) if named else [""] * len(segments),
           "slots": slots}
    if checksums is not None:
        doc["sums"] = [None if (v := checksums.get(names[s[0]])) is None else f"{v:016x}"
                       for s in slots]
    return doc


@dataclass(frozen=True, slots=True)
class OpenFetch:
    """The rows one fetch call will move, in plan order."""

    fetch_id: str
    rows: list[StreamRow]
    names: list[bytes]  # row name of each entry of ``rows``
    stream: str = ""  # this call's stream id (what its acknowledgement names)


@dataclass(slots=True)
class _Stream:
    # READ leases this stream sent rows under, with those rows. Held until this stream's
    # acknowledgement: the transport may still be sending from the slots after the last
    # write() returned, and only the client having the bytes proves it is done with them.
    held: list[tuple[str, list[bytes]]] = field(default_factory=list)
    copied: set[bytes] = field(default_factory=set)  # sent from private copies


@dataclass(slots=True)
class _Fetch:
    layout_id: bytes
    streams: OrderedDict[str, _Stream] = field(default_factory=OrderedDict)
    # READ leases lent to a same-host client for this fetch -> the rows they hold
    lent: dict[str, set[bytes]] = field(default_factory=dict)


class TenantShares:
    """Bytes each tenant's put bodies in flight hold (their WRITE reservations), against a
    share of the host tier: a tenant that trickles its bodies holds at most ``limit``
    bytes, and the rest stays free for the others (served-node review D9). Over it, a put
    is ``Busy`` before it reserves anything. Without tenant tokens (tenant None) nothing
    is counted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    @contextmanager
    def hold(self, tenant: str | None, nbytes: int) -> Iterator[None]:
        if tenant is None:
            yield
            return
        with self._lock:
            now = self._held.get(tenant, 0)
            if now and now + nbytes > self.limit:
                raise Busy(f"tenant {tenant!r}: its put bodies in flight hold {now} bytes; "
                           f"one more of {nbytes} would pass its share of {self.limit} "
                           "(half the host tier): try again when one has arrived")
            self._held[tenant] = now + nbytes
        try:
            yield
        finally:
            with self._lock:
                left = self._held[tenant] - nbytes
                if left:
                    self._held[tenant] = left
                else:
                    del self._held[tenant]

    def held(self, tenant: str) -> int:
        with self._lock:
            return self._held.get(tenant, 0)


class Node:
    """One bank behind a service. See the module docstring."""

    def __init__(self, bank: Bank, config: ServiceConfig) -> None:
        self.bank = bank
        self.config = config
        self.pool = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="kvbank-bank")
        self.ledger = FetchLedger(config.bank.fetch_ttl_s)
        self._lock = threading.Lock()
        # fetch id -> its layout id and its unacknowledged streams. Bounded: a client that
        # never acknowledges leaves one.
        self._fetches: OrderedDict[str, _Fetch] = OrderedDict()
        self.identity = host_identity()
        self.traffic = Traffic()  # matches by namespace and tokens served, for the status page
        self.instance = secrets.token_hex(8)
        self.put_bodies = TenantShares(max(1, config.bank.host_bytes // 2))
        self.fleet: Fleet | None = None  # set by the server when the node joins a fleet
        self.dataplane: DataPlane | None = None  # set by the server when it serves a data port
        # the local channel's socket (kvbank.service.local), set by the server once it listens
        self.channel_path: str | None = None
        # a paged engine's lent loads (kvbank.service.engine_routes), set where its routes are
        # installed: the HTTP routes and the local channel share their plans
        self.loads: Loads | None = None
        # The host tier's segment, from an ALL lease (which describes the pools, locks
        # nothing): a same-host client checks it can map it before taking that path.
        pools: tuple[object, ...] = ()
        try:
            everything = bank.lend_all(kind=MemoryKind.HOST)
            pools = everything.pools
            bank.release(everything.id)
        except KvbankError:
            pass  # no host tier: clients take the TCP path
        self.segment = next((p for p in pools if isinstance(p, HostSlot)), None)
        # False once the segment's name is unlinked (a node with tenant tokens): nothing
        # can open it by name, and no answer names it (see unlink_segment)
        self.segment_named = self.segment is not None

    def unlink_segment(self) -> None:
        """Unlink the host segment's name from the shm directory (a node with tenant
        tokens, right after it starts): the node keeps its mapping, and the local channel
        the descriptor it opened, which it passes only to connections bound to no tenant;
        no other process can open the segment by its name from now on (admin.md, trust
        model). The memory is freed when the node's mapping and descriptors are closed."""
        seg = self.segment
        if seg is None:
            return
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / seg.segment).unlink()
        self.segment_named = False

    def check_named(self) -> None:
        """TierUnavailable where the host segment has no name a same-host client could map
        (a node with tenant tokens): its page bodies go over the data port or HTTP."""
        if not self.segment_named:
            raise TierUnavailable("host memory: this node has tenant tokens and its segment has no name to "
                                  "map; move page bodies over the data port or HTTP", field="via")

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the node's bounded pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, partial(fn, *args, **kwargs))

    def info(self) -> dict[str, Any]:
        segment = self.segment
        cfg = self.config.bank
        return {
            "version": __version__,
            # this process: a client that sees it change knows the node restarted (and
            # reads the rest of this document again: the data port is a new one)
            "instance": self.instance,
            "host": {**self.identity, "segment": None if segment is None or not self.segment_named
                     else segment.segment,
                     "segment_bytes": None if segment is None else segment.size,
                     # kept resident (reserve_host): a same-host client may build its page
                     # tables for the whole segment up front without claiming new memory
                     "resident": segment is not None and self.bank.reservation is not None,
                     # the local channel: same-host workers' calls, the memory as a descriptor
                     "socket": self.channel_path},
            "data_dir": None if cfg.data_dir is None else str(cfg.data_dir),
            "host_bytes": cfg.host_bytes,
            "disk_bytes": cfg.disk_bytes,
            "max_body_bytes": self.config.max_body_bytes,
            # remote page bodies over a plain socket (kvbank.service.dataplane); None: HTTP only
            "data_port": None if self.dataplane is None else self.dataplane.port,
        }

    # ---- remote fetches --------------------------------------------------------------

    def open_fetch(self, match: Match, fetch_id: str | None, max_rows: int | None) -> OpenFetch:
        """Open (or resume) ``fetch_id`` for ``match``; the rows this call moves."""
        layout = self.bank.layout(match.layout_id)
        if max_rows is not None and (isinstance(max_rows, bool) or max_rows < 0):
            raise InvalidInput(f"max_rows: must be a non-negative integer, got {max_rows!r}")
        if self.bank.audit.holds(match.layout_id):
            max_rows = 0  # quarantined since the match (kvbank.bank.quarantine): nothing served
        self.ledger.expire()
        if fetch_id is not None and fetch_id in self.ledger:
            want = [(g, n) for g, rows in enumerate(match.resume.rows) for n in rows]
            if [(r.group, r.name) for r in self.ledger.plan(fetch_id)] != want:
                raise InvalidInput(f"fetch_id: {fetch_id!r} was opened for another match")
            self.ledger.renew(fetch_id)  # a resumed fetch is activity
        else:
            fetch_id = self.ledger.open(layout, match.prompt_tokens, match.names, match.resume, fetch_id)
            # Rows found under another shard count have no bytes under their own names
            # until built; the stream and the lease read rows by name.
            self.bank.reshard_rows(match)
        plan = self.ledger.plan(fetch_id)
        got = self.ledger.delivered(fetch_id)
        # the rows not yet delivered, in plan order, with their plan positions
        todo: list[tuple[int, PlannedRow]] = (
            list(enumerate(plan)) if not got else [(i, r) for i, r in enumerate(plan) if r.name not in got])
        if max_rows is not None:
            todo = todo[:max_rows]
        sizes = layout.group_page_bytes
        groups = [r.group for _, r in todo]
        rows = columns.build(StreamRow, len(todo), (
            [i for i, _ in todo], groups, [r.out_index for _, r in todo], [sizes[g] for g in groups]))
        stream = secrets.token_hex(8)
        with self._lock:
            state = self._fetches.get(fetch_id)
            if state is None:
                state = self._fetches[fetch_id] = _Fetch(match.layout_id)
            self._fetches.move_to_end(fetch_id)
            while len(self._fetches) > _FETCHES:
                self._fetches.popitem(last=False)
            # An earlier stream of this fetch is left alone: it may still be on the wire.
            state.streams[stream] = _Stream()
            while len(state.streams) > _STREAMS:
                state.streams.popitem(last=False)
        return OpenFetch(fetch_id, rows, [r.name for _, r in todo], stream)

    def match(self, layout_id: bytes, args: dict[str, Any]) -> Match:
        """:meth:`Bank.match` completed from the remote tier and the fleet: the rows Redis
        still holds are recalled, the rows a peer holds are sent for, and the match is
        taken again where either brought rows (``args``: the keyword arguments of
        ``Bank.match``)."""
        bank = self.bank
        m = bank.match(layout_id, **args)
        if bank.fleet.has_remote and any(None in ts for ts in m.tiers) and bank.fleet.recall_remote(m):
            m = bank.match(layout_id, **args)
        if self.fleet is not None and self.fleet.complete(m, args):
            m = bank.match(layout_id, **args)
        self.traffic.match(m)
        return m

    def match_lend(self, layout_id: bytes, args: dict[str, Any], fetch_id: str | None,
                   max_rows: int | None) -> tuple[Match, OpenFetch | None, Lease | None]:
        """A same-host (or data-port) fetch of a prompt in one call: :meth:`match`, then
        :meth:`lend_fetch` of its bound's rows (no fetch is opened when it needs none)."""
        m = self.match(layout_id, args)
        if not any(m.resume.rows):
            return m, None, None
        return (m, *self.lend_fetch(m, fetch_id, max_rows))

    def lend_fetch(self, match: Match, fetch_id: str | None,
                   max_rows: int | None) -> tuple[OpenFetch, Lease | None]:
        """A same-host fetch in one call: :meth:`open_fetch`, then a READ HOST lease on
        its rows (None when there are none), recorded for the acknowledgement."""
        opened = self.open_fetch(match, fetch_id, max_rows)
        if not opened.names:
            return opened, None
        lease = self.lend_rows(opened.names)
        self.lent(opened.fetch_id, lease.id, {r.name for r in lease.rows if r.location is not None})
        return opened, lease

    def lend_rows(self, names: list[bytes]) -> Lease:
        """A READ HOST lease on a fetch's rows, each counted as one read served: a hit in
        the tier it was found in (a disk row staged into host is a disk hit, as
        ``Bank.get_into`` counts it), or a miss when the lease has nothing to read."""
        bank = self.bank
        found = bank.locate(names)
        lease = bank.lend(names, mode=LeaseMode.READ, kind=MemoryKind.HOST)
        served = [None if lease.row(n).location is None else (t or TierKind.HOST)
                  for n, t in zip(names, found, strict=True)]
        bank.fleet.count_served(served)
        return lease

    def _stream(self, fetch_id: str, stream: str) -> _Stream | None:
        with self._lock:
            state = self._fetches.get(fetch_id)
            return None if state is None else state.streams.get(stream)

    def verified(self, fetch_id: str, stream: str, names: list[bytes]) -> None:
        """Rows of ``stream`` sent from private copies: nothing can reclaim them."""
        s = self._stream(fetch_id, stream)
        if s is not None:
            with self._lock:
                s.copied.update(names)

    def lent(self, fetch_id: str, lease_id: str, names: set[bytes]) -> None:
        """A same-host client reads ``names`` in place through ``lease_id``."""
        with self._lock:
            state = self._fetches.get(fetch_id)
            if state is not None:
                state.lent[lease_id] = names

    def hold(self, fetch_id: str, stream: str, lease_id: str, names: list[bytes]) -> None:
        """``names`` were streamed from the slots of READ lease ``lease_id``: keep it
        until ``stream`` is acknowledged (or it expires). A stream the node no longer
        remembers keeps it to its TTL: releasing it now could hand its slots to another
        row while the transport still sends from them."""
        s = self._stream(fetch_id, stream)
        if s is not None:
            with self._lock:
                s.held.append((lease_id, names))

    def _settle(self, held: list[tuple[str, list[bytes]]]) -> set[bytes]:
        """End a stream's held leases; the rows of those still live (the client has
        every byte it acknowledges by now) are the verified ones."""
        ok: set[bytes] = set()
        for lease_id, names in held:
            try:
                self.bank.check_live(lease_id)
                # Verified again after the send: bytes changed while they were on the
                # wire do not count (nor do the rows stay: dropped at the lease's end).
                ok.update(self.unchanged(lease_id, names))
            except KvbankError:
                pass  # expired: what it sent may be another row's bytes by now
            finally:
                self.bank.release(lease_id)
        return ok

    def unchanged(self, lease_id: str, names: Iterable[bytes]) -> list[bytes]:
        """The rows of a READ lease whose host bytes still match their checksums (the
        lender notes the others, and drops their host copies when the lease ends)."""
        out: list[bytes] = []
        for name in names:
            try:
                self.bank.view(lease_id, name).release()  # the view is verified
            except CorruptPage:
                continue
            out.append(name)
        return out

    def acknowledge(self, fetch_id: str, positions: list[int], lease_id: str | None,
                    stream: str | None = None, changed: Sequence[int] = ()) -> FetchResult:
        """Record the acknowledged rows that were verified; the fetch's result so far.

        With ``stream`` the rows came in that stream: they count if it sent them under a
        lease still live now, or from private copies; its leases are released. With
        ``lease_id`` (the same-host path) the rows were read in place by the client: they
        count only if that lease is still live now (the completion check), and the lease
        is released either way; ``changed`` names lent rows whose copies failed the
        client's checksum check: the node checks them itself, and drops the host copies
        that fail (a client cannot make the node drop a row whose bytes are right).
        With neither, no row counts.
        """
        plan = self.ledger.plan(fetch_id)
        with self._lock:
            state = self._fetches.get(fetch_id)
        if state is None:
            raise InvalidInput(f"fetch_id: {fetch_id} was not opened on this node")
        if positions and not (set(map(type, positions)) == {int} and min(positions) >= 0
                              and max(positions) < len(plan)):
            for i, p in enumerate(positions):
                if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < len(plan):
                    raise InvalidInput(f"rows[{i}]: not a row position of fetch {fetch_id} (0..{len(plan) - 1})")
        acked = list(map(_name_of, map(plan.__getitem__, positions)))
        if lease_id is not None:
            with self._lock:
                ready = state.lent.pop(lease_id, None)
            if ready is None:
                raise InvalidInput(f"lease_id: {lease_id} was not lent for fetch {fetch_id}")
            try:
                suspect = [plan[p].name for p in changed
                           if isinstance(p, int) and 0 <= p < len(plan)]
                self.unchanged(lease_id, [n for n in suspect if n in ready])
                self.bank.check_live(lease_id)
                good = [n for n in acked if n in ready]
            finally:
                self.bank.release(lease_id)
        elif stream is not None:
            with self._lock:
                s = state.streams.pop(stream, None)
            if s is None:
                raise InvalidInput(f"stream: {stream!r} is not an open stream of fetch {fetch_id}")
            ok = self._settle(s.held) | s.copied
            good = [n for n in acked if n in ok]
        elif acked:
            raise InvalidInput("stream: an acknowledgement of rows names the stream (or lease) they came in")
        else:
            good = []
        done = self.ledger.delivered(fetch_id)
        fresh = [n for n in dict.fromkeys(good) if n not in done]
        self.ledger.record(fetch_id, fresh)
        layout = self.bank.layout(state.layout_id)
        sizes = layout.group_page_bytes
        if len(set(sizes)) == 1:  # one page size for every group: no per-row lookup
            moved = len(fresh) * sizes[0]
        else:
            group = {r.name: r.group for r in plan}
            moved = sum(sizes[group[n]] for n in fresh)
        return self._result(fetch_id, len(layout.groups), moved)

    def _result(self, fetch_id: str, n_groups: int, moved: int) -> FetchResult:
        plan = self.ledger.plan(fetch_id)
        got = self.ledger.delivered(fetch_id)
        bound = self.ledger.bound(fetch_id)
        arrived: list[list[int]] = [[] for _ in range(n_groups)]
        lost: list[list[int]] = [[] for _ in range(n_groups)]
        for r in plan:  # one pass, in plan order (group by group, chain order within one)
            (arrived if r.name in got else lost)[r.group].append(r.index)
        delivered = tuple(map(tuple, arrived))
        missing = tuple(map(tuple, lost))
        complete = not any(missing)
        if complete:
            self.traffic.fetched(bound.tokens)
            self.ledger.close(fetch_id)
            with self._lock:
                self._fetches.pop(fetch_id, None)
        return FetchResult(fetch_id, delivered, missing, bound, moved, complete)

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
