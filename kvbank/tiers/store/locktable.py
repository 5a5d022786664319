"""``store.locks``: the page-lock operations of a store, each under the store lock."""

from __future__ import annotations

from collections.abc import Sequence

from kvbank.errors import InvalidInput
from kvbank.tiers.base import check_name, check_names
from kvbank.tiers.store.state import StoreState


class LockTable:
    """Counted page locks per holder (n locks need n unlocks). A locked row is never
    evicted, demoted, overwritten or deleted (``RowLocked``); a name may be locked
    before it exists (a write lease)."""

    def __init__(self, st: StoreState) -> None:
        self._st = st

    def lock(self, names: Sequence[bytes], holder: str) -> None:
        check_names(names)
        names = list(names)
        if not isinstance(holder, str) or not holder:
            raise InvalidInput(f"holder: expected a non-empty string, got {holder!r}")
        with self._st.lock:
            self._st.check_open()
            self._st.locks.lock(names, holder)

    def unlock(self, names: Sequence[bytes], holder: str) -> None:
        """Give back locks; ``InvalidInput`` (nothing changed) if one is not held."""
        names = [check_name(n) for n in names]
        with self._st.lock:
            self._st.locks.unlock(names, holder)
            self._st.notify()

    def unlock_all(self, holder: str) -> None:
        with self._st.lock:
            self._st.locks.unlock_all(holder)
            self._st.notify()

    def is_locked(self, name: bytes) -> bool:
        with self._st.lock:
            return check_name(name) in self._st.locks

    def holders(self, name: bytes) -> frozenset[str]:
        with self._st.lock:
            return frozenset(self._st.locks.holders(check_name(name)))
