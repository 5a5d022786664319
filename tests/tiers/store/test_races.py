"""Threads racing on the SAME rows of one store: puts, reads, leases' lock and stage,
evictions, deletes, pins and the mover's demotions, all on a handful of names.

The older concurrency tests give each thread its own names, so two operations never meet
on one row. Here every thread works on the same six rows under budgets small enough that
the mover demotes (device -> host -> disk) while the others read, lock and stage them.
What must hold: a read answers the row's exact bytes or a miss; a staged slot holds the
row's exact bytes while its lock is held; a refusal is one of the typed ones (the row is
locked or pinned, no room, a deadline); and ``check_invariants`` is clean at the end.
"""

from __future__ import annotations

import collections
import random
import threading
from collections.abc import Callable

import pytest

from kvbank.errors import Busy, RowLocked, TierFull
from kvbank.testing.tiers import name_of, page_of
from kvbank.tiers.store.store import TieredStore

from ..conftest import MakeStore

P = 4096
ROWS = 6  # every thread works on these same rows
OPS = 120  # per thread; small, the point is overlap, not volume
REFUSALS = (RowLocked, Busy, TierFull)  # what a racing operation may be told, typed


def _check_bytes(i: int, data: bytes | bytearray | memoryview) -> None:
    if bytes(data) != page_of(i, P):
        raise AssertionError(f"row {i}: wrong bytes")


def _race(store: TieredStore, ops: dict[str, Callable[[random.Random, str], None]],
          threads: int = 4) -> None:
    """Run ``threads`` workers, each drawing ``OPS`` operations at random (seeded per
    worker), started together on a barrier; re-raise the first unexpected error."""
    errors: list[BaseException] = []
    start = threading.Barrier(threads)
    names = sorted(ops)
    done: collections.Counter[str] = collections.Counter()  # completed, not refused

    def worker(w: int) -> None:
        rng = random.Random(w)
        holder = f"worker-{w}"
        start.wait()
        try:
            for _ in range(OPS):
                op = rng.choice(names)
                try:
                    ops[op](rng, holder)
                    done[op] += 1
                except REFUSALS:
                    pass
                finally:
                    store.locks.unlock_all(holder)
        except BaseException as exc:  # re-raised by the test thread
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)  # a hang bound, not a timing figure
    assert not any(t.is_alive() for t in ts), "a worker hung"
    assert not errors, errors
    assert set(done) == set(names), done  # every kind of operation really ran
    store.flush()
    store.check_invariants()
    out = bytearray(P)
    for i in range(ROWS):  # whatever survived is whole
        n = store.get_into(name_of(i), out)
        assert n is None or bytes(out) == page_of(i, P), i


def _ops(store: TieredStore) -> dict[str, Callable[[random.Random, str], None]]:
    def put(rng: random.Random, _: str) -> None:
        i = rng.randrange(ROWS)
        store.put(name_of(i), page_of(i, P), parent=name_of(i - 1) if i else None)

    def put_many(rng: random.Random, _: str) -> None:
        picked = rng.sample(range(ROWS), 3)
        store.put_many([(name_of(i), memoryview(page_of(i, P)), None) for i in picked])

    def get(rng: random.Random, _: str) -> None:
        i = rng.randrange(ROWS)
        out = bytearray(P)
        if store.get_into(name_of(i), out) is not None:
            _check_bytes(i, out)

    def get_many(rng: random.Random, _: str) -> None:
        picked = rng.sample(range(ROWS), 3)
        outs = [bytearray(P) for _ in picked]
        for i, n, out in zip(picked, store.get_many_into([name_of(i) for i in picked], outs),
                             outs, strict=True):
            if n is not None:
                _check_bytes(i, out)

    def lend(rng: random.Random, holder: str) -> None:
        # A lease's store side: lock, stage into host, read in place, unlock.
        picked = rng.sample(range(ROWS), 2)
        names = [name_of(i) for i in picked]
        store.locks.lock(names, holder)
        for i, slot in zip(picked, store.host.stage_many(names), strict=True):
            if slot is not None:
                view = store.host.view(slot)
                try:
                    _check_bytes(i, view)
                finally:
                    view.release()

    def evict(rng: random.Random, _: str) -> None:
        store.evict([name_of(rng.randrange(ROWS))])

    def delete(rng: random.Random, _: str) -> None:
        store.delete(name_of(rng.randrange(ROWS)))

    def pin(rng: random.Random, _: str) -> None:
        names = [name_of(rng.randrange(ROWS))]
        store.pin(names)
        store.unpin(names)

    return {"put": put, "put_many": put_many, "get": get, "get_many": get_many,
            "lend": lend, "evict": evict, "delete": delete, "pin": pin}


@pytest.mark.parametrize("policy", ["write-back", "write-through"])
def test_store_same_row_races_over_host_and_disk(make_store: MakeStore, policy: str) -> None:
    """Host room for 3 of the 6 rows: the mover demotes rows others are reading, locking
    and staging back; puts and evictions hit the same names meanwhile."""
    s = make_store(host_bytes=3 * P, disk_bytes=1 << 20, write_policy=policy,
                   dirty_expire_s=0, wait_timeout_s=5, pin_bytes=2 * P)
    _race(s, _ops(s))


def test_store_same_row_races_over_device_host_and_disk(make_store: MakeStore) -> None:
    """With a device pool (on the CPU) over the host: device -> host copies race leases."""
    s = make_store(host_bytes=3 * P, device="cpu", device_bytes=2 * P, disk_bytes=1 << 20,
                   wait_timeout_s=5, pin_bytes=2 * P)
    _race(s, _ops(s))


def test_store_same_row_put_vs_lock_never_overwrites_a_locked_row(make_store: MakeStore) -> None:
    """Two threads on ONE row: one puts it over and over, one locks it, stages it, checks
    the bytes in place and unlocks. A put meets the lock as RowLocked or as a skipped
    row, never as new bytes under a reader's slot."""
    s = make_store(host_bytes=4 * P, disk_bytes=1 << 20, pin_bytes=2 * P)
    s.put(name_of(0), page_of(0, P))
    ops = _ops(s)
    only_row_0: dict[str, Callable[[random.Random, str], None]] = {}
    for key in ("put", "lend", "evict", "get"):
        only_row_0[key] = (lambda op: lambda _rng, holder: op(_Zero(), holder))(ops[key])
    _race(s, only_row_0, threads=3)


class _Zero(random.Random):
    """A random source that always picks row 0 (and pairs it with row 1 for samples)."""

    def randrange(self, *_: object, **__: object) -> int:
        return 0

    def sample(self, population: object, k: int, **__: object) -> list[int]:  # type: ignore[override]
        return list(range(k))
