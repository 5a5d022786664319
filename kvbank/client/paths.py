"""The three ways a :class:`~kvbank.client.client.Client`'s page bodies travel, as handlers
behind one small protocol, :class:`PagePath` (the routing of vLLM's ``OffloadingHandler``):

- :class:`SharedMemory` — the node runs on this host: a put takes a WRITE HOST lease, fills
  the reserved slots in the node's segment in place and commits what arrived whole; a fetch
  takes a READ HOST lease, copies the rows straight into ``out`` and acknowledges them with
  the lease, which the node checks is still live (bytes read after expiry are refused).
- :class:`DataPort` — another host whose node advertises a data port: the same control
  calls with ``via=data`` answer a ticket; the bodies go over the data port
  (:class:`~kvbank.client.dataport.DataLink`), then the same commit or acknowledgement.
- :class:`Stream` — the bodies go over HTTP: a put body sent from the page buffers, a fetch
  stream read with ``readinto`` into each destination row.

Each handler answers the same three requests: ``put`` (a put's pages: their row names),
``fetch`` (a match's rows into the caller's buffers: the acknowledged result) and ``prefix``
(match and lend in one control call, then the copies). None from a handler means "not this
way, this time" (the node can lend no slots now, the data port went away, the segments
cannot be mapped here): the client then puts or fetches over the :class:`Stream`, which
always answers, or matches first for a prefix. The client picks the handler once a call
(``Client._path``).

Lifecycle of a lent transfer: control call (lease, and a ticket on the data port) → the
copies or the transfer → commit or acknowledgement (the node checks the lease outlived
them; a lease is released wherever the transfer fails first).
"""

from __future__ import annotations

import abc
import http.client
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvbank.buffers import OutBuffers, fetched, out_views
from kvbank.client.dataport import DataLink, DataPortUnreachable
from kvbank.client.http import raise_for
from kvbank.client.io import (
    Deadline,
    Slot,
    changed_copies,
    fetch_stream,
    lease_slots,
    merged_copies,
    send_put,
)
from kvbank.client.shm import Borrower
from kvbank.errors import Busy, InvalidInput, KvbankError, LeaseExpired, TierFull, TierUnavailable
from kvbank.results import Fetched, FetchResult, Match
from kvbank.tiers.host import SHM_DIR
from kvbank.wire.framing import PutKind

if TYPE_CHECKING:
    from kvbank.client.client import Client

T = TypeVar("T")
DATA_RETRY_S = 5.0  # a data port given up as unreachable is asked for again after this
Views = dict[int, list[memoryview]]  # group -> a writable view of each destination row
Doc = dict[str, Any]  # a request body or the node's JSON answer


class PagePath(Protocol):
    """One way page bodies travel between a client and its node."""

    def put(self, kind: PutKind, head: bytes, views: list[memoryview],
            deadline: Deadline | None) -> list[bytes] | None:
        """Store the pages ``views`` (put body prefix ``head``); their row names, or None
        where they must go over the stream instead."""
        ...

    def fetch(self, req: Doc, views: Views, out: OutBuffers,
              deadline: Deadline | None) -> FetchResult | None:
        """The rows ``req`` names into ``views`` (of ``out``), acknowledged; None where they
        must stream over HTTP instead (``req`` then names the fetch id to go on with)."""
        ...

    def prefix(self, prompt: Doc, out: OutBuffers | None, max_rows: int | None) -> Fetched | None:
        """Match ``prompt`` and fetch its rows in one control call; None where this path
        needs the match first."""
        ...


