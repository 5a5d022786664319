"""The disk tier's consistency machinery: every row checked at open, a damaged index
salvaged and rebuilt from the segments, the tier's own invariants held by ``check()``.

Primitives (over a :class:`~kvbank.tiers.disk.DiskTier`, which owns the state):

- :func:`scan_checked` — every row whose ``meta`` record passes its checks and agrees
  with its frame (only the frame's header is read from its segment: 40 bytes a row);
  the names that fail; the frame bytes of those that pass. It sets each segment's live
  bytes. Runs at open, and again for :meth:`DiskTier.scan` once a write has made the
  open's answer stale.
- :func:`drop_bad` — delete and count the rows a scan failed (a damaged key included),
  then :func:`recount_locked` — ``used_bytes`` and the segments' live bytes summed
  again from the records (also after a write or delete replaced a record that failed).
- :func:`salvage_hint` and :func:`salvage_index` — an open refused for damage names
  ``disk_salvage``; with it set, the readable rows are copied into a fresh environment
  (:func:`kvbank.tiers.diskfile.salvage`, a segment row kept when its frame decodes
  whole) and, when segment files hold the rows' entries, the index is rebuilt from
  them: a later entry supersedes an earlier one, newest rows first until the budget.
- :func:`check` — :meth:`DiskTier.check`: the records, the ``frames`` values and the
  segments agree with each other and with ``used_bytes``; ``AssertionError`` if not.
  Tests call it at their end.

Lifecycle: ``DiskTier(...)`` opens the environment and calls :func:`scan_checked`
(after :func:`salvage_index` if the open was refused for damage and ``salvage`` is
set), then :func:`drop_bad` for the rows that failed; the open never fails for a row.
A row that fails on a later read is dropped by the read path
(:meth:`DiskTier.drop_corrupt`), not here.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import lmdb

from kvbank.codec import HEADER_SIZE
from kvbank.errors import CorruptPage, TierUnavailable
from kvbank.keys import ROW_NAME_BYTES
from kvbank.tiers.base import OS_ERRORS
from kvbank.tiers.diskfile import SalvageReport
from kvbank.tiers.diskfile import salvage as run_salvage
from kvbank.tiers.disklegacy import orphan_frames
from kvbank.tiers.diskmeta import (
    LMDB_ERRORS,
    DiskRow,
    Where,
    check_header,
    check_row,
    check_salvaged,
    delete_exact,
    pack_meta,
    unpack_record,
)

if TYPE_CHECKING:
    from kvbank.tiers.disk import DiskTier

# The disk tier's logger, as in its other modules: what an operator reads, and what
# tests capture, is one logger for the tier.
logger = logging.getLogger("kvbank.tiers.disk")

# LMDB's answers to a damaged file, which a salvage may get rows out of
_DAMAGED: tuple[type[Exception], ...] = (lmdb.CorruptedError, lmdb.PageNotFoundError,
                                         lmdb.InvalidError, lmdb.VersionMismatchError,
                                         lmdb.PanicError, lmdb.BadRslotError)


def scan_checked(tier: DiskTier) -> tuple[list[DiskRow], list[bytes], int]:
    """Every row whose meta record passes its checks and agrees with its frame
    (length, header raw length and dtype; only header bytes are read, a segment
    row's must lie wholly inside its segment); the names that fail (a frame with no
    record included); the frame bytes of the rows that pass. Sets the live bytes of
    every segment."""
    rows: list[DiskRow] = []
    bad: list[bytes] = []
    used = 0
    live: dict[int, int] = {}
    first: str | None = None
    try:
        with tier._env.begin(buffers=True) as txn:
            with_frame = 0
            for key, value in txn.cursor(db=tier._meta):
                name, rec = bytes(key), bytes(value)
                frame = txn.get(name, db=tier._frames)
                with_frame += frame is not None
                try:
                    if len(name) != ROW_NAME_BYTES:
                        raise CorruptPage(f"meta key of {len(name)} bytes is no row name")
                    row, where = unpack_record(name, rec)
                    if where is None:
                        check_row(row, frame)
                    else:
                        _check_located(tier, row, where)
                        live[where.seg] = live.get(where.seg, 0) + row.frame_len
                except CorruptPage as exc:
                    bad.append(name)
                    first = first or str(exc)
                    continue
                used += row.frame_len
                rows.append(row)
            # frames with no meta record (or a damaged key)
            bad += orphan_frames(txn, tier._frames, with_frame,
                                 {r.name for r in rows}.union(bad))
    except LMDB_ERRORS as exc:
        raise TierUnavailable(f"disk tier: scanning {tier.path}: {exc}") from exc
    for seg in tier._segs.ids():
        tier._segs.add_live(seg, live.get(seg, 0) - tier._segs.live_of(seg))
    if first is not None:
        logger.warning("disk tier: %d rows failed their metadata checks (first: %s)",
                       len(bad), first)
    return rows, bad, used


def _check_located(tier: DiskTier, row: DiskRow, where: Where) -> None:
    """A segment row's frame lies inside its segment and its header agrees."""
    what = f"row {row.name.hex()[:16]}…"
    seg = tier._segs.pin(where.seg)
    if seg is None:
        raise CorruptPage(f"{what}: segment {where.seg} is missing")
    try:
        if where.offset + row.frame_len > seg.size:
            raise CorruptPage(f"{what}: its frame ends at {where.offset + row.frame_len}, "
                              f"segment {where.seg} holds {seg.size} bytes")
        head = bytearray(HEADER_SIZE)
        try:
            got = tier._segs.read_into(seg, where.offset, [memoryview(head)])
        except OS_ERRORS as exc:
            raise TierUnavailable(f"disk tier: reading segment {where.seg}: {exc}") from exc
        if got != HEADER_SIZE:
            raise CorruptPage(f"{what}: frame header cut short in segment {where.seg}")
        check_header(row, row.frame_len, head)
    finally:
        tier._segs.unpin(seg)


