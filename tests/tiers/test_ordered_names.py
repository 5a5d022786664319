"""The index's ordered names: pages by prefix after a cursor, against a sorted list."""

from __future__ import annotations

import bisect

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbank.testing.tiers import name_of
from kvbank.tiers import index
from kvbank.tiers.index import HOST, OrderedNames, RowIndex


def model_page(model: list[bytes], prefix: bytes, after: bytes | None, limit: int) -> list[bytes]:
    return [n for n in model if n.startswith(prefix) and (after is None or n > after)][:limit]


def test_ordered_names_pages_follow_the_cursor_across_sublists(monkeypatch) -> None:
    """Small sublists (split at 8) so that pages cross many of them; every page starts
    strictly after the cursor, stays inside the prefix and ends at the prefix's end."""
    monkeypatch.setattr(index, "_LOAD", 4)
    names = OrderedNames()
    pool = [bytes([a, b]) + bytes(52) for a in range(4) for b in range(50)]
    for n in reversed(pool):
        names.add(n)
    names.check()
    assert list(names) == sorted(pool) and len(names) == len(pool)
    got: list[bytes] = []
    after: bytes | None = None
    while True:
        page = names.page(b"\x02", after, 7)
        got += page
        if len(page) < 7:
            break
        after = page[-1]
    assert got == [n for n in sorted(pool) if n[0] == 2]
    assert names.page(b"\x02", sorted(pool)[-1], 5) == []  # a cursor past the prefix
    assert names.page(b"\x02", b"\x00" * 54, 3) == got[:3]  # a cursor before the prefix
    assert names.page(b"\x09", None, 3) == []


def test_ordered_names_discard_keeps_maxima_and_drops_empty_sublists(monkeypatch) -> None:
    monkeypatch.setattr(index, "_LOAD", 2)
    names = OrderedNames()
    pool = [bytes([i]) for i in range(30)]
    for n in pool:
        names.add(n)
    for n in pool[::3] + pool[1::3]:
        assert names.discard(n)
        names.check()
    assert not names.discard(pool[0]) and not names.discard(b"\xff")
    assert list(names) == pool[2::3]


def test_row_index_keeps_ordered_names_with_its_live_rows() -> None:
    ix = RowIndex(1 << 20)
    rids = {}
    for i in range(100):
        rids[i] = ix.add(name_of(i), 64, 0, -1)
        ix.where[rids[i]] = HOST
    for i in range(0, 100, 2):
        ix.remove(rids[i])
    assert ix.check() == []
    assert list(ix.ordered) == sorted(name_of(i) for i in range(1, 100, 2))


NAMES = st.binary(min_size=1, max_size=3)


class OrderedNamesMachine(RuleBasedStateMachine):
    """OrderedNames against a sorted list, with sublists small enough to split and merge."""

    def __init__(self) -> None:
        super().__init__()
        self.saved = index._LOAD
        index._LOAD = 2
        self.names = OrderedNames()
        self.model: list[bytes] = []

    def teardown(self) -> None:
        index._LOAD = self.saved

    @rule(name=NAMES)
    def add(self, name: bytes) -> None:
        i = bisect.bisect_left(self.model, name)
        if i < len(self.model) and self.model[i] == name:
            return  # the index never adds a name twice
        self.model.insert(i, name)
        self.names.add(name)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def discard_present(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.model))
        self.model.remove(name)
        assert self.names.discard(name)

    @rule(name=NAMES)
    def discard_any(self, name: bytes) -> None:
        present = name in self.model
        if present:
            self.model.remove(name)
        assert self.names.discard(name) == present

    @rule(prefix=st.binary(max_size=2), after=st.none() | NAMES, limit=st.integers(1, 6))
    def page(self, prefix: bytes, after: bytes | None, limit: int) -> None:
        assert self.names.page(prefix, after, limit) == model_page(self.model, prefix, after, limit)

    @invariant()
    def same(self) -> None:
        self.names.check()
        assert list(self.names) == self.model and len(self.names) == len(self.model)


TestOrderedNamesMachine = OrderedNamesMachine.TestCase
TestOrderedNamesMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
