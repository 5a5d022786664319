"""A reference model of the lender and a Hypothesis state machine that checks one against it.

:class:`LenderModel` is the lender's semantics in a few dozen lines of dicts: live leases
with deadlines on a fake clock, the readers/writer conflict rule, which rows a READ lease
locks, what a WRITE commit makes visible. :class:`LenderMachine` drives a real
:class:`~kvbank.lender.lender.Lender` over a real :class:`~kvbank.tiers.store.store.TieredStore`
(host tier only, a small budget) through lend, read, write, commit (partial), renew,
release, clock jumps (expiry without sleeping), puts, deletes, existence probes and
eviction pressure, and after every step checks the lender and the store against the
model and against their own ``check_invariants()``.

The store may evict any unlocked row at any time (the mover demotes under pressure), so
the model holds the *last visible bytes* of each name: a row that is present must carry
them, and a row a live READ lease locks must be present.

Use: ``TestLender = LenderMachine.TestCase`` in a test module (settings on the class).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvbank.config import BankConfig
from kvbank.errors import LeaseConflict, LeaseExpired, LeaseNotFound, RowLocked
from kvbank.lender.base import Delivery, LeaseMode, PageShape, Region
from kvbank.lender.lender import Lender
from kvbank.testing.tiers import stored
from kvbank.tiers.store.store import TieredStore

PAGE = 4096
NAMES = [bytes([i + 1]) * 54 for i in range(10)]  # the rows leases are taken on
SHAPE = PageShape(PAGE, (Region(0, "KEY", 0, PAGE),))
TTL = 5.0
MAX_TTL = 20.0


PICK = st.integers(0, 63)  # an index drawn independently of state, mapped with pick()


def pick(items: list[Any], k: int) -> Any:
    """``items[k % len]``: draws keep one shape whatever the store evicted meanwhile, so
    Hypothesis replays stay consistent (the mover thread makes eviction timing vary)."""
    return items[k % len(items)]


class FakeClock:
    """A monotonic clock that moves only when told (expiry without sleeping)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._jump: tuple[int, float] | None = None

    def jump_after(self, calls: int, to: float) -> None:
        """Answer ``to`` from the ``calls + 1``-th call on: time passing *inside* an
        operation, e.g. while a read copies."""
        self._jump = (calls, to)

    def __call__(self) -> float:
        if self._jump is not None:
            left, to = self._jump
            if left == 0:
                self.now, self._jump = to, None
            else:
                self._jump = (left - 1, to)
        return self.now


@dataclass
class ModelLease:
    id: str
    mode: LeaseMode
    names: tuple[bytes, ...]
    deadline: float
    ready: dict[bytes, bytes] = field(default_factory=dict)  # READ: locked rows and bytes
    reserved: set[bytes] = field(default_factory=set)  # WRITE: rows with a slot
    written: dict[bytes, bytes] = field(default_factory=dict)  # WRITE: filled rows


@dataclass
class LenderModel:
    """The lender's semantics over dicts."""

    now: float
    contents: dict[bytes, bytes] = field(default_factory=dict)  # last visible bytes by name
    live: dict[str, ModelLease] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)  # id -> expired | released | committed

    def expire(self) -> None:
        for lid in [lid for lid, m in self.live.items() if m.deadline <= self.now]:
            del self.live[lid]
            self.ended[lid] = "expired"

    def end(self, lid: str, why: str) -> None:
        del self.live[lid]
        self.ended[lid] = why

    def conflicts(self, names: tuple[bytes, ...], mode: LeaseMode) -> bool:
        for m in self.live.values():
            if set(m.names) & set(names) and (m.mode is LeaseMode.WRITE or mode is LeaseMode.WRITE):
                return True
        return False

    def locked(self) -> set[bytes]:
        return {n for m in self.live.values() if m.mode is LeaseMode.READ for n in m.ready}

    def readable(self) -> list[str]:
        """Live READ leases with rows to read (deadline not passed)."""
        return [lid for lid, m in self.live.items()
                if m.mode is LeaseMode.READ and m.ready and m.deadline > self.now]

    def writable(self) -> list[str]:
        return [lid for lid, m in self.live.items()
                if m.mode is LeaseMode.WRITE and m.deadline > self.now]

    def failure(self, lid: str) -> type[Exception] | None:
        """The error an operation on ``lid`` must raise now, or None if it is live."""
        if lid in self.live:
            return None
        return LeaseExpired if self.ended.get(lid) == "expired" else LeaseNotFound


