"""The bank's catalog: registered layouts, their shards, and the namespaces it has seen.

Primitives of :class:`Catalog` (thread-safe, one lock):

- :meth:`~Catalog.register` / :meth:`~Catalog.layout` / :meth:`~Catalog.shard` — layouts
  by id, and which tensor-parallel shards of each were registered.
- :meth:`~Catalog.learn` — record a (scope, layout) namespace; :meth:`~Catalog.describe`
  — a row name's page size and buffer regions, for names under a namespace learnt.

Why a table: a row name starts with ``SHA-256(scope, layout id)[:16]``, a one-way digest,
so a name alone cannot say which layout it belongs to. The bank learns pairs on commands
(register, put, lend of a match, register_scope), never on a query, into a bounded LRU of
:data:`MAX_NAMESPACES`: a fleet with a cache salt per request would otherwise grow it
forever. A pair that fell out is learnt again by the next command under it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvbank.errors import InvalidInput, UnknownLayout
from kvbank.keys import Scope, group_of, namespace, namespace_of
from kvbank.layout import PageLayout
from kvbank.lender.base import PageShape

MAX_NAMESPACES = 65_536  # (scope, layout) pairs whose rows a lease can describe


class Catalog:
    """Layouts, shards and namespaces of one bank. See the module docstring."""

    def __init__(self, max_namespaces: int | None = None) -> None:
        self._lock = threading.Lock()
        self._max = MAX_NAMESPACES if max_namespaces is None else max_namespaces
        self._layouts: dict[bytes, PageLayout] = {}
        # Shards registered per layout id. The id leaves the shard index out (every rank of
        # a layout shares it), so the shard a call names must come from the caller: taking
        # the first registration's index would hand one rank another rank's rows.
        self._shards: dict[bytes, set[int]] = {}
        self._namespaces: OrderedDict[bytes, bytes] = OrderedDict()  # ns -> layout id, LRU last
        self._shapes: dict[tuple[bytes, int], PageShape] = {}

    def register(self, layout: PageLayout) -> bytes:
        if not isinstance(layout, PageLayout):
            raise InvalidInput(f"layout: expected a PageLayout, got {type(layout).__name__}")
        lid = layout.layout_id
        with self._lock:
            self._layouts.setdefault(lid, layout)
            self._shards.setdefault(lid, set()).add(layout.shard_index)
        return lid

    def __len__(self) -> int:
        with self._lock:
            return len(self._layouts)

    @property
    def namespaces(self) -> int:
        with self._lock:
            return len(self._namespaces)

    def layout(self, layout_id: bytes) -> PageLayout:
        """The registered layout ``layout_id`` (:class:`UnknownLayout` otherwise)."""
        with self._lock:
            layout = self._layouts.get(layout_id) if isinstance(layout_id, bytes) else None
        if layout is None:
            shown = layout_id.hex() if isinstance(layout_id, bytes) else repr(layout_id)
            raise UnknownLayout(f"layout_id: {shown} was never registered with this bank")
        return layout

    def shard(self, layout_id: bytes, shard: int | None) -> int:
        """The shard a call means: the one given (it must be registered), or the only one."""
        with self._lock:
            shards = sorted(self._shards.get(layout_id, ()))
        if shard is None:
            if len(shards) == 1:
                return shards[0]
            raise InvalidInput(f"shard: layout {layout_id.hex()[:16]}… is registered for shards "
                               f"{shards}; name the shard this call is for")
        if isinstance(shard, bool) or not isinstance(shard, int) or shard not in shards:
            raise UnknownLayout(f"shard: shard {shard!r} of layout {layout_id.hex()[:16]}… was never "
                                f"registered (registered shards: {shards})")
        return shard

    def learn(self, layout_id: bytes, scope: Scope) -> bytes:
        """Record the (scope, layout) namespace so leases can describe its rows."""
        if not isinstance(scope, Scope):
            raise InvalidInput(f"scope: expected a Scope, got {type(scope).__name__}")
        ns = namespace(layout_id, scope)
        with self._lock:
            self._namespaces[ns] = layout_id
            self._namespaces.move_to_end(ns)
            if len(self._namespaces) > self._max:
                self._namespaces.popitem(last=False)
        return ns

    def layout_ids(self) -> list[bytes]:
        """Every registered layout id (for admin listings)."""
        with self._lock:
            return list(self._layouts)

    def namespaces_of(self, layout_id: bytes) -> list[bytes]:
        """The namespaces learnt (still in the table) under ``layout_id``."""
        with self._lock:
            return [ns for ns, lid in self._namespaces.items() if lid == layout_id]

    def describe(self, name: bytes) -> PageShape | None:
        """A row's page size and regions, for names under a namespace learnt. It depends
        on the name's namespace and group only (the lender keeps answers per pair)."""
        with self._lock:
            lid = self._namespaces.get(namespace_of(name))
            if lid is None:
                return None
            group = group_of(name)
            shape = self._shapes.get((lid, group))
            if shape is None:
                layout = self._layouts[lid]
                if group >= len(layout.groups):
                    return None
                shape = self._shapes[(lid, group)] = PageShape.of(layout, group)
            return shape
