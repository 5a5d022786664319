"""The calls of the node's local channel (mixed into
:class:`~kvbank.service.local.LocalChannel`, which holds the socket and its connections).

Each handler takes a connection (:class:`_Conn`: its tenant and the leases it holds) and
a request's columns (:mod:`kvbank.wire.local`), and answers columns:

- HELLO binds the connection to the caller's tenant and passes the host segment's
  descriptor where the node lends memory to it; SYNC answers once every earlier frame
  of the connection was applied;
- MATCH and PRESENCE — a prompt by tokens or engine keys, as columns;
- FETCH_PREFIX / FETCH — the match (or the caller's), its plan and a READ lease on its
  rows, each slot's offset, size and checksum; ACK — what arrived (one-way from a
  client that built its result itself);
- LOAD / LOAD_KEYS / LOADED — a paged engine's load on this host (the same
  :class:`~kvbank.service.engine_routes.Loads` as the HTTP routes);
- LEND / CHECK / RELEASE, PUT_RESERVE / COMMIT.

Every call goes through the same tenant checks as its HTTP route
(:class:`~kvbank.service.admin.tenants.TenantGuard`); the leases a fetch, load or put
opened are the connection's until its acknowledgement, LOADED or commit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbank import wire
from kvbank.errors import InvalidInput
from kvbank.keys import Scope as KeyScope
from kvbank.lender.base import Delivery, HostLocation, Lease, LeaseMode, MemoryKind
from kvbank.service.engine_routes import LoadBody, LoadedBody
from kvbank.service.fast_routes import validate_body
from kvbank.wire import local as fr
from kvbank.wire.framing import PREFIX, PUT_MAGIC, decode_prefix, decode_put_header

if TYPE_CHECKING:
    import socket

    from kvbank.service.engine_routes import Loads
    from kvbank.service.node import Node, OpenFetch


class _Caller:
    """What :class:`TenantGuard` reads of a request: the tenant bound to it."""

    __slots__ = ("scope",)

    def __init__(self, tenant: str | None) -> None:
        self.scope: dict[str, Any] = {"state": {"tenant": tenant}} if tenant is not None else {}


class _Conn:
    """One worker's connection: its tenant and the leases it holds."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tenant: str | None = None
        self.hello = False
        self.caller = _Caller(None)
        self.leases: set[str] = set()


