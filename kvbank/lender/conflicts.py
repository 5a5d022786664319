"""The readers/writer rule over the row names a lease lists.

Any number of READ leases may share a name; a WRITE lease excludes every other lease on
that name, READ or WRITE. :class:`Conflicts` holds the names of live leases and of lends
between their plan and their publish (``pending``), so a concurrent lend sees them.

Lifecycle of a lend's names: :meth:`Conflicts.check` → :meth:`Conflicts.claim` (pending)
→ :meth:`Conflicts.settle` (the claim becomes the live lease's) → :meth:`Conflicts.drop`
when the lease ends; a lend that fails in between calls :meth:`Conflicts.unclaim`.

Not thread-safe on its own: the :class:`~kvbank.lender.lender.Lender` calls it with its
lock held.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from kvbank.errors import LeaseConflict
from kvbank.lender.base import LeaseMode

# (lease id, the names it lists, its mode): one live lease, as the invariant check sees it
Listing = tuple[str, tuple[bytes, ...], LeaseMode]


class Conflicts:
    """Names listed by live and pending leases, by mode. See the module docstring."""

    __slots__ = ("pending", "readers", "writer")

    def __init__(self) -> None:
        # name -> how many READ leases list it. A count, not a set of ids: lend and
        # release touch each name once at C speed; the conflict message finds an id the
        # slow way, on the error path only.
        self.readers: Counter[bytes] = Counter()
        self.writer: dict[bytes, str] = {}  # name -> the WRITE lease id listing it
        # lends between their plan and their publish: id -> (names, mode), claimed above
        self.pending: dict[str, tuple[tuple[bytes, ...], LeaseMode]] = {}

    def check(
        self, rows: tuple[bytes, ...], mode: LeaseMode, reader_of: Callable[[bytes], str | None]
    ) -> None:
        """Raise LeaseConflict if the rule refuses ``rows`` to ``mode``.

        The tables are checked as whole sets; the names are looked at one by one only to
        word the error. ``reader_of`` names a live READ lease listing a name (or None).
        """
        writer, readers = self.writer, self.readers
        if writer and not writer.keys().isdisjoint(rows):
            n = next(n for n in rows if n in writer)
            raise LeaseConflict(
                f"names: row {n.hex()[:16]}… is held by WRITE lease {writer[n]}; "
                f"a {mode.name} lease cannot share it"
            )
        if mode is LeaseMode.WRITE and readers and not readers.keys().isdisjoint(rows):
            n = next(n for n in rows if n in readers)
            r = reader_of(n) or next((lid for lid, (ns, _) in self.pending.items() if n in ns), "?")
            raise LeaseConflict(
                f"names: row {n.hex()[:16]}… is held by READ lease {r}; "
                "a WRITE lease excludes readers"
            )

    def claim(self, lease_id: str, rows: tuple[bytes, ...], mode: LeaseMode) -> None:
        """Hold ``rows`` while a lend stages them."""
        self.pending[lease_id] = (rows, mode)
        if mode is LeaseMode.READ:
            self.readers.update(rows)
        else:
            self.writer.update(dict.fromkeys(rows, lease_id))

    def unclaim(self, lease_id: str, rows: tuple[bytes, ...], mode: LeaseMode) -> None:
        """Undo :meth:`claim` for a lend that failed."""
        del self.pending[lease_id]
        self.drop(rows, mode)

    def settle(self, lease_id: str) -> None:
        """The lend published: its claim becomes the live lease's entry."""
        del self.pending[lease_id]

    def drop(self, rows: tuple[bytes, ...], mode: LeaseMode) -> None:
        """Take an ended lease's names out."""
        if mode is LeaseMode.READ:
            # Take every name out at C speed; put back the few other leases still read.
            readers = self.readers
            counts = list(map(readers.pop, rows))
            if max(counts, default=0) > 1:
                for n, k in zip(rows, counts, strict=True):
                    if k > 1:
                        readers[n] = k - 1
        else:
            for n in rows:
                del self.writer[n]

    def check_invariants(self, live: Iterable[Listing]) -> None:
        """The tables hold exactly the pending claims and the ``live`` leases' names."""
        readers: Counter[bytes] = Counter()
        writer: dict[bytes, str] = {}
        for lid, (names, mode) in self.pending.items():
            if mode is LeaseMode.READ:
                readers.update(names)
            else:
                writer.update(dict.fromkeys(names, lid))
        for lid, names, mode in live:
            for n in names:
                if mode is LeaseMode.READ:
                    readers[n] += 1
                else:
                    if n in writer:
                        raise AssertionError(f"two WRITE leases list {n.hex()}")
                    writer[n] = lid
        if dict(readers) != dict(self.readers) or writer != self.writer:
            raise AssertionError("conflict maps disagree with the lease table")
        for n in set(readers) & set(writer):
            raise AssertionError(f"row {n.hex()} is held by a reader and a writer")
