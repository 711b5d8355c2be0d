"""The web dashboard: static files served at ``/``, and the routes it reads besides the API's own.

The page (``static/``: plain ES modules, no build step) and its vendored chart libraries
(``vendor/``, pinned versions with their licences) need no token: they hold no data. Everything
they show comes from ``/api/v1`` with the tenant token the user logged in with, sent as a bearer
header, so a tenant sees in the page exactly what its token may read.

Every string a tenant controls is shown as text (``static/util.js``, ``static/charts.js``), and
every answer of the service carries a strict Content-Security-Policy (``headers.py``).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

HERE = Path(__file__).resolve().parent
STATIC = HERE / "static"
VENDOR = HERE / "vendor"


def mount_dashboard(app: FastAPI) -> None:
    """Serve the page at ``/`` (assets under ``/dashboard/``) and add the dashboard's API routes."""
    from fusetune.server.api.dashboard import router
    from fusetune.server.dashboard.headers import SecurityHeaders

    app.include_router(router)
    # The CSP and nosniff on every answer: the page, its files, the API (whose JSON is never
    # HTML). Around the whole middleware stack, built on the first request, so that the answers
    # of the middleware added after this (413, 415, 503) and the 500s have them too.
    docs = frozenset(p for p in (app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url) if p)
    build_stack = app.build_middleware_stack
    app.build_middleware_stack = lambda: SecurityHeaders(build_stack(), docs_paths=docs)  # type: ignore[method-assign]

    @app.get("/", include_in_schema=False)
    def dashboard_page() -> FileResponse:
        # No data in it; revalidated on every load so a new version of the page is seen at once.
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/dashboard/vendor", StaticFiles(directory=VENDOR), name="dashboard-vendor")
    app.mount("/dashboard", StaticFiles(directory=STATIC), name="dashboard")
