"""One fetch call: copy a match's planned rows into caller views through the fetch ledger.

:func:`fetch_rows` opens the ledger entry (or resumes it: same ``fetch_id``, same plan,
renewed), copies the pending rows in plan order until ``max_rows`` or the deadline, and
records each row only when it arrived *whole*: a row gone since the match, or cut short,
stays undelivered (a miss, never "loaded"). The answer's bound is recomputed from the
delivered rows alone; a complete fetch closes its entry. An exception leaves the entry
open and carries a note naming the ``fetch_id`` to resume with.
"""

from __future__ import annotations

from collections.abc import Callable

from kvbank.errors import InvalidInput
from kvbank.layout import PageLayout
from kvbank.lender.ledger import FetchLedger
from kvbank.results import FetchResult, Match

GetInto = Callable[[bytes, memoryview], "int | None"]  # the store's get_into: bytes copied or None


def fetch_rows(ledger: FetchLedger, get_into: GetInto, layout: PageLayout, match: Match,
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
        for row in todo:
            if deadline is not None and clock() >= deadline:
                break  # what arrived so far is the answer; the same fetch_id resumes
            size = layout.group_page_bytes[row.group]
            got = get_into(row.name, views[row.group][row.out_index])
            # Only a row that arrived whole counts; anything else stays undelivered.
            if got == size:
                ledger.record(fetch_id, [row.name])
                moved += size
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