def drop_bad(tier: DiskTier, names: list[bytes]) -> None:
    """Delete rows that failed their checks at a scan, and count them. A key whose
    stored bytes are damaged sits out of B-tree order, where a lookup by key never
    finds it: such an entry is found by walking the database and deleted through the
    cursor. ``used_bytes`` and the segments' live bytes are recounted after."""
    with tier._lock:
        tier._check_open()
        try:
            with tier._env.begin(write=True, buffers=True) as txn:
                for name in names:
                    for db in (tier._frames, tier._meta):
                        delete_exact(txn, db, name)
        except LMDB_ERRORS as exc:
            raise tier._mapped("deleting damaged rows", exc) from exc
        tier._opened = None
        tier.corrupt_rows += len(names)
        recount_locked(tier)
    logger.warning("disk tier: dropped %d rows whose metadata failed its checks", len(names))


def recount_locked(tier: DiskTier) -> None:
    """Sum the frame bytes of every row whose record passes its checks, overall and
    per segment (after a record that failed was replaced or deleted: its own figures
    could not be trusted). The caller holds the tier's lock."""
    used = 0
    live: dict[int, int] = {}
    try:
        with tier._env.begin(buffers=True) as txn:
            for key, value in txn.cursor(db=tier._meta):
                name = bytes(key)
                try:
                    row, where = unpack_record(name, value)
                except CorruptPage:
                    continue
                if where is None:
                    frame = txn.get(name, db=tier._frames)
                    used += 0 if frame is None else len(frame)
                else:
                    used += row.frame_len
                    live[where.seg] = live.get(where.seg, 0) + row.frame_len
    except LMDB_ERRORS as exc:
        raise TierUnavailable(f"disk tier: counting {tier.path}: {exc}") from exc
    tier._used = used
    for seg in tier._segs.ids():
        tier._segs.add_live(seg, live.get(seg, 0) - tier._segs.live_of(seg))
    tier._retire(tier._segs.empty_sealed())


# -- salvage ---------------------------------------------------------------------------

def salvage_hint(exc: TierUnavailable) -> TierUnavailable:
    """An open refused for damage names ``disk_salvage``, as the truncation check does."""
    if "disk_salvage" in str(exc) or not isinstance(exc.__cause__, _DAMAGED):
        return exc
    return TierUnavailable(f"{exc}; set disk_salvage (KVBANK_DISK_SALVAGE=1) to copy the rows "
                           "that can be read into a fresh environment (the damaged files are kept)")


def salvage_index(tier: DiskTier, reason: str, *, map_size: int, sync: bool) -> None:
    """After an open refused for ``reason``: copy the readable rows into a fresh
    environment (the damaged files are kept), open it, and, when segment files hold the
    rows' entries, rebuild the index from them (then LMDB's B-tree is not walked: it
    aborts the process on some damaged pages). Sets ``tier.salvaged``."""
    if hasattr(tier, "_env"):
        tier._env.close()
    logged = bool(tier._segs.ids())
    tier.salvaged = run_salvage(tier.path, reason, partial(_salvage_row, tier),
                                map_size=map_size, walk_meta=not logged)
    tier._open_env(map_size, sync)
    if logged:
        tier.salvaged = _rebuild(tier, tier.salvaged)


def _salvage_row(tier: DiskTier, name: bytes, frame: bytes | None,
                 meta: bytes | None) -> tuple[bytes, bytes | None]:
    """A salvage's check (see :func:`~kvbank.tiers.diskmeta.check_salvaged`): a segment
    row keeps its record when its frame, read from the segment, decodes whole."""
    if frame is None and meta is not None and len(name) == ROW_NAME_BYTES:
        row, where = unpack_record(name, meta)
        if where is not None:
            got = tier._segment_frame(where, row)
            if got is None:
                raise CorruptPage(f"row {name.hex()[:16]}…: segment {where.seg} is gone")
            check_salvaged(name, got, meta)  # decodes (checksum included)
            return meta, None
    return check_salvaged(name, frame, meta), frame


