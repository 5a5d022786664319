"""The operator's calls on a bank, reached as ``bank.admin``: thin wrappers over the
store's admin calls, apart from the worker's calls on :class:`~kvbank.bank.bank.Bank`.

:class:`BankAdmin` is built by the bank with what it needs: its store, its catalog and
whether the bank is closed (every call then raises
:class:`~kvbank.errors.TierUnavailable`, as the bank's own do). Primitives:

- :meth:`~BankAdmin.rows` — one page of rows (name order) by layout, scope and/or a name
  prefix, after a cursor (the last name of the previous page). By layout alone, the
  namespaces are the (scope, layout) pairs the catalog knows: learnt since the bank
  opened, or restored from the data dir for rows kept across a restart (a row name's
  namespace is a one-way digest: a pair never known lists only by naming the scope, or
  by name prefix). Each namespace is one bisect of the store's ordered names, so a page
  costs O(namespaces · log n + page). Pure: no lock, no recency.
- :meth:`~BankAdmin.evict` (names) and :meth:`~BankAdmin.evict_rows` (layout / scope /
  prefix, page by page) — locked and pinned rows are reported, never evicted.
- :meth:`~BankAdmin.pin` / :meth:`~BankAdmin.unpin` — under the ``pin_bytes`` budget
  (:class:`~kvbank.errors.PinBudgetExceeded`, nothing pinned).
- :meth:`~BankAdmin.touch`, :meth:`~BankAdmin.take_events` (the change feed, which
  ``bank.fleet``'s node follows), :meth:`~BankAdmin.read_frame` (a row's encoded frame),
  :meth:`~BankAdmin.layouts`, :meth:`~BankAdmin.prefixes`, :meth:`~BankAdmin.count` (rows
  under a name prefix, from the ordered index: what the status page's usage table reads).
- :meth:`~BankAdmin.unregister` — forget a layout that holds no rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvbank.bank.closing import BankPart, refused_once_closed
from kvbank.errors import InvalidInput
from kvbank.keys import ROW_NAME_BYTES, Scope, namespace
from kvbank.layout import PageLayout
from kvbank.results import EvictResult, RowEvent, RowInfo

if TYPE_CHECKING:
    from kvbank.tiers.disk import CompactReport

MAX_PAGE_ROWS = 10_000  # the store's own scan bound
DEFAULT_PAGE_ROWS = 100


@refused_once_closed("bank.admin")
class BankAdmin(BankPart):
    """A bank's admin calls (``bank.admin``). See the module docstring."""

    def prefixes(self, layout_id: bytes | None = None, scope: Scope | None = None,
                 prefix: bytes = b"") -> list[bytes]:
        """The name prefixes a listing of (layout, scope, prefix) covers, sorted, disjoint."""
        if not isinstance(prefix, bytes) or len(prefix) > ROW_NAME_BYTES:
            raise InvalidInput(f"prefix: expected at most {ROW_NAME_BYTES} bytes, got {prefix!r}")
        if scope is not None and not isinstance(scope, Scope):
            raise InvalidInput(f"scope: expected a Scope, got {type(scope).__name__}")
        if layout_id is None and scope is None:
            return [prefix]
        if layout_id is not None:
            self._catalog.layout(layout_id)  # UnknownLayout when never registered
            spaces = ([namespace(layout_id, scope)] if scope is not None
                      else self._catalog.namespaces_of(layout_id))
        else:
            assert scope is not None
            spaces = [namespace(lid, scope) for lid in self._catalog.layout_ids()]
        # A namespace and a longer prefix combine only where one extends the other.
        out = set()
        for ns in spaces:
            if prefix.startswith(ns):
                out.add(prefix)
            elif ns.startswith(prefix):
                out.add(ns)
        return sorted(out)

    def layouts(self) -> list[PageLayout]:
        """Every registered layout."""
        return [self._catalog.layout(i) for i in self._catalog.layout_ids()]

    def unregister(self, layout_id: bytes) -> int:
        """Forget a registered layout (every shard of it: its registration, its file in the
        data dir, the namespaces learnt under it); how many registrations were removed.
        Refused while any of its namespaces holds rows (evict them first): a row whose
        layout is gone could be neither fetched nor described."""
        self._catalog.layout(layout_id)  # UnknownLayout when never registered
        held = [ns for ns in self._catalog.namespaces_of(layout_id) if self._store.scan(ns, limit=1)]
        if held:
            raise InvalidInput(f"layout_id: {len(held)} scopes of layout {layout_id.hex()} still hold "
                               "rows; evict them first (kvbank admin evict --layout ID)", field="layout_id")
        return self._catalog.unregister(layout_id)

    def rows(self, layout_id: bytes | None = None, *, scope: Scope | None = None,
             prefix: bytes = b"", after: bytes | None = None,
             limit: int = DEFAULT_PAGE_ROWS) -> list[RowInfo]:
        """One page of rows in name order (see the module docstring); the next page
        starts after the last name of this one. Fewer than ``limit`` = the last page."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE_ROWS:
            raise InvalidInput(f"limit: expected an integer in [1, {MAX_PAGE_ROWS}], got {limit!r}")
        if after is not None and (not isinstance(after, bytes) or len(after) != ROW_NAME_BYTES):
            raise InvalidInput(f"after: expected a {ROW_NAME_BYTES}-byte row name, got {after!r:.80}",
                               field="after")
        spaces = self.prefixes(layout_id, scope, prefix)
        # The prefixes are sorted and none extends another, so their name ranges follow
        # one another: the page is the first prefixes' rows after the cursor, in turn.
        out: list[RowInfo] = []
        for p in spaces:
            if after is not None and after[: len(p)] > p:
                continue  # every name under p sorts before the cursor
            out += self._store.scan(p, after=after, limit=limit - len(out))
            if len(out) >= limit:
                break
        return out

    def count(self, prefix: bytes) -> int:
        """How many rows are stored under a name prefix (a namespace: one (scope, layout)
        pair), at the cost of a bisect, not of the rows."""
        return self._store.count(prefix)

    def evict(self, names: Sequence[bytes]) -> EvictResult:
        """Drop rows from every tier; locked and pinned rows are reported, not evicted."""
        return self._store.evict(names)

    def evict_rows(self, layout_id: bytes | None = None, *, scope: Scope | None = None,
                   prefix: bytes = b"") -> EvictResult:
        """Evict every row a listing of (layout, scope, prefix) shows, page by page."""
        if layout_id is None and scope is None and not prefix:
            raise InvalidInput("prefix: evicting every row needs a layout, a scope or a prefix")
        evicted: list[bytes] = []
        locked: list[bytes] = []
        pinned: list[bytes] = []
        after: bytes | None = None
        while True:
            page = self.rows(layout_id, scope=scope, prefix=prefix, after=after, limit=MAX_PAGE_ROWS)
            if not page:
                break
            done = self._store.evict([r.name for r in page])
            evicted += done.evicted
            locked += done.locked
            pinned += done.pinned
            after = page[-1].name
            if len(page) < MAX_PAGE_ROWS:
                break
        return EvictResult(tuple(evicted), tuple(locked), (), tuple(pinned))

    def pin(self, names: Sequence[bytes]) -> tuple[bytes, ...]:
        """Pin the stored rows (all or none, within ``pin_bytes``); the names not stored."""
        return self._store.pin(names)

    def unpin(self, names: Sequence[bytes]) -> None:
        self._store.unpin(names)

    def touch(self, names: Sequence[bytes]) -> int:
        """Record recency without reading; how many of the rows are stored."""
        return self._store.touch(names)

    def take_events(self, max_events: int | None = None) -> list[RowEvent]:
        """Rows published and withdrawn since the last call (see ``TieredStore.take_events``)."""
        return self._store.take_events(max_events)

    def read_frame(self, name: bytes) -> bytes | None:
        """A row's encoded codec frame, not decoded; ``None`` on a miss."""
        return self._store.read_frame(name)

    def compact_disk(self) -> CompactReport | None:
        """Rewrite the disk tier's older-layout rows and sparse segments into fresh
        segments (``kvbank admin compact``); ``None`` without a disk tier."""
        return self._store.compact_disk()
