"""The reuse audit on a served node: engines report, operators clear.

=======================================  ==================================================
route                                    what it does
=======================================  ==================================================
``POST   /v1/audit``                     an engine's audit verdict on a layout's rows; a
                                         mismatch quarantines the layout (data route: a
                                         tenant token where the node requires one)
``GET    /admin/quarantine``             the quarantined layouts and the audit counts
``DELETE /admin/quarantine/{layout_id}`` serve the layout's rows again
=======================================  ==================================================

A quarantined layout is also a health note (``audit: layout … quarantined: …`` in
``/admin/health``'s degraded reasons) and the metrics ``kvbank_audits_total{result}`` and
``kvbank_quarantined_layouts``. The quarantine itself is :mod:`kvbank.bank.quarantine`.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Depends, FastAPI
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from kvbank.bank.quarantine import BankAudit
from kvbank.errors import InvalidInput
from kvbank.service.admin import models as M
from kvbank.service.admin.routes import Admin

__all__ = ["install_audit"]


class AuditReportModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    layout_id: str = Field(description="hex layout id of the audited rows", min_length=64, max_length=64)
    ok: bool = Field(description="the recomputed pages matched the stored rows")
    pages: int = Field(0, ge=0, le=1 << 30, description="pages compared")
    error: float | None = Field(0.0, ge=0.0, description="worst relative error (null: not finite)")
    tolerance: float = Field(0.0, ge=0.0, description="the dtype's relative tolerance")
    detail: str = Field("", max_length=2000, description="what differed, for the operator")


class AuditAnswerModel(BaseModel):
    quarantined: bool


class QuarantineEntryModel(BaseModel):
    layout_id: str
    since: float
    detail: str
    error: float | None
    tolerance: float
    pages: int
    mismatches: int


class QuarantineModel(BaseModel):
    layouts: list[QuarantineEntryModel]
    audits_ok: int
    audits_mismatched: int


class ClearedModel(BaseModel):
    cleared: bool


def _layout_id(value: str) -> bytes:
    try:
        out = bytes.fromhex(value)
    except ValueError:
        raise InvalidInput(f"layout_id: not hex: {value[:80]!r}", field="layout_id") from None
    if len(out) != 32:
        raise InvalidInput(f"layout_id: expected 32 bytes, got {len(out)}", field="layout_id")
    return out


class _AuditCollector(Collector):
    def __init__(self, audit: BankAudit) -> None:
        self._audit = audit

    def collect(self) -> Iterator[Metric]:
        n = self._audit.counts()
        c = CounterMetricFamily("kvbank_audits", "reuse audits reported by engines", labels=["result"])
        c.add_metric(["ok"], float(n.ok))
        c.add_metric(["mismatch"], float(n.mismatched))
        yield c
        yield GaugeMetricFamily("kvbank_quarantined_layouts",
                                "layouts whose rows are not served after an audit mismatch",
                                value=float(n.quarantined))


def install_audit(app: FastAPI, admin: Admin) -> None:
    """The audit's data route, its admin routes, health note and metrics, on ``app``."""
    node = admin.node
    audit = node.bank.audit

    def reasons() -> Iterator[str]:
        for e in audit.entries():
            yield f"audit: layout {e.layout_id.hex()} quarantined: {e.detail[:200]}"

    admin.state.add_health_reasons(reasons)
    if admin.metrics is not None:
        admin.metrics.registry.register(_AuditCollector(audit))

    @app.post("/v1/audit", tags=["audit"])
    async def report(body: AuditReportModel) -> AuditAnswerModel:
        lid = _layout_id(body.layout_id)
        error = float("inf") if body.error is None else body.error
        held = await node.call(audit.report, lid, ok=body.ok, pages=body.pages, error=error,
                               tolerance=body.tolerance, detail=body.detail)
        return AuditAnswerModel(quarantined=held)

    r = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(admin.require)],
                  responses={401: {"model": M.ErrorModel}, 403: {"model": M.ErrorModel},
                             400: {"model": M.ErrorModel}})

    @r.get("/quarantine")
    async def quarantined() -> QuarantineModel:
        n = await node.call(audit.counts)
        entries = await node.call(audit.entries)
        return QuarantineModel(layouts=[QuarantineEntryModel(**e.to_json()) for e in entries],  # type: ignore[arg-type]
                               audits_ok=n.ok, audits_mismatched=n.mismatched)

    @r.delete("/quarantine/{layout_id}")
    async def clear(layout_id: str) -> ClearedModel:
        return ClearedModel(cleared=await node.call(audit.clear, _layout_id(layout_id)))

    app.include_router(r)
