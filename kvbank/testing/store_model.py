"""A Hypothesis state machine of :class:`~kvbank.tiers.store.store.TieredStore` against a dict.

The model holds the last bytes put under each name and the page locks. Budgets are tiny,
so eviction and demotion happen all the time; what must hold after every step:

- a read returns the last bytes put under the name, or a miss (evicted) — never other
  bytes, never a row that was deleted;
- a row that was present when it was locked stays present and readable until unlocked;
- refused writes (``RowLocked``, ``PageSizeMismatch``, ``TierFull``) change nothing;
- a batch stage (``stage_host_many``) puts every present row in host with its bytes, or
  raises ``TierFull`` and leaves no row in host that was not there before;
- a pinned row stays where it was until unpinned; ``pin`` past the pin budget raises
  ``PinBudgetExceeded`` and pins nothing; ``evict`` drops every row it names except the
  locked and pinned ones, which it reports;
- ``scan`` lists exactly the stored rows, in name order, page by page; the change feed
  (``take_events``), applied to a mirror (resynced with ``scan`` after an OVERFLOW),
  always equals the stored rows;
- ``check_invariants()`` passes;
- after a restart (close, reopen the same data dir) no deleted row comes back; under
  write-through every row present before it is back; under write-back a graceful close
  (``persist``) brings back every row unless the disk budget ran out, and
  ``close(persist=False)`` every row that had a disk copy.

Subclass :class:`StoreMachine` to change the configuration (see ``config_overrides``) and
run it with ``TestCase = Machine.TestCase``.
"""

from __future__ import annotations

import collections
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbank.config import BankConfig
from kvbank.errors import PageSizeMismatch, PinBudgetExceeded, RowLocked, TierFull
from kvbank.results import EventKind, RowEvent
from kvbank.testing.tiers import name_of, size_of, stored
from kvbank.tiers.base import TierKind
from kvbank.tiers.store.store import TieredStore

N_NAMES = 24
SIZES = (1000, 1500)
HOLDERS = ("lease-a", "lease-b")


def page_bytes(i: int, version: int, size: int) -> bytes:
    """Distinct, incompressible bytes per (name, version): an old or foreign copy never
    compares equal, and frames are as large as pages so the disk budget fills too."""
    return random.Random(i * 1_000_003 + version).randbytes(size)


