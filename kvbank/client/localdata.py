"""The local channel's calls that move page bytes through the node's passed memory
(mixed into :class:`~kvbank.client.local.LocalLink`, which holds the connections).

- :meth:`fetch_prefix` — one call matches and lends (READ lease) the rows of the bound;
  the copies go straight into the caller's ``out`` buffers, rows that lie back to back
  in the segment and in one destination tensor merged into one copy (planned on arrays,
  not row by row); where the node sent checksums, each row is hashed as it is copied
  (:meth:`Borrower.copy_slots_summed`) and verified against the checksum the node sent
  for it (xxh3-64, docs/reliability.md "Checksums in memory"): one that fails is a miss,
  left out of the acknowledgement and named in it as changed, so the node checks that
  row itself and drops its host copy. The acknowledgement names the rows copied, and the
  node counts them only if the lease outlived the copies (bytes read after expiry are
  never counted). It is one-way where the node takes that (its HELLO says so): a frame
  sent, no answer awaited, so a fetch is one round trip; the result is built here from
  what was copied and verified before the lease's deadline (the client's, from the TTL
  the node sent: never later than the node's), as the node builds it. The node applies
  the acknowledgement before any later call of this connection; ``LocalLink.settle`` makes a
  thread's pending one-way acknowledgements applied before it calls the node another
  way (the client calls it before each HTTP call, so counters it reads include them).
- :meth:`fetch` — the same for a Match the caller holds.
- :meth:`put` — one call reserves (WRITE lease) the rows not yet stored, the pages are
  copied into their slots, one call commits those that arrived whole.

Lifecycle of a fetch: one call lends (the node's match, plan and READ lease, in
columns), the copies run from the segment into the caller's buffers (hashed as they
land where the node sent checksums), then the acknowledgement names what arrived whole
before the lease's deadline. A put: one call reserves, the copies fill the slots, one
call commits what arrived.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvbank.buffers import OutBuffers, out_views
from kvbank.errors import InvalidInput, KvbankError, LeaseExpired, TierUnavailable
from kvbank.lender.base import CommitResult
from kvbank.lender.resume import Flags, resume_bound
from kvbank.results import FetchResult, Match
from kvbank.wire import local as fr

if TYPE_CHECKING:
    from kvbank.client.io import Deadline
    from kvbank.client.shm import Borrower

SEGMENT = "local:host"  # the name the link's borrower knows the passed segment by
_EMPTY = np.zeros(0, dtype="<i8")


class DataCalls:
    """Fetches and puts over a link (see the module docstring)."""

    if TYPE_CHECKING:  # the link's (LocalLink): its connections and control calls
        oneway: bool
        commit_sums: bool

        def call(self, op: fr.Op, cols: Sequence[fr.Column],
                 deadline: Deadline | None = None) -> list[fr.Column]: ...

        def send_oneway(self, op: fr.Op, cols: Sequence[fr.Column]) -> None: ...

        def borrower(self) -> Borrower: ...

        def release(self, lease_id: str) -> bool: ...

        def commit(self, lease_id: str, arrived: Sequence[bytes], deadline: Deadline | None = None,
                   sums: Sequence[int] | None = None) -> CommitResult: ...

    def fetch_prefix(self, prompt: list[fr.Column], max_rows: int | None,
                     out_of: Any) -> tuple[Match, FetchResult | None, OutBuffers]:
        """Match and lend in one call, copy into ``out_of(match)`` (the caller's buffers,
        or new ones), acknowledge. ``(match, result or None, buffers)``."""
        cols = self.call(fr.Op.FETCH_PREFIX, [*prompt, np.array([-1 if max_rows is None else max_rows],
                                                                dtype="<i8")])
        m = fr.match_from(cols)
        bufs: OutBuffers = out_of(m)
        return m, self._read(m, bufs, cols, fr.MATCH_COLUMNS), bufs

    def fetch(self, m: Match, bufs: OutBuffers, max_rows: int | None,
              deadline: Deadline | None = None) -> FetchResult:
        """``Client.fetch`` of ``m``: lent in one call, copied into ``bufs``, acknowledged.
        ``deadline`` bounds the lending call (:class:`Busy`: no fetch was opened); once
        lent, the copies (memory of this host) and the acknowledgement go on."""
        cols = self.call(fr.Op.FETCH, [*fr.match_columns(m), np.array([-1 if max_rows is None else max_rows],
                                                                      dtype="<i8")], deadline)
        got = self._read(m, bufs, cols, 0)
        if got is None:  # nothing to fetch: the node opened nothing
            raise InvalidInput("match: its resume bound needs no rows; nothing to fetch", field="match")
        return got

    def _read(self, m: Match, bufs: OutBuffers, cols: list[fr.Column], at: int) -> FetchResult | None:
        """Copy the rows a lent fetch's answer (its 9 columns from ``at``) names, then
        acknowledge them; None where no fetch was opened."""
        fetch_id = fr.take(cols, at, str, "fetch_id")
        if not fetch_id:
            return None
        pos, grp, slot = (fr.ints(cols, at + i, w) for i, w in ((1, "rows.position"), (2, "rows.group"),
                                                                 (3, "rows.slot")))
        lease_id = fr.take(cols, at + 4, str, "lease_id")
        if not lease_id:
            return self._ack(m, fetch_id, "", _EMPTY)
        ttl = float(fr.take(cols, at + 5, np.ndarray, "ttl_s")[0])
        idx, off, size = (fr.ints(cols, at + i, w) for i, w in ((6, "slots.index"), (7, "slots.offset"),
                                                                 (8, "slots.size")))
        # each slot's checksum (0: none recorded); an older node sends no column
        sums = fr.ints(cols, at + 9, "slots.sums", len(idx)) if len(cols) > at + 9 else None
        deadline = time.monotonic() + ttl
        try:
            borrower = self.borrower()
            jobs, rows, dsts = self._read_jobs(m, bufs, grp, slot, idx, off, size)
            want = self._sums_to_check(sums)
            if want is None:
                borrower.copy_slots(jobs, into_slots=False)
            else:  # each row hashed as it is copied: one digest per lent row, in order
                got = np.fromiter(borrower.copy_slots_summed(jobs, rows=rows), dtype="<u8", count=len(dsts))
            if time.monotonic() >= deadline:
                raise LeaseExpired(f"lease_id: lease {lease_id} expired during the copies")
            bad = _EMPTY if want is None else np.flatnonzero((want != 0) & (got != want))
        except BaseException:
            self._release_quietly(lease_id)
            raise
        lent = pos[idx]
        if len(bad):  # a miss, never wrong bytes; the node checks these rows and drops them
            keep = np.ones(len(idx), dtype=bool)
            keep[bad] = False
            return self._ack(m, fetch_id, lease_id, lent[keep], lent[bad])
        # the node counts these rows only if the lease outlived the copies
        return self._ack(m, fetch_id, lease_id, lent)

    def _sums_to_check(self, sums: np.ndarray[Any, Any] | None) -> np.ndarray[Any, Any] | None:
        """The checksums the node sent (uint64, 0: none recorded) where any row's copy is
        to be verified against them (the bytes changed in the host segment since the row
        was committed fail); None where nothing is checked."""
        if sums is None or not self._verify:
            return None
        want = sums.astype("<u8", copy=False)
        return want if want.any() else None

    _verify = True  # verify each copy against its row's checksum (a bench turns it off for a baseline)

    def _ack(self, m: Match, fetch_id: str, lease_id: str, positions: np.ndarray[Any, Any],
             changed: np.ndarray[Any, Any] = _EMPTY) -> FetchResult:
        """Acknowledge ``positions`` (the rows copied and verified before the lease's
        deadline) and name ``changed`` (copies that failed their checksum); the fetch's
        result. One-way where the node takes it: the result is then :meth:`_result`, built
        here; else the node's answer."""
        cols: list[fr.Column] = [fetch_id, lease_id, np.ascontiguousarray(positions, dtype="<i8"),
                                 np.ascontiguousarray(changed, dtype="<i8")]
        if not self.oneway:
            return fr.result_from(self.call(fr.Op.ACK, cols))
        self.send_oneway(fr.Op.ACK, cols)
        return self._result(m, fetch_id, positions)

    def _result(self, m: Match, fetch_id: str, positions: np.ndarray[Any, Any]) -> FetchResult:
        """The FetchResult the node answers an acknowledgement of ``positions`` with, built
        as it builds it (kvbank.service.node ``Node._result``): the fetch was opened by
        this very call (a lent fetch over the channel never resumes an earlier one), so
        the rows delivered are exactly those acknowledged (those ``max_rows`` left out are
        missing). Each group's delivered and missing key indexes in plan order, the page
        bytes of the rows delivered, and the resume bound recomputed from them alone."""
        pages, rows = m.resume.pages, m.resume.rows
        layout = self._layout_of(m)
        got = np.zeros(sum(map(len, pages)), dtype=bool)
        if len(positions) and (int(positions.min()) < 0 or int(positions.max()) >= len(got)):
            raise TierUnavailable("node: a fetch answer names rows beyond the match", field="socket")
        got[positions] = True
        delivered: list[tuple[int, ...]] = []
        missing: list[tuple[int, ...]] = []
        names: set[bytes] = set()
        sizes = layout.group_page_bytes
        nbytes = 0
        at = 0
        for g, idx in enumerate(pages):
            mask = got[at : at + len(idx)]
            keys = np.asarray(idx, dtype="<i8")
            delivered.append(tuple(keys[mask].tolist()))
            missing.append(tuple(keys[~mask].tolist()))
            names.update(map(rows[g].__getitem__, np.flatnonzero(mask).tolist()))
            nbytes += int(mask.sum()) * sizes[g]
            at += len(idx)
        chain = m.names
        # presence read as whole columns (one C pass a group), not asked row by row
        bound = resume_bound(layout, m.prompt_tokens, Flags([list(map(names.__contains__, c)) for c in chain]),
                             chain)
        return FetchResult(fetch_id, tuple(delivered), tuple(missing), bound, nbytes, not any(missing))

    def _release_quietly(self, lease_id: str) -> None:
        with contextlib.suppress(KvbankError):  # else the connection's close or the TTL ends it
            self.release(lease_id)

    def _read_jobs(self, m: Match, bufs: OutBuffers, grp: np.ndarray[Any, Any], slot: np.ndarray[Any, Any],
                   idx: np.ndarray[Any, Any], off: np.ndarray[Any, Any],
                   size: np.ndarray[Any, Any]) -> tuple[list[tuple[str, int, int, memoryview]], list[int],
                                                        list[memoryview]]:
        """The copies of a lent fetch, planned on arrays: the lent rows ``idx`` (of the
        plan's ``grp``/``slot``) at ``off``/``size`` in the segment, merged into one copy
        per run of rows back to back in both the segment and one destination tensor; the
        row size of each copy (a run is rows of one size); and each lent row's own
        destination."""
        n = len(idx)
        if n == 0:
            return [], [], []
        g, s = grp[idx], slot[idx]
        if int(g.min()) < 0 or int(g.max()) >= len(m.resume.pages):
            raise TierUnavailable("node: a fetch answer names groups beyond the match", field="socket")
        dests: dict[int, np.ndarray[Any, Any] | None] = {}
        views: dict[int, list[memoryview]] | None = None
        for gi in np.unique(g).tolist():
            buf = bufs.get(gi) if hasattr(bufs, "get") else None
            ok = (isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.dim() == 2
                  and buf.device.type == "cpu" and buf.is_contiguous()
                  and buf.shape[0] >= len(m.resume.pages[gi]) if gi < len(m.resume.pages) else False)
            dests[gi] = buf.numpy() if ok and isinstance(buf, torch.Tensor) else None
        width = np.full(len(m.resume.pages), -1, dtype=np.int64)  # each group's row width in its buffer
        for gi, d in dests.items():
            if d is not None:
                width[gi] = d.shape[1]
        whole = width[g] == size
        brk = np.ones(n, dtype=bool)
        if n > 1:
            brk[1:] = ((g[1:] != g[:-1]) | (s[1:] != s[:-1] + 1) | (off[1:] != off[:-1] + size[:-1])
                       | (size[1:] != size[:-1]) | ~whole[1:] | ~whole[:-1])
        starts = np.flatnonzero(brk)
        ends = np.append(starts[1:], n)
        jobs: list[tuple[str, int, int, memoryview]] = []
        sizes: list[int] = []
        rows: list[memoryview] = []
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            gi, first, o, z = int(g[a]), int(s[a]), int(off[a]), int(size[a])
            d = dests[gi]
            if d is not None and whole[a]:
                if first < 0 or first + (b - a) > d.shape[0]:
                    raise TierUnavailable("node: a fetch answer names rows beyond the buffers", field="socket")
                run = d[first : first + (b - a)].data.cast("B")
                jobs.append((SEGMENT, o, (b - a) * z, run))
                sizes.append(z)
                rows.extend([run[k * z : (k + 1) * z] for k in range(b - a)])
                continue
            if views is None:
                views = out_views(self._layout_of(m), m.resume.pages, bufs)
            for k in range(a, b):
                gk, sk = int(g[k]), int(s[k])
                dst = views[gk][sk][: int(size[k])]
                jobs.append((SEGMENT, int(off[k]), int(size[k]), dst))
                sizes.append(int(size[k]))
                rows.append(dst)
        return jobs, sizes, rows

    layout_of: Any = None  # set by the client: layout id -> PageLayout

    def _layout_of(self, m: Match) -> Any:
        return self.layout_of(m.layout_id)

    def put(self, head: bytes, views: Sequence[memoryview],
            deadline: Deadline | None = None) -> list[bytes] | None:
        """Reserve, fill and commit; the row names, or None where the pages must go over
        HTTP (no lease could be had). ``deadline`` bounds the reserving and the committing
        call (:class:`Busy`; a lease taken is released, pages committed before stay)."""
        cols = self.call(fr.Op.PUT_RESERVE, [head], deadline)
        names = list(fr.names_of(fr.take(cols, 0, bytes, "names"), "names"))
        fallback = bool(fr.ints(cols, 1, "fallback", 1)[0])
        lease_id = fr.take(cols, 2, str, "lease_id")
        if not lease_id:
            return None if fallback else names
        ttl = float(fr.take(cols, 3, np.ndarray, "ttl_s")[0])
        idx = fr.ints(cols, 4, "slots.index").tolist()
        off = fr.ints(cols, 5, "slots.offset").tolist()
        size = fr.ints(cols, 6, "slots.size").tolist()
        expires = time.monotonic() + ttl  # the lease's
        try:
            if any(not 0 <= i < len(views) for i in idx):
                raise TierUnavailable("node: a put answer names pages beyond the put", field="socket")
            jobs = [(SEGMENT, o, z, views[i]) for i, o, z in zip(idx, off, size, strict=True)]
            sums: list[int] | None = None
            if self.commit_sums:  # each row hashed in the slot right after its copy, in cache
                sums = self.borrower().copy_slots_summed(jobs, into_slots=True)
            else:
                self.borrower().copy_slots(jobs, into_slots=True)
            if time.monotonic() >= expires:
                raise LeaseExpired(f"lease_id: lease {lease_id} expired during the copies")
            self.commit(lease_id, [names[i] for i in idx], deadline, sums)
        except BaseException:
            self._release_quietly(lease_id)
            raise
        return names



__all__ = ["SEGMENT", "DataCalls"]
