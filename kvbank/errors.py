"""The kvbank exception tree.

Every error kvbank raises on purpose is a :class:`KvbankError`. A miss is never an
exception (it is ``None`` or an empty result); bad input, corruption, an unreachable tier
and a broken lease are. Leaves also inherit the builtin a caller would expect, so
``except KeyError`` still works for a lookup of an unknown lease.

::

    KvbankError
    ├── ConfigError(ValueError)            a setting is out of range or malformed
    ├── InvalidInput(ValueError)           a request's argument is wrong
    │   ├── LayoutError                    a layout declaration is invalid
    │   ├── InvalidTokens                  token ids outside int32 / wrong shape
    │   ├── InvalidRowName                 bytes that are not a 54-byte row name
    │   └── PageSizeMismatch               page bytes do not match the layout
    ├── UnknownLayout(KeyError)            a layout id that was never registered
    ├── CorruptPage                        a codec frame failed its checks
    ├── TierError                          a tier's own fault
    │   ├── TierFull                       no room even after eviction (budget, map full, disk full)
    │   ├── TierUnavailable                the tier cannot be reached or is closed
    │   ├── RowLocked                      a locked row cannot be deleted, moved or overwritten
    │   ├── Busy                           a blocking call's deadline passed while it waited
    │   ├── PinBudgetExceeded              pinning the rows would pass the pin budget
    │   └── CodecError                     the compression library failed to encode a page
    ├── LeaseError                         lender faults
    │   ├── LeaseNotFound(KeyError)        no such lease (released, reaped, never lent)
    │   ├── LeaseExpired                   the lease's TTL ran out before the operation finished
    │   └── LeaseConflict                  the rows are held by a lease that excludes this one
    ├── FetchError                         fetch-ledger faults
    │   └── FetchNotFound(KeyError)        no such fetch id (finished, expired, never started)
    └── AccessError                        a served node refused the caller's token
        ├── Unauthorized                   no bearer token where one is needed (401)
        └── Forbidden                      a wrong token, or another tenant's rows (403)

Lower-library errors are mapped at the module that calls the library, through one table
per library there (``raise TierUnavailable(...) from exc``): ``LMDB_ERRORS`` in
:mod:`kvbank.tiers.diskmeta` (for the disk tier's modules), ``ZSTD_ERRORS`` in :mod:`kvbank.codec.entropy`,
``TORCH_ERRORS`` in :mod:`kvbank.kernels.faults` (the kernels and the device tier), ``OS_ERRORS`` (files, mmap) in
:mod:`kvbank.tiers.base` for the host slab and the disk tier's files; ``redis.RedisError``
in :mod:`kvbank.tiers.remote`, ``http.client`` and socket errors in :mod:`kvbank.client`. Messages
name the field, the limit and the value received.
"""

from __future__ import annotations

import re

# "scope.tenant: must be …", "out[0][2]: expected …": messages lead with the field they name.
_FIELD_PREFIX = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


class KvbankError(Exception):
    """Root of every error kvbank raises on purpose.

    :attr:`field` names the argument or document path at fault (``None`` when no single
    field is): given as ``field=`` or read from the message's ``"field: …"`` prefix, so a
    service can return ``{type, field, message}`` and its client raise the same class."""

    def __init__(self, *args: object, field: str | None = None) -> None:
        super().__init__(*args)
        self._field = field

    @property
    def field(self) -> str | None:
        if self._field is not None:
            return self._field
        msg = self.args[0] if self.args and isinstance(self.args[0], str) else ""
        m = _FIELD_PREFIX.match(msg)
        return m.group(1) if m else None


class ConfigError(KvbankError, ValueError):
    """A setting is out of range or malformed (names the setting and the value)."""


class InvalidInput(KvbankError, ValueError):
    """A request's argument is wrong; nothing was changed."""


class LayoutError(InvalidInput):
    """A layout declaration is invalid (names the field and the value)."""


class InvalidTokens(InvalidInput):
    """Token ids are not a 1-D sequence of int32-range integers."""


class InvalidRowName(InvalidInput):
    """Bytes that do not parse as a row name."""


class PageSizeMismatch(InvalidInput):
    """A page's byte length differs from what its layout declares."""


class UnknownLayout(KvbankError, KeyError):
    """A layout id that was never registered with this bank."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown layout"


class CorruptPage(KvbankError):
    """A codec frame failed a length, format or checksum check. Its bytes are not used."""


class TierError(KvbankError):
    """A tier's own fault."""


class TierFull(TierError):
    """No room for the row even after eviction (budget, LMDB map or disk full)."""


class TierUnavailable(TierError):
    """The tier cannot be reached or has been closed."""


class RowLocked(TierError):
    """The row is locked by a lease and cannot be deleted, moved or overwritten."""


class Busy(TierError):
    """A blocking call waited past its deadline (for the mover, room, or a lock)."""


class PinBudgetExceeded(TierError):
    """Pinning these rows would hold more bytes pinned than ``pin_bytes`` allows."""


class CodecError(TierError):
    """The codec's compression library failed to encode a page (memory, an internal
    fault): a fault of the node, not of the page; nothing was stored. A frame that fails
    to *decode* is :class:`CorruptPage` instead."""


class LeaseError(KvbankError):
    """A lender fault."""


class LeaseNotFound(LeaseError, KeyError):
    """No such lease: released, reaped after expiry, or never lent."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "lease not found"


class LeaseExpired(LeaseError):
    """The lease's TTL ran out before the operation completed; its bytes are not used."""


class LeaseConflict(LeaseError):
    """The rows are held by another lease whose mode excludes this one."""


class FetchError(KvbankError):
    """A fetch-ledger fault."""


class FetchNotFound(FetchError, KeyError):
    """No such fetch id: finished, expired, or never started."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "fetch not found"


class AccessError(KvbankError):
    """A served node refused the caller (its admin or tenant token)."""


class Unauthorized(AccessError):
    """No bearer token where one is required (a service answers 401)."""


class Forbidden(AccessError):
    """A wrong token, or a tenant reaching for another tenant's rows (answered 403)."""
