"""The node's engine-facing routes under ``/v1/engine/`` (:mod:`kvbank.bank.engine` served).

=======================================  ==================================================
route                                    what it does
=======================================  ==================================================
``POST /v1/engine/match``                many key chains → ``{"bounds": [Bound, ...]}``
                                         (``hold``/``pin``: handles, pinned rows)
``POST /v1/engine/release``              a handle → ``{"released": bool}`` (its pin too)
``POST /v1/engine/load``                 a handle (or a Match), ``shard``, ``start_page``
                                         → a READ lease on the rows from that page in
                                         slots form and ``rows`` ``[group, page, size]``
                                         (``via="match"``: the match for ``shard``
                                         instead, for a client off the node's host)
``POST /v1/engine/loaded``               that lease and the ``[group, page]`` that
                                         arrived whole → released, the FetchResult
``POST /v1/engine/put``                  a key range, ``pages`` per group → names per
                                         group and one WRITE lease (slots form) on the
                                         rows not stored; commit it as any lease
=======================================  ==================================================

A load's plan is remembered by its lease id until ``/loaded`` (bounded: the oldest go
first; an unacknowledged load's lease ends at its ttl). With tenant tokens, a handle is
its tenant's (as a fetch id), and a load's match is checked as a fetch's. :class:`Loads`
holds those plans and is the one implementation of a lent load and its acknowledgement:
the routes here and the local channel's LOAD and LOADED (:mod:`kvbank.service.local`,
same JSON bodies) both call it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from kvbank import wire
from kvbank.bank.engine import Load
from kvbank.errors import InvalidInput, LeaseError
from kvbank.keys import Scope
from kvbank.lender.base import Delivery, Lease
from kvbank.lender.loads import load_result
from kvbank.results import Match
from kvbank.service.admin.tenants import TenantGuard
from kvbank.service.node import Node, slots_doc
from kvbank.wire.forms import from_hex as _hex

__all__ = ["LoadBody", "LoadedBody", "Loads", "install_engine"]

_LOADS = 4096  # load plans remembered until their acknowledgement


class ScopeDoc(BaseModel):
    tenant: str = ""
    cache_salt: str = ""
    lora: str = ""


class MatchManyBody(BaseModel):
    layout_id: str = Field(description="hex of the 32-byte layout id")
    keys: list[list[str]] = Field(description="one engine page-key chain (hex) a prompt")
    prompt_tokens: list[int | None] | None = None
    have_pages: list[int] | None = None
    scope: ScopeDoc = ScopeDoc()
    shard: int | None = None
    hold: bool = False
    pin: bool = False
    ttl_s: float | None = Field(None, gt=0)


class HandleBody(BaseModel):
    handle: str


class LoadBody(BaseModel):
    handle: str | None = None
    match: dict[str, Any] | None = Field(None, description="a Match in its wire form, instead of a handle")
    layout_id: str | None = Field(None, description="with keys: hex of the 32-byte layout id")
    keys: list[str] | None = Field(None, description="an engine's page-key chain (hex), matched here and "
                                   "lent in the same call (its match comes back in the answer), instead "
                                   "of a handle or a match")
    prompt_tokens: int | None = Field(None, ge=1, description="with keys: the prompt's length")
    scope: ScopeDoc = ScopeDoc()
    shard: int | None = Field(None, ge=0)
    start_page: int | None = Field(None, ge=0)
    ttl_s: float | None = Field(None, gt=0, description="the load's lease's ttl (default: the node's)")
    via: Literal["lease", "match"] = "lease"


class LoadedBody(BaseModel):
    lease_id: str
    arrived: list[tuple[int, int]] = Field(description="[group, page] of each row that arrived whole")
    changed: list[tuple[int, int]] | None = Field(
        None, description="given where the load's lease carried sums: the client hashed every row it read "
        "and names here, [group, page], those whose bytes did not match (not in arrived); the node reads "
        "only these again, dropping the host copies that fail. Absent: the node checks every arrived row")


class PutGroupsBody(BaseModel):
    layout_id: str
    keys: list[str]
    first_page: int = Field(0, ge=0)
    scope: ScopeDoc = ScopeDoc()
    shard: int | None = None
    pages: dict[int, list[int]] = Field(description="group -> page indices to store")


class Loads:
    """A node's lent loads: ``/v1/engine/load`` (``via="lease"``) and ``/v1/engine/loaded``
    written once, for the HTTP routes and the local channel's LOAD and LOADED alike (a
    caller is a request or the channel's stand-in for one: the same tenant checks).

    A load's plan is remembered by its lease id until its acknowledgement (at most
    ``_LOADS``, the oldest forgotten first: an unacknowledged load's lease ends at its
    ttl). Each call runs on a bank thread (it calls the bank directly)."""

    def __init__(self, node: Node, guard: TenantGuard) -> None:
        self.node = node
        self.guard = guard
        self._lock = threading.Lock()
        self._plans: OrderedDict[str, Load] = OrderedDict()

    def target(self, caller: Any, body: LoadBody) -> Match | str:
        """The handle or Match ``body`` names, the caller's own (as a fetch id, as a fetch's
        match), or the match of its ``keys`` in the caller's scope, taken here."""
        if sum(x is not None for x in (body.handle, body.match, body.keys)) != 1:
            raise InvalidInput("match: give one of handle, match or keys")
        if body.keys is not None:
            if body.layout_id is None:
                raise InvalidInput("layout_id: keys need the layout they are of", field="layout_id")
            lid = _hex(body.layout_id, "layout_id", 32)
            scope = self.guard.scope(caller, lid, Scope(body.scope.tenant, body.scope.cache_salt, body.scope.lora))
            keys = [_hex(k, f"keys[{i}]") for i, k in enumerate(body.keys)]
            return self.node.match(lid, {"keys": keys, "prompt_tokens": body.prompt_tokens, "scope": scope,
                                         "shard": body.shard})
        if body.handle is not None:
            self.guard.fetch(caller, body.handle)
            self.guard.match(caller, self.node.bank.held(body.handle))
            return body.handle
        return self.guard.match(caller, wire.from_dict(Match, body.match))

    def lend_plan(self, caller: Any, target: Match | str, shard: int | None, start_page: int | None,
                  ttl_s: float | None) -> tuple[Load, Lease | None]:
        """The plan of a load of ``target`` (the caller's: :meth:`target`) and a READ lease
        on its rows, the caller's, remembered until LOADED (None: no rows to move)."""
        self.node.check_named()  # the engine reads the lent rows in place, mapping the segment by its name
        plan, lease = self.node.bank.lend_load(target, shard=shard, start_page=start_page, ttl_s=ttl_s)
        if lease is not None:
            self.guard.own_lease(caller, lease)
            with self._lock:
                self._plans[lease.id] = plan
                while len(self._plans) > _LOADS:
                    self._plans.popitem(last=False)
        return plan, lease

    def lend(self, caller: Any, body: LoadBody) -> dict[str, Any]:
        """The plan of a load and a READ lease on its rows, in slots form (none where it
        needs no rows: its ``result`` instead)."""
        bank = self.node.bank
        target = self.target(caller, body)
        plan, lease = self.lend_plan(caller, target, body.shard, body.start_page, body.ttl_s)
        layout = bank.layout(plan.match.layout_id)
        doc: dict[str, Any] = {"layout_id": plan.match.layout_id.hex(), "start_page": plan.start_page,
                               "lease": None,
                               "rows": [[g, j, layout.group_page_bytes[g]] for g, j, _ in plan.rows]}
        if body.keys is not None:  # the caller has not seen this match
            doc["match"] = wire.to_dict(plan.match)
        if lease is None:
            doc["result"] = wire.to_dict(load_result(layout, plan.match, plan.start_page, "", (), 0))
            return doc
        doc["lease"] = slots_doc(lease, [n for _, _, n in plan.rows], Delivery.READY, bank.clock(),
                                 bank.checksums(lease.id))
        return doc

    def loaded(self, caller: Any, body: LoadedBody, answer: bool = True) -> dict[str, Any] | None:
        """The load's lease released and its FetchResult (wire form): the rows that
        arrived whole, still unchanged, under a lease still live. Not ``answer`` (a
        one-way LOADED, whose client built the result itself): None, no result built."""
        node, bank = self.node, self.node.bank
        self.guard.lease(caller, body.lease_id)
        with self._lock:
            plan = self._plans.pop(body.lease_id, None)
        if plan is None:
            raise InvalidInput(f"lease_id: {body.lease_id} is not an open load")
        layout = bank.layout(plan.match.layout_id)
        planned = {(g, j) for g, j, _ in plan.rows}
        arrived = {(g, j) for g, j in body.arrived if (g, j) in planned}
        names = {(g, j): n for g, j, n in plan.rows}
        try:
            if body.changed is None:
                # The engine read the rows in place, straight into its pool, and checked none:
                # verified here, after its reads, so that bytes changed since commit are a miss.
                kept = set(node.unchanged(body.lease_id, [names[a] for a in arrived]))
                arrived = {a for a in arrived if names[a] in kept}
            else:
                # The client hashed each row after its read and names those that failed (a
                # miss for it): only they are read again, and their host copies dropped if
                # they fail here too (a client cannot make the node drop a row that is right).
                suspect = {(g, j) for g, j in body.changed if (g, j) in planned}
                node.unchanged(body.lease_id, [names[a] for a in suspect])
                arrived -= suspect
            live = bank.release(body.lease_id)
        except LeaseError:
            live = False
        if not answer:
            return None
        if not live:  # the lease ended before the copies did: nothing read under it counts
            arrived = set()
        nbytes = sum(layout.group_page_bytes[g] for g, _ in arrived)
        return wire.to_dict(load_result(layout, plan.match, plan.start_page, body.lease_id, arrived, nbytes))


