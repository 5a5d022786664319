"""What the fleet needs of a bank: the rows it holds, the layouts it serves, and storing
rows a peer sent by their names.

:class:`BankFleet` is reached as ``bank.fleet`` and built by the bank with what it needs:
its store, its catalog and whether the bank is closed (every call then raises
:class:`~kvbank.errors.TierUnavailable`, as the bank's own do). The change feed the fleet
follows is ``bank.admin.take_events``. Primitives:

- :meth:`~BankFleet.layout_ids` — every registered layout id (what a node announces).
- :meth:`~BankFleet.held_names` — every row name the bank holds, page by page in name
  order (a full republish after a (re)join; pure: no lock, no recency).
- :meth:`~BankFleet.as_if_held` — a match with its missing rows counted as held: what a
  node asks a peer the index lists to stream (the peer sends what it has and reports the
  rest missing; the fetch's bound covers only what arrived whole), saving the round trip
  of the peer's own match.
- :meth:`~BankFleet.put_rows` — store rows by name (a peer's rows of one group of one
  layout, in chain order, each linked to its chain parent so eviction still takes a
  chain from its tail). Rows already stored, or locked by a lease, are skipped: equal
  names are equal bytes. The fleet's fast path receives rows straight into host slots
  under a WRITE lease (:meth:`~kvbank.bank.bank.Bank.lend`); this is its fallback when no
  host slot can be leased.
- :meth:`~BankFleet.recall_remote` — the rows of a match missing locally that the remote
  tier (Redis, below the disk) still holds, read back and stored locally in chain order,
  so the next match sees them. A match is a pure query and never asks Redis; the node
  calls this when a served match stops short (before asking peers) and matches again.
  A recall counts no read: the row counts when a fetch serves it (:meth:`count_served`).
- :meth:`~BankFleet.count_served` — reads a node served in place (its READ leases on a
  fetch's rows), counted as the store counts its own reads, so a served node's hits,
  gets and misses say what its clients received.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from kvbank.bank.closing import BankPart, closed_error, refused_once_closed
from kvbank.errors import InvalidInput
from kvbank.keys import ROW_NAME_BYTES, group_of, same_chain
from kvbank.layout import GroupKind
from kvbank.lender.resume import resume_bound, resume_boundaries
from kvbank.results import Match
from kvbank.tiers.base import Buffer, TierKind

DEFAULT_NAME_PAGE = 4096  # rows per page of held_names (one store scan each)
RECALL_BATCH_ROWS = 64  # rows per store batch of a recall from the remote tier


@refused_once_closed("bank.fleet")
class BankFleet(BankPart):
    """What the fleet needs of a bank (``bank.fleet``). See the module docstring."""

    def layout_ids(self) -> list[bytes]:
        """Every registered layout id."""
        return self._catalog.layout_ids()

    def held_names(self, page: int = DEFAULT_NAME_PAGE) -> Iterator[list[bytes]]:
        """Every stored row's name, ``page`` at a time, in name order."""
        if isinstance(page, bool) or not isinstance(page, int) or not 1 <= page <= 10_000:
            raise InvalidInput(f"page: expected an integer in [1, 10000], got {page!r}")
        after: bytes | None = None
        while True:
            if self._closed:  # checked at the call too, but the bank may close between pages
                raise closed_error("bank.fleet.held_names")
            rows = self._store.scan(b"", after=after, limit=page)
            if not rows:
                return
            names = [r.name for r in rows]
            yield names
            if len(rows) < page:
                return
            after = names[-1]

    def as_if_held(self, match: Match) -> Match:
        """``match`` with every missing row counted as held (in host memory) and its
        bound recomputed: what to ask a peer for. Groups of 0-byte pages stay misses."""
        if not isinstance(match, Match):
            raise InvalidInput(f"match: expected a Match, got {type(match).__name__}")
        layout = self._catalog.layout(match.layout_id)
        n = len(layout.groups)
        tiers = tuple(tuple(t if t is not None or not layout.group_page_bytes[g % n]
                            else TierKind.HOST for t in row)
                      for g, row in enumerate(match.tiers))

        def have(g: int, j: int) -> bool:
            return tiers[g][j] is not None

        return dataclasses.replace(
            match, tiers=tiers,
            resume=resume_bound(layout, match.prompt_tokens, have, match.names),
            boundaries=resume_boundaries(layout, match.prompt_tokens, have), via=())

    def put_rows(self, layout_id: bytes, rows: Sequence[tuple[bytes, Buffer]]) -> int:
        """Store ``(name, bytes)`` rows of ``layout_id`` (see the module docstring); how
        many were new. Sizes are checked by the store (``PageSizeMismatch``)."""
        layout = self._catalog.layout(layout_id)  # UnknownLayout when never registered
        todo: list[tuple[bytes, Buffer, bytes | None]] = []
        prev: bytes | None = None
        for i, (name, data) in enumerate(rows):
            if not isinstance(name, bytes) or len(name) != ROW_NAME_BYTES:
                raise InvalidInput(f"rows[{i}]: expected a {ROW_NAME_BYTES}-byte row name",
                                   field=f"rows[{i}]")
            g = group_of(name)
            if not 0 <= g < len(layout.groups):
                raise InvalidInput(f"rows[{i}]: group {g} is not a group of the layout",
                                   field=f"rows[{i}]")
            parent = prev if prev is not None and same_chain(prev, name) else None
            todo.append((name, data, parent))
            prev = name
        stored = 0
        held = self._store.locate([n for n, _, _ in todo])
        new = [r for r, where in zip(todo, held, strict=True) if where is None]
        for g in sorted({group_of(n) for n, _, _ in new}):
            batch = [r for r in new if group_of(r[0]) == g]
            stored += sum(self._store.put_many(batch, dtype=layout.page_dtype(g)))
        return stored

    def count_served(self, tiers: Sequence[TierKind | None]) -> None:
        """Count one read per row a node served in place: its tier (a hit) or ``None``."""
        self._store.count_reads(tiers)

    @property
    def has_remote(self) -> bool:
        """Whether a remote tier lies below the disk (what :meth:`recall_remote` reads):
        without one a caller need not hand it a match at all."""
        return self._store.has_remote

    def recall_remote(self, match: Match, *, max_rows: int = RECALL_BATCH_ROWS * 16) -> int:
        """Rows of ``match``'s prompt that no local tier holds but the remote tier does,
        read back (checksums verified) and stored here; how many. Attention rows are taken
        in chain order up to the first row the remote tier lacks too (a later one could
        not extend the bound); state snapshots wherever they are. One remote lookup for
        the whole prompt; 0 at once without a remote tier, or when nothing is missing."""
        if not isinstance(match, Match):
            raise InvalidInput(f"match: expected a Match, got {type(match).__name__}", field="match")
        store = self._store
        if not store.has_remote:
            return 0
        layout = self._catalog.layout(match.layout_id)
        missing = [[n for n, t in zip(names, tiers, strict=True) if t is None]
                   for names, tiers in zip(match.names, match.tiers, strict=True)]
        flat = [n for g in missing for n in g]
        if not flat:
            return 0
        held = dict(zip(flat, store.remote_has(flat), strict=True))
        stored = 0
        for g, names in enumerate(match.names):
            size = layout.group_page_bytes[g]
            state = layout.groups[g].kind is GroupKind.STATE
            rows: list[tuple[bytes, Buffer]] = []
            for name, tier in zip(names, match.tiers[g], strict=True):
                if tier is not None:
                    continue
                if not held.get(name, False):
                    if state:
                        continue
                    break  # the chain stops here: nothing after it extends the bound
                buf = bytearray(size)
                if store.recall_into(name, buf) != size:  # gone since, or failed its checks
                    if state:
                        continue
                    break
                rows.append((name, buf))
                if len(rows) >= max_rows:
                    break
            for i in range(0, len(rows), RECALL_BATCH_ROWS):
                stored += self.put_rows(match.layout_id, rows[i:i + RECALL_BATCH_ROWS])
        return stored
