"""The put planner: a put's rules, written once, for whoever receives a put.

A put stores one group's pages (an ``ATTENTION`` group) or state snapshots (a ``STATE``
group) of one prompt, under row names taken from the prompt's chain
(:func:`kvbank.bank.Bank.row_names`: one name per full page, in order). A receiver — the
bank's own ``put``/``put_state``/``put_states``, the node's put body route
(through :meth:`kvbank.bank.bank.Bank.lend_put`) — checks and plans the put here, then stores it
its own way (a batch into the store, or a WRITE lease filled in place).

Primitives, pure (no bank, no store, no clock); each raises a typed error whose message
names the field it was given (``group`` or ``header.group`` …), the limit and the value:

- :func:`put_group` — the group index: in range, of the receiver's kind, and
  transferring bytes.
- :func:`check_page_bytes` — a declared page size equals the layout's for the group
  (:class:`~kvbank.errors.PageSizeMismatch`).
- :func:`page_rows` — the rows of ``count`` pages from chain page ``first_page``; a
  partial last page is never stored, so they must lie within the chain.
- :func:`state_row` — the row of one snapshot after ``at`` tokens (default: all full
  pages), keyed by the page that ends there.
- :func:`state_rows` — the rows of several snapshots, one boundary each.

Lifecycle of a put::

    put_group (+ check_page_bytes) ─► chain = row_names(…) ─► page_rows / state_row(s)
      ─► store the rows not stored yet (equal names are equal bytes: the rest are skipped)
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbank import checks
from kvbank.buffers import snapshot_boundaries
from kvbank.errors import InvalidInput, PageSizeMismatch
from kvbank.layout import GroupKind, PageLayout


def put_group(
    layout: PageLayout,
    group: object,
    kind: GroupKind,
    *,
    field: str = "group",
    route: str = "put",
    other: str | None = None,
) -> int:
    """``group`` checked for a put of ``kind`` groups received by ``route`` (``other``,
    if given, names the call that takes the other kind)."""
    g = checks.count(group, field, 0, len(layout.groups) - 1)
    found = layout.groups[g].kind
    if found is not kind:
        hint = f" (use {other})" if other else ""
        raise InvalidInput(f"{field}: group {g} is a {found.name} group; {route} takes "
                           f"{kind.name} groups{hint}")
    if layout.group_page_bytes[g] == 0:
        raise InvalidInput(f"{field}: group {g} transfers no bytes (every buffer transferred=False)")
    return g


def check_page_bytes(layout: PageLayout, group: int, page_bytes: int, field: str) -> None:
    """A put's declared page size is the layout's page size for ``group``."""
    size = layout.group_page_bytes[group]
    if page_bytes != size:
        raise PageSizeMismatch(f"{field}: {page_bytes}, the layout's page is {size} bytes")


def page_rows(
    chain: Sequence[bytes],
    first_page: object,
    count: int,
    *,
    field: str = "pages",
    first_field: str = "first_page",
) -> list[bytes]:
    """The rows of pages ``first_page … first_page + count - 1`` of ``chain``."""
    first = checks.count(first_page, first_field)
    if first + count > len(chain):
        raise InvalidInput(f"{field}: {count} pages from page {first} exceed the {len(chain)} "
                           "full pages of the tokens (a partial last page is never stored)")
    return list(chain[first : first + count])


def state_row(chain: Sequence[bytes], at: object, tokens_per_page: int, *, field: str = "at") -> bytes:
    """The row of the snapshot after ``at`` tokens (None: after every full page)."""
    p = tokens_per_page
    boundary = len(chain) * p if at is None else at
    if isinstance(boundary, bool) or not isinstance(boundary, int) or boundary <= 0 or boundary % p:
        raise InvalidInput(f"{field}: must be a positive multiple of tokens_per_page {p}, "
                           f"got {boundary!r}")
    if boundary // p > len(chain):
        raise InvalidInput(f"{field}: boundary {boundary} is beyond the {len(chain)} full pages given")
    return chain[boundary // p - 1]


def state_rows(chain: Sequence[bytes], at: Sequence[int], count: int, tokens_per_page: int) -> list[bytes]:
    """The rows of ``count`` snapshots, ``at[i]`` tokens each (every boundary checked)."""
    p = tokens_per_page
    return [chain[b // p - 1] for b in snapshot_boundaries(at, count, p, len(chain))]
