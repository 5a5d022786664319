"""The segments as the index's write-ahead log: one full sync per durable group commit.

A durable write appends its frames to a segment and ``fdatasync``\\s them, then commits
the index transaction that names them. LMDB's own durable commit costs two more syncs
(its data pages, then its meta page). The index is opened with ``metasync=False``
instead: LMDB still syncs the data pages of every commit, and writes the meta page
without a sync, so a crash of the machine may undo the last committed index
transaction, never more and never leaving the index torn (LMDB's own promise for that
setting). Nothing acknowledged is lost by it, because every segment entry carries its
row's name and meta record: each index transaction that appends also records the end of
its append (:func:`mark`, the ``log`` database), and at open :func:`replay` indexes every
entry past the recorded end whose frame decodes whole — the writes of an undone
transaction, and those appended and synced whose commit never ran.

What an undone transaction's deletes leave: the rows come back, with bytes that are
still theirs (equal names, interchangeable bytes) as long as their segment is still
there. So a segment is unlinked only after the commit that stopped naming its rows is
durable (:func:`sync_index` before every retire), and a close syncs the index.

Primitives (over a :class:`~kvbank.tiers.disk.DiskTier`, which owns the state):

- :func:`mark` — record, in an open write transaction, where the log's last append ends.
- :func:`replay` — at open: index the entries past the mark, then set the mark to the
  end of every segment (the next open's start) and sync. Returns the rows indexed.
- :func:`sync_index` — make every committed index transaction durable.
"""

from __future__ import annotations

import logging
import struct
from typing import TYPE_CHECKING

import lmdb

from kvbank.errors import CorruptPage, TierUnavailable
from kvbank.tiers.diskmeta import (
    LMDB_ERRORS,
    DiskRow,
    Where,
    check_salvaged,
    pack_meta,
    unpack_record,
)

if TYPE_CHECKING:
    from kvbank.tiers.disk import DiskTier

logger = logging.getLogger("kvbank.tiers.disk")

LOG_DB = b"log"
_END = b"end"  # the one key: (segment, offset) where the last indexed append ends
_MARK = struct.Struct("<IQ")


def mark(txn: lmdb.Transaction, log_db: lmdb._Database, seg: int, end: int) -> None:
    """Record in the write transaction ``txn`` that the log is indexed up to ``end`` of
    segment ``seg``."""
    txn.put(_END, _MARK.pack(seg, end), db=log_db)


def sync_index(tier: DiskTier) -> None:
    """Every committed index transaction durable (one ``fdatasync`` of LMDB's file)."""
    tier._env.sync(True)


def _frame_len(name: bytes, record: bytes) -> int | None:
    try:
        return unpack_record(name, record)[0].frame_len
    except CorruptPage:
        return None


def replay(tier: DiskTier) -> int:
    """Index the segment entries past the mark (see the module docstring) within the
    budget, later entries first in line; set the mark to the end of the segments; sync.
    The rows indexed. A data dir with no mark (written before the log, or a fresh or
    salvaged index) has nothing to replay: its commits were durable on their own."""
    segs = tier._segs
    ids = segs.ids()
    try:
        with tier._env.begin(db=tier._log) as txn:
            got = txn.get(_END)
    except LMDB_ERRORS as exc:
        raise TierUnavailable(f"disk tier: reading the log mark of {tier.path}: {exc}") from exc
    end = (ids[-1], segs.size_of(ids[-1]) or 0) if ids else (0, 0)
    found: dict[bytes, tuple[DiskRow, Where]] = {}
    if got is not None and len(got) == _MARK.size:
        seg0, off0 = _MARK.unpack(got)
        for seg in ids:
            if seg < seg0:
                continue
            start = off0 if seg == seg0 else 0
            for name, record, off, _ in segs.entries(seg, _frame_len, start=start):
                found.pop(name, None)  # a later entry of a row supersedes (and goes last)
                found[name] = (unpack_record(name, record)[0], Where(seg, off))
    if not found and got is not None and bytes(got) == _MARK.pack(*end):
        return 0  # nothing appended since the last mark
    replayed = 0
    try:
        with tier._env.begin(write=True, buffers=True) as txn:
            if found:
                used = _used(tier, txn)
                for row, where in found.values():
                    old = _old_len(tier, txn, row.name)
                    if used - old + row.frame_len > tier._budget:
                        continue  # over the budget: left as dead bytes
                    try:
                        frame = tier._segment_frame(where, row)
                        if frame is None:
                            continue
                        check_salvaged(row.name, frame, None)  # decodes whole
                    except CorruptPage:
                        continue  # torn or never synced: bytes nothing names
                    txn.delete(row.name, db=tier._frames)
                    txn.put(row.name, pack_meta(row.name, row.raw_len, row.frame_len, row.seq,
                                                row.dtype, row.parent, where), db=tier._meta)
                    used += row.frame_len - old
                    replayed += 1
            mark(txn, tier._log, *end)
        sync_index(tier)
    except LMDB_ERRORS as exc:
        raise TierUnavailable(f"disk tier: replaying the segments of {tier.path}: "
                              f"{exc}") from exc
    if replayed:
        logger.warning("disk tier %s: indexed %d rows written before a crash whose index "
                       "commit was not durable", tier.path, replayed)
    return replayed


def _used(tier: DiskTier, txn: lmdb.Transaction) -> int:
    """Frame bytes of every row whose record passes its checks."""
    used = 0
    for key, value in txn.cursor(db=tier._meta):
        try:
            used += unpack_record(bytes(key), value)[0].frame_len
        except CorruptPage:
            continue
    return used


def _old_len(tier: DiskTier, txn: lmdb.Transaction, name: bytes) -> int:
    rec = txn.get(name, db=tier._meta)
    if rec is None:
        return 0
    try:
        return unpack_record(name, rec)[0].frame_len
    except CorruptPage:
        return 0