def install_engine(app: FastAPI, node: Node, admin: Any, json: Any) -> None:
    """Add the ``/v1/engine/`` routes to ``app`` (``admin``: the admin install's guard and
    drain state); ``json`` builds a JSON response."""
    bank = node.bank
    guard: TenantGuard = admin.guard
    # a scheduler's matches see what the node's own match sees: rows the remote tier still
    # holds are recalled, rows a fleet peer holds are sent for
    bank.match_with(lambda layout_id, **args: node.match(layout_id, dict(args, tokens=None)))
    loads = node.loads = Loads(node, guard)

    @app.post("/v1/engine/match")
    async def match_many(body: MatchManyBody, request: Request) -> Response:
        lid = _hex(body.layout_id, "layout_id", 32)
        scope = guard.scope(request, lid, Scope(body.scope.tenant, body.scope.cache_salt, body.scope.lora))
        keys = [[_hex(k, f"keys[{i}][{j}]") for j, k in enumerate(chain)] for i, chain in enumerate(body.keys)]
        bounds = await node.call(bank.match_many, lid, keys, prompt_tokens=body.prompt_tokens,
                                 have_pages=body.have_pages, scope=scope, shard=body.shard,
                                 hold=body.hold, pin=body.pin, ttl_s=body.ttl_s)
        for b in bounds:
            if b.handle is not None:
                guard.own_fetch(request, b.handle)
        response: Response = json({"bounds": [wire.to_dict(b) for b in bounds]})
        return response

    @app.post("/v1/engine/release")
    async def release_match(body: HandleBody, request: Request) -> Response:
        guard.fetch(request, body.handle)
        response: Response = json({"released": await node.call(bank.release_match, body.handle)})
        return response

    @app.post("/v1/engine/load")
    async def load(body: LoadBody, request: Request) -> Response:
        if body.via == "match":
            target = await node.call(loads.target, request, body)
            m, start = await node.call(bank.load_match, target, shard=body.shard, start_page=body.start_page)
            response: Response = json({"match": wire.to_dict(m), "start_page": start})
            return response
        response = json(await node.call(loads.lend, request, body))
        return response

    @app.post("/v1/engine/loaded")
    async def loaded(body: LoadedBody, request: Request) -> Response:
        response: Response = json(await node.call(loads.loaded, request, body))
        return response

    @app.post("/v1/engine/put")
    async def put_groups(body: PutGroupsBody, request: Request) -> Response:
        admin.state.check_writable()
        lid = _hex(body.layout_id, "layout_id", 32)
        scope = guard.scope(request, lid, Scope(body.scope.tenant, body.scope.cache_salt, body.scope.lora))
        keys = [_hex(k, f"keys[{i}]") for i, k in enumerate(body.keys)]
        node.check_named()  # the engine fills the reserved rows in place, by the segment's name
        names, lease = await node.call(bank.lend_put_groups, lid, pages=body.pages, keys=keys,
                                       first_page=body.first_page, scope=scope, shard=body.shard)
        guard.own_lease(request, lease)
        flat = [n for g in names.values() for n in g]
        doc: dict[str, Any] = {"names": {str(g): [n.hex() for n in ns] for g, ns in names.items()},
                               "lease": None}
        if lease is not None:
            doc["lease"] = slots_doc(lease, flat, Delivery.RESERVED, bank.clock())
        response: Response = json(doc)
        return response
