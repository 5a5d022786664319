"""Page bodies on the wire: receiving a put body, streaming a fetch, without extra copies.

**Put** (:func:`receive_put`): the prefix, header and token ids are read and checked
first (layout known, group and page size right, the body's declared length exactly what
the header implies, under ``max_body_bytes``), so a wrong page size is refused before a
page is read. The pages then land straight in host slots: a ``WRITE`` lease on the rows
not yet stored, each body chunk copied once into its slot, and a commit once the body has
arrived whole. A short body, a disconnect or a timeout releases the lease: nothing becomes
visible. Where no lease can be had (no host tier, a full one, another writer filling the
same rows) the pages are read into private buffers and stored with ``Bank.put``.

**Fetch** (:class:`RowStream`): an ASGI response with a fixed content-length whose body
is memoryviews of the host slots themselves (uvicorn + httptools hands them to the
transport without a copy). Rows are lent in batches of about :data:`BATCH_BYTES`, so rows
held on disk are decoded into host slots a batch ahead of the socket instead of the whole
body being built first. The batches' leases are held until the client acknowledges *this
stream* (the transport may still be sending from a slot after its last ``write``
returned: uvloop keeps a pointer, not a copy, and holds no buffer export one could test);
then :meth:`Lender.check_live` confirms each lease outlived the send, and only then are
its rows *verified* (see :mod:`kvbank.service.node`). Nothing else ends them early: not
a resume of the same fetch id, not the node forgetting the fetch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvbank.errors import (
    CorruptPage,
    InvalidInput,
    KvbankError,
    LeaseConflict,
    TierError,
)
from kvbank.keys import PAGE_KEY_BYTES
from kvbank.keys import Scope as KeyScope
from kvbank.layout import GroupKind
from kvbank.lender.base import Delivery, Lease, MemoryKind
from kvbank.service.admin.tenants import bind_put_header, tenant_of
from kvbank.service.node import Node, OpenFetch
from kvbank.wire.framing import (
    PREFIX,
    PUT_MAGIC,
    FrameKind,
    PutHeader,
    PutKind,
    decode_prefix,
    decode_put_header,
    encode_frame,
)

logger = logging.getLogger(__name__)

BATCH_BYTES = 32 << 20  # rows lent (and staged) per lease while streaming a fetch


class BodyTooLarge(InvalidInput):
    """A request body over ``max_body_bytes`` (answered 413)."""


class _Body:
    """Reads a request body exactly: ``read(n)`` for small parts, ``into(view)`` for pages."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._left = memoryview(b"")
        self.received = 0

    async def _next(self) -> bool:
        async for chunk in self._chunks:
            if chunk:
                self._left = memoryview(chunk)
                self.received += len(chunk)
                return True
        return False

    async def into(self, view: memoryview) -> None:
        pos, n = 0, len(view)
        while pos < n:
            if not self._left and not await self._next():
                raise InvalidInput(f"body: ended {n - pos} bytes short of what its header declares")
            k = min(n - pos, len(self._left))
            view[pos : pos + k] = self._left[:k]
            self._left = self._left[k:]
            pos += k

    async def read(self, n: int) -> bytearray:
        buf = bytearray(n)
        await self.into(memoryview(buf))
        return buf

    async def at_end(self) -> bool:
        return not self._left and not await self._next()


async def receive_put(node: Node, request: Request, kind: PutKind) -> dict[str, Any]:
    """Read, check and store one put body; ``{"names": [...]}`` (hex) of its rows."""
    cfg = node.config
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cfg.max_body_bytes:
        raise BodyTooLarge(f"body: {declared} bytes, over the {cfg.max_body_bytes}-byte limit")
    body = _Body(request.stream())
    try:
        async with asyncio.timeout(cfg.body_timeout_s):
            return await _put(node, body, kind, declared, request)
    except TimeoutError:
        raise InvalidInput(f"body: did not arrive within {cfg.body_timeout_s}s") from None
    except ClientDisconnect:
        raise InvalidInput("body: the client went away mid-body; nothing was stored") from None


