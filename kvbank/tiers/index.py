"""The store's row index: one dict entry plus ~36 bytes of parallel arrays per row.

A Python object per row (a dataclass, even a tuple) costs 60-100 bytes on top of the dict
entry, which would put a million-row index well past 200 bytes a row. Instead each row
gets an integer id, and its fields live in numpy arrays indexed by that id:

=========  =======  ================================================================
array      dtype    meaning
=========  =======  ================================================================
size       uint32   page bytes
where      uint8    tier bits, ``1 << TierKind.rank``: DEVICE=1, HOST=2, DISK=4
                    (HOST|DISK = a clean host copy)
off        uint32   memory slot offset >> 6 (slots are 64-byte aligned); int64 when the
                    tiers' address space does not fit that
dtype      uint8    code into :attr:`RowIndex.dtypes` (the codec needs it on demotion)
parent     int32    id of the previous page of the chain, -1 for none
atime      uint32   logical clock of the last put/get; also the row's version stamp.
                    Before it wraps, stamps are renumbered by rank (order kept)
flags      uint8    MOVING: a demotion job holds the row; SUMMED: ``checksum`` is set
checksum   uint64   xxh3-64 of the row's bytes (:func:`kvbank.codec.checksum`), taken when
                    a memory copy was committed: a memory read is verified against it
freq       uint8    uses of the row's name (puts and reads), saturating at 255, counted
                    from the :class:`ReuseHistory` at add: a row evicted and put again
                    remembers that it was used before
vkey       uint32   the value eviction rule's key, written with ``atime`` at each use:
                    ``2 * (stamp + head) + 1`` for a reused row (``freq`` >= REUSED),
                    ``2 * stamp`` for a first-time one; ``head`` is REUSE_SPAN times the
                    index's live rows at that use. Unique like the stamps, so an
                    eviction orders it exactly as it orders ``atime`` under LRU, at the
                    same cost (:mod:`kvbank.tiers.store.policy`)
=========  =======  ================================================================

Reuse history: :class:`ReuseHistory` is a small count sketch (two uint8 slots per name,
the smaller one read) of the names used lately, rows gone from the store included; it is
halved every quarter of its size in notes, so a name seen once is forgotten after about
that many uses of others. The value eviction rule reads ``freq`` (see
:mod:`kvbank.tiers.store.policy`).

Ages without a per-row field: the index keeps a short list of *clock marks* — (stamp,
time) pairs, one at most every 50 ms while stamps are issued, thinned by half past 4,096 —
and a row's age is the time since the last mark at or before its stamp (at most one mark
interval too old for recent rows, coarser for old ones).

Removed ids are not reused at once: a child may still name one as its parent. They wait
in a pending list; one vectorised pass every ``n/8`` removals clears the parent links
that point at them, and only then are they reused.

Names in order: :class:`OrderedNames` keeps every live name sorted, so that listing one
page of rows by name prefix after a cursor costs O(log n + page) instead of sorting the
name table. It is a list of sorted sublists of at most ``2 * _LOAD`` references to the
very bytes objects the dict holds (about 9 bytes a row: a pointer and the lists' slack),
plus the sublists' maxima to bisect on; an insert or a removal is two bisects and a
memmove of at most a few kilobytes. Not thread-safe (the store locks).
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbank.errors import InvalidInput
from kvbank.tiers.base import TierKind


def tier_bit(kind: TierKind) -> int:
    """A tier's bit in ``where``: derived from its position in the tier order."""
    return 1 << kind.rank


