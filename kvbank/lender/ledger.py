"""The fetch ledger: which planned rows of a fetch arrived whole, and what that allows.

Primitives:

- :class:`FetchLedger` — a table of open fetches, each under a fetch id.
- :class:`PlannedRow` — one row a fetch means to deliver: group, key index, name and its
  position in the caller's output buffer of that group.

Lifecycle: ``open`` (the plan: the rows a :class:`~kvbank.lender.resume.ResumeBound`
needs) → ``record`` each row as it arrives *whole* → ``bound`` recomputes the resume bound
from the delivered rows alone → ``close``. A row that did not arrive whole is a miss,
never "loaded" (dynamo#15079). A broken fetch resumes with ``pending``: the planned rows
not yet delivered, in plan order, so the first one is the first undelivered row. An entry
not touched for ``ttl_s`` expires (checked lazily on every call); its id then answers
:class:`~kvbank.errors.FetchNotFound`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvbank.errors import FetchNotFound, InvalidInput
from kvbank.layout import PageLayout
from kvbank.lender.resume import ResumeBound, resume_bound

logger = logging.getLogger(__name__)

Clock = Callable[[], float]  # monotonic seconds


@dataclass(frozen=True, slots=True)
class PlannedRow:
    group: int
    index: int  # key index in the group's chain
    name: bytes
    slot: int  # position in the caller's output buffer of this group


@dataclass(slots=True)
class _Entry:
    layout: PageLayout
    prompt_tokens: int
    names: tuple[tuple[bytes, ...], ...]  # per group, the keyed chain's row names
    plan: tuple[PlannedRow, ...]
    deadline: float
    delivered: set[bytes] = field(default_factory=set)


class FetchLedger:
    """Open fetches and their delivered rows. Thread-safe."""

    def __init__(self, ttl_s: float, clock: Clock = time.monotonic) -> None:
        if not ttl_s > 0:
            raise InvalidInput(f"ttl_s: must be positive, got {ttl_s!r}")
        self._ttl = float(ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def open(
        self,
        layout: PageLayout,
        prompt_tokens: int,
        names: Sequence[Sequence[bytes]],
        plan: ResumeBound,
        fetch_id: str | None = None,
    ) -> str:
        """Start a fetch of ``plan``'s rows; returns its id (``fetch_id`` or a new one)."""
        if fetch_id is not None and (not isinstance(fetch_id, str) or not fetch_id):
            raise InvalidInput(f"fetch_id: must be a non-empty string, got {fetch_id!r}")
        if len(plan.rows) != len(layout.groups) or (plan.row_count and not plan.needed()):
            raise InvalidInput("plan: a fetch plan must carry row names for every group")
        rows = tuple(
            PlannedRow(gi, j, name, slot)
            for gi, (idx, nm) in enumerate(zip(plan.pages, plan.rows, strict=True))
            for slot, (j, name) in enumerate(zip(idx, nm, strict=True))
        )
        fid = fetch_id or uuid.uuid4().hex
        with self._lock:
            now = self._clock()
            self._expire_locked(now)
            if fid in self._entries:
                raise InvalidInput(f"fetch_id: {fid!r} is already open")
            self._entries[fid] = _Entry(
                layout, prompt_tokens, tuple(tuple(g) for g in names), rows, now + self._ttl
            )
        logger.debug("fetch %s opened: %d rows planned", fid, len(rows))
        return fid

    def _entry(self, fetch_id: str) -> _Entry:
        now = self._clock()
        self._expire_locked(now)
        entry = self._entries.get(fetch_id)
        if entry is None:
            raise FetchNotFound(f"fetch_id: no open fetch {fetch_id!r} (finished, expired or never started)")
        entry.deadline = now + self._ttl  # activity keeps a long, streamed fetch alive
        return entry

    def __contains__(self, fetch_id: object) -> bool:
        with self._lock:
            self._expire_locked(self._clock())
            return fetch_id in self._entries

    def plan(self, fetch_id: str) -> tuple[PlannedRow, ...]:
        with self._lock:
            return self._entry(fetch_id).plan

    def record(self, fetch_id: str, names: Sequence[bytes]) -> None:
        """Mark rows of the plan as delivered *whole*. A name outside the plan is refused."""
        with self._lock:
            entry = self._entry(fetch_id)
            planned = {r.name for r in entry.plan}
            for i, n in enumerate(names):
                if n not in planned:
                    raise InvalidInput(f"names[{i}]: row {bytes(n).hex()[:16]}… is not in fetch {fetch_id!r}")
            entry.delivered.update(names)

    def pending(self, fetch_id: str) -> tuple[PlannedRow, ...]:
        """Planned rows not yet delivered, in plan order."""
        with self._lock:
            entry = self._entry(fetch_id)
            return tuple(r for r in entry.plan if r.name not in entry.delivered)

    def delivered(self, fetch_id: str) -> frozenset[bytes]:
        with self._lock:
            return frozenset(self._entry(fetch_id).delivered)

    def bound(self, fetch_id: str) -> ResumeBound:
        """The resume bound recomputed from the delivered rows alone."""
        with self._lock:
            entry = self._entry(fetch_id)
            got = set(entry.delivered)
            names = entry.names
            layout, t = entry.layout, entry.prompt_tokens
        return resume_bound(layout, t, lambda g, j: names[g][j] in got, names)

    def close(self, fetch_id: str) -> None:
        with self._lock:
            self._entry(fetch_id)
            del self._entries[fetch_id]
        logger.debug("fetch %s closed", fetch_id)

    def expire(self) -> int:
        """Drop entries past their deadline now; returns how many."""
        with self._lock:
            return self._expire_locked(self._clock())

    def _expire_locked(self, now: float) -> int:
        dead = [fid for fid, e in self._entries.items() if e.deadline <= now]
        for fid in dead:
            del self._entries[fid]
            logger.debug("fetch %s expired", fid)
        return len(dead)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def check_invariants(self) -> None:
        """Delivered rows are planned rows; plans are in group, slot order."""
        with self._lock:
            for fid, e in self._entries.items():
                planned = {r.name for r in e.plan}
                if not e.delivered <= planned:
                    raise AssertionError(f"fetch {fid}: delivered rows outside the plan")
                for gi in range(len(e.layout.groups)):
                    slots = [r.slot for r in e.plan if r.group == gi]
                    if slots != list(range(len(slots))):
                        raise AssertionError(f"fetch {fid}: group {gi} slots {slots}")
