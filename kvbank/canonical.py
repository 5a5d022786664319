"""The canonical form of frozen layout objects: what a layout id hashes, what a layout
document parses back from.

- :func:`encode` — a dataclass as plain JSON values (enums by name, defaults left out),
  so adding a defaulted field keeps old encodings, hence old layout ids.
- :func:`fields_of` / :func:`list_of` — strict parsing of a document back into
  dataclass keyword arguments: an unknown or missing field is a
  :class:`~kvbank.errors.LayoutError` naming it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from kvbank.errors import LayoutError


def encode(value: object, identity: bool) -> object:
    """``value`` as plain JSON values: enums by name, dataclasses as objects with the
    fields equal to their default left out (and, for ``identity``, the fields whose
    metadata says ``identity=False``), tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, object] = {}
        for f in dataclasses.fields(value):
            if not f.init:
                continue
            if identity and not f.metadata.get("identity", True):
                continue
            v = getattr(value, f.name)
            if f.default is not dataclasses.MISSING and v == f.default:
                continue
            out[f.name] = encode(v, identity)
        return out
    if isinstance(value, (tuple, list)):
        return [encode(v, identity) for v in value]
    return value


def list_of(doc: Mapping[str, Any], key: str) -> list[Any]:
    """``doc[key]``, which must be a list (or tuple)."""
    value = doc.get(key)
    if not isinstance(value, list | tuple):
        raise LayoutError(f"{key}: expected a list, got {value!r}")
    return list(value)


def fields_of(cls: type, doc: object, what: str) -> dict[str, Any]:
    """``doc`` as keyword arguments for dataclass ``cls``: unknown fields and missing
    required ones are refused (``groups``/``buffers`` are built by the caller)."""
    if not isinstance(doc, Mapping):
        raise LayoutError(f"{what}: expected an object, got {doc!r}")
    allowed = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(doc) - allowed
    if unknown:
        raise LayoutError(f"{what}: unknown field(s) {sorted(unknown)}; allowed {sorted(allowed)}")
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.init and f.default is dataclasses.MISSING and f.name not in ("groups", "buffers")
    }
    if required - set(doc):
        raise LayoutError(f"{what}: missing required field(s) {sorted(required - set(doc))}")
    out = dict(doc)
    if "layers" in out:
        out["layers"] = tuple(out["layers"])
    return out