async def _head(node: Node, body: _Body, declared: str | None, with_pages: bool,
                request: Request) -> tuple[PutHeader, int]:
    """The checked header of a put body (bound to the caller's tenant), and the body's
    exact length."""
    header_len = decode_prefix(await body.read(PREFIX.size), PUT_MAGIC)
    header = bind_put_header(request, decode_put_header(await body.read(header_len)))
    total = header.body_bytes(header_len) - (0 if with_pages else header.pages * header.page_bytes)
    if total > node.config.max_body_bytes:
        raise BodyTooLarge(f"body: {total} bytes, over the {node.config.max_body_bytes}-byte limit")
    if declared is not None and declared != str(total):
        raise InvalidInput(f"body: content-length {declared}, the header implies {total} bytes")
    return header, total


async def receive_put_lease(node: Node, request: Request) -> tuple[list[bytes], Lease | None, bool]:
    """The same-host put: a put body without its pages → the row names, a WRITE HOST
    lease on those not yet stored, and whether the client must put over TCP instead
    (no lease could be had: no host tier, a full one, another writer on the rows)."""
    declared = request.headers.get("content-length")
    body = _Body(request.stream())
    try:
        async with asyncio.timeout(node.config.body_timeout_s):
            header, total = await _head(node, body, declared, with_pages=False, request=request)
            key_bytes = await body.read(header.key_bytes)
            if not await body.at_end():
                raise InvalidInput(f"body: longer than the {total} bytes its header declares")
    except TimeoutError:
        raise InvalidInput(f"body: did not arrive within {node.config.body_timeout_s}s") from None
    except ClientDisconnect:
        raise InvalidInput("body: the client went away mid-body") from None
    return await node.call(_lease_put, node, header, key_bytes)  # one hop to the pool


def _lease_put(node: Node, header: PutHeader, key_bytes: bytearray) -> tuple[list[bytes], Lease | None, bool]:
    """The put's row names, its WRITE lease (None: every row is stored already) and
    whether the client must put over TCP instead (no lease could be had)."""
    return lend_put(node, header, key_bytes, ttl_s=None)


def lend_put(node: Node, header: PutHeader, key_bytes: bytes | bytearray,
             ttl_s: float | None) -> tuple[list[bytes], Lease | None, bool]:
    """One bank call (:meth:`~kvbank.bank.bank.Bank.lend_put`): the put planned and a
    WRITE HOST lease on its rows not stored yet. A lease refused (a reader holds a row,
    the host tier is full) answers ``fallback`` with the names: the body is then stored
    through ``Bank.put``."""
    try:
        names, lease = _bank_put(node, header, key_bytes, ttl_s, lease=True)
    except (LeaseConflict, TierError) as exc:
        logger.debug("put lease: none (%s); the pages go through Bank.put", exc)
        names, _ = _bank_put(node, header, key_bytes, ttl_s, lease=False)
        return names, None, True
    return names, lease, False


def _bank_put(node: Node, header: PutHeader, key_bytes: bytes | bytearray, ttl_s: float | None,
              *, lease: bool) -> tuple[list[bytes], Lease | None]:
    """The header's put through ``Bank.lend_put`` (the rules are :mod:`kvbank.bank.puts`)."""
    tokens, keys = _prompt(header, key_bytes)
    want = GroupKind.STATE if header.kind is PutKind.STATE else GroupKind.ATTENTION
    scope = KeyScope(header.tenant, header.cache_salt, header.lora)
    node.traffic.scope(header.layout_id, scope)  # whose rows these are, for the status page
    return node.bank.lend_put(
        header.layout_id, tokens, group=header.group, group_kind=want, count=header.pages,
        first_page=header.first_page, at=header.at, page_bytes=header.page_bytes,
        scope=scope, keys=keys,
        shard=header.shard, kind=MemoryKind.HOST, ttl_s=ttl_s, fields="header.", lease=lease)


async def _put(node: Node, body: _Body, kind: PutKind, declared: str | None,
               request: Request) -> dict[str, Any]:
    header, total = await _head(node, body, declared, with_pages=True, request=request)
    if header.kind is not kind:
        raise InvalidInput(f"header.kind: this route takes {kind.value!r} bodies, got {header.kind.value!r}")
    key_bytes = await body.read(header.key_bytes)
    # The lease outlives the body deadline, so it cannot expire (and its slots go to
    # another row) while chunks are still being copied into them outside its lock.
    ttl = min(node.config.bank.max_lease_ttl_s, 2 * node.config.body_timeout_s)
    with node.put_bodies.hold(tenant_of(request), header.pages * header.page_bytes):
        return await _put_held(node, body, header, key_bytes, total, ttl)


