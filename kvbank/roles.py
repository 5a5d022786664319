"""The page layout's closed vocabularies (see :mod:`kvbank.layout` for what they mean).

- :class:`Role` — what a buffer holds. A new role is a code change, never a guess.
- :class:`Split` — how a buffer's bytes divide over tensor-parallel ranks (derived from a
  buffer's fields, never encoded).
- :class:`GroupKind` — ``ATTENTION`` or ``STATE``; :func:`role_kind` maps a role to the
  kind of group its buffers belong to (:data:`STATE_ROLES` are the recurrent ones).
- :class:`QuantMode` — how K/V bytes are quantized.

``parse`` takes a member's exact name; anything else is a
:class:`~kvbank.errors.LayoutError` naming the field. :mod:`kvbank.layout` re-exports
every name here.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from kvbank.errors import LayoutError

_E = TypeVar("_E", bound=enum.Enum)


def _parse_enum(cls: type[_E], name: object, what: str) -> _E:
    """An enum member by its exact name; anything else is a LayoutError naming ``what``."""
    if isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise LayoutError(f"{what}: unknown {cls.__name__} {name!r}; expected one of "
                      f"{list(cls.__members__)}")


class Role(enum.Enum):
    """What a buffer holds. Closed: a new role is a code change, never a guess."""

    KEY = "KEY"
    VALUE = "VALUE"
    KEY_SCALE = "KEY_SCALE"
    VALUE_SCALE = "VALUE_SCALE"
    INDEX_KEY = "INDEX_KEY"
    CONV_STATE = "CONV_STATE"
    SSM_STATE = "SSM_STATE"

    @classmethod
    def parse(cls, name: object) -> Role:
        return _parse_enum(cls, name, "role")


class Split(enum.Enum):
    """How a buffer's bytes divide over tensor-parallel ranks (derived, never encoded)."""

    REPLICATED = "REPLICATED"
    HEAD = "HEAD"
    SECTIONED = "SECTIONED"


class GroupKind(enum.Enum):
    ATTENTION = "ATTENTION"
    STATE = "STATE"

    @classmethod
    def parse(cls, name: object) -> GroupKind:
        return _parse_enum(cls, name, "kind")


class QuantMode(enum.Enum):
    NONE = "NONE"
    FP8 = "FP8"  # float8 K/V with float32 scales
    NVFP4 = "NVFP4"  # packed fp4 K/V with float8 block scales
    MXFP4 = "MXFP4"  # packed fp4 K/V with e8m0 block scales
    INT8 = "INT8"

    @classmethod
    def parse(cls, name: object) -> QuantMode:
        return _parse_enum(cls, name, "quant")


STATE_ROLES = frozenset({Role.CONV_STATE, Role.SSM_STATE})


def role_kind(role: Role) -> GroupKind:
    """The kind of group a buffer of ``role`` belongs to."""
    return GroupKind.STATE if role in STATE_ROLES else GroupKind.ATTENTION