def _rebuild(tier: DiskTier, report: SalvageReport) -> SalvageReport:
    """Index every row the segment files hold (after a salvage of a damaged index):
    each entry names its row and carries its record, a later entry supersedes an
    earlier one, and a frame that does not decode whole is dropped. Newest rows first
    until the budget is full. Rows deleted but not yet compacted away come back: their
    bytes are still the row's (equal names, interchangeable bytes)."""
    def frame_len(name: bytes, record: bytes) -> int | None:
        try:
            return unpack_record(name, record)[0].frame_len
        except CorruptPage:
            return None

    found: dict[bytes, tuple[DiskRow, Where]] = {}
    for seg in tier._segs.ids():
        for name, record, off, _ in tier._segs.entries(seg, frame_len):
            found[name] = (unpack_record(name, record)[0], Where(seg, off))
    kept: list[tuple[DiskRow, Where]] = []
    dropped = 0
    first = report.first_error
    used = 0
    for row, where in sorted(found.values(), key=lambda rw: -rw[0].seq):
        try:
            frame = tier._segment_frame(where, row)
            if frame is None:
                raise CorruptPage(f"row {row.name.hex()[:16]}…: segment {where.seg} is gone")
            check_salvaged(row.name, frame, None)
        except CorruptPage as exc:
            dropped += 1
            first = first or str(exc)
            continue
        if used + row.frame_len > tier._budget:
            dropped += 1
            continue
        used += row.frame_len
        kept.append((row, where))
    try:
        with tier._env.begin(write=True) as txn:
            for row, where in kept:
                txn.delete(row.name, db=tier._frames)  # an older copy: the segment's is newer
                txn.put(row.name, pack_meta(row.name, row.raw_len, row.frame_len, row.seq,
                                            row.dtype, row.parent, where), db=tier._meta)
    except LMDB_ERRORS as exc:
        raise tier._mapped("rebuilding the index from the segments", exc) from exc
    return replace(report, copied=report.copied + len(kept),
                   dropped=report.dropped + dropped, first_error=first)


# -- the tier's invariants -------------------------------------------------------------

def check(tier: DiskTier) -> None:
    """Every record passes its checks; an older-layout row has its ``frames`` value
    (of the recorded length) and a segment row none, its frame inside its segment;
    no ``frames`` value lacks a record; ``used_bytes`` and each segment's live bytes
    are the sums of the rows'."""
    tier._check_open()
    try:
        with tier._lock, tier._env.begin(buffers=True) as txn:
            frames = {bytes(k): len(v) for k, v in txn.cursor(db=tier._frames)}
            try:
                metas = {bytes(k): unpack_record(bytes(k), v)
                         for k, v in txn.cursor(db=tier._meta)}
            except CorruptPage as exc:
                raise AssertionError(f"disk tier: {exc}") from exc
            live = {seg: tier._segs.live_of(seg) for seg in tier._segs.ids()}
            sizes = {seg: tier._segs.size_of(seg) for seg in tier._segs.ids()}
            used = tier._used
    except LMDB_ERRORS as exc:
        raise TierUnavailable(f"disk tier: checking {tier.path}: {exc}") from exc
    if frames.keys() - metas.keys():
        raise AssertionError(f"disk tier: {len(frames.keys() - metas.keys())} frames "
                             "have no meta record")
    total = 0
    counted: dict[int, int] = {}
    for name, (row, where) in metas.items():
        tag = name.hex()[:16]
        if where is None:
            if frames.get(name) != row.frame_len:
                raise AssertionError(f"disk tier: {tag}… frame is {frames.get(name)} "
                                     f"bytes, meta says {row.frame_len}")
        else:
            if name in frames:
                raise AssertionError(f"disk tier: {tag}… is in a segment and in frames")
            size = sizes.get(where.seg)
            if size is None or where.offset + row.frame_len > size:
                raise AssertionError(f"disk tier: {tag}… lies outside segment {where.seg}")
            counted[where.seg] = counted.get(where.seg, 0) + row.frame_len
        total += row.frame_len
    if total != used:
        raise AssertionError(f"disk tier: used_bytes {used} != frames {total}")
    for seg, n in live.items():
        if counted.get(seg, 0) != n:
            raise AssertionError(f"disk tier: segment {seg} live bytes {n} != its rows' "
                                 f"{counted.get(seg, 0)}")
    if total > tier._budget:
        raise AssertionError(f"disk tier: {total} bytes over the budget {tier._budget}")