async def _put_held(node: Node, body: _Body, header: PutHeader, key_bytes: bytes | bytearray,
                    total: int, ttl: float) -> dict[str, Any]:
    """The rest of :func:`_put`, its bytes counted against the tenant's share."""
    names, lease, fallback = await node.call(lend_put, node, header, key_bytes, ttl)
    pages: list[bytearray] = []
    if lease is None and not fallback:  # every row is stored already: read and drop the pages
        scratch = memoryview(bytearray(header.page_bytes))
        for _ in names:
            await body.into(scratch)
        if not await body.at_end():
            raise InvalidInput(f"body: longer than the {total} bytes its header declares")
        return {"names": [n.hex() for n in names]}
    views: dict[bytes, memoryview] = {}
    try:
        if lease is not None:
            views = await node.call(_slot_views, node, lease, names)
            scratch = memoryview(bytearray(header.page_bytes))
            for name in names:
                # A row stored before the lease (PRESENT) already holds these bytes.
                await body.into(views.get(name, scratch))
        else:
            pages = [await body.read(header.page_bytes) for _ in range(header.pages)]
        if not await body.at_end():
            raise InvalidInput(f"body: longer than the {total} bytes its header declares")
    except BaseException:
        _release_views(views)
        if lease is not None:
            await node.call(node.bank.release, lease.id)
        raise
    _release_views(views)  # before the commit: the slab must never outlive an export
    if lease is not None:
        await node.call(node.bank.commit, lease.id, [n for n in lease.names if _reserved(lease, n)])
    else:
        tokens, keys = _prompt(header, key_bytes)
        await node.call(_store_pages, node, header, tokens, keys, pages)
    return {"names": [n.hex() for n in names]}


def _release_views(views: dict[bytes, memoryview]) -> None:
    for v in views.values():
        v.release()


def _reserved(lease: Lease, name: bytes) -> bool:
    return lease.row(name).delivery is Delivery.RESERVED


def _prompt(header: PutHeader, key_bytes: bytes | bytearray) -> tuple[Any, list[bytes] | None]:
    """The put's prompt as the header sends it: token ids, or page keys."""
    if header.tokens is not None:
        return np.frombuffer(bytes(key_bytes), dtype="<i4").astype(np.int64), None
    raw = bytes(key_bytes)
    return None, [raw[i : i + PAGE_KEY_BYTES] for i in range(0, len(raw), PAGE_KEY_BYTES)]


def _slot_views(node: Node, lease: Lease, names: list[bytes]) -> dict[bytes, memoryview]:
    return {n: node.bank.view(lease.id, n) for n in lease.names if _reserved(lease, n)}


def _store_pages(node: Node, header: PutHeader, tokens: Any, keys: Any, pages: list[bytearray]) -> None:
    scope = KeyScope(header.tenant, header.cache_salt, header.lora)
    if header.kind is PutKind.PAGES:
        node.bank.put(header.layout_id, tokens, group=header.group, pages=pages, scope=scope,
                      keys=keys, first_page=header.first_page, shard=header.shard)
    else:
        node.bank.put_state(header.layout_id, tokens, group=header.group, state=pages[0],
                            at=header.at, scope=scope, keys=keys, shard=header.shard)


