"""The HTTP rules every route shares, installed on the app by :func:`install`.

* request bodies: at most ``FUSETUNE_MAX_BODY_BYTES`` (413), JSON on write routes (415); a code
  package's upload a zip of at most ``FUSETUNE_PACKAGE_MAX_BYTES``
  (:mod:`fusetune.server.api.limits`);
* a database that cannot be reached is a 503 naming the reason, on every route, never a 500, and
  so is a connection pool that stayed busy for its whole timeout (overload; with Retry-After);
* a 405's ``Allow`` lists every method of the path (:func:`errors.method_not_allowed`);
* the event streams (:mod:`fusetune.server.api.events`) and ``GET /metrics``
  (:mod:`fusetune.server.api.ops`, :mod:`fusetune.server.metrics`), with every request timed;
* the OpenAPI document lists every answer of every route (:func:`errors.document_errors`).
"""

from __future__ import annotations

import logging
import sqlite3
from urllib.parse import unquote_to_bytes

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as SATimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from fusetune.server.api import events, ops
from fusetune.server.api.errors import document_errors, method_not_allowed
from fusetune.server.api.limits import RequestBodyLimits
from fusetune.server.metrics import Metrics, RequestMetrics

log = logging.getLogger(__name__)

#: SQLite's OperationalErrors that say the database cannot be used now (not a bad statement).
_SQLITE_UNAVAILABLE = ("unable to open database", "database is locked", "disk i/o error", "database or disk is full")


def unreachable(exc: BaseException) -> bool:
    """Whether a database error means the database cannot be reached or used now (503),
    not that a statement was wrong (a 500: a bug)."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    orig = getattr(exc, "orig", None)
    if isinstance(orig, sqlite3.OperationalError):
        return str(orig).lower().startswith(_SQLITE_UNAVAILABLE)
    return isinstance(exc, OperationalError)  # psycopg: connection failures, server shutdowns


class Utf8Paths:
    """A path whose %-escapes do not decode to UTF-8 is a 422 naming it. Starlette decodes a
    path leniently (each bad byte a U+FFFD), so ``/user_attrs/%FF`` and ``/user_attrs/%FE``
    were one mangled key, stored without a word."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                unquote_to_bytes(scope.get("raw_path") or scope["path"].encode()).decode("utf-8")
            except UnicodeDecodeError as exc:
                msg = f"the path is not UTF-8 once its %-escapes are decoded: {exc.reason} at byte {exc.start}"
                await JSONResponse(status_code=422, content={"detail": [{"loc": ["path"], "msg": msg, "type": "utf8"}]})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install(app: FastAPI) -> None:
    """Add the shared rules, the event and metrics routes to ``app`` (its settings in ``app.state``)."""
    settings = app.state.settings
    app.state.metrics = Metrics(app)
    app.state.event_streams = events.StreamSlots(settings.events_max_streams_per_tenant)
    # The last middleware added runs first: every request is timed, refused ones included.
    app.add_middleware(
        RequestBodyLimits, max_bytes=settings.max_body_bytes, package_max_bytes=settings.package_max_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    app.add_middleware(Utf8Paths)
    app.add_middleware(RequestMetrics, fastapi=app)
    app.include_router(events.router)
    app.include_router(ops.router)
    app.add_exception_handler(StarletteHTTPException, method_not_allowed)  # type: ignore[arg-type]

    async def database_unreachable(_: Request, exc: Exception) -> JSONResponse:
        if not unreachable(exc):
            log.error("database error", exc_info=exc)
            return JSONResponse(status_code=500, content={"detail": "Internal Server Error"})
        reason = ops._reason(exc) if isinstance(exc, SQLAlchemyError) else str(exc)
        return JSONResponse(status_code=503, content={"detail": f"the database is unreachable: {reason}"})

    app.add_exception_handler(OperationalError, database_unreachable)

    async def pool_exhausted(_: Request, exc: Exception) -> JSONResponse:
        # Every connection of the pool stayed busy for its whole timeout: the server is
        # overloaded, not broken. A 503 with Retry-After lets a client back off and retry.
        return JSONResponse(status_code=503, content={"detail": f"the server is overloaded: {exc}"}, headers={"Retry-After": "1"})

    app.add_exception_handler(SATimeoutError, pool_exhausted)
    document_errors(app)
