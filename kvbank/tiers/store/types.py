"""The mover's job records (internal). The store's public values (stats, health, admin
listings, the change feed) are in :mod:`kvbank.results`."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class JobKind(enum.Enum):
    DEMOTE = "demote"  # a memory row encoded and written to disk
    COPY_DOWN = "copy-down"  # a device row copied into a host slot
    PURGE = "purge"  # stale disk names deleted


@dataclass(frozen=True, slots=True)
class Job:
    """One unit of the mover's queue."""

    kind: JobKind
    bit: int = 0  # the memory tier the row leaves (DEMOTE, COPY_DOWN)
    rid: int = -1
    name: bytes = b""
    off: int = -1  # the pinned source slot
    size: int = 0
    dst_off: int = -1  # COPY_DOWN: the pinned host slot claimed at planning
    names: tuple[bytes, ...] = ()  # PURGE
    evict: bool = False  # PURGE: a disk eviction batch (the planner waits for it)
