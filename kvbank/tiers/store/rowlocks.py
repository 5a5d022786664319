"""Page locks and admin pins: pure tables, no I/O, owned by the store's lock.

- :class:`PageLocks` — counted locks per (row name, holder). A locked row is never
  evicted, demoted, overwritten or deleted; a name may be locked before it exists (a
  write lease). ``lock``/``unlock``/``unlock_all``/``holders``/``check``.
- :class:`RowPins` — rows the admin pinned: never chosen as victims, so never evicted or
  demoted out of the tier they are in, within a byte budget (``pin_bytes``).

Not thread-safe: the store calls them under its lock.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

from kvbank.errors import InvalidInput, PinBudgetExceeded


class PageLocks:
    """Counted page locks: ``holder`` may lock a name n times and must unlock it n times."""

    __slots__ = ("_by_holder", "_by_name")

    def __init__(self) -> None:
        self._by_name: dict[bytes, dict[str, int]] = {}
        self._by_holder: dict[str, dict[bytes, int]] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def names(self) -> Iterable[bytes]:
        return self._by_name.keys()

    def holders(self, name: bytes) -> dict[str, int]:
        """The holders of ``name`` and their counts (empty when unlocked)."""
        return self._by_name.get(name, {})

    def locked_by_other(self, name: bytes, holder: str | None) -> bool:
        held = self._by_name.get(name)
        if not held:
            return False
        return holder is None or any(h != holder for h in held)

    def lock(self, names: Sequence[bytes], holder: str) -> None:
        by_name = self._by_name
        if holder not in self._by_holder:
            fresh = dict.fromkeys(names, 1)
            if len(fresh) == len(names):  # a new holder of distinct rows: every lease's first lock
                self._by_holder[holder] = fresh
                for name in names:
                    per = by_name.get(name)
                    if per is None:
                        by_name[name] = {holder: 1}
                    else:
                        per[holder] = 1
                return
        mine = self._by_holder.setdefault(holder, {})
        for name in names:
            per = by_name.get(name)
            if per is None:
                per = by_name[name] = {}
            per[holder] = per.get(holder, 0) + 1
            mine[name] = mine.get(name, 0) + 1

    def unlock(self, names: Sequence[bytes], holder: str) -> None:
        """Give back locks; ``InvalidInput`` (nothing changed) if one is not held."""
        mine = self._by_holder.get(holder, {})
        need = collections.Counter(names)
        for name, k in need.items():
            if mine.get(name, 0) < k:
                raise InvalidInput(
                    f"unlock: holder {holder!r} holds {mine.get(name, 0)} lock(s) on row "
                    f"{name.hex()[:16]}…, asked to release {k}")
        for name, k in need.items():
            self._release(name, holder, k)

    def unlock_all(self, holder: str) -> None:
        for name, k in list(self._by_holder.get(holder, {}).items()):
            self._release(name, holder, k)

    def _release(self, name: bytes, holder: str, k: int) -> None:
        mine = self._by_holder[holder]
        per = self._by_name[name]
        left = per[holder] - k
        if left:
            per[holder] = left
            mine[name] = left
            return
        del per[holder]
        del mine[name]
        if not per:
            del self._by_name[name]
        if not mine:
            del self._by_holder[holder]

    def check(self) -> list[str]:
        """The two tables agree (every count positive and mirrored)."""
        out: list[str] = []
        for name, per in self._by_name.items():
            for holder, k in per.items():
                if k <= 0 or self._by_holder.get(holder, {}).get(name) != k:
                    out.append(f"lock on {name.hex()[:16]}… by {holder!r}: count {k} "
                               "does not match the holder's table")
        for holder, mine in self._by_holder.items():
            for name, k in mine.items():
                if self._by_name.get(name, {}).get(holder) != k:
                    out.append(f"holder {holder!r}: lock table and row locks differ")
        return out


class RowPins:
    """Rows pinned by the admin, with their sizes, within ``budget`` bytes."""

    __slots__ = ("_rows", "budget", "nbytes")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._rows: dict[bytes, int] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    def names(self) -> Iterable[bytes]:
        return self._rows.keys()

    def add(self, rows: dict[bytes, int]) -> None:
        """Pin ``rows`` (name -> size) all or none: ``PinBudgetExceeded`` over budget."""
        new = {n: s for n, s in rows.items() if n not in self._rows}
        total = self.nbytes + sum(new.values())
        if total > self.budget:
            raise PinBudgetExceeded(
                f"pin_bytes: pinning {len(new)} rows ({sum(new.values())} bytes) would hold "
                f"{total} bytes pinned, over the pin budget of {self.budget} bytes")
        self._rows.update(new)
        self.nbytes = total

    def drop(self, name: bytes) -> None:
        size = self._rows.pop(name, None)
        if size is not None:
            self.nbytes -= size
