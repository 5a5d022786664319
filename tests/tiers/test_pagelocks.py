"""PageLocks against a plain counter model: every lock counted, both tables agreeing."""

from __future__ import annotations

import collections

from hypothesis import given
from hypothesis import strategies as st

from kvbank.tiers.store.rowlocks import PageLocks

_NAMES = [bytes([i]) * 54 for i in range(5)]
_HOLDERS = ["a", "b", "c"]

op: st.SearchStrategy[tuple[str, list[bytes], str]] = st.one_of(
    st.tuples(st.just("lock"), st.lists(st.sampled_from(_NAMES), max_size=6), st.sampled_from(_HOLDERS)),
    st.tuples(st.just("unlock_all"), st.just([]), st.sampled_from(_HOLDERS)),
)


@given(st.lists(op, max_size=30))
def test_locks_match_a_counter_model(ops: list[tuple[str, list[bytes], str]]) -> None:
    locks = PageLocks()
    model: dict[str, collections.Counter[bytes]] = collections.defaultdict(collections.Counter)
    for kind, names, holder in ops:
        if kind == "lock":  # a new holder, repeated names, an existing holder: each path
            locks.lock(names, holder)
            model[holder].update(names)
        else:
            locks.unlock_all(holder)
            model.pop(holder, None)
        assert locks.check() == []
        for name in _NAMES:
            want = {h: c[name] for h, c in model.items() if c[name]}
            assert locks.holders(name) == want
            assert (name in locks) == bool(want)
