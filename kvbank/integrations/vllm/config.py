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

__all__ = ["DEFAULT_URL", "ConnectorConfig", "Guard", "registered", "safe"]

DEFAULT_URL = "http://127.0.0.1:7410"
# A lookup blocks vLLM's scheduler loop: the Client's own defaults (120 s, 5 s of retries)
# would stall every running request that long on a dead node.
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_RETRY_S = 0.5
DEFAULT_BREAKER_S = 10.0
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
        doc = dict(extra or {})
        known = {"url", "tenant", "token", "timeout_s", "retry_s", "breaker_s", "load_async",
                 "kvbank_url", "lookup_timeout_s", "lookup_batch", "pin", "hold_s", "audit_fraction"}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise InvalidInput(f"kv_connector_extra_config: unknown keys {unknown} "
                               f"(known: {sorted(known)})")
        url = str(doc.get("url", doc.get("kvbank_url", DEFAULT_URL)))
        la = doc.get("load_async", "auto")
        if la not in ("auto", True, False, None):
            raise InvalidInput(f"kv_connector_extra_config.load_async: true, false or 'auto', "
                               f"got {la!r}")
        pin = doc.get("pin", True)
        if not isinstance(pin, bool):
            raise InvalidInput(f"kv_connector_extra_config.pin: true or false, got {pin!r}")
        batch = doc.get("lookup_batch", DEFAULT_LOOKUP_BATCH)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InvalidInput(f"kv_connector_extra_config.lookup_batch: an integer >= 1, got {batch!r}")
        out = cls(url=url, tenant=str(doc.get("tenant", "")), token=doc.get("token"),
                  load_async=None if la in ("auto", None) else bool(la), pin=pin, lookup_batch=batch)
        defaults = {"timeout_s": DEFAULT_TIMEOUT_S, "retry_s": DEFAULT_RETRY_S,
                    "breaker_s": DEFAULT_BREAKER_S, "lookup_timeout_s": DEFAULT_LOOKUP_TIMEOUT_S,
                    "hold_s": DEFAULT_HOLD_S}
        for name, default in defaults.items():
            v = doc.get(name, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise InvalidInput(f"kv_connector_extra_config.{name}: a number >= 0, got {v!r}")
            object.__setattr__(out, name, float(v))
        fraction = doc.get("audit_fraction", 0.0)
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise InvalidInput("kv_connector_extra_config.audit_fraction: a number in [0, 1], "
                               f"got {fraction!r}")
        object.__setattr__(out, "audit_fraction", float(fraction))
        return out
