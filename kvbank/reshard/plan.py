"""Resharding: which bytes of which source shards make a page of another shard count.

A fleet runs one model at several tensor-parallel sizes. Two layouts that are equal but
for the shard count (and index) describe the same logical page cut differently, and each
buffer's split (:class:`~kvbank.layout.Split`) says exactly how, so the bytes a
destination rank needs follow from the two layouts alone.

Primitives:

- :func:`refusal` — why two layouts cannot be resharded into each other (the first
  differing field of their TP 1 forms), or ``None``; :func:`check_compatible` raises it
  as a :class:`~kvbank.errors.LayoutError`.
- :func:`shard_layout` — a layout as declared for another shard count (the inverse of
  :meth:`~kvbank.layout.PageLayout.unsharded`); a head count or section that does not
  divide (and cannot duplicate evenly) is refused naming the buffer.
- :func:`plan_reshard` — the :class:`ReshardPlan` for one destination rank from a source
  shard count: per group, the source shards needed and the strided byte copies
  (:class:`Copy`) from their pages into the destination page.

Lifecycle: a worker at TP m, rank j, finds rows stored under TP n (same
:attr:`~kvbank.layout.PageLayout.logical_id`); ``plan_reshard(src, dst)`` says which
source rows to fetch per group (:attr:`GroupPlan.sources`);
:func:`kvbank.kernels.reshard.reshard_pages` builds the destination pages from them.

Choices: a destination byte is written by exactly one copy. Heads one source rank holds
alone come from it. Bytes several ranks hold (replicated buffers, heads duplicated
because ranks outnumber heads) come from a rank the page already needs when there is
one, else from the ``j mod holders``-th holder, which spreads TP n → TP m fetches over
the source ranks. Copies from one source are merged where they continue each other, so a
GQA page is one or two strided copies per source, not one per buffer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from kvbank import checks
from kvbank.errors import InvalidInput, LayoutError
from kvbank.layout import BufferSpec, GroupKind, PageLayout

PLAN_CACHE = 1024  # (source count, destination layout and rank) pairs kept planned


@dataclass(frozen=True, slots=True)
class Copy:
    """``count`` runs of ``length`` bytes: run ``i`` starts at ``src_offset + i ×
    src_stride`` in source shard ``source``'s page and lands at ``dst_offset + i ×
    dst_stride`` in the destination page."""

    source: int
    src_offset: int
    src_stride: int
    dst_offset: int
    dst_stride: int
    count: int
    length: int

    def ranges(self) -> Iterator[tuple[int, int, int]]:
        """``(src_start, dst_start, length)`` of every run (for checks, not for moving)."""
        for i in range(self.count):
            yield self.src_offset + i * self.src_stride, self.dst_offset + i * self.dst_stride, self.length


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """How one group's destination page is built."""

    group: int
    sources: tuple[int, ...]  # source shard indices whose page of this group is read
    copies: tuple[Copy, ...]  # disjoint destinations; together every region byte
    padding: tuple[tuple[int, int], ...]  # destination byte ranges no copy writes (zeroed)
    src_page_bytes: int
    dst_page_bytes: int


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """Destination ``dst`` (its shard index included) from pages of ``src``'s shard count
    (``src``'s shard index means nothing here)."""

    src: PageLayout
    dst: PageLayout
    groups: tuple[GroupPlan, ...]

    @property
    def sources(self) -> tuple[int, ...]:
        """Every source shard any group needs."""
        return tuple(sorted({s for g in self.groups for s in g.sources}))


# ---- compatibility ---------------------------------------------------------------------


def _layout(value: object, what: str) -> PageLayout:
    if not isinstance(value, PageLayout):
        raise InvalidInput(f"{what}: expected a PageLayout, got {type(value).__name__}")
    return value


def _first_difference(a: object, b: object, path: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            where = f"{path}.{key}" if path else key
            if key not in a or key not in b:
                return f"{where}: {a.get(key, '(default)')!r} in the source, " \
                       f"{b.get(key, '(default)')!r} in the destination"
            found = _first_difference(a[key], b[key], where)
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} entries in the source, {len(b)} in the destination"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if a != b:
        return f"{path}: {a!r} in the source, {b!r} in the destination"
    return None


