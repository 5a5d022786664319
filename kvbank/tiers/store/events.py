"""The store's change feed: rows PUBLISHED (first visible) and WITHDRAWN (gone from every
tier), bounded, like vLLM's ``take_events``.

The feed records from the first :meth:`EventFeed.take` on (a consumer subscribes by
taking, then lists what is already there with ``scan``, then follows the feed); until
then nobody listens and nothing is kept. It holds at most ``capacity`` events. When it is
full the oldest event is dropped and counted; the next take starts with one ``OVERFLOW``
event carrying the count, so a consumer (the fleet index) knows it missed changes and
resyncs with ``scan``. Not thread-safe (the store's lock).
"""

from __future__ import annotations

import collections

from kvbank.results import EventKind, RowEvent

DEFAULT_EVENT_CAPACITY = 65536


class EventFeed:
    __slots__ = ("_events", "_lost", "active", "capacity", "dropped", "seq")

    def __init__(self, capacity: int = DEFAULT_EVENT_CAPACITY) -> None:
        self.capacity = capacity
        self._events: collections.deque[RowEvent] = collections.deque()
        self._lost = 0  # dropped since the last take
        self.dropped = 0  # dropped since open
        self.seq = 0
        self.active = False  # set by the first take: a consumer listens

    def _add(self, kind: EventKind, name: bytes) -> None:
        if not self.active:
            return
        self.seq += 1
        if len(self._events) >= self.capacity:
            self._events.popleft()
            self._lost += 1
            self.dropped += 1
        self._events.append(RowEvent(kind, name, self.seq))

    def published(self, name: bytes) -> None:
        self._add(EventKind.PUBLISHED, name)

    def withdrawn(self, name: bytes) -> None:
        self._add(EventKind.WITHDRAWN, name)

    def take(self, max_events: int | None) -> list[RowEvent]:
        self.active = True
        out: list[RowEvent] = []
        if self._lost:
            out.append(RowEvent(EventKind.OVERFLOW, b"", self.seq, self._lost))
            self._lost = 0
        n = len(self._events) if max_events is None else min(max_events, len(self._events))
        out.extend(self._events.popleft() for _ in range(n))
        return out
