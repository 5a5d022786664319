"""The keys every engine adapter reads from its engine's config, read by one strict rule.

Each engine hands its kvbank adapter a free-form mapping (vLLM's
``kv_connector_extra_config``, SGLang's ``--hicache-storage-backend-extra-config``,
LMCache's ``adapter_params``). The keys they share — where the node is (``url``, or
``kvbank_url``), who asks (``tenant``, ``token``), and how long to wait (``timeout_s``,
``retry_s``, ``breaker_s``) — mean the same in each, and a value of the wrong type is an
:class:`~kvbank.errors.InvalidInput` naming the key, as on kvbank's own routes (``true`` is
not a number).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

from kvbank.errors import InvalidInput

__all__ = ["CONNECTION_KEYS", "DEFAULT_BREAKER_S", "DEFAULT_RETRY_S", "DEFAULT_URL", "Reader"]

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:7410"
DEFAULT_RETRY_S = 0.5
DEFAULT_BREAKER_S = 10.0  # a dead node is skipped this long before it is asked again
CONNECTION_KEYS = ("url", "kvbank_url", "tenant", "token", "timeout_s", "retry_s", "breaker_s")


class Reader:
    """Reads one adapter's mapping; every error names ``where`` and the key."""

    def __init__(self, doc: Mapping[str, Any] | None, where: str) -> None:
        self.doc = dict(doc or {})
        self.where = where

    def refuse_unknown(self, known: Iterable[str], *, foreign: Iterable[str] = (),
                       warn_only: bool = False) -> None:
        """Unknown keys are refused (a typo would silently keep a default), or with
        ``warn_only`` logged: where the mapping is shared with other backends. ``foreign``
        keys are the engine's own and pass."""
        known = sorted(known)
        unknown = sorted(set(self.doc) - set(known) - set(foreign))
        if not unknown:
            return
        if warn_only:
            logger.warning("kvbank: %s keys %s are not kvbank's (known: %s)", self.where, unknown, known)
            return
        raise InvalidInput(f"{self.where}: unknown keys {unknown} (known: {known})")

    def url(self) -> str:
        """``url``, or its alias ``kvbank_url``; both given must agree."""
        url, alias = self.doc.get("url"), self.doc.get("kvbank_url")
        if url is not None and alias is not None and url != alias:
            raise InvalidInput(f"{self.where}.url: {url!r} and kvbank_url {alias!r} disagree")
        return self.text("kvbank_url" if url is None else "url", DEFAULT_URL)

    def text(self, name: str, default: str) -> str:
        v = self.doc.get(name, default)
        if not isinstance(v, str):
            raise InvalidInput(f"{self.where}.{name}: a string, got {v!r}")
        return v

    def token(self) -> str | None:
        v = self.doc.get("token")
        if v is not None and not isinstance(v, str):
            raise InvalidInput(f"{self.where}.token: a string")  # never echo a secret
        return v

    def flag(self, name: str, default: bool) -> bool:
        v = self.doc.get(name, default)
        if not isinstance(v, bool):
            raise InvalidInput(f"{self.where}.{name}: true or false, got {v!r}")
        return v

    def seconds(self, name: str, default: float, *, positive: bool = False) -> float:
        """A finite number >= 0 (> 0 with ``positive``: a timeout of 0 would fail every call)."""
        v = self.doc.get(name, default)
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                or (positive and v == 0)):
            bound = "> 0" if positive else ">= 0"
            raise InvalidInput(f"{self.where}.{name}: a finite number {bound}, got {v!r}")
        return float(v)

    def fraction(self, name: str, default: float) -> float:
        v = self.doc.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise InvalidInput(f"{self.where}.{name}: a number in [0, 1], got {v!r}")
        return float(v)

    def count(self, name: str, default: int) -> int:
        v = self.doc.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidInput(f"{self.where}.{name}: an integer >= 1, got {v!r}")
        return v