def refusal(src: PageLayout, dst: PageLayout) -> str | None:
    """Why ``src`` pages cannot be resharded into ``dst`` pages (the field that differs
    between their TP 1 forms, sizes over all ranks), or ``None`` when they can."""
    src = _layout(src, "src")
    dst = _layout(dst, "dst")
    if src.logical_id == dst.logical_id:
        return None
    a, b = src.unsharded().to_dict(), dst.unsharded().to_dict()
    found = _first_difference(a, b, "")
    # Equal TP 1 forms have equal ids; a difference the walk cannot place is a bug.
    return found or "layout: the TP 1 forms differ"  # pragma: no cover


def check_compatible(src: PageLayout, dst: PageLayout) -> None:
    """Raise :class:`LayoutError` naming the field when ``src`` and ``dst`` differ in
    anything but the shard count and index."""
    reason = refusal(src, dst)
    if reason is not None:
        raise LayoutError(f"reshard refused: {reason}")


def shard_layout(layout: PageLayout, shard_count: int, shard_index: int = 0) -> PageLayout:
    """``layout`` as declared for ``shard_count`` ranks, seen by rank ``shard_index``."""
    layout = _layout(layout, "layout")
    checks.count(shard_count, "shard_count", 1, error=LayoutError)
    n = layout.shard_count
    buffers = tuple(
        b.resplit(n, shard_count, f"buffers[{i}]") for i, b in enumerate(layout.buffers)
    )
    return PageLayout(
        model=layout.model,
        tokens_per_page=layout.tokens_per_page,
        groups=layout.groups,
        buffers=buffers,
        quant=layout.quant,
        shard_count=shard_count,
        shard_index=shard_index,
    )


# ---- the plan --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Piece:
    """A copy whose source is one of ``holders`` (several when the bytes are duplicated)."""

    holders: tuple[int, ...]
    src_offset: int
    src_stride: int
    dst_offset: int
    dst_stride: int
    count: int
    length: int


def _held_units(total: int, count: int, rank: int) -> tuple[int, int]:
    """The ``[lo, hi)`` units of a run of ``total`` that rank ``rank`` of ``count`` holds."""
    if total % count == 0:
        per = total // count
        return rank * per, (rank + 1) * per
    head = rank // (count // total)  # duplicated: consecutive ranks share one head
    return head, head + 1


