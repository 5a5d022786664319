"""The connector's settings (``kv_connector_extra_config``) and the guard around kvbank calls.

Keys of ``kv_connector_extra_config`` (all optional):

| key | default | meaning |
| --- | --- | --- |
| ``url`` | ``http://127.0.0.1:7410`` | the ``kvbank serve`` node of this host |
| ``tenant`` | ``""`` | goes into the scope: tenants never share pages |
| ``token`` | none | a tenant token, when the node requires one |
| ``timeout_s`` | 5 | one kvbank call's socket timeout (the scheduler waits on lookups) |
| ``retry_s`` | 0.5 | how long idempotent calls are retried |
| ``breaker_s`` | 10 | after a node failure, kvbank is skipped (every lookup a miss) this long |
| ``lookup_timeout_s`` | 2 | the deadline of one batched lookup (``match_many``), never retried |
| ``lookup_batch`` | 64 | waiting requests a lookup answers at once (the one asked, and those queued) |
| ``pin`` | true | a lookup that offers rows pins them (every rank's) until the load or ``hold_s`` |
| ``hold_s`` | 60 | how long the node keeps a lookup's match (and its pin) for the workers |
| ``load_async`` | ``"auto"`` | ``true``: every load async; ``false``: sync; ``auto``: async |
|  |  | when the model has more than one KV-cache group (vLLM can only recover a failed |
|  |  | load of such a model asynchronously) |
| ``audit_fraction`` | 0 | the share of hits audited (:mod:`.audit`): declined, recomputed, and |
|  |  | the recomputed pages compared with the stored rows; a mismatch quarantines the |
|  |  | layout on the node. A request's ``kv_transfer_params`` ``{"kvbank_audit": true}`` |
|  |  | audits it whatever the fraction (``false``: never) |

Every kvbank error, a dead node or a timeout is a miss for vLLM: :class:`Guard` (shared by
the engine adapters, :mod:`kvbank.integrations.guard`) logs it at warning and answers the
caller's fallback; only a transport failure trips the breaker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbank.errors import InvalidInput

# the guard around kvbank calls is shared by every engine adapter
from kvbank.integrations.guard import Guard, registered, safe
from kvbank.integrations.settings import (
    CONNECTION_KEYS,
    DEFAULT_BREAKER_S,
    DEFAULT_RETRY_S,
    DEFAULT_URL,
    Reader,
)

__all__ = ["DEFAULT_URL", "ConnectorConfig", "Guard", "registered", "safe"]

# A lookup blocks vLLM's scheduler loop: the Client's own defaults (120 s, 5 s of retries)
# would stall every running request that long on a dead node.
DEFAULT_TIMEOUT_S = 5.0
# A batched lookup's deadline: far under Client's 120 s, yet above what a busy 2-core host
# answers a 64-prompt match in (a timed-out lookup trips the breaker: misses for breaker_s).
DEFAULT_LOOKUP_TIMEOUT_S = 2.0
DEFAULT_LOOKUP_BATCH = 64
# Longer than a request usually waits for blocks between its lookup and its load; a load
# after it falls back to matching by keys (the rows may have gone: a miss).
DEFAULT_HOLD_S = 60.0


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    url: str = DEFAULT_URL
    tenant: str = ""
    token: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    retry_s: float = DEFAULT_RETRY_S
    breaker_s: float = DEFAULT_BREAKER_S
    load_async: bool | None = None  # None = auto
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    lookup_batch: int = DEFAULT_LOOKUP_BATCH
    pin: bool = True
    hold_s: float = DEFAULT_HOLD_S
    audit_fraction: float = 0.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        r = Reader(extra, "kv_connector_extra_config")
        r.refuse_unknown((*CONNECTION_KEYS, "load_async", "lookup_timeout_s", "lookup_batch", "pin",
                          "hold_s", "audit_fraction"))
        la = r.doc.get("load_async", "auto")
        if la not in ("auto", True, False, None):
            raise InvalidInput(f"kv_connector_extra_config.load_async: true, false or 'auto', "
                               f"got {la!r}")
        return cls(url=r.url(), tenant=r.text("tenant", ""), token=r.token(),
                   timeout_s=r.seconds("timeout_s", DEFAULT_TIMEOUT_S),
                   retry_s=r.seconds("retry_s", DEFAULT_RETRY_S),
                   breaker_s=r.seconds("breaker_s", DEFAULT_BREAKER_S),
                   load_async=None if la in ("auto", None) else bool(la),
                   lookup_timeout_s=r.seconds("lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S),
                   lookup_batch=r.count("lookup_batch", DEFAULT_LOOKUP_BATCH),
                   pin=r.flag("pin", True), hold_s=r.seconds("hold_s", DEFAULT_HOLD_S),
                   audit_fraction=r.fraction("audit_fraction", 0.0))
