"""The FastAPI application: REST API, migrations at start-up, and the scheduling loop."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from fusetune.fusion import import_torch_dynamo
from fusetune.server.api import health_router, packages_router, router, tenants_router
from fusetune.server.api.errors import answer_refusals
from fusetune.server.api.http import install as install_http
from fusetune.server.dashboard import mount_dashboard
from fusetune.server.db import get_optuna_storage, get_read_sessionmaker, get_sessionmaker, upgrade
from fusetune.server.leader import Leadership
from fusetune.server.settings import Settings, get_settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, schedule: bool = True) -> FastAPI:
    """Build the service.

    Args:
        settings: configuration; read from ``FUSETUNE_*`` variables when omitted.
        schedule: start Ray workers and the scheduling loop (off: API only, e.g. read-only
            replicas or tests of the API alone).
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        upgrade(settings.database_url)
        get_optuna_storage(settings.database_url)  # creates Optuna's tables beside ours
        app.state.pool = app.state.loop = None
        app.state.leadership = None
        if schedule:
            # One scheduler per database (server/leader.py): this server schedules if it takes
            # the database's scheduler lock, else it serves the API as a standby and takes
            # over when the lock's holder dies.
            app.state.leadership = Leadership(app, settings)
            app.state.leadership.start()
        # torch.optim imports torch._dynamo (~1 s on the 2-core machine) when the first
        # optimizer is built, which checking a study's optimizer does: now, not in the first
        # study's asks.
        import_torch_dynamo()
        # What the server holds once it is up (its modules, Ray, torch, Optuna) lives as long
        # as it does: frozen, the collector's full passes stop walking it. Unfrozen, one took
        # ~200 ms on the 2-core machine every few sweeps, stalling the scheduling loop and
        # every request.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            if app.state.leadership is not None:
                app.state.leadership.stop()

    app = FastAPI(
        title="fusetune",
        summary="Hyper-parameter tuning that trains many trials at once as fused models.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.sessions = get_sessionmaker(settings.database_url)
    app.state.read_sessions = get_read_sessionmaker(settings.database_url)
    app.include_router(router)
    app.include_router(tenants_router)
    app.include_router(packages_router)
    app.include_router(health_router)
    mount_dashboard(app)  # the web dashboard at /, and the routes it reads
    install_http(app)  # body limits, JSON-only writes, 503s, 405's Allow, events, /metrics, OpenAPI errors
    answer_refusals(app)  # NotFound 404, Conflict 409, Invalid 422, Unavailable 503

    return app