class _Lent(abc.ABC):
    """What the two lent paths share: a prefix is one control call that matches and lends
    (``via``), then the lent rows are read as a fetch's are."""

    via: str  # how a fetch body names this path

    def __init__(self, client: Client) -> None:
        self.client = client

    def prefix(self, prompt: Doc, out: OutBuffers | None, max_rows: int | None) -> Fetched | None:
        return self._attempt(lambda: self._prefix(prompt, out, max_rows))

    def _attempt(self, run: Callable[[], T]) -> T | None:
        """``run``; None where the host tier cannot lend every row at once (the stream
        sends them in batches)."""
        try:
            return run()
        except TierFull:
            return None

    def _prefix(self, prompt: Doc, out: OutBuffers | None, max_rows: int | None) -> Fetched:
        """Match and lend in one call, then copy and acknowledge. A bound that needs no
        rows opened no fetch on the node: nothing to copy."""
        c = self.client
        doc = c._call("POST", "/v1/fetch", body={"prompt": prompt, "via": self.via, "max_rows": max_rows})
        m = c._matched(doc["match"])
        return fetched(c.layout(m.layout_id), m, out, lambda bufs: self._read_lent(doc, m, bufs, max_rows))

    def _read_lent(self, doc: Doc, m: Match, bufs: OutBuffers, max_rows: int | None) -> FetchResult:
        """The rows the node lent for ``m`` (its answer ``doc``), into ``bufs``."""
        try:
            views = out_views(self.client.layout(m.layout_id), m.resume.pages, bufs)
        except InvalidInput:
            if doc["lease"] is not None:
                self.client.release(doc["lease"]["id"])
            raise
        return self._answered(doc, m, views, bufs, max_rows)

    @abc.abstractmethod
    def _answered(self, doc: Doc, m: Match, views: Views, bufs: OutBuffers,
                  max_rows: int | None) -> FetchResult:
        """Copy the lent rows into ``views`` by this path, and acknowledge them."""


