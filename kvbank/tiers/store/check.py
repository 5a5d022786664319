"""The store's consistency checker: every broken invariant as one line (diskcache's
``check``); the facade's ``check_invariants`` raises ``AssertionError`` on the first.

Checked: index vs tiers (bits, sizes, slots, overlap, staged copies), budgets and slot
accounting of every pool (rows + reservations + busy private slots = used bytes), the
page-lock tables, the pins, and — when the mover is idle — the disk tier against the
index (no stale frame, no row missing its frame). Caller holds the store lock.
"""

from __future__ import annotations

from kvbank.tiers.index import DEV, DISK, HOST, KIND_OF_BIT, MOVING
from kvbank.tiers.store.residency import SlotKey
from kvbank.tiers.store.state import StoreState
from kvbank.tiers.store.types import JobKind


def check(st: StoreState) -> list[str]:
    out = _rows(st)
    out += st.ix.check()
    out += st.locks.check()
    for name in st.pins.names():
        if name not in st.ix.ids:
            out.append(f"row {name.hex()[:16]}…: pinned but not in the store")
    if st.has_disk and not st.jobs and not st.busy:
        out += _disk(st)
    return out


def _rows(st: StoreState) -> list[str]:
    ix, res = st.ix, st.res
    n = ix.high
    out: list[str] = []
    seen: dict[SlotKey, bytes] = {}
    charged = {DEV: 0, HOST: 0}
    moving_jobs = {j.rid for j in st.jobs if j.kind is not JobKind.PURGE}
    for name, rid in ix.ids.items():
        tag = f"row {name.hex()[:16]}… (id {rid})"
        if ix.names[rid] != name:
            out.append(f"{tag}: names[{rid}] is {ix.names[rid]!r}")
        where, size = int(ix.where[rid]), int(ix.size[rid])
        if where == 0 or where & ~(DEV | HOST | DISK):
            out.append(f"{tag}: tier bits {where:#x}")
        if size <= 0:
            out.append(f"{tag}: size {size}")
        if where & DEV and where & HOST and rid not in res.host_copy:
            out.append(f"{tag}: in device and host without a staged copy")
        if rid in res.host_copy and not (where & DEV and where & HOST):
            out.append(f"{tag}: a staged second copy but bits {where:#x}")
        for bit in (DEV, HOST):
            if not where & bit:
                continue
            kind = KIND_OF_BIT[bit].value
            pool = st.pools.get(bit)
            if pool is None:
                out.append(f"{tag}: in the {kind} tier, which is off")
                continue
            off = res.mem_off(rid, bit)
            if not pool.allocator.is_slot(off):
                out.append(f"{tag}: {kind} offset {off} is not a slot")
                continue
            if pool.capacity(off) < size:
                out.append(f"{tag}: slot capacity {pool.capacity(off)} < {size}")
            if (bit, off) in seen:
                out.append(f"{tag}: shares {kind} slot {off} with {seen[(bit, off)].hex()[:16]}…")
            if (bit, off) in res.free_after:
                out.append(f"{tag}: its slot {off} is waiting to be freed")
            seen[(bit, off)] = name
            charged[bit] += pool.capacity(off)
        if where & DISK and not st.has_disk:
            out.append(f"{tag}: on disk, but there is no disk tier")
        if int(ix.flags[rid]) & MOVING and rid not in moving_jobs and not st.busy:
            out.append(f"{tag}: marked moving with no job")
        p = int(ix.parent[rid])
        if p >= n:
            out.append(f"{tag}: parent id {p} out of range")
    for rid in range(n):
        if ix.names[rid] is None and int(ix.where[rid]):
            out.append(f"id {rid}: removed but has tier bits {int(ix.where[rid])}")
    for key, (holder, _size) in res.reserved.items():
        if key in seen:
            out.append(f"reserved slot {key} of {holder!r} also holds a row")
        charged[key[0]] += st.pools[key[0]].capacity(key[1])
    for key in res.free_after:
        if key not in res.busy:
            out.append(f"slot {key}: waits to be freed but nothing holds it")
        charged[key[0]] += st.pools[key[0]].capacity(key[1])
    for key in res.busy:  # private slots of puts/stages/copies in flight
        if key not in seen and key not in res.free_after and key not in res.reserved:
            charged[key[0]] += st.pools[key[0]].capacity(key[1])
    for bit, pool in st.pools.items():
        kind = KIND_OF_BIT[bit].value
        try:
            pool.allocator.check()
        except AssertionError as exc:
            out.append(f"{kind} tier allocator: {exc}")
        if pool.used_bytes != charged[bit]:
            out.append(f"{kind} tier: {pool.used_bytes} bytes in use, rows/reservations "
                       f"account for {charged[bit]}")
        if pool.allocated_bytes > pool.budget:
            out.append(f"{kind} tier: holds {pool.allocated_bytes} bytes, budget {pool.budget}")
    return out


def _disk(st: StoreState) -> list[str]:
    disk, ix = st.disk(), st.ix
    out: list[str] = []
    try:
        disk.check()
    except AssertionError as exc:
        out.append(str(exc))
    disk_names = {name for name, rid in ix.ids.items() if int(ix.where[rid]) & DISK}
    on_disk = set(disk.names())
    missing = disk_names - on_disk
    if missing:
        out.append(f"{len(missing)} rows marked on disk are not in LMDB, "
                   f"e.g. {next(iter(missing)).hex()[:16]}…")
    extra = on_disk - set(ix.ids)
    if extra:
        out.append(f"{len(extra)} rows in LMDB are not in the index, "
                   f"e.g. {next(iter(extra)).hex()[:16]}…")
    for name in sorted(on_disk - disk_names - extra)[:1]:
        rid = ix.ids[name]
        out.append(f"row {name.hex()[:16]}…: in LMDB but its index bits are "
                   f"{int(ix.where[rid]):#x} (a stale frame)")
    return out