DEV, HOST, DISK = (tier_bit(k) for k in (TierKind.DEVICE, TierKind.HOST, TierKind.DISK))
KIND_OF_BIT = {tier_bit(k): k for k in TierKind}
MOVING = 1  # bit in `flags`
SUMMED = 2  # bit in `flags`: `checksum` holds the row's checksum
OFF_SHIFT = 6  # memory slot offsets are multiples of 64 (slots.SMALL_ALIGN)
_MIN_CAP = 1024
# The value rule (kvbank.tiers.store.policy): a row used at least REUSED times counts as
# reused and is keyed REUSE_SPAN times the live rows later than its stamp. Chosen on the
# first half of the Mooncake trace and checked on its second half and on generated
# traces (docs/tiers.md); 1 to 8 score within a point of each other there.
REUSE_SPAN = 4
REUSED = 2
_HEAD_MAX = 2**29  # the head start's cap (a 134 M-row index), so value keys fit 32 bits
# Stamps are renumbered before the value keys, 2 * (stamp + head) + 1, would pass 32 bits.
_CLOCK_MAX = 2**31 - 1 - _HEAD_MAX
_MARK_S = 0.05  # seconds between clock marks at most (the resolution of ages)
_MAX_MARKS = 4096

_LOAD = 512  # sublist length of OrderedNames after a split (splits above 2 * _LOAD)

I64 = npt.NDArray[np.int64]


