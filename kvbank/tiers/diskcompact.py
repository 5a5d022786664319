"""The disk tier's compaction: live frames moved out of mostly-dead segments (and out of
the older layout's LMDB values) so that whole segment files can go.

Primitives:

- :func:`compact` — every older-layout row (with ``legacy``), then the rows of sparse
  sealed segments (emptiest first), rewritten into the active segment a batch at a time;
  a segment left with no live frame is unlinked. Stops after ``budget`` bytes written.
- :func:`run_compactor` — the background compactor's loop (one thread per tier): woken
  when a delete leaves a sealed segment sparse, it moves at most the tier's
  ``compact_bytes`` per wake-up (the write budget).
- :class:`CompactReport` — what one compaction did.

Each batch is one append to the segments (durable before its index commit: the
write-ahead order of every other write) and one index transaction, taken under the
tier's lock, which is let go between batches so that puts and reads go on.
:class:`~kvbank.tiers.disk.DiskTier` owns the state; these functions are its
``compact`` and its compactor thread, kept apart from the read and write paths.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbank.errors import CorruptPage, KvbankError, TierUnavailable
from kvbank.tiers.disklegacy import locate
from kvbank.tiers.disklog import mark
from kvbank.tiers.diskmeta import LMDB_ERRORS, DiskRow, Where, pack_meta, unpack_record
from kvbank.tiers.diskseg import entry_head

if TYPE_CHECKING:
    from kvbank.tiers.disk import DiskTier

logger = logging.getLogger("kvbank.tiers.disk")

DEFAULT_COMPACT_BYTES = 64 << 20  # the background compactor's writes per wake-up
COMPACT_BATCH = 32  # rows per compaction batch (one append + one index commit)


@dataclass(frozen=True, slots=True)
class CompactReport:
    """What a compaction did: rows moved, bytes written, segments and older-layout rows
    it emptied."""

    moved: int
    written: int
    segments_freed: int
    legacy_moved: int

    def summary(self) -> str:
        return (f"disk: compacted {self.moved} rows ({self.written} bytes written): "
                f"{self.legacy_moved} from the older layout, {self.segments_freed} segments freed")


def compact(tier: DiskTier, *, legacy: bool = True, budget: int | None = None) -> CompactReport:
    """Rewrite live rows into the active segment: every older-layout row (with
    ``legacy``), then the rows of sparse sealed segments (emptiest first), which are
    then unlinked. Stops after ``budget`` bytes written (``None``: no limit). Rows are
    moved a batch at a time, each batch durable before its index commit, with the
    tier's lock let go between batches so that puts and reads go on."""
    tier._check_open()
    moved = written = freed = legacy_moved = 0
    limit = budget if budget is not None else 1 << 62
    for names, from_legacy in _plan(tier, legacy):
        for i in range(0, len(names), COMPACT_BATCH):
            if written >= limit:
                break
            n, nbytes, gone = _move(tier, names[i : i + COMPACT_BATCH])
            moved += n
            written += nbytes
            freed += gone
            legacy_moved += n if from_legacy else 0
    report = CompactReport(moved, written, freed, legacy_moved)
    if moved:
        logger.debug("%s", report.summary())
    return report


def _plan(tier: DiskTier, legacy: bool) -> list[tuple[list[bytes], bool]]:
    """The names to move: the older-layout rows, then each sparse segment's rows."""
    sparse = tier._segs.sparse()
    rank = {seg: i for i, seg in enumerate(sparse)}
    old: list[bytes] = []
    by_seg: list[list[bytes]] = [[] for _ in sparse]
    try:
        with tier._env.begin(buffers=True) as txn:
            for key, value in txn.cursor(db=tier._meta):
                name = bytes(key)
                try:
                    _, where = unpack_record(name, value)
                except CorruptPage:
                    continue  # a read drops it
                if where is None:
                    old.append(name)
                elif where.seg in rank:
                    by_seg[rank[where.seg]].append(name)
    except LMDB_ERRORS as exc:
        raise TierUnavailable(f"disk tier: planning a compaction: {exc}") from exc
    plan = [(old, True)] if legacy and old else []
    return plan + [(names, False) for names in by_seg]


def _move(tier: DiskTier, names: Sequence[bytes]) -> tuple[int, int, int]:
    """Rewrite these rows (as they are now) into the active segment; rows moved,
    bytes written, segments freed."""
    segs = tier._segs
    with tier._lock:
        tier._check_open()
        batch: list[tuple[DiskRow, Where | None, bytes]] = []
        try:
            with tier._env.begin(write=True, buffers=True) as txn:
                for name in names:
                    try:
                        found = locate(txn, tier._meta, tier._frames, name)
                    except CorruptPage:
                        continue  # left for a read to drop and count
                    if found is None:
                        continue  # deleted since the plan
                    row, where, legacy = found
                    if where is None:
                        assert legacy is not None
                        frame = bytes(legacy)
                    else:
                        if where.seg == segs.active:
                            continue
                        try:
                            got = tier._segment_frame(where, row)
                        except CorruptPage:
                            continue
                        if got is None:
                            continue
                        frame = got
                    batch.append((row, where, frame))
                if not batch:
                    return 0, 0, 0
                at = segs.append([
                    (entry_head(r.name, pack_meta(r.name, r.raw_len, len(f), r.seq, r.dtype,
                                                  r.parent)), f) for r, _, f in batch])
                mark(txn, tier._log, at[-1][0], at[-1][1] + len(batch[-1][2]))
                for (row, _, frame), (seg, off) in zip(batch, at, strict=True):
                    txn.put(row.name, pack_meta(row.name, row.raw_len, len(frame), row.seq,
                                                row.dtype, row.parent, Where(seg, off)),
                            db=tier._meta)
                    txn.delete(row.name, db=tier._frames)
        except LMDB_ERRORS as exc:
            raise tier._mapped("compacting", exc) from exc
        for (_, _, frame), (seg, _) in zip(batch, at, strict=True):
            segs.add_live(seg, len(frame))
        freed = tier._let_go([(w.seg, row.frame_len) for row, w, _ in batch if w is not None])
        tier._opened = None
        return len(batch), sum(len(f) for _, _, f in batch), freed


def run_compactor(tier: DiskTier) -> None:
    """The background compactor: woken when a delete leaves a sealed segment sparse,
    it moves at most ``compact_bytes`` per wake-up (the write budget)."""
    while True:
        tier._wake.wait()
        tier._wake.clear()
        if tier._closed:
            return
        try:
            compact(tier, legacy=False, budget=tier._compact_bytes)
        except KvbankError as exc:  # a degraded disk: the next delete tries again
            if tier._closed:
                return
            logger.warning("disk tier: background compaction failed: %s", exc)
