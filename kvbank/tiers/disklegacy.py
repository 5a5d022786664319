"""Rows of the older layout (a data dir written before segments): frames as LMDB values.

A data dir of the previous release keeps each frame as the value of its row name in the
``frames`` database; its ``meta`` record then names no segment. Such a row is found,
checked and read here, alongside the segment rows' lookup, so that the disk tier's read
and write paths treat both alike; a new write of the row goes to a segment and drops
the value (:mod:`kvbank.tiers.disk`), and ``compact(legacy=True)``
(:mod:`kvbank.tiers.diskcompact`) moves every such row into segments.

Primitives (each over an open transaction and the two databases):

- :func:`locate` — a row's checked record, where its frame lies, and (older layout)
  the frame itself, LMDB's mapped page, valid only inside the transaction.
- :func:`replaced` — what a write of a row replaces: its frame bytes, where they lie,
  whether its record failed its checks.
- :func:`orphan_frames` — ``frames`` values with no record (or a damaged key).

The :class:`~kvbank.tiers.disk.DiskTier` owns the environment and the locks; the
errors of LMDB pass through to it.
"""

from __future__ import annotations

import lmdb

from kvbank.errors import CorruptPage, PageSizeMismatch
from kvbank.tiers.diskmeta import DiskRow, Where, check_row, unpack_record

__all__ = ["locate", "orphan_frames", "replaced"]


def locate(txn: lmdb.Transaction, meta_db: lmdb._Database, frames_db: lmdb._Database,
           name: bytes) -> tuple[DiskRow, Where | None, bytes | memoryview | None] | None:
    """The row's checked record, where its frame lies, and (older layout) the frame;
    ``None`` if there is no such row. ``CorruptPage`` if the record fails its checks,
    a frame has no record, or an older-layout frame's header disagrees with its record."""
    rec = txn.get(name, db=meta_db)
    legacy = txn.get(name, db=frames_db)
    if rec is None:
        if legacy is None:
            return None
        raise CorruptPage(f"row {name.hex()[:16]}…: frame has no meta record")
    row, where = unpack_record(name, rec)
    if where is None:
        check_row(row, legacy)  # the header's raw length is the record's
    return row, where, legacy


def replaced(txn: lmdb.Transaction, meta_db: lmdb._Database, frames_db: lmdb._Database,
             name: bytes, raw_len: int, replace: bool) -> tuple[int, Where | None, int]:
    """What a write of ``raw_len`` bytes under ``name`` replaces: its frame bytes, where
    they lie (``None``: nowhere, or an older-layout value), and 1 if its record failed
    its checks (its bytes are then recounted after the commit). ``PageSizeMismatch``
    when the row holds another size and ``replace`` is off."""
    old = txn.get(name, db=meta_db)
    legacy = txn.get(name, db=frames_db)
    legacy_len = 0 if legacy is None else len(legacy)
    if old is None:
        return legacy_len, None, 0
    try:
        prev, where = unpack_record(name, old)
    except CorruptPage:
        return legacy_len, None, 1
    if prev.raw_len != raw_len and not replace:
        raise PageSizeMismatch(f"data: {raw_len} bytes, but row {name.hex()[:16]}… "
                               f"holds {prev.raw_len}")
    if where is None:
        return legacy_len, None, 0
    return prev.frame_len, where, 0


def orphan_frames(txn: lmdb.Transaction, frames_db: lmdb._Database, with_record: int,
                  known: set[bytes]) -> list[bytes]:
    """The keys of ``frames`` that are not in ``known`` (the rows a scan saw), when the
    database holds more values than the ``with_record`` rows that had one: frames with
    no meta record, or whose key is damaged."""
    if txn.stat(frames_db)["entries"] <= with_record:
        return []
    return [bytes(key) for key, _ in txn.cursor(db=frames_db) if bytes(key) not in known]
