"""Operations: ``GET /metrics`` for Prometheus.

Open like ``/healthz`` unless ``FUSETUNE_METRICS_TOKEN`` is set; then it takes that bearer
token (Prometheus' ``authorization: {credentials: ...}``) and answers 401 to anything else.
Tenants' and the admin's tokens are not metrics tokens: the series cover every tenant.
"""

from __future__ import annotations

import secrets

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import SQLAlchemyError

from fusetune.server.api.errors import UNAVAILABLE, ErrorMessage

router = APIRouter()


def _check_token(request: Request) -> None:
    expected = request.app.state.settings.metrics_token
    if expected is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), expected.get_secret_value().encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "/metrics needs the metrics token (FUSETUNE_METRICS_TOKEN) as a bearer token",
            headers={"WWW-Authenticate": "Bearer"},
        )


@router.get(
    "/metrics",
    response_class=Response,
    tags=["operations"],
    responses={
        200: {"description": "Prometheus' text exposition format.", "content": {"text/plain": {"schema": {"type": "string"}}}},
        401: {"model": ErrorMessage, "description": "FUSETUNE_METRICS_TOKEN is set and the request did not send it."},
        **UNAVAILABLE,
    },
)
def metrics(request: Request) -> Response:
    """Request latency, trials by state, arrays running, worker utilisation, reports ingested."""
    _check_token(request)
    try:
        body = generate_latest(request.app.state.metrics.registry)
    except SQLAlchemyError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, f"the database is unreachable: {_reason(exc)}") from exc
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _reason(exc: SQLAlchemyError) -> str:
    """The database error's first line, without its SQL or parameters."""
    cause = getattr(exc, "orig", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0][:200]}" if text else type(cause).__name__