def _after_prefix(prefix: bytes) -> bytes | None:
    """The least byte string above every string starting with ``prefix`` (None: none is)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


class OrderedNames:
    """A sorted set of names: add, discard, and pages by prefix after a cursor."""

    def __init__(self) -> None:
        self._lists: list[list[bytes]] = []  # sorted, disjoint, in order
        self._maxes: list[bytes] = []  # the last name of each sublist
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def add(self, name: bytes) -> None:
        """Insert ``name`` (the caller guarantees it is not present)."""
        maxes, lists = self._maxes, self._lists
        if not maxes:
            lists.append([name])
            maxes.append(name)
            self._len = 1
            return
        i = bisect_left(maxes, name)
        if i == len(maxes):  # past every name: the last sublist grows at its end
            i -= 1
            lists[i].append(name)
            maxes[i] = name
        else:
            insort(lists[i], name)
        self._len += 1
        lst = lists[i]
        if len(lst) > 2 * _LOAD:
            lists.insert(i + 1, lst[_LOAD:])
            del lst[_LOAD:]
            maxes.insert(i, lst[-1])

    def discard(self, name: bytes) -> bool:
        """Remove ``name``; whether it was there."""
        maxes = self._maxes
        i = bisect_left(maxes, name)
        if i == len(maxes):
            return False
        lst = self._lists[i]
        j = bisect_left(lst, name)
        if j == len(lst) or lst[j] != name:
            return False
        del lst[j]
        self._len -= 1
        if not lst:
            del self._lists[i]
            del maxes[i]
        elif j == len(lst):
            maxes[i] = lst[-1]
        return True

    def page(self, prefix: bytes, after: bytes | None, limit: int) -> list[bytes]:
        """Up to ``limit`` names starting with ``prefix``, in order, each greater than
        ``after`` when it is given."""
        if after is not None and after >= prefix:
            start, find = after, bisect_right  # strictly after the cursor
        else:
            start, find = prefix, bisect_left  # the first name >= prefix
        lists = self._lists
        i = find(self._maxes, start)
        out: list[bytes] = []
        j = find(lists[i], start) if i < len(lists) else 0
        while i < len(lists) and len(out) < limit:
            for name in lists[i][j : j + limit - len(out)]:
                if not name.startswith(prefix):
                    return out
                out.append(name)
            i += 1
            j = 0
        return out

    def count(self, prefix: bytes) -> int:
        """How many names start with ``prefix``: two bisects and the lengths of the
        sublists between them, never the names themselves."""
        if not prefix:
            return self._len
        end = _after_prefix(prefix)
        return self._rank(end) - self._rank(prefix) if end is not None else self._len - self._rank(prefix)

    def _rank(self, name: bytes) -> int:
        """How many names sort before ``name``."""
        i = bisect_left(self._maxes, name)
        before = sum(len(lst) for lst in self._lists[:i])
        return before + (bisect_left(self._lists[i], name) if i < len(self._lists) else 0)

    def __iter__(self) -> Iterator[bytes]:
        for lst in self._lists:
            yield from lst

    def check(self) -> None:
        """Sublists sorted, non-empty, in order, maxima right, length right."""
        prev: bytes | None = None
        n = 0
        if len(self._lists) != len(self._maxes):
            raise AssertionError("ordered names: sublists and maxima disagree in number")
        for lst, top in zip(self._lists, self._maxes, strict=True):
            if not lst or lst[-1] != top or len(lst) > 2 * _LOAD:
                raise AssertionError("ordered names: a sublist is empty, too long or its maximum is stale")
            for name in lst:
                if prev is not None and not prev < name:
                    raise AssertionError("ordered names: names out of order or repeated")
                prev = name
            n += len(lst)
        if n != self._len:
            raise AssertionError(f"ordered names: {n} names, length says {self._len}")


_HISTORY_MIN_BITS = 20  # 1 MiB of counters: the reuse horizon is ~256 k uses at least


class ReuseHistory:
    """How often each name was used lately, rows no longer stored included: a count-min
    sketch of two uint8 slots per name (Python's cached hash of the name bytes), halved
    every ``size / 4`` notes so that old uses fade and the table stays sparse (few false
    "seen before"). Grows with the index by tiling, which keeps every count: a hash's slot
    modulo ``2 size`` tiles the one modulo ``size``."""

    __slots__ = ("_mask", "_notes", "counts")

    def __init__(self, bits: int = _HISTORY_MIN_BITS) -> None:
        self.counts = np.zeros(1 << bits, np.uint8)
        self._mask = (1 << bits) - 1
        self._notes = 0

    def seen(self, name: bytes) -> int:
        """Uses of ``name`` the sketch remembers (an upper bound)."""
        h = hash(name)
        c = self.counts
        return int(min(c[h & self._mask], c[(h >> 32) & self._mask]))

    def note(self, name: bytes) -> None:
        """Count one use of ``name``."""
        h = hash(name)
        c, m = self.counts, self._mask
        for i in (h & m, (h >> 32) & m):
            if c[i] < 255:
                c[i] += 1
        self._notes += 1
        if self._notes >= c.shape[0] >> 2:
            self._notes = 0
            c >>= 1

    def note_many(self, names: Sequence[bytes]) -> None:
        """:meth:`note` of each of ``names`` in turn, counted in arrays: a lease of 252
        rows noted them in 0.2 ms one by one (numpy scalar reads and writes per slot).
        The same counts: a slot used k times gains k (up to 255), and the halving falls
        after the same note as in turn."""
        hs = np.fromiter(map(hash, names), dtype=np.int64, count=len(names)).view(np.uint64)
        mask = np.uint64(self._mask)
        at = 0
        while at < hs.size:
            c = self.counts
            part = hs[at : at + (c.shape[0] >> 2) - self._notes]
            slots, uses = np.unique(np.concatenate((part & mask, (part >> np.uint64(32)) & mask)),
                                    return_counts=True)
            c[slots] = np.minimum(c[slots] + uses, 255)
            self._notes += part.size
            at += part.size
            if self._notes >= c.shape[0] >> 2:
                self._notes = 0
                c >>= 1

    def fit(self, rows: int) -> None:
        """Keep at least four slots a row (the index grew)."""
        size = self.counts.shape[0]
        if size >= 4 * rows:
            return
        while size < 4 * rows:
            size *= 2
        self.counts = np.tile(self.counts, size // self.counts.shape[0])
        self._mask = size - 1


class RowIndex:
    """Rows by name -> id, fields in parallel arrays."""

    def __init__(self, max_offset: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._now = clock
        self._t0 = clock()
        self.ids: dict[bytes, int] = {}
        self.names: list[bytes | None] = []
        self.ordered = OrderedNames()  # the live names, sorted (admin listings)
        self.dtypes: list[str] = []
        self._dtype_codes: dict[str, int] = {}
        self.wide = (max_offset >> OFF_SHIFT) >= 2**32
        cap = _MIN_CAP
        self.size = np.zeros(cap, np.uint32)
        self.where = np.zeros(cap, np.uint8)
        self.off: npt.NDArray[Any] = np.zeros(cap, np.int64 if self.wide else np.uint32)
        self.dtype = np.zeros(cap, np.uint8)
        self.parent = np.full(cap, -1, np.int32)
        self.atime = np.zeros(cap, np.uint32)
        self.flags = np.zeros(cap, np.uint8)
        self.freq = np.zeros(cap, np.uint8)
        self.checksum = np.zeros(cap, np.uint64)
        self.vkey = np.zeros(cap, np.uint32)
        self.history = ReuseHistory()
        self._mark_c: list[int] = []  # stamps of the clock marks, increasing
        self._mark_t: list[float] = []  # when each was issued
        self._free: list[int] = []
        self._pending: list[int] = []
        self.clock = 0

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def high(self) -> int:
        """One past the highest id ever used (array prefix worth scanning)."""
        return len(self.names)

    def dtype_code(self, dtype: str) -> int:
        code = self._dtype_codes.get(dtype)
        if code is None:
            if not isinstance(dtype, str) or not dtype:
                raise InvalidInput(f"dtype: expected a dtype name, got {dtype!r}")
            if len(self.dtypes) >= 255:
                raise InvalidInput(f"dtype: more than 255 distinct dtypes (got {dtype!r})")
            code = len(self.dtypes)
            self.dtypes.append(dtype)
            self._dtype_codes[dtype] = code
        return code

    def _grow(self) -> None:
        cap = self.size.shape[0] * 2
        for attr in _ARRAYS:
            old = getattr(self, attr)
            new = np.full(cap, -1, old.dtype) if attr == "parent" else np.zeros(cap, old.dtype)
            new[: old.shape[0]] = old
            setattr(self, attr, new)
        self.history.fit(cap)

    def add(self, name: bytes, size: int, dtype: int, parent: int) -> int:
        if self._free:
            rid = self._free.pop()
            self.names[rid] = name
        else:
            rid = len(self.names)
            if rid >= self.size.shape[0]:
                self._grow()
            self.names.append(name)
        if name not in self.ids:
            self.ordered.add(name)
        self.ids[name] = rid
        self.size[rid] = size
        self.where[rid] = 0
        self.dtype[rid] = dtype
        self.parent[rid] = parent
        self.flags[rid] = 0
        self.freq[rid] = min(254, self.history.seen(name))  # touch adds this use
        self.touch(rid)
        return rid

    def remove(self, rid: int) -> None:
        name = self.names[rid]
        if name is not None:
            del self.ids[name]
            self.ordered.discard(name)
        self.names[rid] = None
        self.where[rid] = 0
        self.flags[rid] = 0
        self.parent[rid] = -1
        self._pending.append(rid)
        if len(self._pending) >= max(64, len(self.names) // 8):
            self._compact()

    def _compact(self) -> None:
        gone = np.asarray(self._pending, dtype=np.int32)
        n = len(self.names)
        stale = np.isin(self.parent[:n], gone)
        self.parent[:n][stale] = -1
        self._free.extend(self._pending)
        self._pending.clear()

    def touch(self, rid: int) -> int:
        """Stamp the row as just used; the stamp doubles as a version for races."""
        if self.clock >= _CLOCK_MAX:
            self.renumber()
        self.clock += 1
        self.atime[rid] = self.clock
        if self.freq[rid] < 255:
            self.freq[rid] += 1
        if self.freq[rid] >= REUSED:
            self.vkey[rid] = 2 * (self.clock + self._head()) + 1
        else:
            self.vkey[rid] = 2 * self.clock
        name = self.names[rid]
        if name is not None:
            self.history.note(name)
        self._mark(self.clock)
        return self.clock

    def touch_many(self, rids: I64) -> I64:
        """:meth:`touch` for distinct rows in the order given; their new stamps."""
        k = int(rids.size)
        if self.clock + k >= _CLOCK_MAX:
            self.renumber()
        stamps = np.arange(self.clock + 1, self.clock + k + 1, dtype=np.int64)
        self.atime[rids] = stamps
        freq = np.minimum(self.freq[rids], 254) + 1
        self.freq[rids] = freq
        self.vkey[rids] = self._value_keys(stamps, freq)
        names = self.names
        self.history.note_many([n for n in map(names.__getitem__, rids.tolist()) if n is not None])
        if k:
            self._mark(self.clock + 1)
        self.clock += k
        return stamps

    def renumber(self) -> None:
        """Replace stamps by their rank among live rows (1..n), keeping the LRU order,
        so that the 32-bit clock never wraps. In-flight version checks then fail, which
        only skips a promotion."""
        n = len(self.names)
        live = np.flatnonzero(self.where[:n] != 0)
        order = live[np.argsort(self.atime[live], kind="stable")]
        old = self.atime[order].astype(np.int64)
        self.atime[:n] = 0
        self.atime[order] = np.arange(1, order.size + 1, dtype=np.uint32)
        self.clock = int(order.size)
        # The value keys of the ranks, with the head start of the live rows now (a
        # reused row keeps its head start over the first-time rows, in ranks).
        self.vkey[order] = self._value_keys(self.atime[order].astype(np.int64), self.freq[order])
        # A mark (c, t) says "stamps >= c were issued at or after t"; in ranks that is the
        # rank of the first live stamp >= c.
        ranks = np.searchsorted(old, np.asarray(self._mark_c, dtype=np.int64), side="left") + 1
        self._mark_c = ranks.tolist()

    def _head(self) -> int:
        """The value rule's head start for a reused row, in stamps (see ``vkey``)."""
        return min(REUSE_SPAN * len(self.ids), _HEAD_MAX)

    def _value_keys(self, stamps: I64, freq: npt.NDArray[Any]) -> npt.NDArray[np.uint32]:
        reused = (freq >= REUSED).astype(np.int64)
        return (2 * (stamps + reused * self._head()) + reused).astype(np.uint32)

    def get_off(self, rid: int) -> int:
        v = int(self.off[rid])
        return v if self.wide else v << OFF_SHIFT

    def set_off(self, rid: int, offset: int) -> None:
        self.off[rid] = offset if self.wide else offset >> OFF_SHIFT

    def set_checksum(self, rid: int, value: int | None) -> None:
        """Record the row's checksum (None: forget it; the next memory copy sets it)."""
        if value is None:
            self.flags[rid] = int(self.flags[rid]) & ~SUMMED
            return
        self.checksum[rid] = value
        self.flags[rid] = int(self.flags[rid]) | SUMMED

    def get_checksum(self, rid: int) -> int | None:
        """The row's checksum, None when no memory copy recorded one."""
        return int(self.checksum[rid]) if int(self.flags[rid]) & SUMMED else None

    def parent_name(self, rid: int) -> bytes | None:
        p = int(self.parent[rid])
        return self.names[p] if p >= 0 else None

    def live_ids(self) -> I64:
        n = len(self.names)
        return np.flatnonzero(self.where[:n] != 0).astype(np.int64)

    def nbytes(self) -> int:
        """Bytes of the arrays (the dict and names list are measured by the caller)."""
        return sum(int(getattr(self, a).nbytes) for a in _ARRAYS) + int(self.history.counts.nbytes)

    def check(self) -> list[str]:
        """The ordered names hold exactly the live names (the checker calls it)."""
        try:
            self.ordered.check()
        except AssertionError as exc:
            return [str(exc)]
        if len(self.ordered) != len(self.ids) or any(n not in self.ids for n in self.ordered):
            return [f"ordered names: {len(self.ordered)} names, not the index's {len(self.ids)}"]
        return []

    @property
    def marks(self) -> int:
        """How many clock marks the index keeps (bounded by 4,096)."""
        return len(self._mark_c)

    def _mark(self, stamp: int) -> None:
        t = self._now()
        if not self._mark_t or t - self._mark_t[-1] >= _MARK_S:
            self._mark_c.append(stamp)
            self._mark_t.append(t)
            if len(self._mark_c) > _MAX_MARKS:  # halve, keeping the newest mark exact
                del self._mark_c[-2::-2]
                del self._mark_t[-2::-2]

    def age_s(self, rid: int) -> float:
        """Seconds since the row was last put, read or touched (see the clock marks)."""
        i = bisect_right(self._mark_c, int(self.atime[rid])) - 1
        since = self._mark_t[i] if i >= 0 else self._t0
        return max(0.0, self._now() - since)


_ARRAYS = ("size", "where", "off", "dtype", "parent", "atime", "flags", "freq", "checksum", "vkey")