class LocalCalls:
    """The local channel's calls (see the module docstring)."""

    if TYPE_CHECKING:  # the channel's (LocalChannel)
        node: Node
        admin: Any
        guard: Any
        _segment: str | None
        _fd: int | None

    def _hello(self, c: _Conn, cols: list[fr.Column]) -> tuple[list[fr.Column], list[int]]:
        token = fr.take(cols, 0, str, "token")
        tokens = self.guard.tokens
        if tokens:
            c.tenant = tokens.tenant_of(f"Bearer {token}" if token else None)
            c.caller = _Caller(c.tenant)
        c.hello = True
        fd = self._fd if c.tenant is None else None
        seg = self.node.segment
        size = 0 if seg is None else seg.size
        resident = int(seg is not None and self.node.bank.reservation is not None)
        # column 1: what this node takes beyond the first version's calls (an older client
        # reads column 0 alone)
        features = fr.FEATURE_ONEWAY_ACK | fr.FEATURE_COMMIT_SUMS
        if self.node.loads is not None:
            features |= fr.FEATURE_ENGINE_LOAD | fr.FEATURE_ONEWAY_LOADED | fr.FEATURE_LOAD_KEYS
        return [np.array([int(fd is not None), size, resident, os.getpid()], dtype="<i8"),
                np.array([features], dtype="<i8")], ([] if fd is None else [fd])

    def _sync(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        """Nothing: answered after every earlier frame of ``c`` was applied (the frames of
        one connection are applied in order), which is what a client waits for."""
        return []

    def _prompt(self, c: _Conn, cols: list[fr.Column], what: str = "prompt") -> tuple[bytes, dict[str, Any]]:
        """``(layout id, Bank.match keyword arguments)`` of a prompt's 6 columns:
        layout id, tenant, cache salt, lora, [shard, prompt_tokens, by_keys], data."""
        lid = fr.take(cols, 0, bytes, "layout_id")
        if len(lid) != 32:
            raise InvalidInput(f"layout_id: expected 32 bytes, got {len(lid)}", field="layout_id")
        scope = KeyScope(fr.take(cols, 1, str, "scope.tenant"), fr.take(cols, 2, str, "scope.cache_salt"),
                         fr.take(cols, 3, str, "scope.lora"))
        scope = self.guard.scope(c.caller, lid, scope)
        shard, prompt_tokens, by_keys = fr.ints(cols, 4, "args", 3).tolist()
        tokens: Any = None
        keys: list[bytes] | None = None
        if by_keys:
            keys = list(fr.names_of(fr.take(cols, 5, bytes, "keys"), "keys", fr.KEY_BYTES))
        else:
            arr = fr.take(cols, 5, np.ndarray, "tokens")
            if arr.dtype != np.dtype("<i4"):
                raise InvalidInput(f"tokens: expected int32, got {arr.dtype}", field="tokens")
            tokens = arr
        return lid, dict(tokens=tokens, scope=scope, shard=None if shard < 0 else shard, keys=keys,
                         prompt_tokens=None if prompt_tokens < 0 else prompt_tokens)

    def _match(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        lid, args = self._prompt(c, cols)
        return fr.match_columns(self.node.match(lid, args))

    def _slots(self, lease: Lease, names: Sequence[bytes], delivery: Delivery,
               checksums: dict[bytes, int] | None = None) -> list[fr.Column]:
        """The lease's id, seconds left, and for each entry ``i`` of ``names`` whose row is
        in the passed segment with ``delivery``: ``i``, offset, size (three arrays); with
        ``checksums`` (a READ lease's) a fourth, each slot's xxh3-64 as uint64 (0: none
        recorded, the copy is not checked)."""
        idx: list[int] = []
        off: list[int] = []
        size: list[int] = []
        seg = self._segment
        for i, name in enumerate(names):
            try:
                row = lease.row(name)
            except KeyError:
                continue
            loc = row.location
            if row.delivery is delivery and isinstance(loc, HostLocation) and loc.segment == seg:
                idx.append(i)
                off.append(loc.offset)
                size.append(loc.size)
        ttl = lease.expires_at - self.node.bank.clock()
        out: list[fr.Column] = [lease.id, np.array([ttl], dtype="<f8"), np.array(idx, dtype="<i8"),
                                np.array(off, dtype="<i8"), np.array(size, dtype="<i8")]
        if checksums is not None:
            out.append(np.fromiter((checksums.get(names[i], 0) for i in idx), dtype="<u8", count=len(idx)))
        return out

    def _own(self, c: _Conn, lease: Lease | None, *, tied: bool = True) -> None:
        """``lease`` is ``c``'s caller's; ``tied``: the call's own lease (a fetch's, a
        put's), released when the connection closes before its acknowledgement or commit."""
        if lease is not None:
            self.guard.own_lease(c.caller, lease)
            if tied:
                c.leases.add(lease.id)

    def _fetch_prefix(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        if c.tenant is not None or self._fd is None:
            raise InvalidInput("socket: this connection was passed no host memory; fetch over HTTP",
                               field="socket")
        lid, args = self._prompt(c, cols)
        max_rows = int(fr.ints(cols, 6, "max_rows", 1)[0])
        m, opened, lease = self.node.match_lend(lid, args, None, None if max_rows < 0 else max_rows)
        return [*fr.match_columns(m), *self._lent(c, opened, lease)]

    def _fetch(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        """A fetch of a Match the caller holds (``Client.fetch``): lent as fetch_prefix's."""
        if c.tenant is not None or self._fd is None:
            raise InvalidInput("socket: this connection was passed no host memory; fetch over HTTP",
                               field="socket")
        m = self.guard.match(c.caller, fr.match_from(cols))
        max_rows = int(fr.ints(cols, fr.MATCH_COLUMNS, "max_rows", 1)[0])
        opened, lease = self.node.lend_fetch(m, None, None if max_rows < 0 else max_rows)
        return self._lent(c, opened, lease)

    def _lent(self, c: _Conn, opened: OpenFetch | None, lease: Lease | None) -> list[fr.Column]:
        """A lent fetch's 10 columns: fetch id ("" when none was opened), each planned
        row's position, group and slot, then the lease's id, seconds left, slots and each
        slot's checksum (the client verifies its copies: docs/reliability.md)."""
        none = np.zeros(0, "<i8")
        sums = np.zeros(0, "<u8")
        if opened is None:
            return ["", none, none, none, "", np.zeros(1, "<f8"), none, none, none, sums]
        self.guard.own_fetch(c.caller, opened.fetch_id)
        rows = opened.rows
        pos = np.fromiter((r.position for r in rows), dtype="<i8", count=len(rows))
        grp = np.fromiter((r.group for r in rows), dtype="<i8", count=len(rows))
        slot = np.fromiter((r.slot for r in rows), dtype="<i8", count=len(rows))
        if lease is None:
            return [opened.fetch_id, pos, grp, slot, "", np.zeros(1, "<f8"), none, none, none, sums]
        self._own(c, lease)
        checksums = self.node.bank.checksums(lease.id)
        return [opened.fetch_id, pos, grp, slot, *self._slots(lease, opened.names, Delivery.READY, checksums)]

    def _ack(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        fetch_id = fr.take(cols, 0, str, "fetch_id")
        lease_id = fr.take(cols, 1, str, "lease_id") or None
        positions = fr.ints(cols, 2, "rows").tolist()
        # lent rows whose copies failed their checksum: the node checks them and drops
        # the host copies that fail, as on the HTTP path (an older client sends none)
        changed = fr.ints(cols, 3, "changed").tolist() if len(cols) > 3 else []
        self.guard.fetch(c.caller, fetch_id)
        if lease_id is not None:
            self.guard.lease(c.caller, lease_id)
        result = self.node.acknowledge(fetch_id, positions, lease_id, None, changed=changed)
        if lease_id is not None:
            c.leases.discard(lease_id)
        metrics = self.admin.metrics
        if metrics is not None and lease_id is not None:
            metrics.add_moved("out", "shm", result.nbytes)
        return fr.result_columns(result)

    def _loads(self) -> Loads:
        loads = self.node.loads
        if loads is None:  # a node without the engine routes (its HELLO did not offer LOAD)
            raise InvalidInput("op: this node serves no engine loads", field="op")
        return loads

    def _load(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        """``POST /v1/engine/load`` with ``via="lease"``, its body and answer the same JSON
        (:class:`~kvbank.service.engine_routes.Loads`: one implementation, the same tenant
        checks). The load's lease is the connection's until LOADED: a worker gone before
        it leaves none held until its ttl."""
        body = validate_body(LoadBody, fr.take(cols, 0, str, "load"))
        if body.via != "lease":
            raise InvalidInput("via: LOAD lends the rows (\"lease\"); a match goes over HTTP", field="via")
        doc = self._loads().lend(c.caller, body)
        lease = doc["lease"]
        if lease is not None:
            c.leases.add(lease["id"])
        return [json.dumps(doc, separators=(",", ":"))]

    def _load_keys(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        """A hit query and its load's lease in one call (``Client.prepare_load``): the
        prompt's Match (16 columns), then its load's plan from page 0 — [start page], each
        row's group, page and size — and the READ lease on them as LOAD answers it in
        slots form: its id ("" when none), [seconds left], each slot's plan entry, offset,
        size and checksum, and the segment's name. The lease is the connection's until
        LOADED, as LOAD's."""
        lid, args = self._prompt(c, cols)
        ttl = _ttl(cols, 6)
        loads = self._loads()
        m = self.node.match(lid, args)
        plan, lease = loads.lend_plan(c.caller, m, args["shard"], 0, ttl)
        layout = self.node.bank.layout(m.layout_id)
        grp = np.fromiter((g for g, _, _ in plan.rows), dtype="<i8", count=len(plan.rows))
        page = np.fromiter((j for _, j, _ in plan.rows), dtype="<i8", count=len(plan.rows))
        size = np.array([layout.group_page_bytes[g] for g, _, _ in plan.rows], dtype="<i8")
        out: list[fr.Column] = [*fr.match_columns(m), np.array([plan.start_page], dtype="<i8"), grp, page, size]
        if lease is None:
            none = np.zeros(0, "<i8")
            return [*out, "", np.zeros(1, "<f8"), none, none, none, np.zeros(0, "<u8"), ""]
        c.leases.add(lease.id)
        names = [n for _, _, n in plan.rows]
        return [*out, *self._slots(lease, names, Delivery.READY, self.node.bank.checksums(lease.id)),
                self._segment or ""]

    def _loaded(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        """``POST /v1/engine/loaded``: the load's lease released, its FetchResult (JSON)."""
        body = validate_body(LoadedBody, fr.take(cols, 0, str, "loaded"))
        doc = self._loads().loaded(c.caller, body)
        c.leases.discard(body.lease_id)
        return [json.dumps(doc, separators=(",", ":"))]

    def _loaded_oneway(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        """LOADED as a ONEWAY frame: the same release and checks; no result built (its
        client built it)."""
        body = validate_body(LoadedBody, fr.take(cols, 0, str, "loaded"))
        self._loads().loaded(c.caller, body, answer=False)
        c.leases.discard(body.lease_id)
        return []

    def _lend(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        names = list(fr.names_of(fr.take(cols, 0, bytes, "names"), "names"))
        mode_i, kind_i = fr.ints(cols, 1, "mode", 2).tolist()
        ttl = _ttl(cols, 2) if len(cols) > 2 else None
        modes, kinds = list(LeaseMode), list(MemoryKind)
        if not (0 <= mode_i < len(modes) and 0 <= kind_i < len(kinds)):
            raise InvalidInput(f"mode: unknown mode {mode_i} or kind {kind_i}", field="mode")
        mode, kind = modes[mode_i], kinds[kind_i]
        if mode is LeaseMode.WRITE:
            self.admin.state.check_writable()
        self.guard.names(c.caller, names)
        bank = self.node.bank
        lease = bank.lend(names, mode=mode, kind=kind, ttl_s=ttl)
        self._own(c, lease, tied=False)  # it may be handed on: it ends at release or TTL
        if mode is LeaseMode.READ and kind is MemoryKind.HOST:  # the reader verifies its copies
            lease = lease.with_sums(bank.checksums(lease.id))
        # a lease's full form (regions, locations) stays the JSON one: lend by name is not
        # a per-request call of a worker (fetch_prefix and put carry slots as columns)
        return [wire.to_json(lease, now=bank.clock())]

    def _lease_id(self, c: _Conn, cols: list[fr.Column]) -> str:
        lease_id: str = fr.take(cols, 0, str, "lease_id")
        self.guard.lease(c.caller, lease_id)
        return lease_id

    def _check(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        self.node.bank.check_live(self._lease_id(c, cols))
        return []

    def _release(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        lease_id = self._lease_id(c, cols)
        c.leases.discard(lease_id)
        return [np.array([int(self.node.bank.release(lease_id))], dtype="<i8")]

    def _put_reserve(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        from kvbank.service.stream import lend_put

        head = fr.take(cols, 0, bytes, "head")
        header_len = decode_prefix(head[: PREFIX.size], PUT_MAGIC)
        header = self.guard.header(c.tenant, decode_put_header(head[PREFIX.size : PREFIX.size + header_len]))
        key_bytes = head[PREFIX.size + header_len :]
        if len(key_bytes) != header.key_bytes:
            raise InvalidInput(f"head: {len(key_bytes)} bytes of tokens or keys, the header declares "
                               f"{header.key_bytes}", field="head")
        self.admin.state.check_writable()
        if c.tenant is not None or self._fd is None:
            raise InvalidInput("socket: this connection was passed no host memory; put over HTTP",
                               field="socket")
        names, lease, fallback = lend_put(self.node, header, key_bytes, ttl_s=None)
        blob = b"".join(names)
        if lease is None:
            return [blob, np.array([int(fallback)], dtype="<i8"), "", np.zeros(1, "<f8"),
                    np.zeros(0, "<i8"), np.zeros(0, "<i8"), np.zeros(0, "<i8")]
        self._own(c, lease)
        return [blob, np.array([0], dtype="<i8"), *self._slots(lease, names, Delivery.RESERVED)]

    def _commit(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        lease_id = self._lease_id(c, cols)
        arrived = list(fr.names_of(fr.take(cols, 1, bytes, "arrived"), "arrived"))
        if len(cols) > 2:  # each row's checksum as the writer hashed its copy (0: none)
            sums = fr.ints(cols, 2, "sums", len(arrived)).astype("<u8").tolist()
            result = self.node.bank.commit_summed(lease_id, arrived,
                                                  {n: v for n, v in zip(arrived, sums, strict=True) if v})
        else:
            result = self.node.bank.commit(lease_id, arrived)
        c.leases.discard(lease_id)
        return fr.commit_columns(result)

    def _presence(self, c: _Conn, cols: list[fr.Column]) -> list[fr.Column]:
        lid, args = self._prompt(c, cols)
        del args["shard"]
        shards = fr.ints(cols, 6, "shards").tolist()
        got = self.node.bank.presence(lid, shards=shards or None, **args)
        return fr.presence_columns(got)



def _ttl(cols: list[fr.Column], at: int) -> float | None:
    """A lease ttl column ``[ttl_s]``: positive seconds, or NaN for the node's default (None)."""
    ttls = fr.take(cols, at, np.ndarray, "ttl_s")
    if len(ttls) != 1 or ttls.dtype.kind != "f" or not (np.isnan(ttls[0]) or ttls[0] > 0):
        raise InvalidInput("ttl_s: expected one positive number of seconds (NaN: the default)", field="ttl_s")
    return None if np.isnan(ttls[0]) else float(ttls[0])


__all__ = ["LocalCalls"]
