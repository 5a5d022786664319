"""One fetch call: copy a match's planned rows into caller views through the fetch ledger.

:func:`fetch_rows` opens the ledger entry (or resumes it: same ``fetch_id``, same plan,
renewed), copies the pending rows in plan order until ``max_rows`` or the deadline, and
records each row only when it arrived *whole*: a row gone since the match, or cut short,
stays undelivered (a miss, never "loaded"). The answer's bound is recomputed from the
delivered rows alone; a complete fetch closes its entry. An exception leaves the entry
open and carries a note naming the ``fetch_id`` to resume with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvbank.errors import InvalidInput
from kvbank.layout import PageLayout
from kvbank.lender.ledger import FetchLedger
from kvbank.results import FetchResult, Match

GetInto = Callable[[bytes, memoryview], "int | None"]  # the store's get_into: bytes copied or None
# The store's get_many_into: per row, bytes copied or None.
GetMany = Callable[[Sequence[bytes], Sequence[memoryview]], "list[int | None]"]

# A store batch: up to this many rows and bytes (at least one row). Each batch costs one
# hand-off to the copy lanes and one wait for the slowest; at 16 rows of 2 MiB that was a
# third of a host fetch. 128 MiB is ~6 ms of memcpy, ~30 ms of disk decode: the deadline
# step.
FETCH_BATCH_ROWS = 64
FETCH_BATCH_BYTES = 128 << 20


def one_by_one(get_into: GetInto) -> GetMany:
    """A ``get_many`` that reads row after row with ``get_into``."""
    return lambda names, outs: [get_into(n, o) for n, o in zip(names, outs, strict=True)]


def fetch_rows(ledger: FetchLedger, get_many: GetMany, layout: PageLayout, match: Match,
               views: dict[int, list[memoryview]], *, fetch_id: str | None, max_rows: int | None,
               deadline: float | None, clock: Callable[[], float]) -> FetchResult:
    if fetch_id is not None and fetch_id in ledger:
        if [(r.group, r.name) for r in ledger.plan(fetch_id)] != [
            (g, n) for g, rows in enumerate(match.resume.rows) for n in rows
        ]:
            raise InvalidInput(f"fetch_id: {fetch_id!r} was opened for another match")
        ledger.renew(fetch_id)  # a resumed fetch is activity, whatever arrives
    else:
        fetch_id = ledger.open(layout, match.prompt_tokens, match.names, match.resume, fetch_id)
    todo = ledger.pending(fetch_id)
    if max_rows is not None:
        todo = todo[:max_rows]
    moved = 0
    try:
        i = 0
        while i < len(todo):
            # The deadline is checked before each row is planned; a batch is read whole.
            k = nbytes = 0
            while (k < FETCH_BATCH_ROWS and i + k < len(todo) and (k == 0 or nbytes < FETCH_BATCH_BYTES)
                   and (deadline is None or clock() < deadline)):
                nbytes += layout.group_page_bytes[todo[i + k].group]
                k += 1
            if not k:
                break  # what arrived so far is the answer; the same fetch_id resumes
            batch = todo[i : i + k]
            i += k
            got = get_many([r.name for r in batch], [views[r.group][r.out_index] for r in batch])
            # Only a row that arrived whole counts; anything else stays undelivered.
            whole = [r for r, n in zip(batch, got, strict=True) if n == layout.group_page_bytes[r.group]]
            if whole:
                ledger.record(fetch_id, [r.name for r in whole])
                moved += sum(layout.group_page_bytes[r.group] for r in whole)
    except BaseException as exc:
        exc.add_note(f"kvbank fetch {fetch_id}: resume it with fetch_id={fetch_id!r}")
        raise
    return _result(ledger, fetch_id, len(layout.groups), moved)


def _result(ledger: FetchLedger, fetch_id: str, n_groups: int, moved: int) -> FetchResult:
    plan = ledger.plan(fetch_id)
    got = ledger.delivered(fetch_id)
    bound = ledger.bound(fetch_id)
    delivered = tuple(tuple(r.index for r in plan if r.group == g and r.name in got) for g in range(n_groups))
    missing = tuple(tuple(r.index for r in plan if r.group == g and r.name not in got) for g in range(n_groups))
    complete = not any(missing)
    if complete:
        ledger.close(fetch_id)
    return FetchResult(fetch_id, delivered, missing, bound, moved, complete)
