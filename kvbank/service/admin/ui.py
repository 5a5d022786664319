"""What an operator opens in a browser: the status page and the API docs, both served by
the node from files in the package (nothing fetched from elsewhere, so both work offline).

==============================  ==========================================================
route                           what it answers
==============================  ==========================================================
``GET /admin/ui``               the status page (``static/status.html``: one file, its
                                plots drawn as SVG by its own script). No token to load
                                it; it asks for the admin token and keeps it in the
                                tab's ``sessionStorage``, sent as a bearer header, never
                                in a URL. A refused token shows the form and no data.
``GET /admin/series``           the ring of samples (:mod:`.timeseries`) after ``after``,
                                and latency percentiles per route (admin token)
``GET /admin/usage``            rows, bytes and hit rate per model, layout and tenant
                                (admin token; recomputed at most every
                                :data:`USAGE_MAX_AGE_S`)
``GET /docs``                   Swagger UI on ``/openapi.json``, its assets from
                                ``static/swagger-ui/`` (swagger-ui-dist, Apache-2.0)
==============================  ==========================================================

The page polls ``/admin/series`` at the sampling interval (at least once a second) and
the usage and fleet tables every fifth poll.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time
from importlib import resources
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from kvbank.service.admin import models as M
from kvbank.service.admin.timeseries import Series, Traffic, usage

if TYPE_CHECKING:
    from kvbank.service.admin.routes import Admin

USAGE_MAX_AGE_S = 5.0
_STATIC = resources.files("kvbank.service.admin") / "static"
_SWAGGER = {  # file -> media type: the only names /docs/assets serves
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}


def _page_policy(page: bytes) -> str:
    """The page's Content-Security-Policy: its one script runs by its hash (no other
    script can, injected or not), it may talk to this node only, and nothing else loads."""
    script = page.split(b"<script>", 1)[1].split(b"</script>", 1)[0]
    digest = base64.b64encode(hashlib.sha256(script).digest()).decode()
    return (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src data:; form-action 'none'; frame-ancestors 'none'; "
            "base-uri 'none'")


class _Usage:
    """``usage()`` answered from a copy at most USAGE_MAX_AGE_S old: several open pages
    share one answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at = -USAGE_MAX_AGE_S
        self._doc: dict[str, Any] | None = None

    def get(self, compute: Any) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            if self._doc is None or now - self._at >= USAGE_MAX_AGE_S:
                self._doc, self._at = compute(), now
            return self._doc


def install_status(app: FastAPI, admin: Admin, series: Series, traffic: Traffic) -> None:
    """Put the status page, its JSON routes and the offline ``/docs`` on ``app``."""
    node = admin.node
    page = (_STATIC / "status.html").read_bytes()
    policy = _page_policy(page)
    assets = {name: (_STATIC / "swagger-ui" / name).read_bytes() for name in _SWAGGER}
    cached = _Usage()

    @app.get("/admin/ui", include_in_schema=False)
    async def status_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": policy, "Cache-Control": "no-store",
                                 "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="kvbank node: API",
                                   swagger_js_url="/docs/assets/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/assets/swagger-ui.css",
                                   swagger_favicon_url="/docs/assets/favicon-32x32.png")

    @app.get("/docs/assets/{name}", include_in_schema=False)
    async def docs_asset(name: str) -> Response:
        if name not in _SWAGGER:
            return Response(status_code=404)
        return Response(assets[name], media_type=_SWAGGER[name],
                        headers={"Cache-Control": "public, max-age=86400"})

    r = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(admin.require)],
                  responses={401: {"model": M.ErrorModel}, 403: {"model": M.ErrorModel},
                             400: {"model": M.ErrorModel}})

    @r.get("/series")
    async def series_route(
        after: Annotated[int | None, Query(ge=0, description="only the samples numbered above this (n)")] = None,
    ) -> dict[str, Any]:
        doc = series.answer(after)
        doc["fleet"] = node.fleet is not None
        return doc

    @r.get("/usage")
    async def usage_route() -> dict[str, Any]:
        return await node.call(cached.get, lambda: usage(node.bank, traffic))

    app.include_router(r)
