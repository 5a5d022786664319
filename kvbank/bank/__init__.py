"""The embedded bank a worker or the node uses, and its parts.

- :mod:`.bank` — :class:`Bank`, the facade: register, put, match, fetch, lend, …
- :mod:`.catalog` — registered layouts and scopes, persisted beside the disk tier.
- :mod:`.lookup` — a prompt's row names and their residency; the match.
- :mod:`.fetch` — one fetch call through the fetch ledger.
- :mod:`.leases` — the bank's lease calls (lend, view, read, write, commit, release).
- :mod:`.cross_shard` — matches and fetches across TP sizes (plans from ``kvbank.reshard``).
- :mod:`.admin`, :mod:`.fleet` — the operator's and the fleet's calls, reached as
  ``bank.admin`` and ``bank.fleet``.
- :mod:`.closing` — the closed bank's rule, shared by the bank and those two.

``Bank`` is imported on first use, so importing a part does not open the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbank.bank.bank import Bank

__all__ = ["Bank"]


def __getattr__(name: str) -> Any:
    if name == "Bank":
        from kvbank.bank.bank import Bank
        return Bank
    raise AttributeError(f"module 'kvbank.bank' has no attribute {name!r}")
