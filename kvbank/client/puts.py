"""The put calls of :class:`~kvbank.client.client.Client` (mixed into it): ``put``,
``put_state`` and ``put_states``, as :class:`~kvbank.bank.bank.Bank` has them.

Each checks its pages here (sizes from the layout, the snapshot boundaries) and builds
the put's head (:func:`kvbank.client.io.put_head`: the rows' keys, scope and shard),
then stores the page bodies by the client's path: on the node's host through the local
channel (one call reserves a WRITE lease, the pages are copied into their slots, one
call commits what arrived whole), elsewhere by the data port or the HTTP stream
(:mod:`kvbank.client.paths`); a path that cannot take them answers None and the HTTP
stream does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvbank.buffers import Pages, page_views, snapshot_boundaries
from kvbank.client.io import Deadline, deadline_of, page_size, put_head
from kvbank.errors import InvalidInput
from kvbank.keys import DEFAULT_SCOPE, Scope, TokenIds, prompt_keys
from kvbank.wire.framing import PutKind

if TYPE_CHECKING:
    from kvbank.client.local import LocalLink
    from kvbank.client.paths import PagePath, Stream
    from kvbank.layout import PageLayout


class PutCalls:
    """The put calls of a client (see the module docstring)."""

    if TYPE_CHECKING:  # the client's (Client): its token, paths and layouts
        _tenant_token: bool  # the client sends a tenant token
        _stream: Stream

        def _local_memory(self) -> LocalLink | None: ...

        def _path(self) -> PagePath: ...

        def layout(self, layout_id: bytes) -> PageLayout: ...

    def _store(self, kind: PutKind, head: bytes, views: list[memoryview],
               deadline: Deadline | None = None) -> list[bytes]:
        link = self._local_memory()
        if link is not None:
            got = link.put(head, views, deadline)
            return self._stream.put(kind, head, views, deadline) if got is None else got
        names = self._path().put(kind, head, views, deadline)
        return self._stream.put(kind, head, views, deadline) if names is None else names

    def put(self, layout_id: bytes, tokens: TokenIds | None = None, *, group: int, pages: Pages,
            scope: Scope = DEFAULT_SCOPE, keys: Sequence[bytes] | None = None, first_page: int = 0,
            shard: int | None = None, timeout: float | None = None) -> list[bytes]:
        """:meth:`Bank.put` on the node: pages of an ATTENTION group; their row names.

        ``timeout`` bounds this client's waits on the node (:class:`Busy` once it passed;
        pages committed before then stay stored, and a put again skips them)."""
        deadline = deadline_of(timeout)
        layout = self.layout(layout_id)
        size = page_size(layout, group)
        views = page_views(pages, size, "pages")
        head = put_head(PutKind.PAGES, layout_id, tokens, keys, scope, group, first_page,
                        shard, None, views, size, self._tenant_token)
        return self._store(PutKind.PAGES, head, views, deadline)

    def put_state(self, layout_id: bytes, tokens: TokenIds | None = None, *, group: int,
                  state: torch.Tensor | bytes | bytearray | memoryview, at: int | None = None,
                  scope: Scope = DEFAULT_SCOPE, keys: Sequence[bytes] | None = None,
                  shard: int | None = None) -> bytes:
        """:meth:`Bank.put_state` on the node: one STATE snapshot; its row name."""
        layout = self.layout(layout_id)
        size = page_size(layout, group)
        if isinstance(state, torch.Tensor):
            views = page_views(state.reshape(1, -1) if state.dim() == 1 else state, size, "state")
        else:
            views = page_views([state], size, "state")
        if len(views) != 1:
            raise InvalidInput(f"state: expected one snapshot, got {len(views)}")
        head = put_head(PutKind.STATE, layout_id, tokens, keys, scope, group, 0, shard,
                        at, views, size, self._tenant_token)
        return self._store(PutKind.STATE, head, views)[0]

    def put_states(self, layout_id: bytes, tokens: TokenIds | None = None, *, group: int,
                   states: Pages, at: Sequence[int], scope: Scope = DEFAULT_SCOPE,
                   keys: Sequence[bytes] | None = None, shard: int | None = None) -> list[bytes]:
        """:meth:`Bank.put_states` on the node: ``states[i]`` after ``at[i]`` tokens; their row
        names, in the order given. Every snapshot and boundary is checked here before any
        is sent; then one put of a snapshot each (the node has no batch of them)."""
        layout = self.layout(layout_id)
        size = page_size(layout, group)
        views = page_views(states, size, "states")
        chain = prompt_keys(tokens, keys, layout.tokens_per_page, layout_id, scope)
        bounds = snapshot_boundaries(at, len(views), layout.tokens_per_page, len(chain))
        return [self._store(PutKind.STATE, put_head(PutKind.STATE, layout_id, tokens, keys, scope, group,
                                                    0, shard, b, [view], size, self._tenant_token),
                                      [view])[0]
                for view, b in zip(views, bounds, strict=True)]


__all__ = ["PutCalls"]
