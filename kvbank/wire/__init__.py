"""The forms that cross a process line, shared by the node and its clients.

- :mod:`.forms` — validated JSON forms of the wire types (:func:`to_dict`,
  :func:`from_dict`, typed errors as ``{type, field, message}``).
- :mod:`.columns` — the column encoding of a form's bulky parts (row names, tiers,
  delivery states, lease regions).
- :mod:`.framing` — the binary forms: the put body's header and the fetch stream.

This face re-exports :mod:`.forms`' calls (``from kvbank import wire; wire.to_dict(...)``).
"""

from __future__ import annotations

from kvbank.wire.forms import (
    WIRE_TYPES,
    Doc,
    error_from_dict,
    error_to_dict,
    from_dict,
    from_json,
    to_dict,
    to_json,
)

__all__ = [
    "WIRE_TYPES",
    "Doc",
    "error_from_dict",
    "error_to_dict",
    "from_dict",
    "from_json",
    "to_dict",
    "to_json",
]
