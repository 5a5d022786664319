"""The admin API under ``/admin/``, ``/metrics``, and :func:`install_admin`, which puts
them (with the tenant and drain gates) on the node's application.

=====================================  ===================================================
route                                  what it does
=====================================  ===================================================
``GET  /admin/health``                 liveness, readiness, degraded reasons, in-flight
``GET  /admin/health/live``            200 while the process serves
``GET  /admin/health/ready``           200 when ready, 503 (with the reasons) otherwise
``GET  /admin/stats``                  BankStats, per-tier figures, in-flight, draining
``GET  /admin/tiers``                  per tier: budget, used, rows, watermarks, counters
``GET  /admin/layouts``                every registered layout
``DELETE /admin/layouts/{layout_id}``  unregister one that holds no rows (every shard)
``GET  /admin/leases``                 every live lease
``DELETE /admin/leases/{lease_id}``    force-release one
``GET  /admin/fetches``                open fetch-ledger entries (in-process and remote)
``GET  /admin/rows``                   one page of rows by layout / scope / name prefix
``POST /admin/evict``                  by names, or by layout / scope / prefix
``POST /admin/flush``                  wait until the mover is idle (demotions written)
``POST /admin/drain``, ``/undrain``    refuse new puts and turn unready; accept them again
``POST /admin/pin``, ``/unpin``        pin rows under the pin budget (409 over it)
``POST /admin/check``                  the bank's invariant check, what it found
``GET  /admin/series``, ``/usage``      the status page's samples and usage table (:mod:`.ui`)
``GET  /admin/ui``                     the status page (no token to load; it asks for one)
``POST /admin/compact``                the disk tier rewritten into segments, what moved
``GET  /metrics``                      Prometheus text (admin token with metrics_auth)
=====================================  ===================================================

Every admin route needs ``Authorization: Bearer <admin token>``: 401 without one, 403 for a
wrong one (constant-time compare). Bad input is 400/422 naming the field, never 5xx.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvbank import wire
from kvbank.bank.bank import Bank
from kvbank.errors import InvalidInput
from kvbank.keys import ROW_NAME_BYTES
from kvbank.keys import Scope as KeyScope
from kvbank.results import StoreStats, TierStats
from kvbank.service.admin import models as M
from kvbank.service.admin.auth import (
    Forbidden,
    TenantTokens,
    Unauthorized,
    resolve_admin_token,
    same,
)
from kvbank.service.admin.metrics import CONTENT_TYPE, Metrics, MetricsMiddleware
from kvbank.service.admin.state import AdminState, GateMiddleware
from kvbank.service.admin.tenants import TenantGuard, TenantMiddleware
from kvbank.service.admin.timeseries import Series
from kvbank.service.admin.ui import install_status
from kvbank.service.node import Node
from kvbank.tiers.base import TierKind

_bearer = HTTPBearer(auto_error=False, description="the node's admin token")
Creds = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _hex(value: str, field: str, nbytes: int | None = None) -> bytes:
    try:
        out = bytes.fromhex(value)
    except ValueError:
        raise InvalidInput(f"{field}: not hex: {value[:80]!r}", field=field) from None
    if nbytes is not None and len(out) != nbytes:
        raise InvalidInput(f"{field}: expected {nbytes} bytes, got {len(out)}", field=field)
    return out


def _names(names: list[str]) -> list[bytes]:
    return [_hex(n, f"names[{i}]", ROW_NAME_BYTES) for i, n in enumerate(names)]


def _tiers(bank: Bank, stats: StoreStats) -> list[M.TierModel]:
    cfg = bank.config
    on = [t.kind for t in stats.tiers if t.enabled]
    return [M.TierModel(kind=t.kind.name, enabled=t.enabled, budget_bytes=t.budget_bytes,
                        used_bytes=t.used_bytes, allocated_bytes=t.allocated_bytes, rows=t.rows,
                        high_watermark=cfg.high_watermark, low_watermark=cfg.low_watermark,
                        hits=t.hits, misses=t.misses, evictions=t.evictions, demotions=t.demotions,
                        promotions=t.promotions, corrupt_frames=t.corrupt_rows,
                        raw_bytes=t.raw_bytes, codec_ratio=_codec_ratio(t),
                        victims_first_time=t.victims_first, victims_reused=t.victims_reused,
                        admitted_bytes=t.admitted_bytes, rejected_bytes=t.rejected_bytes,
                        demoted_bytes={k.name: t.demoted_to(k) for k in on if k.rank > t.kind.rank},
                        promoted_bytes={k.name: t.promoted_from(k) for k in on
                                        if k is not t.kind and t.kind is not TierKind.DISK})
            for t in stats.tiers]


def _codec_ratio(t: TierStats) -> float | None:
    """Raw page bytes over the bytes stored, for a tier that encodes rows (the disk);
    None for memory tiers (they hold pages as they are) and for an empty disk."""
    if t.kind is not TierKind.DISK or not t.used_bytes or not t.raw_bytes:
        return None
    return round(t.raw_bytes / t.used_bytes, 4)


class Admin:
    """What :func:`install_admin` puts on an app: the state, the guard, the metrics."""

    def __init__(self, node: Node, state: AdminState, guard: TenantGuard, metrics: Metrics | None) -> None:
        self.node = node
        self.state = state
        self.guard = guard
        self.metrics = metrics
        self.series: Series | None = None  # the status page's samples (install_admin starts it)

    def require(self, creds: Creds, request: Request) -> None:
        """The admin token, or 401 (none) / 403 (wrong)."""
        given = creds.credentials if creds is not None else None
        if given is None:
            raise Unauthorized("authorization: the admin API needs the admin token "
                               "(Authorization: Bearer <token>)", field="authorization")
        if not same(given, self.state.token):
            raise Forbidden("authorization: not the admin token of this node", field="authorization")

    async def health(self) -> M.HealthModel:
        bank = self.node.bank
        h = await self.node.call(bank.health)
        s = await self.node.call(bank.stats)
        reasons = self.state.degraded(h, s.store)
        return M.HealthModel(live=True, ready=h.ok and not self.state.draining,
                             draining=self.state.draining, degraded=reasons,
                             in_flight=self.state.in_flight, store=wire.to_dict(h))


def install_admin(app: FastAPI, node: Node) -> Admin:
    """Add the admin routes, ``/metrics`` and the gates to ``app``; what routes call."""
    cfg = node.config
    token, token_file = resolve_admin_token(cfg.admin_token, cfg.bank.data_dir)
    state = AdminState(token, token_file)
    tokens = TenantTokens.of(cfg.tenants)
    guard = TenantGuard(tokens)
    ready = lambda: not state.draining and node.bank.health().ok  # noqa: E731
    metrics = Metrics(node.bank, ready=ready, draining=lambda: state.draining) if cfg.metrics else None
    admin = Admin(node, state, guard, metrics)
    app.state.admin = admin
    app.add_middleware(GateMiddleware, state=state)
    if tokens:
        app.add_middleware(TenantMiddleware, tokens=tokens)
    if metrics is not None:
        app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.include_router(_router(admin))
    admin.series = Series(node.bank, node.traffic, metrics=metrics, interval_s=cfg.series_interval_s,
                          extra=lambda: {"served_fetches": len(node.ledger), "in_flight": state.in_flight})
    admin.series.start()
    install_status(app, admin, admin.series, node.traffic)
    if metrics is not None:
        deps = [Depends(admin.require)] if cfg.metrics_auth else []

        @app.get("/metrics", dependencies=deps, response_class=Response,
                 responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text"}})
        async def scrape() -> Response:
            assert metrics is not None
            body = await node.call(metrics.render)
            return Response(body, media_type=CONTENT_TYPE)
    return admin


def _router(admin: Admin) -> APIRouter:
    r = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(admin.require)],
                  responses={401: {"model": M.ErrorModel}, 403: {"model": M.ErrorModel},
                             400: {"model": M.ErrorModel}})
    node, state = admin.node, admin.state
    bank = node.bank

    @r.get("/health")
    async def health() -> M.HealthModel:
        return await admin.health()

    @r.get("/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @r.get("/health/ready", responses={503: {"model": M.HealthModel}})
    async def ready() -> Response:
        h = await admin.health()
        return Response(h.model_dump_json(), status_code=200 if h.ready else 503,
                        media_type="application/json")

    @r.get("/stats")
    async def stats() -> M.StatsModel:
        s = await node.call(bank.stats)
        return M.StatsModel(bank=wire.to_dict(s), tiers=_tiers(bank, s.store), in_flight=state.in_flight,
                            draining=state.draining, remote_fetches=len(node.ledger))

    @r.get("/tiers")
    async def tiers() -> M.TiersModel:
        s = await node.call(bank.stats)
        return M.TiersModel(tiers=_tiers(bank, s.store))

    @r.get("/fleet")
    async def fleet() -> M.FleetModel:
        fl = node.fleet
        if fl is None:
            raise InvalidInput("fleet: this node runs without Redis (--redis)", field="fleet")
        nodes = await node.call(fl.nodes)
        return M.FleetModel(self=fl.node_id, nodes=[
            M.FleetNodeModel(node_id=n.node_id, name=n.name, address=n.address, version=n.version,
                             layouts=list(n.layouts), rows=n.rows,
                             heartbeat_age_s=round(max(0.0, n.heartbeat_age_s), 3),
                             state="live" if n.heartbeat_age_s <= fl.index.deadline_s else "dead")
            for n in nodes])

    @r.get("/layouts")
    async def layouts() -> M.LayoutsModel:
        return M.LayoutsModel(layouts=[wire.to_dict(x) for x in await node.call(bank.admin.layouts)])

    @r.delete("/layouts/{layout_id}")
    async def unregister(layout_id: str) -> M.UnregisteredModel:
        lid = _hex(layout_id, "layout_id", 32)
        return M.UnregisteredModel(unregistered=await node.call(bank.admin.unregister, lid))

    @r.get("/leases", responses={200: {"description": "Successful Response", "links": {
        "force_release": {"operationId": "force_release_admin_leases__lease_id__delete",
                          "parameters": {"lease_id": "$response.body#/leases/0/id"}}}}})
    async def leases() -> M.LeasesModel:
        now = bank.clock()
        return M.LeasesModel(leases=[wire.to_dict(x, now=now) for x in await node.call(bank.leases)])

    @r.delete("/leases/{lease_id}")
    async def force_release(lease_id: str) -> M.ReleasedModel:
        return M.ReleasedModel(released=await node.call(bank.release, lease_id))

    @r.get("/fetches")
    async def fetches() -> M.FetchesModel:
        local = await node.call(bank.fetches)
        remote = await node.call(node.ledger.entries)
        return M.FetchesModel(fetches=[{**wire.to_dict(f), "where": w}
                                       for w, fs in (("bank", local), ("remote", remote)) for f in fs])

    @r.get("/rows")
    async def rows(
        layout_id: Annotated[str | None, Query(max_length=64, description="hex layout id")] = None,
        tenant: Annotated[str | None, Query(max_length=256, description="scope: given with any field")] = None,
        cache_salt: Annotated[str | None, Query(max_length=256)] = None,
        lora: Annotated[str | None, Query(max_length=256)] = None,
        prefix: Annotated[str, Query(max_length=108, description="row-name prefix (hex)")] = "",
        limit: Annotated[int, Query(ge=1, le=M.MAX_LIST)] = 100,
        cursor: Annotated[str | None, Query(max_length=200)] = None,
    ) -> M.RowsModel:
        lid = None if layout_id is None else _hex(layout_id, "layout_id", 32)
        parts = (tenant, cache_salt, lora)
        scope = None if all(p is None for p in parts) else KeyScope(*(p or "" for p in parts))
        raw_prefix = _hex(prefix, "prefix")
        query = hashlib.sha256(repr((layout_id, parts, prefix)).encode()).hexdigest()
        after = None if cursor is None else state.cursors.open(query, cursor)
        got = await node.call(bank.admin.rows, lid, scope=scope, prefix=raw_prefix, after=after, limit=limit)
        nxt = state.cursors.issue(query, got[-1].name) if len(got) == limit else None
        return M.RowsModel(rows=[M.RowModel(name=x.name.hex(), size=x.size,
                                            tiers=sorted(t.name for t in x.tiers), age_s=max(0.0, x.age_s),
                                            holders=sorted(x.holders), pinned=x.pinned) for x in got],
                           next_cursor=nxt)

    @r.post("/evict")
    async def evict(body: M.EvictRequest) -> M.EvictModel:
        listing = (body.prefix, body.layout_id, body.scope)
        if body.names is not None:
            if any(x is not None for x in listing):
                raise InvalidInput("names: give names, or a layout / scope / prefix, not both", field="names")
            done = await node.call(bank.admin.evict, _names(body.names))
        else:
            if all(x is None for x in listing):
                raise InvalidInput("names: name rows, or a layout_id, scope or prefix", field="names")
            lid = None if body.layout_id is None else _hex(body.layout_id, "layout_id", 32)
            scope = None if body.scope is None else KeyScope(body.scope.tenant, body.scope.cache_salt,
                                                             body.scope.lora)
            done = await node.call(bank.admin.evict_rows, lid, scope=scope, prefix=_hex(body.prefix or "", "prefix"))
        return M.EvictModel(evicted=[n.hex() for n in done.evicted], locked=[n.hex() for n in done.locked],
                            missing=[n.hex() for n in done.missing], pinned=[n.hex() for n in done.pinned])

    @r.post("/flush", responses={503: {"model": M.ErrorModel}})
    async def flush(body: M.FlushRequest | None = None) -> M.FlushModel:
        await node.call(bank.flush, None if body is None else body.timeout_s)
        s = await node.call(bank.stats)
        return M.FlushModel(flushed=True, queued_jobs=s.store.queued_jobs)

    @r.post("/drain")
    async def drain(body: M.DrainRequest | None = None) -> M.DrainModel:
        body = body or M.DrainRequest(wait=True, timeout_s=30.0)
        state.set_draining(True)
        if body.wait:
            loop = asyncio.get_running_loop()
            end = loop.time() + body.timeout_s
            while state.in_flight and loop.time() < end:
                await asyncio.sleep(0.02)
        return M.DrainModel(draining=True, in_flight=state.in_flight, done=state.in_flight == 0)

    @r.post("/undrain")
    async def undrain() -> M.DrainModel:
        state.set_draining(False)
        return M.DrainModel(draining=False, in_flight=state.in_flight, done=state.in_flight == 0)

    @r.post("/pin", responses={409: {"model": M.ErrorModel, "description": "over the pin budget"}})
    async def pin(body: M.NamesRequest) -> M.PinModel:
        names = _names(body.names)
        missing = await node.call(bank.admin.pin, names)
        s = await node.call(bank.stats)
        return M.PinModel(pinned=len(set(names)) - len(set(missing)), missing=[n.hex() for n in missing],
                          pinned_bytes=s.store.pinned_bytes, pin_budget_bytes=bank.config.pin_budget)

    @r.post("/unpin")
    async def unpin(body: M.NamesRequest) -> M.UnpinModel:
        names = _names(body.names)
        await node.call(bank.admin.unpin, names)
        return M.UnpinModel(unpinned=len(set(names)))

    @r.post("/check")
    async def check() -> M.CheckModel:
        def run() -> list[str]:
            try:
                bank.check_invariants()
            except AssertionError as exc:
                return [str(exc) or "an invariant failed"]
            return []

        problems = await node.call(run)
        return M.CheckModel(ok=not problems, problems=problems)

    @r.post("/compact")
    async def compact() -> M.CompactModel:
        got = await node.call(bank.admin.compact_disk)
        if got is None:
            return M.CompactModel(disk=False, moved=0, written_bytes=0, segments_freed=0,
                                  legacy_moved=0)
        return M.CompactModel(disk=True, moved=got.moved, written_bytes=got.written,
                              segments_freed=got.segments_freed, legacy_moved=got.legacy_moved)

    return r


def admin_of(app: Any) -> Admin:
    """The :class:`Admin` an app was installed with."""
    out = app.state.admin
    assert isinstance(out, Admin)
    return out
