"""REST routes, ``/api/v1``: thin wrappers that validate, call the service layer and serialise."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Depends, Path, Query, Request, status
from sqlalchemy import text
from sqlalchemy.orm import Session

from fusetune.server import service
from fusetune.server.schemas import ArrayOut, Health, StudyCreate, StudyOut, TenantOut, TenantUpdate, TrialOut

router = APIRouter(prefix="/api/v1")
health_router = APIRouter()


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


def get_url(request: Request) -> str:
    return request.app.state.settings.database_url


@router.post("/studies", status_code=status.HTTP_201_CREATED, response_model=StudyOut, tags=["studies"])
def create_study(
    body: StudyCreate, request: Request, session: Session = Depends(get_session), url: str = Depends(get_url)
) -> StudyOut:
    """Start a tuning study; its trials are asked, fused into arrays and trained in the background."""
    study = service.create_study(session, url, body)
    coordinator = getattr(request.app.state, "coordinator", None)
    if coordinator is not None:
        coordinator.wake()  # schedule it now, not at the next poll
    return study


@router.get("/studies", response_model=list[StudyOut], tags=["studies"])
def list_studies(
    tenant: str | None = Query(None), session: Session = Depends(get_session), url: str = Depends(get_url)
) -> list[StudyOut]:
    return service.list_studies(session, url, tenant)


@router.get("/studies/{study_id}", response_model=StudyOut, tags=["studies"])
def get_study(study_id: int, session: Session = Depends(get_session), url: str = Depends(get_url)) -> StudyOut:
    return service.get_study(session, url, study_id)


@router.get("/studies/{study_id}/trials", response_model=list[TrialOut], tags=["trials"])
def list_trials(study_id: int, session: Session = Depends(get_session), url: str = Depends(get_url)) -> list[TrialOut]:
    """Every trial: params, state, per-epoch validation metric, final value and its array."""
    return service.list_trials(session, url, study_id)


@router.get("/arrays", response_model=list[ArrayOut], tags=["arrays"])
def list_arrays(study_id: int | None = Query(None), session: Session = Depends(get_session)) -> list[ArrayOut]:
    """Fused arrays, optionally of one study: members, worker, progress and measured throughput."""
    return service.list_arrays(session, study_id)


@router.get("/tenants", response_model=list[TenantOut], tags=["tenants"])
def list_tenants(session: Session = Depends(get_session)) -> list[TenantOut]:
    return service.list_tenants(session)


@router.put("/tenants/{name}", response_model=TenantOut, tags=["tenants"])
def put_tenant(
    body: TenantUpdate, name: str = Path(min_length=1, max_length=255), session: Session = Depends(get_session)
) -> TenantOut:
    """Set a tenant's weight: its share of the devices when tenants compete."""
    return service.put_tenant(session, name, body)


@health_router.get("/healthz", response_model=Health, tags=["health"])
def healthz(request: Request, session: Session = Depends(get_session)) -> Health:
    session.execute(text("SELECT 1"))
    pool = request.app.state.pool
    return Health(
        status="ok",
        database=session.get_bind().dialect.name,
        workers=len(pool.workers) if pool is not None else 0,
    )
