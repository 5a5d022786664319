"""Eviction policy: which rows leave a tier, as a pure function over the row index.

:func:`victims` answers row ids in the order to take them out of tier ``bit`` to free
``need`` bytes, oldest *key* first, with prefix awareness — a row is not chosen while one
of its children (``parent=`` links) is an evictable candidate in the same tier, so chains
go from their tail and the longest usable prefixes stay. Rows in ``keep`` (locked or
pinned), rows whose slot is busy and rows being moved are never chosen. It reads the index
and changes nothing; the caller holds the store lock.

Two rules give the key (:class:`~kvbank.config.EvictionPolicy`):

- ``lru``: the row's stamp (the index's logical clock at its last put or read).
- ``value`` (the default): the stamp, plus a head start of :data:`REUSE_SPAN` times the
  index's live rows for a row whose name was used at least twice (``freq``, which the
  index's reuse history carries across evictions). On prompt traces most pages are used
  once and never again, and a page that was used before is several times likelier to be
  used again (docs/tiers.md, "Eviction"); under LRU the one-time pages push the reused
  ones out. The head start is a bounded age bonus, not a class: a reused row that stops
  being used still ages out, REUSE_SPAN index-fulls of uses later than a first-time row.

The index writes each row's value key (``vkey``) at each use, as it writes the stamp, so
the value order is read exactly like the LRU order and a value eviction costs what an
LRU one does (``kvbank bench tiers``, ``evict-1m-value-choice``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import numpy.typing as npt

from kvbank.config import EvictionPolicy
from kvbank.tiers.allocator import PAGE_ALIGN, SMALL_ALIGN
from kvbank.tiers.index import HOST, MOVING, OFF_SHIFT, REUSE_SPAN, REUSED, RowIndex

LRU_FIRST_K = 64  # victims ordered in the first chunk at least (see lru_order)
__all__ = ["REUSED", "REUSE_SPAN", "keys", "lru_order", "order", "victims"]


def victims(
    ix: RowIndex,
    bit: int,
    need: int,
    *,
    keep: Iterable[int],
    busy_offs: set[int],
    host_copy: dict[int, int],
    charge: Callable[[int], int],
    cls: int | None = None,
    first_k: int = LRU_FIRST_K,
    rule: EvictionPolicy = EvictionPolicy.LRU,
) -> list[int]:
    """Row ids to take out of tier ``bit`` to free ``need`` bytes (``charge(rid)`` bytes
    each). With ``cls`` only rows in slots of that capacity (so each frees a usable slot).
    ``busy_offs``: offsets in this tier being copied; ``host_copy``: rid → host offset of
    rows staged in both memory tiers."""
    n = ix.high
    if n == 0 or need <= 0:
        return []
    where = ix.where[:n]
    cand = ((where & bit) != 0) & ((ix.flags[:n] & MOVING) == 0)
    keep_ids = list(keep)
    if busy_offs:
        # Compare the encoded offsets in one pass. A staged row in both memory tiers
        # keeps its device offset in `off`; a numeric clash only keeps a row longer.
        enc = [o if ix.wide else o >> OFF_SHIFT for o in busy_offs]
        cand &= ~np.isin(ix.off[:n], np.asarray(enc, dtype=ix.off.dtype))
        if bit == HOST:
            keep_ids.extend(rid for rid, hoff in host_copy.items() if hoff in busy_offs)
    if keep_ids:
        cand[np.asarray(keep_ids, dtype=np.int64)] = False
    idx = np.flatnonzero(cand)
    if cls is not None and idx.size:
        size = ix.size[idx].astype(np.int64)
        align = np.where(size >= PAGE_ALIGN, PAGE_ALIGN, SMALL_ALIGN)
        same = (-(-size // align) * align) == cls
        cand[idx[~same]] = False
        idx = idx[same]
    if idx.size == 0:
        return []
    parents = ix.parent[idx]
    blockers = np.bincount(parents[parents >= 0], minlength=n)
    blockers[~cand] = 0  # only evictable rows are blocked
    parent_of = ix.parent
    out: list[int] = []
    taken: set[int] = set()
    deferred: set[int] = set()
    freed = 0
    for rid in order(ix, idx, need, first_k, rule):
        if freed >= need:
            break
        if rid in taken:
            continue
        if blockers[rid] > 0:
            deferred.add(rid)
            continue
        cur = rid
        while True:  # take cur, then walk up while its parent became a free tail
            taken.add(cur)
            out.append(cur)
            freed += charge(cur)
            p = int(parent_of[cur])
            if p < 0 or not cand[p]:
                break
            blockers[p] -= 1
            if blockers[p] > 0 or p not in deferred or freed >= need:
                break
            deferred.discard(p)
            cur = p
    return out


def keys(ix: RowIndex, idx: npt.NDArray[np.int64],
         rule: EvictionPolicy = EvictionPolicy.LRU) -> npt.NDArray[np.int64]:
    """The eviction keys of the candidate ids ``idx`` under ``rule``, smallest first out:
    the stamps, or the value keys the index wrote at each row's last use (``vkey``:
    doubled, plus the class bit, so they stay unique — a reused row whose head start
    lands on a first-time row's stamp sorts after it — and chunks sort exactly).
    :func:`order` yields this order without building all of them."""
    keys_of = ix.vkey if rule is EvictionPolicy.VALUE else ix.atime
    return keys_of[idx].astype(np.int64)


def order(ix: RowIndex, idx: npt.NDArray[np.int64], need: int,
          first_k: int = LRU_FIRST_K,
          rule: EvictionPolicy = EvictionPolicy.LRU) -> Iterator[int]:
    """The candidate ids ``idx`` in the order of :func:`keys`, sorting only what the
    caller consumes: the stored 32-bit keys of the rule (the stamps, or the value keys
    the index wrote beside them), so both rules' partial sorts cost the same."""
    keys_of = ix.vkey if rule is EvictionPolicy.VALUE else ix.atime
    yield from lru_order(ix, idx, need, first_k, keys_of[idx])


def lru_order(ix: RowIndex, idx: npt.NDArray[np.int64], need: int,
              first_k: int = LRU_FIRST_K,
              stamps: npt.NDArray[np.uint32] | None = None) -> Iterator[int]:
    """The candidate ids ``idx``, oldest stamp first, sorting only what the caller
    consumes: ``np.argpartition`` takes the k oldest (k from the bytes needed, with room
    for chain prefixes the caller defers), sorts those, and k grows 4x while the caller
    wants more. Live stamps are unique (a clock), so the chunks concatenate to exactly
    the full sort's order. Cost: O(candidates) per chunk, not a full sort. ``stamps``:
    other unique keys of ``idx`` to order by (the value rule's)."""
    if idx.size == 0:
        return
    if stamps is None:
        stamps = ix.atime[idx]
    sample = idx[:: max(1, idx.size // 4096)]  # the mean row size, from a strided sample
    avg = max(1.0, float(ix.size[sample].mean()))
    k = max(first_k, 2 * int(need / avg) + 1)
    while idx.size:
        if idx.size <= k:
            yield from idx[np.argsort(stamps, kind="stable")].tolist()
            return
        part = np.argpartition(stamps, k - 1)
        head, rest = part[:k], part[k:]
        yield from idx[head[np.argsort(stamps[head], kind="stable")]].tolist()
        idx, stamps = idx[rest], stamps[rest]
        k *= 4