def _holders(total: int, count: int, lo: int, hi: int) -> Iterator[tuple[tuple[int, ...], int, int, int]]:
    """``(holders, lo, hi, offset in a holder's part)`` for the pieces of units ``[lo,
    hi)`` of a run of ``total`` split over ``count`` ranks."""
    if total % count == 0:
        per = total // count
        for r in range(lo // per, (hi - 1) // per + 1):
            a, b = max(lo, r * per), min(hi, (r + 1) * per)
            yield (r,), a, b, a - r * per
        return
    dup = count // total
    for head in range(lo, hi):
        yield tuple(range(head * dup, (head + 1) * dup)), head, head + 1, 0


def _buffer_pieces(
    sb: BufferSpec, db: BufferSpec, src: PageLayout, dst: PageLayout,
    src_off: int, dst_off: int, tokens: int,
) -> Iterator[_Piece]:
    n, m, j = src.shard_count, dst.shard_count, dst.shard_index
    everyone = tuple(range(n))
    axis = sb.head_axis
    if axis is None:
        nbytes = tokens * sb.item_bytes
        yield _Piece(everyone, src_off, nbytes, dst_off, nbytes, 1, nbytes)
        return
    inner = 1
    for d in sb.shape[axis + 1 :]:
        inner *= d
    inner *= sb.itemsize
    outer = tokens
    for d in sb.shape[:axis]:
        outer *= d
    s_len, d_len = sb.shape[axis] * inner, db.shape[axis] * inner
    s_base = d_base = 0  # where the current segment starts along the axis, in units
    for total in sb.segments(n):
        lo, hi = _held_units(total, m, j)
        for holders, a, b, in_src in _holders(total, n, lo, hi):
            yield _Piece(
                holders,
                src_off + (s_base + in_src) * inner, s_len,
                dst_off + (d_base + a - lo) * inner, d_len,
                outer, (b - a) * inner,
            )
        s_base += _held_units(total, n, 0)[1] - _held_units(total, n, 0)[0]
        d_base += hi - lo


def _choose(pieces: list[_Piece], j: int) -> list[Copy]:
    """Give every piece one source: its only holder, else a rank already needed, else
    the ``j mod len(holders)``-th holder."""
    needed = {p.holders[0] for p in pieces if len(p.holders) == 1}
    out: list[Copy] = []
    for p in pieces:
        if len(p.holders) == 1:
            source = p.holders[0]
        else:
            have = [h for h in p.holders if h in needed]
            source = have[0] if have else p.holders[j % len(p.holders)]
            needed.add(source)
        out.append(Copy(source, p.src_offset, p.src_stride, p.dst_offset, p.dst_stride,
                        p.count, p.length))
    return out


def _normal(c: Copy) -> Copy:
    """Runs that are back to back on both sides are one run."""
    if c.count > 1 and c.src_stride == c.dst_stride == c.length:
        n = c.count * c.length
        return Copy(c.source, c.src_offset, n, c.dst_offset, n, 1, n)
    return c


def _merge(copies: list[Copy]) -> tuple[Copy, ...]:
    """Per source (in order), fold each copy into the previous one where it continues it."""
    by_source: dict[int, list[Copy]] = {}
    for c in copies:
        by_source.setdefault(c.source, []).append(_normal(c))
    out: list[Copy] = []
    for source in sorted(by_source):
        run: Copy | None = None
        for c in by_source[source]:
            if run is not None and run.count > 1 and c.count > 1 and (
                c.length == run.length and c.src_stride == run.src_stride
                and c.dst_stride == run.dst_stride
                and c.src_offset == run.src_offset + run.count * run.src_stride
                and c.dst_offset == run.dst_offset + run.count * run.dst_stride
            ):
                run = Copy(source, run.src_offset, run.src_stride, run.dst_offset,
                           run.dst_stride, run.count + c.count, run.length)
            elif run is not None and run.count == 1 and c.count == 1 and (
                c.src_offset == run.src_offset + run.length
                and c.dst_offset == run.dst_offset + run.length
            ):
                n = run.length + c.length
                run = Copy(source, run.src_offset, n, run.dst_offset, n, 1, n)
            else:
                if run is not None:
                    out.append(run)
                run = c
        if run is not None:
            out.append(run)
    return tuple(out)


def plan_reshard(src: PageLayout, dst: PageLayout, shard_index: int | None = None) -> ReshardPlan:
    """How rank ``dst.shard_index`` (or ``shard_index``, when given) of ``dst.shard_count``
    builds each group's page from pages stored under ``src.shard_count``
    (``src.shard_index`` is not used).

    Refused with a :class:`LayoutError` naming the field when the layouts differ in
    anything but the shard count and index. Plans are cached (a 32-layer plan takes
    about as long as building the layout, and a bank asks for the same few per match)."""
    src, dst = _layout(src, "src"), _layout(dst, "dst")
    rank = dst.shard_index if shard_index is None else shard_index
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < dst.shard_count:
        raise LayoutError(f"shard_index: {rank!r} is out of range for shard_count "
                          f"{dst.shard_count}")
    if src.logical_id != dst.logical_id:
        check_compatible(src, dst)
    # Keyed by ids: equal ids are equal layouts, and hashing a layout costs more than this.
    key = (src.layout_id, dst.layout_id, rank)
    with _plans_lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
            return plan
    plan = _plan(src, dst if rank == dst.shard_index else dst.with_shard(rank))
    with _plans_lock:
        _plans[key] = plan
        if len(_plans) > PLAN_CACHE:
            _plans.popitem(last=False)
    return plan


_plans: OrderedDict[tuple[bytes, bytes, int], ReshardPlan] = OrderedDict()
_plans_lock = threading.Lock()


def _plan(src: PageLayout, dst: PageLayout) -> ReshardPlan:
    groups = []
    for g, kind in enumerate(group.kind for group in dst.groups):
        tokens = dst.tokens_per_page if kind is GroupKind.ATTENTION else 1
        pieces: list[_Piece] = []
        for sr, dr in zip(src.regions[g], dst.regions[g], strict=True):
            pieces.extend(
                _buffer_pieces(sr.buffer, dr.buffer, src, dst, sr.offset, dr.offset, tokens)
            )
        copies = _merge(_choose(pieces, dst.shard_index))
        groups.append(GroupPlan(
            group=g,
            sources=tuple(sorted({c.source for c in copies})),
            copies=copies,
            padding=dst.padding(g),
            src_page_bytes=src.group_page_bytes[g],
            dst_page_bytes=dst.group_page_bytes[g],
        ))
    return ReshardPlan(src, dst, tuple(groups))