class LenderMachine(RuleBasedStateMachine):
    """The lender against :class:`LenderModel` (see the module docstring)."""

    host_bytes = 96 * PAGE

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.config = BankConfig(
            host_bytes=self.host_bytes, device_bytes=0, lease_ttl_s=TTL, max_lease_ttl_s=MAX_TTL
        )
        self.store = TieredStore(self.config)
        self.lender = Lender(
            self.store, self.config, clock=self.clock, reaper=False,
            describe=lambda name: SHAPE if name in NAMES else None,
        )
        self.model = LenderModel(self.clock.now)
        self.ids: list[str] = []
        self.fillers = 0

    def teardown(self) -> None:
        self.lender.close()
        self.store.close()

    def _store_call_prelude(self) -> None:
        # The reaper thread would have run by now; the store itself never asks the lender.
        self.lender.reap()
        self.model.expire()

    # ---- rules -------------------------------------------------------------------------

    @initialize(fill=st.integers(0, 255))
    def stored(self, fill: int) -> None:
        """Start with the first rows stored, so READ leases find bytes and WRITE leases
        find both stored and missing rows."""
        for i, name in enumerate(NAMES[:6]):
            data = bytes([(fill + i) % 256]) * PAGE
            self.store.put(name, data)
            self.model.contents[name] = data

    @rule(i=st.integers(0, len(NAMES) - 1), fill=st.integers(0, 255))
    def put(self, i: int, fill: int) -> None:
        self._store_call_prelude()
        name, data = NAMES[i], bytes([fill]) * PAGE
        if name in self.model.locked():
            try:
                self.store.put(name, data)
            except RowLocked:
                return
            raise AssertionError("put over a row a live READ lease locks succeeded")
        self.store.put(name, data)
        self.model.contents[name] = data

    @rule(
        idx=st.lists(st.integers(0, len(NAMES) - 1), min_size=1, max_size=4, unique=True),
        mode=st.sampled_from(LeaseMode),
        ttl=st.sampled_from([None, 1.0, 3.0, 12.0]),
    )
    def lend(self, idx: list[int], mode: LeaseMode, ttl: float | None) -> None:
        names = tuple(NAMES[i] for i in idx)
        self.model.expire()
        locked_before = self.model.locked()
        if self.model.conflicts(names, mode):
            try:
                self.lender.lend(names, mode=mode, ttl_s=ttl)
            except LeaseConflict:
                return
            raise AssertionError(f"{mode.name} lease granted over a conflicting lease")
        lease = self.lender.lend(names, mode=mode, ttl_s=ttl)
        if lease.expires_at != self.model.now + (TTL if ttl is None else ttl):
            raise AssertionError("lease deadline is not now + ttl")
        m = ModelLease(lease.id, mode, names, lease.expires_at)
        for row in lease.rows:
            if row.regions != SHAPE.regions:
                raise AssertionError("lease row lost its regions")
            if mode is LeaseMode.READ:
                if row.delivery is Delivery.READY:
                    if row.name not in self.model.contents:
                        raise AssertionError("READY row the model never saw stored")
                    m.ready[row.name] = self.model.contents[row.name]
                elif row.name in locked_before:
                    raise AssertionError("a locked row was reported MISSING")
            elif row.delivery is Delivery.RESERVED:
                m.reserved.add(row.name)
            elif row.name not in self.model.contents:
                raise AssertionError("PRESENT row the model never saw stored")
        self.model.live[lease.id] = m
        self.ids.append(lease.id)

    def _live_read_lease(self, k: int) -> tuple[str, ModelLease] | None:
        """A live READ lease with rows ready to read (id and model entry), or None."""
        self.model.expire()
        if not self.model.readable():
            return None
        lid = pick(self.model.readable(), k)
        m = self.model.live.get(lid)
        if m is None or m.mode is not LeaseMode.READ or not m.ready:
            return None
        return lid, m

    @precondition(lambda self: bool(self.ids))
    @rule(k=PICK)
    def read(self, k: int) -> None:
        picked = self._live_read_lease(k)
        if picked is None:
            return
        lid, m = picked
        name = pick(sorted(m.ready), k // 7)
        if self.lender.read(lid, name) != m.ready[name]:
            raise AssertionError("read through a lease returned other bytes")

    @precondition(lambda self: bool(self.ids))
    @rule(k=PICK)
    def read_after_expiry(self, k: int) -> None:
        """A read that completes after the deadline is refused (its bytes are not used)."""
        picked = self._live_read_lease(k)
        if picked is None:
            return
        lid, m = picked
        name = next(iter(m.ready))
        view = self.lender.view(lid, name)
        out = bytes(view)  # the copy "completes" after the clock passes the deadline
        view.release()
        self.clock.now = self.model.now = m.deadline
        try:
            self.lender.check_live(lid)
        except LeaseExpired:
            self.model.expire()
            if out != m.ready[name]:
                raise AssertionError("leased bytes changed under the lease") from None
            return
        raise AssertionError("check_live accepted a read completed after expiry")

    @precondition(lambda self: bool(self.ids))
    @rule(k=PICK)
    def read_racing_expiry(self, k: int) -> None:
        """The deadline passes while read_into copies: the copy must not count."""
        picked = self._live_read_lease(k)
        if picked is None:
            return
        lid, m = picked
        self.clock.jump_after(1, m.deadline)  # live when the copy starts, not when it ends
        try:
            self.lender.read_into(lid, next(iter(m.ready)), bytearray(PAGE))
        except LeaseExpired:
            self.model.now = self.clock.now
            self.model.expire()
            return
        raise AssertionError("read_into returned bytes from a lease that expired mid-copy")

    @precondition(lambda self: bool(self.ids))
    @rule(k=PICK, fill=st.integers(0, 255))
    def write(self, k: int, fill: int) -> None:
        self.model.expire()
        if not self.model.writable():
            return
        lid = pick(self.model.writable(), k)
        m = self.model.live.get(lid)
        if m is None or m.mode is not LeaseMode.WRITE or not m.reserved:
            return
        name = pick(sorted(m.reserved), k // 7)
        payload = bytes([fill]) * PAGE
        self.lender.write(lid, name, payload)
        m.written[name] = payload

    @precondition(lambda self: bool(self.ids))
    @rule(
        k=PICK,
        live=st.booleans(),
        fills=st.lists(st.integers(0, 255), min_size=1, max_size=4),
        arrived_k=st.lists(st.integers(0, 255), max_size=4),
    )
    def commit(self, k: int, live: bool, fills: list[int], arrived_k: list[int]) -> None:
        """Commit a live WRITE lease (partially), or an ended lease (refused)."""
        self.model.expire()
        pool = self.model.writable() if live and self.model.writable() else self.ids
        lid = pick(pool, k)
        fail = self.model.failure(lid)
        m = self.model.live.get(lid)
        if m is not None and m.mode is not LeaseMode.WRITE:
            return
        if fail is not None:
            try:
                self.lender.commit(lid, [])
            except fail:
                return
            raise AssertionError(f"commit of an ended lease did not raise {fail.__name__}")
        if m is None:  # unreachable: failure() is None only for live leases
            return
        # fill some reserved rows first; only filled rows can arrive whole
        for f in fills if m.reserved else []:
            name = pick(sorted(m.reserved), f)
            payload = bytes([f]) * PAGE
            self.lender.write(lid, name, payload)
            m.written[name] = payload
        written = sorted(m.written)
        arrived = sorted({pick(written, a) for a in arrived_k}) if written else []
        res = self.lender.commit(lid, arrived)
        self.model.end(lid, "committed")
        if set(res.committed) | set(res.already_present) != set(arrived):
            raise AssertionError("commit lost an arrived row")
        if set(res.discarded) != m.reserved - set(arrived):
            raise AssertionError("commit did not discard exactly the rows that did not arrive")
        for n in res.committed:
            self.model.contents[n] = m.written[n]
        for n in res.already_present:
            if n not in self.model.contents:
                raise AssertionError("already_present for a row nobody stored")
        for n in res.discarded:
            if n not in self.model.contents and self.store.locate([n])[0] is not None:
                raise AssertionError("a discarded row became visible")

    @precondition(lambda self: bool(self.ids))
    @rule(k=PICK, ttl=st.sampled_from([None, 2.0, 12.0]))
    def renew(self, k: int, ttl: float | None) -> None:
        lid = pick(self.ids, k)
        self.model.expire()
        fail = self.model.failure(lid)
        if fail is not None:
            try:
                self.lender.renew(lid, ttl)
            except fail:
                return
            raise AssertionError(f"renew of an ended lease did not raise {fail.__name__}")
        lease = self.lender.renew(lid, ttl)
        self.model.live[lid].deadline = lease.expires_at
        if lease.expires_at != self.model.now + (TTL if ttl is None else ttl):
            raise AssertionError("renewed deadline is not now + ttl")

    @precondition(lambda self: bool(self.ids))
    @rule(k=PICK)
    def release(self, k: int) -> None:
        lid = pick(self.ids, k)
        self.model.expire()
        why = self.model.ended.get(lid)
        if lid in self.model.live:
            if self.lender.release(lid) is not True:
                raise AssertionError("release of a live lease did not answer True")
            self.model.end(lid, "released")
        elif why is not None and self.lender.release(lid) is not False:
            # expired, released or committed: a second release is safe and answers False
            raise AssertionError(f"release of a {why} lease did not answer False")

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0]))
    def advance(self, dt: float) -> None:
        self.clock.now += dt
        self.model.now = self.clock.now

    @rule(i=st.integers(0, len(NAMES) - 1))
    def delete(self, i: int) -> None:
        self._store_call_prelude()
        name = NAMES[i]
        if name in self.model.locked():
            try:
                self.store.delete(name)
            except RowLocked:
                return
            raise AssertionError("delete of a locked row succeeded")
        self.store.delete(name)

    @rule(rounds=st.integers(1, 20))
    def probe(self, rounds: int) -> None:
        """Existence checks never lend, lock or renew (Mooncake#2187)."""
        before = {n: self.store.locks.is_locked(n) for n in NAMES}
        deadlines = {lid: m.deadline for lid, m in self.model.live.items()}
        for _ in range(rounds):
            self.store.locate(NAMES)
            stored(self.store, NAMES)
        if {n: self.store.locks.is_locked(n) for n in NAMES} != before:
            raise AssertionError("an existence check changed page locks")
        for lid, d in deadlines.items():
            if self.lender.lease(lid).expires_at != d:
                raise AssertionError("an existence check renewed a lease")

    @rule(n=st.integers(16, 48))
    def pressure(self, n: int) -> None:
        """Fill the host tier with other rows so that eviction must pick victims."""
        self._store_call_prelude()
        for _ in range(n):
            self.fillers += 1
            self.store.put(b"\xf0" + self.fillers.to_bytes(53, "big"), bytes(PAGE))

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        self._store_call_prelude()
        self.lender.check_invariants()
        self.store.check_invariants()
        if set(self.lender.live_ids()) != set(self.model.live):
            raise AssertionError(
                f"live leases {sorted(self.lender.live_ids())} != model {sorted(self.model.live)}"
            )
        locked = self.model.locked()
        where = self.store.locate(NAMES)
        buf = bytearray(PAGE)
        for name, tier in zip(NAMES, where, strict=True):
            if self.store.locks.is_locked(name) != (name in locked):
                raise AssertionError(f"row {NAMES.index(name)}: lock state differs from the model")
            if name in locked and tier is None:
                raise AssertionError(f"row {NAMES.index(name)} is locked but was evicted")
            if tier is not None and self.store.get_into(name, buf) is not None \
                    and bytes(buf) != self.model.contents.get(name):
                raise AssertionError(f"row {NAMES.index(name)} holds bytes nobody stored last")
