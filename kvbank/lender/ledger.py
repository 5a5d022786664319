"""The fetch ledger: which planned rows of a fetch arrived whole, and what that allows.

Primitives:

- :class:`FetchLedger` — a table of open fetches, each under a fetch id.
- :class:`PlannedRow` — one row a fetch means to deliver: group, key index, name and its
  position in the caller's output buffer of that group (``out_index``).
- :class:`FetchInfo` — a snapshot of one open fetch, for listing (:meth:`FetchLedger.entries`).

Lifecycle: ``open`` (the plan: the rows a :class:`~kvbank.lender.resume.ResumeBound`
needs) → ``record`` each row as it arrives *whole* → ``bound`` recomputes the resume bound
from the delivered rows alone → ``close``. A row that did not arrive whole is a miss,
never "loaded" (dynamo#15079). A broken fetch resumes with ``pending``: the planned rows
not yet delivered, in plan order, so the first one is the first undelivered row.

Expiry. An entry lives ``ttl_s`` from its last ``open``, ``record`` or ``renew`` (the
commands). Lookups (``plan``, ``pending``, ``delivered``, ``bound``, ``in``, ``len``,
``entries``) change nothing: they neither renew an entry nor drop one, they only treat an
entry past its deadline as gone (:class:`~kvbank.errors.FetchNotFound`). Dead entries are
dropped by ``expire`` and by the next ``open``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from kvbank import fastrows as columns
from kvbank.errors import FetchNotFound, InvalidInput
from kvbank.layout import PageLayout
from kvbank.lender.resume import ResumeBound, resume_bound

logger = logging.getLogger(__name__)

Clock = Callable[[], float]  # monotonic seconds
# A caller's fetch id: it travels in the stream's header and the acknowledgement's path.
_FETCH_ID = re.compile(r"[A-Za-z0-9._:~+=@-]{1,128}")


@dataclass(frozen=True, slots=True)
class PlannedRow:
    group: int
    index: int  # key index in the group's chain
    name: bytes
    out_index: int  # position in the caller's output buffer of this group


@dataclass(frozen=True, slots=True)
class FetchInfo:
    """One open fetch when it was listed."""

    fetch_id: str
    layout_id: bytes
    prompt_tokens: int
    planned_rows: int
    delivered_rows: int
    ttl_s: float  # seconds left before it expires unless renewed or recorded into


@dataclass(slots=True)
class _Entry:
    layout: PageLayout
    prompt_tokens: int
    names: tuple[tuple[bytes, ...], ...]  # per group, the keyed chain's row names
    plan: tuple[PlannedRow, ...]
    deadline: float
    # The plan's names, built once at open: ``record`` runs once per arriving row (or
    # batch), and rebuilding this set there made a fetch quadratic in its rows.
    planned: frozenset[bytes] = frozenset()
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
        if fetch_id is not None and (not isinstance(fetch_id, str) or not _FETCH_ID.fullmatch(fetch_id)):
            # it travels in an HTTP header and a URL path: printable ASCII, no separators
            raise InvalidInput(f"fetch_id: expected 1 to 128 characters of A-Z a-z 0-9 . _ : ~ + = @ -, "
                               f"got {fetch_id!r:.200}", field="fetch_id")
        if len(plan.rows) != len(layout.groups) or (plan.row_count and not plan.needed()):
            raise InvalidInput("plan: a fetch plan must carry row names for every group")
        group: list[int] = []
        index: list[int] = []
        row_names: list[bytes] = []
        out_index: list[int] = []
        for gi, (idx, nm) in enumerate(zip(plan.pages, plan.rows, strict=True)):
            if len(idx) != len(nm):
                raise InvalidInput(f"plan: group {gi} lists {len(idx)} pages and {len(nm)} row names")
            group += repeat(gi, len(idx))
            index += idx
            row_names += nm
            out_index += range(len(idx))
        rows = tuple(columns.build(PlannedRow, len(row_names), (group, index, row_names, out_index)))
        fid = fetch_id or uuid.uuid4().hex
        with self._lock:
            now = self._clock()
            self._expire_locked(now)
            if fid in self._entries:
                raise InvalidInput(f"fetch_id: {fid!r} is already open")
            self._entries[fid] = _Entry(
                layout, prompt_tokens, tuple(tuple(g) for g in names), rows, now + self._ttl,
                frozenset(row_names),
            )
        logger.debug("fetch %s opened: %d rows planned", fid, len(rows))
        return fid

    def _entry(self, fetch_id: str) -> _Entry:
        """The live entry (a lookup: renews nothing, drops nothing)."""
        entry = self._entries.get(fetch_id)
        if entry is None or entry.deadline <= self._clock():
            raise FetchNotFound(f"fetch_id: no open fetch {fetch_id!r} (finished, expired or never started)")
        return entry

    def __contains__(self, fetch_id: object) -> bool:
        with self._lock:
            entry = self._entries.get(fetch_id) if isinstance(fetch_id, str) else None
            return entry is not None and entry.deadline > self._clock()

    def renew(self, fetch_id: str) -> None:
        """Keep a live fetch open ``ttl_s`` from now (a resumed fetch calls it)."""
        with self._lock:
            self._entry(fetch_id).deadline = self._clock() + self._ttl

    def plan(self, fetch_id: str) -> tuple[PlannedRow, ...]:
        with self._lock:
            return self._entry(fetch_id).plan

    def record(self, fetch_id: str, names: Sequence[bytes]) -> None:
        """Mark rows of the plan as delivered *whole*. A name outside the plan is refused."""
        with self._lock:
            entry = self._entry(fetch_id)
            planned = entry.planned
            for i, n in enumerate(names):
                if n not in planned:
                    raise InvalidInput(f"names[{i}]: row {bytes(n).hex()[:16]}… is not in fetch {fetch_id!r}")
            entry.delivered.update(names)
            entry.deadline = self._clock() + self._ttl  # arriving rows keep a long fetch open

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
        """Open fetches (entries past their deadline are not counted)."""
        with self._lock:
            now = self._clock()
            return sum(1 for e in self._entries.values() if e.deadline > now)

    def entries(self) -> tuple[FetchInfo, ...]:
        """Every open fetch, oldest first (a lookup: renews and drops nothing)."""
        with self._lock:
            now = self._clock()
            return tuple(
                FetchInfo(fid, e.layout.layout_id, e.prompt_tokens, len(e.plan),
                          len(e.delivered), e.deadline - now)
                for fid, e in self._entries.items() if e.deadline > now
            )

    def check_invariants(self) -> None:
        """Delivered rows are planned rows; plans are in group, output-buffer order."""
        with self._lock:
            for fid, e in self._entries.items():
                planned = {r.name for r in e.plan}
                if planned != e.planned:
                    raise AssertionError(f"fetch {fid}: the planned-name set disagrees with the plan")
                if not e.delivered <= planned:
                    raise AssertionError(f"fetch {fid}: delivered rows outside the plan")
                for gi in range(len(e.layout.groups)):
                    order = [r.out_index for r in e.plan if r.group == gi]
                    if order != list(range(len(order))):
                        raise AssertionError(f"fetch {fid}: group {gi} output order {order}")
