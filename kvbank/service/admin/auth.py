"""Bearer tokens: the admin token and the data API's tenant tokens.

Primitives:

- :func:`resolve_admin_token` — the configured admin token, or (none configured) a fresh
  one generated at start and written to ``admin.token`` (mode 0600) in the data dir; the
  node's ready line names that file, never the token.
- :func:`bearer` — the token of an ``Authorization: Bearer …`` header (None if absent).
- :func:`same` — constant-time comparison (:func:`hmac.compare_digest`), so the time of a
  refusal says nothing about how much of a guess was right.
- :class:`TenantTokens` — ``tenant = token`` pairs: :meth:`~TenantTokens.tenant_of`
  answers the tenant a token binds its caller to. Lookup compares the presented token with
  every configured one in constant time each (no early exit on a hit), so the answer's
  timing does not tell which tenant's token was close.

Missing token → 401 (:class:`Unauthorized`), wrong token → 403 (:class:`Forbidden`).
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvbank.errors import ConfigError, Forbidden, Unauthorized
from kvbank.tiers.datadir import private_dir, replace_file

logger = logging.getLogger(__name__)

TOKEN_FILE = "admin.token"
TOKEN_BYTES = 32

__all__ = ["Forbidden", "TenantTokens", "Unauthorized", "bearer", "resolve_admin_token", "same"]


def same(given: str, want: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), want.encode("utf-8"))


def bearer(authorization: str | None) -> str | None:
    """The token of ``Bearer <token>`` (scheme case-insensitive); None when absent."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def write_token_file(path: Path, token: str) -> None:
    """Write ``token`` to ``path`` readable by its owner only (0600 from creation on),
    through a temp file no planted symlink can redirect (:mod:`kvbank.tiers.datadir`)."""
    private_dir(path.parent)
    replace_file(path, (token + "\n").encode())


def read_token_file(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text or None


def resolve_admin_token(configured: str | None, data_dir: Path | None) -> tuple[str, Path | None]:
    """The admin token and the file it was written to (None when configured)."""
    if configured:
        return configured, None
    token = secrets.token_urlsafe(TOKEN_BYTES)
    if data_dir is None:
        return token, None  # an in-process node: the caller reads app.state
    path = data_dir / TOKEN_FILE
    try:
        write_token_file(path, token)
    except OSError as exc:
        # A full data dir must not keep the node from starting (its disk tier degrades
        # and the memory tiers serve): the previous start's token stays valid.
        previous = read_token_file(path)
        if previous is None:
            raise ConfigError(f"admin_token: cannot write {path}: {exc}; free space there "
                              "or set KVBANK_ADMIN_TOKEN", field="admin_token") from exc
        logger.warning("admin: cannot write a new token to %s (%s); keeping the one it holds",
                       path, exc)
        return previous, path
    return token, path


@dataclass(frozen=True, slots=True)
class TenantTokens:
    """``tenant -> token`` pairs of the data API; empty = no tenant tokens."""

    pairs: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, tenants: Mapping[str, str] | tuple[tuple[str, str], ...]) -> TenantTokens:
        items = tenants.items() if isinstance(tenants, Mapping) else tenants
        return cls(tuple(sorted((str(t), str(k)) for t, k in items)))

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def tenant_of(self, authorization: str | None) -> str:
        """The tenant the request's token binds it to (401 without one, 403 if unknown)."""
        token = bearer(authorization)
        if token is None:
            raise Unauthorized("authorization: this node needs a tenant token "
                               "(Authorization: Bearer <token>)", field="authorization")
        found: str | None = None
        for tenant, want in self.pairs:  # no early exit: every pair is compared
            if same(token, want) and found is None:
                found = tenant
        if found is None:
            raise Forbidden("authorization: not a tenant token of this node", field="authorization")
        return found
