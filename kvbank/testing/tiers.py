"""The conformance suite every :class:`~kvbank.tiers.base.Tier` passes.

Subclass :class:`TierTests` in a test module, name the subclass ``Test…`` and implement
:meth:`TierTests.make_tier`; pytest then runs every ``test_*`` method against that tier::

    class TestDiskTier(TierTests):
        def make_tier(self, budget: int) -> Tier:
            return DiskTier(self.data_dir, budget)

The tiered store itself runs it through :class:`StoreTier`, which presents a
:class:`~kvbank.tiers.store.store.TieredStore` as one tier using only its public methods. A
tier whose ``evicts`` capability is set makes room instead of raising ``TierFull``.

A persistent tier also implements :meth:`TierTests.reopen` (close, then open the same
storage again). The restart test runs for every tier and checks what its ``persistent``
flag promises: a persistent tier gives back every row, a volatile one (whose restart is a
fresh tier of the same budget, the default ``reopen``) holds nothing and answers misses.
"""

from __future__ import annotations

import abc
import random
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import pytest

from kvbank.errors import InvalidInput, InvalidRowName, PageSizeMismatch, TierFull, TierUnavailable
from kvbank.keys import ROW_NAME_BYTES
from kvbank.tiers.base import Tier, TierKind

if TYPE_CHECKING:
    from kvbank.tiers.base import Buffer
    from kvbank.tiers.store.store import TieredStore


def name_of(i: int, tag: bytes = b"t") -> bytes:
    """A distinct 54-byte row name for ``i``."""
    return (tag + i.to_bytes(8, "big")).rjust(ROW_NAME_BYTES, b"\x00")


def page_of(i: int, size: int) -> bytes:
    """Deterministic, incompressible page bytes for ``i`` (a compressed tier fills its
    budget like a plain one, and a shifted or foreign copy never compares equal)."""
    return random.Random(i).randbytes(size)