class SharedMemory(_Lent):
    """Page bodies through the node's host segment, mapped in this process.
    ``required``: ``same_host=True`` (a segment that cannot be mapped is an error, not a
    fallback to the stream)."""

    via = "lease"

    def __init__(self, client: Client, *, required: bool) -> None:
        super().__init__(client)
        self.required = required
        self.segment: str | None = None  # the node's host segment
        self.resident = False  # the node keeps it resident: populate our mapping up front
        self._lock = threading.Lock()
        self._reader: Borrower | None = None
        self._writer: Borrower | None = None

    @staticmethod
    def same_machine(info: Doc) -> bool:
        """Whether the node (its ``/v1/node`` ``host`` document ``info``) runs on this
        host's kernel as this uid: the same boot id and uid."""
        try:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            return False
        return bool(boot) and info.get("boot_id") == boot and info.get("uid") == os.getuid()

    @staticmethod
    def maps_here(info: Doc) -> bool:
        """Whether the node's host segment (its ``/v1/node`` ``host`` document ``info``) can
        be mapped here: the same boot id, uid and shm directory, and the segment's file."""
        try:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            return False
        seg = info.get("segment")
        if not boot or info.get("boot_id") != boot or info.get("uid") != os.getuid() or not seg:
            return False
        if info.get("shm_dir") != str(SHM_DIR):
            return False
        try:  # another mount namespace can share the boot id but not /dev/shm
            if (SHM_DIR / seg).stat().st_size != info.get("segment_bytes"):
                return False
        except OSError:
            return False
        return True

    def learn(self, info: Doc) -> None:
        """The segment's state from the node's ``host`` document ``info``."""
        seg = info.get("segment")
        self.segment = seg if isinstance(seg, str) and seg else None
        self.resident = info.get("resident") is True

    def _attempt(self, run: Callable[[], T]) -> T | None:
        try:
            return run()
        except TierUnavailable:
            if self.required:
                raise
            self.client._off_host()  # segments cannot be mapped here after all
        except TierFull:
            pass
        return None

    def put(self, kind: PutKind, head: bytes, views: list[memoryview],
            deadline: Deadline | None) -> list[bytes] | None:
        c = self.client
        doc = c._call("POST", "/v1/put/lease", content=head, deadline=deadline)
        names = [bytes.fromhex(n) for n in doc["names"]]
        if doc["lease"] is not None:
            filled = self._copy(doc["lease"], views, into_slots=True)
            c._commit_or_release(doc["lease"]["id"], [names[i] for i in filled], deadline)
            return names
        return None if doc["fallback"] else names  # not fallback: every row was stored already

    def fetch(self, req: Doc, views: Views, out: OutBuffers,
              deadline: Deadline | None) -> FetchResult | None:
        def run() -> FetchResult:
            doc = self.client._call("POST", "/v1/fetch", body={**req, "via": "lease"}, deadline=deadline)
            return self.read(doc, views, out)
        return self._attempt(run)

    def _answered(self, doc: Doc, m: Match, views: Views, bufs: OutBuffers,
                  max_rows: int | None) -> FetchResult:
        return self.read(doc, views, bufs)

    def read(self, doc: Doc, views: Views, out: OutBuffers) -> FetchResult:
        """Copy the rows a fetch's lease answer ``doc`` lent and acknowledge them."""
        c = self.client
        fid = doc["fetch_id"]
        lease = doc["lease"]
        if lease is None:
            return c._ack(fid, [], None)
        rows = doc["rows"]
        try:
            bufs = [views[g][slot][:size] for _, g, slot, size in rows]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            c.release(lease["id"])
            raise TierUnavailable(f"node: a fetch answer of an unexpected shape: {exc!r}") from exc
        # each row hashed as it is copied, where the node sent checksums
        digests: dict[int, int] | None = {} if any(v is not None for v in lease.get("sums") or ()) else None
        got = self._copy(lease, bufs, into_slots=False, jobs=lambda ss, sizes: merged_copies(ss, rows, out, sizes),
                         digests=digests)
        bad = set() if digests is None else changed_copies(lease, bufs, digests=digests)
        if bad:  # a miss, never wrong bytes; the node checks these rows and drops them
            got = [i for i in got if i not in bad]
        # the node counts these rows only if the lease outlived the copies
        return c._ack(fid, [rows[i][0] for i in got], lease["id"],
                      changed=[rows[i][0] for i in sorted(bad)])

    def _copy(self, lease: Doc, bufs: Sequence[memoryview], *, into_slots: bool,
              jobs: Callable[[list[tuple[int, Slot]], list[int]], list[Slot]] | None = None,
              digests: dict[int, int] | None = None) -> list[int]:
        """Copy between ``bufs`` and a HOST lease in slots form (``slots_doc``): into its
        slots (a WRITE lease) or out of them, ``jobs`` merging the copies where it can
        (and noting each copy's row size); the entries copied. With ``digests`` (a read)
        each entry's row is hashed as it lands, its checksum put there. The lease is released
        if anything fails first, or if its deadline passed by the end of the copies (the
        node checks again when it is committed or acknowledged)."""
        deadline = time.monotonic() + float(lease["ttl_s"])
        try:
            slots = lease_slots(lease, bufs)
            sizes: list[int] = []
            copies = [job for _, job in slots] if jobs is None else jobs(slots, sizes)
            if digests is not None:
                sums = self.borrower(writable=False).copy_slots_summed(
                    copies, rows=sizes if jobs is not None else None)
                digests.update(zip((i for i, _ in slots), sums, strict=True))
            else:
                self.borrower(writable=into_slots).copy_slots(copies, into_slots=into_slots)
            if time.monotonic() >= deadline:
                raise LeaseExpired(f"lease_id: lease {lease['id']} expired during the copies")
        except BaseException:
            self.client.release(lease["id"])
            raise
        return [i for i, _ in slots]

    def borrower(self, writable: bool) -> Borrower:
        """This process's mapping of the node's segments, for writing or for reading."""
        if self.segment is None and (self._reader if not writable else self._writer) is None:
            self.client._host_info()  # same_host=True skips detection: learn the segment's state
        with self._lock:
            if writable:
                self._writer = self._writer or Borrower(writable=True, populate=self.resident)
                return self._writer
            self._reader = self._reader or Borrower(populate=self.resident)
            return self._reader

    def map(self, wait_s: float | None) -> bool:
        """Map the segment for writing and for reading (see ``Client.map_host``)."""
        if self.segment is None:
            self.client._host_info()
        if self.segment is None:
            return False
        deadline = None if wait_s is None else time.monotonic() + wait_s
        ready = True
        for writable in (True, False):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready = self.borrower(writable).wait_populated(self.segment, left) and ready
            except KvbankError as exc:
                raise TierUnavailable(f"node: cannot map its segment {self.segment}: {exc}") from exc
        return ready

    def close(self) -> None:
        """Unmap the node's segments. Idempotent."""
        with self._lock:
            borrowers = [b for b in (self._reader, self._writer) if b is not None]
            self._reader = self._writer = None
        for b in borrowers:
            b.close()