class StoreMachine(RuleBasedStateMachine):
    """Random put/get/delete/lock/unlock/flush/restart against a dict model."""

    config_overrides: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="kvbank-model-"))
        self.store = self._open()
        self.values: dict[bytes, bytes] = {}  # last bytes put per name
        self.locks: dict[bytes, collections.Counter[str]] = {}
        # Locked rows present at lock time -> the tiers they were in: a locked row is
        # never evicted or moved down, so it only ever gains tiers (promotion on read).
        self.must_stay: dict[bytes, frozenset[TierKind]] = {}
        self.pinned: dict[bytes, frozenset[TierKind]] = {}  # pinned rows -> tiers held
        self.mirror: set[bytes] = set()  # the change feed applied so far
        self.version = 0

    def _config(self) -> BankConfig:
        fields: dict[str, Any] = {
            "data_dir": self.dir,
            "host_bytes": 8 * 1024,
            "disk_bytes": 24 * 1024,
            "device_bytes": 0,
            "disk_sync": False,
            "high_watermark": 0.9,
            "low_watermark": 0.6,
        }
        fields.update(self.config_overrides)
        return BankConfig(**fields)

    def _open(self) -> TieredStore:
        store = TieredStore(self._config())
        store.take_events()  # subscribe: the feed records from here on
        return store

    @property
    def write_through(self) -> bool:
        return self.config_overrides.get("write_policy") == "write-through"

    def teardown(self) -> None:
        try:
            self.store.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _locked(self, name: bytes) -> bool:
        return bool(self.locks.get(name))

    # -- rules -------------------------------------------------------------------------

    @rule(i=st.integers(0, N_NAMES - 1), big=st.booleans(),
          chain=st.booleans())
    def put(self, i: int, big: bool, chain: bool) -> None:
        name = name_of(i, b"m")
        size = SIZES[int(big)]
        present = stored(self.store, [name])[0]
        held = size_of(self.store, name)
        self.version += 1
        data = page_bytes(i, self.version, size)
        parent = name_of(i - 1, b"m") if chain and i else None
        try:
            self.store.put(name, data, parent=parent)
        except RowLocked:
            assert self._locked(name) or name in self.pinned, "RowLocked for a free name"
            return
        except PageSizeMismatch:
            assert present and held != size, f"PageSizeMismatch: held {held}, put {size}"
            return
        except TierFull:
            assert self.locks or self.pinned, "TierFull with nothing locked or pinned"
            return
        assert not self._locked(name), "a locked row was overwritten"
        assert not (present and held is not None and held != size), "size change accepted"
        self.values[name] = data

    @rule(i=st.integers(0, N_NAMES - 1))
    def get(self, i: int) -> None:
        name = name_of(i, b"m")
        out = bytearray(max(SIZES))
        n = self.store.get_into(name, out)
        if n is None:
            assert name not in self.must_stay, "a locked row was evicted"
            return
        assert name in self.values, "a row that was never put (or was deleted) came back"
        assert bytes(out[:n]) == self.values[name], "wrong bytes"

    @rule(i=st.integers(0, N_NAMES - 1))
    def delete(self, i: int) -> None:
        name = name_of(i, b"m")
        try:
            found = self.store.delete(name)
        except RowLocked:
            assert self._locked(name)
            return
        assert not self._locked(name), "a locked row was deleted"
        if found:
            assert name in self.values
        self.values.pop(name, None)
        self.pinned.pop(name, None)

    @rule(i=st.integers(0, N_NAMES - 1), holder=st.sampled_from(HOLDERS))
    def lock(self, i: int, holder: str) -> None:
        name = name_of(i, b"m")
        self.store.locks.lock([name], holder)
        self.locks.setdefault(name, collections.Counter())[holder] += 1
        tiers = self.store.residency([name])[0]
        if tiers:
            self.must_stay[name] = self.must_stay.get(name, frozenset()) | tiers

    @rule(holder=st.sampled_from(HOLDERS))
    def unlock_all(self, holder: str) -> None:
        self.store.locks.unlock_all(holder)
        for name in list(self.locks):
            self.locks[name].pop(holder, None)
            if not self.locks[name]:
                del self.locks[name]
                self.must_stay.pop(name, None)

    @rule(ids=st.lists(st.integers(0, N_NAMES - 1), min_size=1, max_size=8))
    def stage_many(self, ids: list[int]) -> None:
        """A lease's batch staging: every present row lands in host with its bytes, or
        ``TierFull`` and no row is in host that was not before."""
        names = [name_of(i, b"m") for i in ids]
        self.store.locks.lock(names, "stager")
        try:
            before = self.store.residency(names)
            try:
                slots = self.store.host.stage_many(names)
            except TierFull:
                after = self.store.residency(names)
                for name, was, now in zip(names, before, after, strict=True):
                    assert TierKind.HOST not in now or TierKind.HOST in was, (
                        f"row {name[-8:].hex()} left staged by a refused batch")
                return
            for name, was, slot in zip(names, before, slots, strict=True):
                if not was:
                    assert slot is None, "a slot for an absent row"
                    continue
                assert slot is not None, f"row {name[-8:].hex()} present but not staged"
                view = self.store.host.view(slot)
                try:
                    assert view.tobytes() == self.values[name], "staged wrong bytes"
                finally:
                    view.release()
        finally:
            self.store.locks.unlock_all("stager")

    @rule(ids=st.lists(st.integers(0, N_NAMES - 1), min_size=1, max_size=4))
    def pin(self, ids: list[int]) -> None:
        names = [name_of(i, b"m") for i in ids]
        before = self.store.residency(names)
        try:
            missing = self.store.pin(names)
        except PinBudgetExceeded:
            assert not any(r.pinned for n in set(names) - set(self.pinned)
                           for r in self.store.scan(n, limit=1)), "a refused pin pinned"
            return
        for name, tiers in zip(names, before, strict=True):
            assert (name in missing) == (not tiers), "pin: missing names are the absent ones"
            if tiers:
                self.pinned[name] = self.pinned.get(name, frozenset()) | tiers

    @rule(ids=st.lists(st.integers(0, N_NAMES - 1), min_size=1, max_size=4))
    def unpin(self, ids: list[int]) -> None:
        names = [name_of(i, b"m") for i in ids]
        self.store.unpin(names)
        for name in names:
            self.pinned.pop(name, None)

    @rule(ids=st.lists(st.integers(0, N_NAMES - 1), min_size=1, max_size=4))
    def evict(self, ids: list[int]) -> None:
        names = [name_of(i, b"m") for i in ids]
        res = self.store.evict(names)
        for name in res.evicted:
            assert not self._locked(name) and name not in self.pinned, "evicted a held row"
            self.values.pop(name, None)
        assert set(res.locked) <= set(self.locks) and set(res.pinned) <= set(self.pinned)
        assert not any(stored(self.store, list(res.evicted))), "an evicted row is still there"

    @rule(ids=st.lists(st.integers(0, N_NAMES - 1), max_size=4))
    def touch(self, ids: list[int]) -> None:
        names = [name_of(i, b"m") for i in ids]
        if names:
            assert self.store.touch(names) == sum(stored(self.store, list(dict.fromkeys(names))))

    @rule(limit=st.integers(1, 7), max_events=st.none() | st.integers(0, 6))
    def scan_and_feed(self, limit: int, max_events: int | None) -> None:
        """Pages of ``scan`` list exactly the stored rows in name order; the change feed,
        applied to a mirror, says the same once drained."""
        listed: list[bytes] = []
        after: bytes | None = None
        while page := self.store.scan(after=after, limit=limit):
            listed.extend(r.name for r in page)
            after = page[-1].name
        names = [name_of(i, b"m") for i in range(N_NAMES)]
        present = {n for n, p in zip(names, stored(self.store, names), strict=True) if p}
        assert listed == sorted(present), "scan differs from the stored rows"
        self._apply(self.store.take_events(max_events))  # a partial take, then the rest
        while events := self.store.take_events():
            self._apply(events)
        assert self.mirror == present, "the change feed disagrees with the stored rows"

    def _apply(self, events: list[RowEvent]) -> None:
        for ev in events:
            if ev.kind is EventKind.OVERFLOW:
                self.mirror = {r.name for r in self.store.scan(limit=1000)}
            elif ev.kind is EventKind.PUBLISHED:
                self.mirror.add(ev.name)
            else:
                self.mirror.discard(ev.name)

    @rule()
    def flush(self) -> None:
        self.store.flush()

    @precondition(lambda self: not self.locks)
    @rule(flush_first=st.booleans(), persist=st.booleans())
    def restart(self, flush_first: bool, persist: bool) -> None:
        """A graceful restart. ``persist`` (the default of ``close``) writes memory-only
        rows to disk, evicting older disk rows when the budget is short; without it only
        rows with a disk copy come back. Either way a deleted row never does."""
        if flush_first:
            self.store.flush()
        names = [name_of(i, b"m") for i in range(N_NAMES)]
        before = self.store.residency(names)
        self.store.close(persist=persist)
        self.store = self._open()
        self.pinned.clear()  # pins live in memory: a restart drops them
        self.mirror = {r.name for r in self.store.scan(limit=1000)}  # a new feed: resync
        after = stored(self.store, names)
        disk = self.store.stats().tier(TierKind.DISK)
        # Room left for one more frame of the largest size (incompressible: ~raw + header).
        roomy = disk.used_bytes + 2 * (max(SIZES) + 64) <= disk.budget_bytes
        for name, tiers, now in zip(names, before, after, strict=True):
            if now:
                assert name in self.values, "a deleted row came back after restart"
            if not tiers or now:
                continue
            tag = name[-8:].hex()
            if self.write_through:
                raise AssertionError(f"row {tag} was written through but is gone")
            if persist:
                assert not roomy, f"row {tag} was dropped at close while the disk had room"
            else:
                assert TierKind.DISK not in tiers, f"row {tag} had a disk copy but is gone"
        for name, now in zip(names, after, strict=True):
            if not now:
                self.values.pop(name, None)  # gone for good: a later read is a miss

    @invariant()
    def invariants_hold(self) -> None:
        self.store.check_invariants()

    @invariant()
    def pinned_rows_stay_where_they_were(self) -> None:
        names = list(self.pinned)
        for name, now in zip(names, self.store.residency(names), strict=True):
            lost = self.pinned[name] - now
            assert not lost, f"pinned row {name[-8:].hex()} left {sorted(t.value for t in lost)}"
            self.pinned[name] = now

    @invariant()
    def locked_rows_stay_where_they_were(self) -> None:
        names = list(self.must_stay)
        for name, now in zip(names, self.store.residency(names), strict=True):
            lost = self.must_stay[name] - now
            assert not lost, f"locked row {name[-8:].hex()} left {sorted(t.value for t in lost)}"
            self.must_stay[name] = now


class WriteThroughMachine(StoreMachine):
    config_overrides: ClassVar[dict[str, Any]] = {"write_policy": "write-through"}


class DeviceMachine(StoreMachine):
    """With a CPU-device pool above the host slab."""

    config_overrides: ClassVar[dict[str, Any]] = {"device": "cpu", "device_bytes": 4 * 1024}
