"""The web dashboard: static files served at ``/``, and the routes it reads besides the API's own.

The page (``static/``: plain ES modules, no build step) and its vendored chart libraries
(``vendor/``, pinned versions with their licences) need no token: they hold no data. Everything
they show comes from ``/api/v1`` with the tenant token the user logged in with, sent as a bearer
header, so a tenant sees in the page exactly what its token may read.
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

    app.include_router(router)

    @app.get("/", include_in_schema=False)
    def dashboard_page() -> FileResponse:
        # No data in it; revalidated on every load so a new version of the page is seen at once.
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/dashboard/vendor", StaticFiles(directory=VENDOR), name="dashboard-vendor")
    app.mount("/dashboard", StaticFiles(directory=STATIC), name="dashboard")
