"""The engine calls' data path: pages moved between the node's shared-memory segment (or
staging buffers) and an engine's paged pool, for :class:`~kvbank.client.engine.EngineCalls`.

A pool is the engine's own paged KV cache (:data:`~kvbank.kernels.strided.PoolViews`),
addressed by block: :data:`BlockIds` maps a group to the block of each page (None: the
engine does not need the page, which is not moved). A load checks every block id and
every group's pool (:func:`check_ids`, :func:`~kvbank.kernels.strided.check_pool`) before
any byte moves.

- :func:`load_lent` — a load on the node's host, straight from its segment: the plan and
  a READ lease (LOAD on the local channel, else ``POST /v1/engine/load``; or a
  :class:`~kvbank.client.engine.PreparedLoad`'s answer), one
  :func:`~kvbank.kernels.strided.scatter_strided` per run of back-to-back slots of one
  group, then the release with what arrived.
- :func:`load_staged` — a load elsewhere: the load's match for the caller's shard
  (``via=match``), trimmed to the pages from ``start_page`` on that have a block, fetched
  into staging buffers by the client's page path (the data port or the HTTP stream), then
  scattered into the pool.
- :func:`put_lent` — a put on the node's host, straight into its segment: one control call
  (``POST /v1/engine/put``) plans every group's pages and takes one WRITE lease, one
  :func:`~kvbank.kernels.strided.gather_strided` from the pool into the slots per run,
  then one commit.
- :func:`put_staged` — a put elsewhere: each run of pages with a block gathered into a
  staging tensor, one ``put`` a group and run.
- :func:`same_shard` — whether the node plans a load of a match from that match itself
  (else it translates it to the caller's shard), so the result can be built here.

Lifecycle of a lent load::

    plan + READ lease      LOAD / POST /v1/engine/load (or taken by prepare_load)
    -> copies into the pool, run by run: a slot that is not a whole page is a miss; one
       beyond its segment is TierUnavailable; where the lease carries checksums each row
       is hashed as it lands and one that differs is a miss, named "changed" (the node
       reads only those again); the deadline passing stops the copies (the rest: misses)
    -> release with what arrived: LOADED, else POST /v1/engine/loaded (one-way where
       the node takes that, the caller knows the match the load was planned from and
       the lease's ttl outlived the copies: the result is then built here as the node
       builds it); the node counts only rows copied before the lease expired

Lifecycle of a lent put::

    plan + WRITE lease     POST /v1/engine/put
    -> copies out of the pool into the slots, run by run: a slot not of the page's size
       or beyond its segment is TierUnavailable; the deadline passing is Busy (nothing
       stored); where the node takes COMMIT's sums each slot is hashed as it is filled
    -> commit of what arrived (with the sums: the node keeps them, reads no slot again)

A lease is released wherever its copies fail first (any exception, an interrupt
included). A staged load or put takes no lease here: the client's ``fetch`` and ``put``
hold their own.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvbank import wire
from kvbank.client.io import Deadline, scope_doc
from kvbank.codec.frame import checksum
from kvbank.errors import InvalidInput, TierUnavailable
from kvbank.kernels.strided import PoolViews, check_pool, gather_strided, scatter_strided
from kvbank.keys import Scope
from kvbank.layout import PageLayout
from kvbank.lender.loads import load_result, load_rows, match_shard
from kvbank.lender.resume import picked
from kvbank.results import FetchResult, Match

if TYPE_CHECKING:
    from kvbank.client.client import Client
    from kvbank.client.local import LocalLink

__all__ = ["BlockIds", "check_ids", "load_lent", "load_staged", "put_lent", "put_staged", "same_shard"]

BlockIds = Mapping[int, Sequence[int | None]]  # group -> block id of page j (None: skip)


def check_ids(layout: PageLayout, block_ids: BlockIds) -> None:
    """``block_ids`` is a mapping of the layout's groups to sequences (the ids themselves:
    :func:`_block`, :func:`_row_blocks`)."""
    if not isinstance(block_ids, Mapping):
        raise InvalidInput(f"block_ids: expected a mapping group -> block ids, got {type(block_ids).__name__}")
    for g, ids in block_ids.items():
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < len(layout.groups):
            raise InvalidInput(f"block_ids: group {g!r} is not a group of the layout")
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise InvalidInput(f"block_ids[{g}]: expected a sequence of block ids")


def _block(block_ids: BlockIds, g: int, j: int, blocks: int | None = None) -> int | None:
    """Page ``j``'s block in group ``g`` (None: the engine does not need the page); with
    ``blocks``, one that is not a block id in ``[0, blocks)`` is refused."""
    ids = block_ids.get(g)
    if ids is None or j >= len(ids):
        raise InvalidInput(f"block_ids[{g}]: no block for page {j}, which the load moves")
    b = ids[j]
    if b is None:
        return None
    if blocks is not None and (isinstance(b, bool) or not isinstance(b, Integral) or not 0 <= int(b) < blocks):
        raise InvalidInput(f"block_ids[{g}][{j}]: expected a block id in [0, {blocks}), got {b!r}")
    return int(b)


def same_shard(m: Match, shard: int | None) -> bool:
    """Whether a load of ``m`` for ``shard`` is planned from ``m`` itself (the node
    translates a match of another shard's rows to the caller's)."""
    own = match_shard(m)
    return shard is None or own is None or own[1] == shard


def load_lent(c: Client, link: LocalLink | None, body: dict[str, Any], pool: PoolViews, block_ids: BlockIds,
               deadline: Deadline | None, own: Match | None = None,
               lent: tuple[dict[str, Any], float] | None = None) -> FetchResult:
    """The plan and its READ lease, one copy per run of slots straight into ``pool``, the
    release with what arrived: two calls on the local channel (``link``), else over HTTP.
    ``own``: the match the node plans the load from, where the caller knows it; with it,
    on a channel whose node takes LOADED one-way, the release is one-way and the result
    built here as the node builds it (if the lease's deadline had not passed by the end
    of the copies: else the node answers what counted). ``lent``: the plan and lease
    already asked for (a prepared load's answer, and when it was asked)."""
    if lent is not None:
        doc, sent = lent
    else:
        load = {**body, "via": "lease"}
        sent = time.monotonic()
        if link is not None:
            doc = link.load(load, deadline)
        else:
            doc = c._call("POST", "/v1/engine/load", body=load, deadline=deadline)
    lease = doc["lease"]
    if lease is None:
        return wire.from_dict(FetchResult, doc["result"])
    arrived: list[np.ndarray[Any, Any]] = []  # (group, page) pairs, run by run
    changed: list[np.ndarray[Any, Any]] = []
    try:
        layout = c.layout(bytes.fromhex(doc["layout_id"]))
        check_ids(layout, block_ids)
        rows = _table(doc["rows"], 3, "rows")  # each planned row's group, page and size
        slots = _table(lease["slots"], 4, "slots")  # each slot's plan entry, segment, offset, size
        if len(slots) and (int(slots[:, 0].min()) < 0 or int(slots[:, 0].max()) >= len(rows)):
            raise TierUnavailable("node: a lease answer names rows beyond its plan", field="socket")
        bid = _row_blocks(layout, rows, block_ids, pool)  # each planned row's block (-1: not moved)
        want = _sums_of(lease, len(slots))
        moving = bid[slots[:, 0]] >= 0
        slots = slots[moving]
        if want is not None:
            want = want[moving]
        segments = [str(x) for x in lease["segments"]]
        borrower = c._shm.borrower(writable=True)
        whole: dict[str, torch.Tensor] = {}
        try:
            for a, b in _slot_runs(slots, rows[:, 0]):
                if deadline is not None and deadline.passed():
                    break
                g, seg_at, off, size = int(rows[slots[a, 0], 0]), int(slots[a, 1]), int(slots[a, 2]), int(slots[a, 3])
                if size != layout.group_page_bytes[g]:
                    continue  # not a whole page: a miss
                seg = segments[seg_at]
                t = whole.get(seg)
                if t is None:
                    t = whole[seg] = torch.frombuffer(borrower.segment(seg), dtype=torch.uint8)
                n = b - a
                if off + size * n > t.numel():
                    raise TierUnavailable(f"node: a slot at {off} is beyond segment {seg}")
                src = t[off : off + size * n].view(n, size)
                idx = slots[a:b, 0]
                pairs = np.stack([np.full(n, g, dtype=np.int64), rows[idx, 1]], axis=1)
                if want is None:
                    scatter_strided(layout, g, src, pool, bid[idx].tolist())
                    arrived.append(pairs)
                    continue
                # each row read in place is hashed right after its part of the scatter, on the
                # lane that copied it, while still in cache: a row whose bytes changed since
                # commit is a miss (the pool's copy is the engine's to overwrite; it never
                # counts as loaded), and the node reads only those again
                got = np.zeros(n, dtype=np.uint64)
                flat = src.numpy().data.cast("B")  # the run's rows back to back, in the segment

                def hashed(first: int, end: int, flat: memoryview = flat, got: np.ndarray[Any, Any] = got,
                           size: int = size) -> None:
                    for k in range(first, end):
                        got[k] = checksum(flat[k * size : (k + 1) * size])

                try:
                    scatter_strided(layout, g, src, pool, bid[idx].tolist(), then=hashed)
                finally:
                    flat.release()  # no view may keep the mapping exported
                w = want[a:b]
                bad = (w != 0) & (w != got)
                if bad.any():
                    arrived.append(pairs[~bad])
                    changed.append(pairs[bad])
                else:  # the usual case: every row as committed
                    arrived.append(pairs)
        finally:
            whole.clear()  # no tensor may keep the mapping exported
    except BaseException:
        c.release(lease["id"])
        raise
    got_pairs: list[list[int]] = np.concatenate(arrived).tolist() if arrived else []
    ack: dict[str, Any] = {"lease_id": lease["id"], "arrived": got_pairs}
    if want is not None:  # every arrived row was checked: the node need not read them again
        ack["changed"] = np.concatenate(changed).tolist() if changed else []
    if link is not None and link.oneway_loaded and own is not None and time.monotonic() < sent + float(lease["ttl_s"]):
        # every copy ended before the lease could have: the node counts what arrived
        link.loaded_oneway(ack)
        pages = {(g, j) for g, j in got_pairs}
        return load_result(layout, own, int(doc["start_page"]), lease["id"], pages,
                           sum(layout.group_page_bytes[g] for g, _ in pages))
    done = link.loaded(ack) if link is not None else c._call("POST", "/v1/engine/loaded", body=ack)
    return wire.from_dict(FetchResult, done)


def _table(value: Any, width: int, what: str) -> np.ndarray[Any, Any]:
    """A load answer's ``rows`` or ``slots`` (lists from JSON, or one array from the local
    channel's LOAD_KEYS) as an int64 array of ``width`` columns."""
    try:
        arr = np.asarray(value, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise TierUnavailable(f"node: a load answer's {what} of an unexpected shape: {exc}",
                              field="socket") from exc
    if arr.size == 0:
        return arr.reshape(0, width)
    if arr.ndim != 2 or arr.shape[1] != width:
        raise TierUnavailable(f"node: a load answer's {what} of shape {arr.shape}, not {width} columns",
                              field="socket")
    return arr


def _row_blocks(layout: PageLayout, rows: np.ndarray[Any, Any], block_ids: BlockIds,
                pool: PoolViews) -> np.ndarray[Any, Any]:
    """Each planned row's block (-1: its page's block is None, the engine does not need
    it), group by group, every group's pool checked first; a page the plan moves with no
    entry in ``block_ids``, a negative block id, or a block named for two pages is
    refused."""
    bid = np.full(len(rows), -1, dtype=np.int64)
    for g in dict.fromkeys(rows[:, 0].tolist()):  # the groups in plan order
        tensors = check_pool(layout, g, pool)
        size = int(next(iter(tensors.values())).shape[0]) if tensors else 0
        at = rows[:, 0] == g
        pages = rows[at, 1]
        ids = block_ids.get(g)
        short = pages if ids is None else pages[pages >= len(ids)]
        if len(short):
            raise InvalidInput(f"block_ids[{g}]: no block for page {int(short[0])}, which the load moves")
        assert ids is not None  # a group with no ids is refused above (its rows have no block)
        if type(ids) is list and set(map(type, ids)) == {int}:  # an engine's usual ids: in bulk
            blocks = np.asarray(ids, dtype=np.int64)[pages]
            if len(blocks) and (int(blocks.min()) < 0 or int(blocks.max()) >= size):  # refused before anything moves
                k = int(np.flatnonzero((blocks < 0) | (blocks >= size))[0])
                raise InvalidInput(f"block_ids[{g}][{int(pages[k])}]: expected a block id in [0, {size}), "
                                   f"got {int(blocks[k])!r}")
        else:
            picked = [ids[j] for j in pages.tolist()]
            for j, b in zip(pages.tolist(), picked, strict=True):  # refused before anything moves
                if b is not None and (isinstance(b, bool) or not isinstance(b, Integral) or not 0 <= int(b) < size):
                    raise InvalidInput(f"block_ids[{g}][{j}]: expected a block id in [0, {size}), got {b!r}")
            blocks = np.array([-1 if b is None else int(b) for b in picked], dtype=np.int64)
        moved = np.sort(blocks[blocks >= 0])  # sorted: a block named twice lies next to itself
        if (moved[1:] == moved[:-1]).any():
            raise InvalidInput(f"block_ids[{g}]: a block id appears twice (two pages into one block)")
        bid[at] = blocks
    return bid


def _slot_runs(slots: np.ndarray[Any, Any], groups: np.ndarray[Any, Any]) -> list[tuple[int, int]]:
    """``[a, b)`` of each run of ``slots`` (plan entry, segment, offset, size) of one
    group lying back to back in one segment, their plan entries consecutive, in order."""
    if not len(slots):
        return []
    i, seg, off, size = slots[:, 0], slots[:, 1], slots[:, 2], slots[:, 3]
    g = groups[i]
    goes_on = ((g[1:] == g[:-1]) & (seg[1:] == seg[:-1]) & (size[1:] == size[:-1])
               & (off[1:] == off[:-1] + size[:-1]) & (i[1:] == i[:-1] + 1))
    cuts = [0, *(np.flatnonzero(~goes_on) + 1).tolist(), len(slots)]
    return list(itertools.pairwise(cuts))


def _sums_of(lease: dict[str, Any], n: int) -> np.ndarray[Any, Any] | None:
    """Each lent slot's checksum (a READ lease's ``sums``, aligned with its ``slots``: hex
    in a node's JSON, an array from the local channel's LOAD_KEYS), 0 where it has none;
    None where the node sent none (an older node: it checks the rows itself)."""
    sums = lease.get("sums")
    if sums is None:
        return None
    try:
        if isinstance(sums, np.ndarray):
            arr = sums.astype(np.uint64)
        else:
            arr = np.array([0 if v is None else int(v, 16) for v in sums], dtype=np.uint64)
    except (TypeError, ValueError) as exc:
        raise TierUnavailable(f"node: a lease answer of an unexpected shape: {exc!r}") from exc
    if len(arr) != n:
        raise TierUnavailable("node: a lease answer's sums do not match its slots")
    return arr


def load_staged(c: Client, body: dict[str, Any], pool: PoolViews, block_ids: BlockIds,
                 deadline: Deadline | None) -> FetchResult:
    """The load's match (``via=match``) trimmed to the pages it moves, fetched into
    staging buffers by the client's page path, then scattered into ``pool``."""
    doc = c._call("POST", "/v1/engine/load", body={**body, "via": "match"}, deadline=deadline, idempotent=True)
    m = wire.from_dict(Match, doc["match"])
    start = int(doc["start_page"])
    layout = c.layout(m.layout_id)
    check_ids(layout, block_ids)
    used: dict[int, list[int]] = {}
    for g, j, _ in load_rows(m, start):  # every id checked before anything moves
        tensors = check_pool(layout, g, pool)
        b = _block(block_ids, g, j, int(next(iter(tensors.values())).shape[0]) if tensors else 0)
        used.setdefault(g, []).extend(() if b is None else (b,))
    for g, ids in used.items():
        if len(set(ids)) != len(ids):
            raise InvalidInput(f"block_ids[{g}]: a block id appears twice (two pages into one block)")
    res = m.resume
    keep = [[k for k, j in enumerate(pages) if j >= start and _block(block_ids, g, j) is not None]
            for g, pages in enumerate(res.pages)]
    trimmed = dataclasses.replace(m, resume=dataclasses.replace(
        res, pages=tuple(tuple(res.pages[g][k] for k in ks) for g, ks in enumerate(keep)),
        rows=tuple(picked(res.rows[g], ks) for g, ks in enumerate(keep))))
    if not any(trimmed.resume.pages):
        return load_result(layout, m, start, "", (), 0)
    out = c.out_buffers(trimmed)
    got = c.fetch(trimmed, out=out, timeout=None if deadline is None else max(deadline.left(), 1e-3))
    arrived = []
    nbytes = 0
    for g, pages in enumerate(trimmed.resume.pages):
        ok = set(got.delivered[g])
        ks = [k for k, j in enumerate(pages) if j in ok]
        if ks:
            scatter_strided(layout, g, out[g][ks], pool, [int(block_ids[g][pages[k]]) for k in ks])  # type: ignore[arg-type]
            arrived += [(g, pages[k]) for k in ks]
            nbytes += len(ks) * layout.group_page_bytes[g]
    return load_result(layout, m, start, got.fetch_id, arrived, nbytes)


def put_lent(c: Client, layout: PageLayout, layout_id: bytes, pool: PoolViews, block_ids: BlockIds,
              keys: Sequence[bytes], first_page: int, scope: Scope, shard: int | None,
              deadline: Deadline | None) -> dict[int, list[bytes]]:
    """Every group's pages planned in one control call with one WRITE lease, gathered from
    ``pool`` straight into its slots, one commit: each group's row names."""
    pages = {g: [first_page + k for k, b in enumerate(ids) if b is not None] for g, ids in block_ids.items()}
    doc = c._call("POST", "/v1/engine/put", deadline=deadline, body={
        "layout_id": layout_id.hex(), "keys": [k.hex() for k in keys], "first_page": first_page,
        "scope": scope_doc(scope), "shard": shard, "pages": {str(g): p for g, p in pages.items()}})
    names = {int(g): [bytes.fromhex(n) for n in ns] for g, ns in doc["names"].items()}
    lease = doc["lease"]
    if lease is None:
        return names
    # the node's flat order: its groups in its answer's order, each group's pages in order
    flat = [(g, name, int(block_ids[g][p - first_page]))  # type: ignore[arg-type]
            for g, ns in names.items() for name, p in zip(ns, pages[g], strict=True)]
    arrived: list[bytes] = []
    link = c._chan()
    sums: list[int] | None = [] if link is not None and link.commit_sums else None
    try:
        segments = [str(x) for x in lease["segments"]]
        slots = _table(lease["slots"], 4, "slots")  # each slot's entry of ``flat``, segment, offset, size
        if len(slots) and (int(slots[:, 0].min()) < 0 or int(slots[:, 0].max()) >= len(flat)):
            raise TierUnavailable("node: a lease answer names pages beyond its put", field="socket")
        borrower = c._shm.borrower(writable=True)
        whole: dict[str, torch.Tensor] = {}
        try:
            for a, b in _slot_runs(slots, np.array([g for g, _, _ in flat], dtype=np.int64)):
                if deadline is not None and deadline.passed():
                    raise deadline.busy("the pages were not all copied (nothing was stored)")
                idx = slots[a:b, 0].tolist()
                g, seg, off, size = flat[idx[0]][0], segments[int(slots[a, 1])], int(slots[a, 2]), int(slots[a, 3])
                if size != layout.group_page_bytes[g]:
                    raise TierUnavailable(f"node: a slot of {size} bytes for a page of {layout.group_page_bytes[g]}")
                t = whole.get(seg)
                if t is None:
                    t = whole[seg] = torch.frombuffer(borrower.segment(seg), dtype=torch.uint8)
                if off + size * len(idx) > t.numel():
                    raise TierUnavailable(f"node: a slot at {off} is beyond segment {seg}")
                dst = t[off : off + size * len(idx)].view(len(idx), size)
                if sums is None:
                    gather_strided(layout, g, pool, [flat[i][2] for i in idx], dst)
                else:
                    # each slot hashed as it landed, on the lane that filled it: the node
                    # keeps these sums and does not read the slots again
                    got = [0] * len(idx)
                    rows = dst.numpy()

                    def hashed(first: int, end: int, rows: Any = rows, got: list[int] = got) -> None:
                        for k in range(first, end):
                            got[k] = checksum(rows[k])

                    try:
                        gather_strided(layout, g, pool, [flat[i][2] for i in idx], dst, then=hashed)
                    finally:
                        del rows, hashed  # no view may keep the mapping exported
                    sums.extend(got)
                arrived.extend(flat[i][1] for i in idx)
        finally:
            whole.clear()
    except BaseException:
        c.release(lease["id"])
        raise
    c._commit_or_release(lease["id"], arrived, deadline, sums)
    return names


def put_staged(c: Client, layout: PageLayout, layout_id: bytes, pool: PoolViews, block_ids: BlockIds,
                keys: Sequence[bytes], first_page: int, scope: Scope, shard: int | None,
                deadline: Deadline | None) -> dict[int, list[bytes]]:
    """Each run of pages with a block gathered into staging and stored with one ``put``:
    each group's row names."""
    names: dict[int, list[bytes]] = {}
    for g, ids in block_ids.items():
        names[g] = []
        k = 0
        while k < len(ids):
            if ids[k] is None:
                k += 1
                continue
            end = k
            while end < len(ids) and ids[end] is not None:
                end += 1
            run = [int(b) for b in ids[k:end]]  # type: ignore[arg-type]
            staging = torch.empty((len(run), layout.group_page_bytes[g]), dtype=torch.uint8)
            gather_strided(layout, g, pool, run, staging)
            names[g] += c.put(layout_id, group=g, pages=staging, keys=list(keys), first_page=first_page + k,
                              scope=scope, shard=shard,
                              timeout=None if deadline is None else max(deadline.left(), 1e-3))
            k = end
    return names