class RowStream(Response):
    """The streamed body of one fetch call (see the module docstring)."""

    media_type = "application/octet-stream"

    def __init__(self, node: Node, fetch: OpenFetch, prefix: bytes, length: int) -> None:
        super().__init__(headers={"content-length": str(length), "x-kvbank-fetch-id": fetch.fetch_id})
        self._node = node
        self._fetch = fetch
        self._prefix = prefix
        self._length = length

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self._prefix, "more_body": True})
        sent = len(self._prefix)
        node, fetch = self._node, self._fetch
        batches = _batches(fetch)
        # Lend (and stage) batch k+1 while batch k is on the wire.
        ahead = [asyncio.ensure_future(_lend(node, fetch, batches[0]))] if batches else []
        done = 0
        try:
            for b, idx in enumerate(batches):
                lease = await ahead[b]
                done = b + 1
                if b + 1 < len(batches):
                    ahead.append(asyncio.ensure_future(_lend(node, fetch, batches[b + 1])))
                sent += await self._send_batch(send, lease, idx)
        finally:
            for task in ahead[done:]:  # lent ahead but never sent (an error or a disconnect)
                left = await task
                if left is not None:
                    await node.call(node.bank.release, left.id)
        pad = self._length - sent - 16
        await send({"type": "http.response.body", "more_body": False,
                    "body": encode_frame(FrameKind.END, 0, pad) + bytes(pad)})

    async def _send_batch(self, send: Send, lease: Lease | None, idx: list[int]) -> int:
        node, fetch = self._node, self._fetch
        if lease is not None:
            try:
                views = await node.call(_read_views, node, lease)
            except KvbankError:
                await node.call(node.bank.release, lease.id)
                raise
        else:
            views = await node.call(_private_copies, node, fetch, idx)
        sent = 0
        try:
            for i in idx:
                row, name = fetch.rows[i], fetch.names[i]
                view = views.get(name)
                if view is None:
                    await send({"type": "http.response.body", "more_body": True,
                                "body": encode_frame(FrameKind.MISSING, row.position, 0)})
                    sent += 16
                    continue
                await send({"type": "http.response.body", "more_body": True,
                            "body": encode_frame(FrameKind.ROW, row.position, row.size)})
                await send({"type": "http.response.body", "body": view, "more_body": True})
                sent += 16 + row.size
        finally:
            for v in views.values():
                v.release()  # our export only: the lease keeps the slots until the ack
            if lease is not None:
                await node.call(node.hold, fetch.fetch_id, fetch.stream, lease.id, list(views))
        return sent


def _batches(fetch: OpenFetch) -> list[list[int]]:
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, r in enumerate(fetch.rows):
        cur.append(i)
        size += r.size
        if size >= BATCH_BYTES:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


async def _lend(node: Node, fetch: OpenFetch, idx: list[int]) -> Lease | None:
    """A READ HOST lease on a batch (staging its rows into host slots), or None when the
    host tier cannot hold it (the batch is then copied out row by row)."""
    try:
        return await node.call(node.lend_rows, [fetch.names[i] for i in idx])
    except TierError as exc:
        logger.debug("fetch %s: no read lease (%s); copying rows out", fetch.fetch_id, exc)
        return None


def _private_copies(node: Node, fetch: OpenFetch, idx: list[int]) -> dict[bytes, memoryview]:
    """The batch's rows copied into fresh buffers (the host tier could not hold the batch
    at once): ``Bank.get_into`` needs no host slot, so a disk row decodes straight into its
    buffer however full the host tier is with other readers' leases. A row that is gone or
    fails its checksum is left out, so it streams as MISSING."""
    out: dict[bytes, memoryview] = {}
    bank = node.bank
    for i in idx:
        name, size = fetch.names[i], fetch.rows[i].size
        buf = bytearray(size)
        try:
            got = bank.get_into(name, buf)
        except KvbankError as exc:
            logger.warning("fetch %s: row %s not served: %s", fetch.fetch_id, name.hex()[:16], exc)
            continue
        if got == size:
            out[name] = memoryview(buf)
    node.verified(fetch.fetch_id, fetch.stream, list(out))  # private copies: nothing can reclaim them
    return out


def _read_views(node: Node, lease: Lease) -> dict[bytes, memoryview]:
    """The lease's ready rows in place, each verified against its checksum first: a row
    whose bytes changed since commit is left out (streamed as MISSING; the lender drops
    its host copy when the lease ends)."""
    out: dict[bytes, memoryview] = {}
    try:
        for r in lease.rows:
            if r.delivery is Delivery.READY:
                try:
                    out[r.name] = node.bank.view(lease.id, r.name)
                except CorruptPage:
                    continue
    except BaseException:
        for v in out.values():
            v.release()
        raise
    return out