class DataPort(_Lent):
    """Page bodies over the node's data port (``link``). ``required``: ``data_plane=True``
    (a port that cannot take a transfer is an error, not a fallback to the stream)."""

    via = "data"

    def __init__(self, client: Client, link: DataLink, *, required: bool) -> None:
        super().__init__(client)
        self.link = link
        self.required = required

    def _lost(self, exc: DataPortUnreachable | Busy) -> bool:
        """The data port cannot take this transfer. Unreachable: ``/v1/node`` is read again,
        and True when the node (restarted) now listens on another port: try there. Else
        over HTTP instead, unless the data plane is required; a port still unreachable is
        given up for ``DATA_RETRY_S`` (then asked for again), a full one (``Busy``: every
        data connection in use) is tried again next time."""
        if isinstance(exc, DataPortUnreachable) and self.client._data_moved():
            return True
        if self.required:
            raise exc
        if isinstance(exc, DataPortUnreachable):
            self.link.port = None
            self.client._data_retry_at = time.monotonic() + DATA_RETRY_S
        return False

    def put(self, kind: PutKind, head: bytes, views: list[memoryview],
            deadline: Deadline | None, *, retried: bool = False) -> list[bytes] | None:
        """WRITE lease and ticket, the pages, the commit of what arrived whole; ``deadline``
        bounds the control calls (the pages go at the data port's own pace). A port that
        moved (the node restarted) is tried once more at its new number."""
        c = self.client
        doc = c._call("POST", "/v1/put/lease?via=data", content=head, deadline=deadline)
        names = [bytes.fromhex(n) for n in doc["names"]]
        lease = doc["lease"]
        if lease is None:
            return None if doc["fallback"] else names
        try:
            slots = lease_slots(lease, views)
            self.link.put(doc["ticket"], [buf for _, (_, _, _, buf) in slots])
        except (DataPortUnreachable, Busy) as exc:
            c.release(lease["id"])
            if self._lost(exc) and not retried:
                return self.put(kind, head, views, deadline, retried=True)
            return None
        except BaseException as exc:
            c.release(lease["id"])  # nothing was committed: nothing of this put is visible
            if isinstance(exc, TierUnavailable):
                raise TierUnavailable(f"node: put to {c.url} broke off: {exc}; nothing was stored") from exc
            raise
        c._commit_or_release(lease["id"], [names[i] for i, _ in slots], deadline)
        return names

    def fetch(self, req: Doc, views: Views, out: OutBuffers,
              deadline: Deadline | None) -> FetchResult | None:
        return self._attempt(lambda: self.transfer(req, views, deadline=deadline))

    def _answered(self, doc: Doc, m: Match, views: Views, bufs: OutBuffers,
                  max_rows: int | None) -> FetchResult:
        c = self.client
        req = {"match": c._match_doc(m), "fetch_id": doc["fetch_id"], "max_rows": max_rows}
        result = self.transfer(req, views, doc)
        if result is None:  # the data port went away: stream the rest over HTTP
            result = c.fetch(m, out=bufs, fetch_id=doc["fetch_id"], max_rows=max_rows)
        return result

    def transfer(self, req: Doc, views: Views, first: Doc | None = None, *,
                 deadline: Deadline | None = None) -> FetchResult | None:
        """A fetch over the data port, resumed under its fetch id while it breaks off
        (until ``retry_s``, or ``deadline``); None where the port cannot be reached (``req``
        then names the fetch id, for the HTTP stream to go on with). ``first``: the node's
        answer to the first call, already made."""
        c = self.client
        retry_end = time.monotonic() + c._pool.retry_s
        if deadline is not None:
            retry_end = min(retry_end, deadline.at)
        moved = False
        while True:
            doc, first = first or c._call("POST", "/v1/fetch", body={**req, "via": "data"},
                                          deadline=deadline), None
            fid, lease, rows = doc["fetch_id"], doc["lease"], doc["rows"]
            req["fetch_id"] = fid
            if lease is None:
                return c._ack(fid, [], None)
            try:
                bufs = [views[g][slot][:size] for _, g, slot, size in rows]
                slots = lease_slots(lease, bufs)
                got, err = self.link.fetch(doc["ticket"], [buf[:size] for _, (_, _, size, buf) in slots])
            except (DataPortUnreachable, Busy) as exc:
                c._ack(fid, [], lease["id"])  # releases the lease
                if self._lost(exc) and not moved:
                    moved = True  # the node listens on a new port: resume there, once
                    continue
                return None
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                c.release(lease["id"])
                raise TierUnavailable(f"node: a fetch answer of an unexpected shape: {exc!r}") from exc
            arrived = [i for i, _ in slots[:got]]
            bad = changed_copies(lease, bufs, set(arrived))
            # the node counts these rows only if the lease outlived the transfer; a row
            # whose bytes fail their checksum is a miss, never wrong bytes
            result = c._ack(fid, [rows[i][0] for i in arrived if i not in bad], lease["id"],
                            changed=[rows[i][0] for i in sorted(bad)])
            if err is None or result.complete or time.monotonic() >= retry_end:
                return result
            time.sleep(0.01)