class TierTests(abc.ABC):
    """Behaviour every tier keeps; see :mod:`kvbank.tiers.base`."""

    page_size = 4096
    budget_pages = 16

    @abc.abstractmethod
    def make_tier(self, budget: int) -> Tier:
        """A fresh, empty tier with this byte budget."""

    def reopen(self, tier: Tier) -> Tier:
        """Close ``tier`` and open the same storage again. For a volatile tier a restart
        is a fresh tier of the same budget (this default); a persistent tier overrides it."""
        if tier.persistent:
            raise NotImplementedError(
                f"{type(self).__name__} has a persistent tier: implement reopen")
        tier.close()
        return self.make_tier(self.budget_pages * self.page_size)

    @pytest.fixture
    def tier(self) -> Iterator[Tier]:
        t = self.make_tier(self.budget_pages * self.page_size)
        try:
            yield t
        finally:
            t.close()

    # -- basic round trips -------------------------------------------------------------

    def test_tier_put_then_get_returns_the_same_bytes(self, tier: Tier) -> None:
        data = page_of(1, self.page_size)
        tier.put(name_of(1), data)
        out = bytearray(self.page_size + 100)
        assert tier.get_into(name_of(1), out) == self.page_size
        assert bytes(out[: self.page_size]) == data
        assert bytes(out[self.page_size :]) == bytes(100), "bytes past the row were written"

    def test_tier_accepts_bytearray_and_memoryview(self, tier: Tier) -> None:
        data = page_of(2, self.page_size)
        tier.put(name_of(1), bytearray(data))
        tier.put(name_of(2), memoryview(data))
        out = memoryview(bytearray(self.page_size))
        for i in (1, 2):
            assert tier.get_into(name_of(i), out) == self.page_size
            assert out.tobytes() == data

    def test_tier_miss_is_none_not_an_exception(self, tier: Tier) -> None:
        out = bytearray(self.page_size)
        assert tier.get_into(name_of(9), out) is None
        assert out == bytes(self.page_size)
        assert tier.delete(name_of(9)) is False

    def test_tier_contains_many_at_once(self, tier: Tier) -> None:
        for i in (1, 3):
            tier.put(name_of(i), page_of(i, self.page_size))
        assert tier.contains([name_of(i) for i in range(5)]) == [False, True, False, True, False]
        assert tier.contains([]) == []

    def test_tier_delete_removes_and_frees_budget(self, tier: Tier) -> None:
        tier.put(name_of(1), page_of(1, self.page_size))
        used = tier.used_bytes
        assert used > 0
        assert tier.delete(name_of(1)) is True
        assert tier.contains([name_of(1)]) == [False]
        assert tier.used_bytes < used
        assert tier.delete(name_of(1)) is False

    def test_tier_overwrite_same_size_replaces(self, tier: Tier) -> None:
        tier.put(name_of(1), page_of(1, self.page_size))
        tier.put(name_of(1), page_of(2, self.page_size))
        out = bytearray(self.page_size)
        assert tier.get_into(name_of(1), out) == self.page_size
        assert bytes(out) == page_of(2, self.page_size)

    def test_tier_refuses_other_size_for_same_name_and_keeps_old_row(self, tier: Tier) -> None:
        tier.put(name_of(1), page_of(1, self.page_size))
        with pytest.raises(PageSizeMismatch):
            tier.put(name_of(1), page_of(1, self.page_size // 2))
        out = bytearray(self.page_size)
        assert tier.get_into(name_of(1), out) == self.page_size
        assert bytes(out) == page_of(1, self.page_size)

    # -- bad input ---------------------------------------------------------------------

    @pytest.mark.parametrize("bad", [b"short", b"x" * 55, "s" * 54, 7])
    def test_tier_refuses_bad_names(self, tier: Tier, bad: object) -> None:
        with pytest.raises(InvalidRowName):
            tier.put(bad, b"x")  # type: ignore[arg-type]
        with pytest.raises(InvalidRowName):
            tier.get_into(bad, bytearray(8))  # type: ignore[arg-type]

    def test_tier_refuses_empty_page_and_non_buffers(self, tier: Tier) -> None:
        with pytest.raises(InvalidInput):
            tier.put(name_of(1), b"")
        with pytest.raises(InvalidInput):
            tier.put(name_of(1), "text")  # type: ignore[arg-type]
        assert tier.contains([name_of(1)]) == [False]

    def test_tier_out_too_small_is_invalid_input(self, tier: Tier) -> None:
        tier.put(name_of(1), page_of(1, self.page_size))
        with pytest.raises(InvalidInput):
            tier.get_into(name_of(1), bytearray(self.page_size - 1))
        with pytest.raises(InvalidInput):
            tier.get_into(name_of(1), bytes(self.page_size))  # type: ignore[arg-type]

    # -- budget ------------------------------------------------------------------------

    def test_tier_full_is_typed_and_keeps_serving(self, tier: Tier) -> None:
        if tier.evicts:  # a full tier that evicts keeps taking rows: the newest stay
            n = self.budget_pages * 4
            for i in range(n):
                tier.put(name_of(i), page_of(i, self.page_size))
            out = bytearray(self.page_size)
            assert tier.get_into(name_of(n - 1), out) == self.page_size
            assert bytes(out) == page_of(n - 1, self.page_size)
            assert tier.used_bytes <= tier.budget_bytes
            assert not all(tier.contains([name_of(i) for i in range(n)]))
            return
        stored: list[int] = []
        with pytest.raises(TierFull):
            for i in range(self.budget_pages * 4):
                tier.put(name_of(i), page_of(i, self.page_size))
                stored.append(i)
        assert stored, "not even one page fitted the budget"
        assert tier.used_bytes <= tier.budget_bytes
        out = bytearray(self.page_size)
        for i in stored:
            assert tier.get_into(name_of(i), out) == self.page_size
            assert bytes(out) == page_of(i, self.page_size)
        tier.delete(name_of(stored[0]))
        tier.put(name_of(10_000), page_of(10_000, self.page_size))  # room again

    def test_tier_used_bytes_tracks_rows(self, tier: Tier) -> None:
        assert tier.used_bytes == 0
        for i in range(3):
            tier.put(name_of(i), page_of(i, self.page_size))
        three = tier.used_bytes
        assert three >= 3 * self.page_size * (0.5 if tier.compressed else 1.0)
        for i in range(3):
            tier.delete(name_of(i))
        assert tier.used_bytes == 0

    # -- batch helpers, capabilities, lifecycle ---------------------------------------

    def test_tier_batch_helpers(self, tier: Tier) -> None:
        tier.put_many([(name_of(i), page_of(i, self.page_size)) for i in range(4)])
        outs = [bytearray(self.page_size) for _ in range(5)]
        got = tier.get_many_into([name_of(i) for i in range(5)], outs)
        assert got == [self.page_size] * 4 + [None]
        assert all(bytes(outs[i]) == page_of(i, self.page_size) for i in range(4))
        assert tier.delete_many([name_of(0), name_of(9)]) == [True, False]
        with pytest.raises(InvalidInput):
            tier.get_many_into([name_of(1)], [])

    def test_tier_capabilities_are_consistent(self, tier: Tier) -> None:
        assert isinstance(tier.kind, TierKind)
        assert tier.budget_bytes == self.budget_pages * self.page_size
        if tier.evicts:  # a stack of tiers: persistent and compressed when it ends on disk
            assert tier.persistent == tier.compressed == (tier.kind is TierKind.DISK)
            assert tier.in_place
            return
        assert tier.persistent == (tier.kind is TierKind.DISK)
        assert tier.compressed == (tier.kind is TierKind.DISK)
        assert tier.in_place == (tier.kind is not TierKind.DISK)
        assert tier.budget_bytes == self.budget_pages * self.page_size

    def test_tier_closed_raises_unavailable_and_close_is_idempotent(self) -> None:
        tier = self.make_tier(self.budget_pages * self.page_size)
        tier.put(name_of(1), page_of(1, self.page_size))
        tier.close()
        tier.close()
        with pytest.raises(TierUnavailable):
            tier.get_into(name_of(1), bytearray(self.page_size))
        with pytest.raises(TierUnavailable):
            tier.put(name_of(2), page_of(2, self.page_size))
        with pytest.raises(TierUnavailable):
            tier.contains([name_of(1)])

    def test_tier_concurrent_puts_and_gets_never_mix_bytes(self, tier: Tier) -> None:
        errors: list[BaseException] = []

        def work(base: int) -> None:
            out = bytearray(self.page_size)
            try:
                for k in range(30):
                    i = base + k % 3
                    tier.put(name_of(i), page_of(i, self.page_size))
                    n = tier.get_into(name_of(i), out)
                    if n is not None and bytes(out) != page_of(i, self.page_size):
                        raise AssertionError(f"row {i}: wrong bytes")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(b * 10,)) for b in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors

    def test_tier_restart_keeps_what_the_tier_promises(self, tier: Tier) -> None:
        """Persistent: every row survives a restart with its bytes, a deleted one stays
        deleted. Volatile: after a restart the tier holds nothing and answers misses,
        never errors."""
        for i in range(3):
            tier.put(name_of(i), page_of(i, self.page_size))
        tier.delete(name_of(1))
        again = self.reopen(tier)
        try:
            names = [name_of(i) for i in range(3)]
            out = bytearray(self.page_size)
            if again.persistent:
                assert again.contains(names) == [True, False, True]
                assert again.get_into(name_of(2), out) == self.page_size
                assert bytes(out) == page_of(2, self.page_size)
                assert again.used_bytes > 0
            else:
                assert again.contains(names) == [False, False, False]
                assert all(again.get_into(n, out) is None for n in names)
                assert out == bytes(self.page_size)
                assert again.delete(name_of(0)) is False
                assert again.used_bytes == 0
                again.put(name_of(0), page_of(0, self.page_size))  # and it serves again
                assert again.get_into(name_of(0), out) == self.page_size
        finally:
            again.close()


def stored(store: TieredStore, names: Sequence[bytes]) -> list[bool]:
    """Whether the store holds each row (through its public ``locate``)."""
    return [t is not None for t in store.locate(names)]


def size_of(store: TieredStore, name: bytes) -> int | None:
    """The row's size (through the public ``scan``: the full name is its own prefix)."""
    rows = store.scan(name, limit=1)
    return rows[0].size if rows else None


class StoreTier(Tier):
    """A :class:`~kvbank.tiers.store.store.TieredStore` as one :class:`Tier` (public API only):
    its kind is its slowest enabled tier; it evicts rather than refuse a row."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        enabled = [t.kind for t in store.stats().tiers if t.enabled]
        self.kind = enabled[-1]

    @property
    def persistent(self) -> bool:
        return self.kind is TierKind.DISK

    @property
    def in_place(self) -> bool:
        return True

    @property
    def compressed(self) -> bool:
        return self.kind is TierKind.DISK

    @property
    def evicts(self) -> bool:
        return True

    @property
    def used_bytes(self) -> int:
        self.store.flush()  # purges and demotions settle first
        return sum(t.used_bytes for t in self.store.stats().tiers)

    @property
    def budget_bytes(self) -> int:
        return sum(t.budget_bytes for t in self.store.stats().tiers)

    def get_into(self, name: bytes, out: memoryview | bytearray) -> int | None:
        return self.store.get_into(name, out)

    def put(self, name: bytes, data: Buffer, *, dtype: str = "uint8") -> None:
        self.store.put(name, data, dtype=dtype)

    def delete(self, name: bytes) -> bool:
        return self.store.delete(name)

    def contains(self, names: Sequence[bytes]) -> list[bool]:
        return stored(self.store, names)

    def close(self) -> None:
        self.store.close()
