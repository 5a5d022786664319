"""The bank's queries as pure functions: prompts to row names, names to tiers, tiers to
matches, presences and resume bounds. Nothing here leases, locks, renews or records.

- :func:`chain_keys` — a prompt's page keys from token ids, or from an engine's own key
  chain (:func:`kvbank.keys.engine_keys`).
- :func:`prompt_length` — ``T`` for the resume rules: the tokens' length, or with keys the
  engine's ``prompt_tokens`` (default: exactly the keyed pages).
- :func:`build_match`, :func:`build_presence` — the answers, given a ``locate`` function
  (the store's: one lookup per call); :func:`~kvbank.lender.resume.resumed_at` (re-exported
  here) needs none: a match already says where its rows are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvbank.errors import InvalidInput
from kvbank.keys import Scope, TokenIds, namespace, prompt_keys, row_names
from kvbank.layout import PageLayout
from kvbank.lender.resume import Columns, Obstacle, resume_and_boundaries, resume_bound
from kvbank.lender.resume import resumed_at as resumed_at  # Bank.resume_at: lookup.resumed_at
from kvbank.results import Match, Presence
from kvbank.tiers.base import TierKind

Locate = Callable[[Sequence[bytes]], list[TierKind | None]]  # the store's locate
AnyStored = Callable[[bytes], bool]  # a row name prefix -> some stored row starts with it
Tiers = tuple[tuple[TierKind | None, ...], ...]  # per group, per page: where the row is


def chain_keys(layout: PageLayout, tokens: TokenIds | None, keys: Sequence[bytes] | None,
               scope: Scope) -> list[bytes]:
    return prompt_keys(tokens, keys, layout.tokens_per_page, layout.layout_id, scope)


def prompt_length(layout: PageLayout, tokens: TokenIds | None, chain: list[bytes],
                  prompt_tokens: int | None) -> int:
    p, n = layout.tokens_per_page, len(chain)
    if tokens is not None:
        if prompt_tokens is not None:
            raise InvalidInput("prompt_tokens: only with keys= (tokens give their own length)")
        return len(tokens)
    if prompt_tokens is None:
        return n * p
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) \
            or not n * p <= prompt_tokens < (n + 1) * p:
        raise InvalidInput(f"prompt_tokens: {n} keys of {p}-token pages cover "
                           f"[{n * p}, {(n + 1) * p}) prompt tokens, got {prompt_tokens!r}")
    return prompt_tokens


def tiers_of(layout: PageLayout, names: Sequence[Sequence[bytes]], locate: Locate) -> Tiers:
    """Where each row is, group by group, in one lookup (groups of 0-byte pages: None)."""
    n_groups = len(layout.groups)
    carried = [bool(layout.group_page_bytes[i % n_groups]) for i in range(len(names))]
    flat: list[bytes] = []
    for g, c in zip(names, carried, strict=True):
        if c:
            flat.extend(g)
    where = locate(flat) if flat else []
    out: list[tuple[TierKind | None, ...]] = []
    at = 0
    for g, c in zip(names, carried, strict=True):
        if c:
            out.append(tuple(where[at : at + len(g)]))
            at += len(g)
        else:
            out.append((None,) * len(g))
    return tuple(out)


# Reasons that mean "a row needed for the first boundary is not here" (not LAST_TOKEN,
# not None: a prompt too short to resume from is not a miss)
_BLOCKED = frozenset({Obstacle.MISSING_PAGE, Obstacle.WINDOW_EVICTED, Obstacle.SINK_EVICTED,
                      Obstacle.NO_SNAPSHOT})


def _have(tiers: Tiers) -> Columns:
    return Columns(tiers)


def build_match(layout: PageLayout, scope: Scope, prompt_tokens: int, chain: list[bytes],
                shard_index: int, locate: Locate, any_stored: AnyStored | None = None) -> Match:
    ns = namespace(layout.layout_id, scope)
    names = tuple(tuple(row_names(ns, chain, g, layout.shard_count, shard_index))
                  for g in range(len(layout.groups)))
    tiers = tiers_of(layout, names, locate)
    bound, boundaries = resume_and_boundaries(layout, prompt_tokens, _have(tiers), names)
    if (any_stored is not None and bound.tokens == 0 and bound.reason in _BLOCKED
            and not any(t is not None for g in tiers for t in g) and not any_stored(ns)):
        # Asked only on a total miss, so a hit pays nothing for it.
        bound = dataclasses.replace(bound, reason=Obstacle.NOTHING_STORED, blocking_group=None)
    return Match(layout.layout_id, scope, prompt_tokens, bound, names, tiers, boundaries)


def build_presence(layout: PageLayout, scope: Scope, prompt_tokens: int, chain: list[bytes],
                   shards: Sequence[int] | None, locate: Locate) -> Presence:
    count = layout.shard_count
    picked = tuple(range(count)) if shards is None else shards
    if isinstance(picked, (str, bytes)) or not isinstance(picked, Sequence) or not picked:
        raise InvalidInput(f"shards: expected a non-empty sequence of shard indices, got {shards!r}")
    for i, s in enumerate(picked):
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < count:
            raise InvalidInput(f"shards[{i}]: expected a shard index in [0, {count}), got {s!r}")
    order = tuple(sorted(set(picked)))
    ns = namespace(layout.layout_id, scope)
    n_groups = len(layout.groups)
    names = [row_names(ns, chain, g, count, s) for s in order for g in range(n_groups)]
    flat = tiers_of(layout, names, locate)  # every shard in one lookup
    tiers = tuple(flat[k * n_groups : (k + 1) * n_groups] for k in range(len(order)))
    bounds = tuple(resume_bound(layout, prompt_tokens, _have(t)).tokens for t in tiers)
    return Presence(layout.layout_id, scope, prompt_tokens, order, tiers, bounds, min(bounds))