class Stream:
    """Page bodies over HTTP, on the client's pooled connections: the path every put and
    fetch can take, so it never answers None."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def put(self, kind: PutKind, head: bytes, views: list[memoryview],
            deadline: Deadline | None) -> list[bytes]:
        c, pool = self.client, self.client._pool
        path = "/v1/put" if kind is PutKind.PAGES else "/v1/put_state"
        conn = pool.conn(pool.limit(deadline, "the put was not sent"))
        try:
            status, body = send_put(conn, path, head, views, pool.auth)
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            if deadline is not None and deadline.passed():
                raise deadline.busy(f"the put to {c.url} was not answered (pages it stored stay)") from exc
            raise TierUnavailable(f"node: put to {c.url} broke off: {exc}; nothing was stored") from exc
        pool.give_back(conn)
        if status >= 400:
            raise_for(status, body)
        return [bytes.fromhex(n) for n in json.loads(body)["names"]]

    def fetch(self, req: Doc, views: Views, out: OutBuffers,
              deadline: Deadline | None) -> FetchResult:
        """The rows over one fetch stream, acknowledged up to its last whole row; a broken
        stream is resumed under the same fetch id until ``retry_s`` (or ``deadline``)."""
        c, pool = self.client, self.client._pool
        retry_end = time.monotonic() + pool.retry_s
        if deadline is not None:
            retry_end = min(retry_end, deadline.at)
        while True:
            conn = pool.conn(pool.limit(deadline, "the fetch stream did not begin"))
            read = fetch_stream(conn, json.dumps({**req, "via": "stream"}).encode(), views, pool.auth)
            got, fid, err = read.got, read.fetch_id, read.error
            if err is None:
                pool.give_back(conn)
            else:
                conn.close()
            if fid is None:  # refused before any stream began
                if err is not None and isinstance(err, KvbankError):
                    raise err
                if time.monotonic() < retry_end:
                    time.sleep(0.05)
                    continue
                if deadline is not None and deadline.passed():
                    raise deadline.busy("the fetch stream did not begin") from err
                raise TierUnavailable(f"node: fetch from {c.url} failed: {err}") from err
            result = c._ack(fid, got, None, read.stream)
            if err is None or result.complete or time.monotonic() >= retry_end:
                return result
            req["fetch_id"] = fid  # resume from the first undelivered row

    def prefix(self, prompt: Doc, out: OutBuffers | None, max_rows: int | None) -> None:
        """A stream needs the match first: never one call."""
        return None


__all__ = ["DataPort", "PagePath", "SharedMemory", "Stream"]
