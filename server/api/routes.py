"""REST routes, ``/api/v1``: thin wrappers that validate, call the service layer and serialise.

Every route of ``router`` authenticates (see :mod:`fusetune.server.api.deps` for the rules);
routes on tenant resources pass the caller's tenant to the service as ``as_tenant``.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query, Request, status
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from fusetune.server import service
from fusetune.server.api.deps import authenticate, get_app_settings, get_session, get_url
from fusetune.server.api.errors import CONFLICT, MAX_ID, UNAVAILABLE, StudyId, TrialId
from fusetune.server.auth import Principal
from fusetune.server.schemas import (
    ArrayOut,
    AttrValue,
    Health,
    PruningDecision,
    StudyCreate,
    StudyOut,
    TrialEnqueue,
    TrialOut,
)
from fusetune.server.settings import Settings

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)])
health_router = APIRouter()


@router.post("/studies", status_code=status.HTTP_201_CREATED, response_model=StudyOut, tags=["studies"], responses=CONFLICT)
def create_study(
    body: StudyCreate,
    request: Request,
    principal: Principal = Depends(authenticate),
    settings: Settings = Depends(get_app_settings),
    session: Session = Depends(get_session),
    url: str = Depends(get_url),
) -> StudyOut:
    """Start a tuning study; its trials are asked, fused into arrays and trained in the background."""
    study = service.create_study(
        session, url, body, as_tenant=principal.tenant, allow_workload_imports=settings.allow_workload_imports
    )
    coordinator = getattr(request.app.state, "coordinator", None)
    if coordinator is not None:
        coordinator.wake()  # schedule it now, not at the next poll
    return study


@router.get("/studies", response_model=list[StudyOut], tags=["studies"])
def list_studies(
    tenant: str | None = Query(None, description="Only this tenant's (a tenant's token sees only its own anyway)."),
    name: str | None = Query(None, min_length=1, max_length=255, description="Only the study of this name."),
    principal: Principal = Depends(authenticate),
    session: Session = Depends(get_session),
    url: str = Depends(get_url),
) -> list[StudyOut]:
    return service.list_studies(session, url, tenant, name, as_tenant=principal.tenant)


@router.get("/studies/{study_id}", response_model=StudyOut, tags=["studies"])
def get_study(
    study_id: StudyId,
    principal: Principal = Depends(authenticate),
    session: Session = Depends(get_session),
    url: str = Depends(get_url),
) -> StudyOut:
    return service.get_study(session, url, study_id, as_tenant=principal.tenant)


@router.get("/studies/{study_id}/trials", response_model=list[TrialOut], tags=["trials"])
def list_trials(
    study_id: StudyId,
    principal: Principal = Depends(authenticate),
    session: Session = Depends(get_session),
    url: str = Depends(get_url),
) -> list[TrialOut]:
    """Every trial: params, state, per-epoch validation metric, final value and its array."""
    return service.list_trials(session, url, study_id, as_tenant=principal.tenant)


@router.get("/trials/{trial_id}", response_model=TrialOut, tags=["trials"])
def get_trial(
    trial_id: TrialId,
    principal: Principal = Depends(authenticate),
    session: Session = Depends(get_session),
    url: str = Depends(get_url),
) -> TrialOut:
    """One trial: params and their distributions, state, values, intermediate values, attrs."""
    return service.get_trial(session, url, trial_id, as_tenant=principal.tenant)


@router.post(
    "/studies/{study_id}/trials", status_code=status.HTTP_201_CREATED, response_model=TrialOut, tags=["trials"], responses=CONFLICT
)
def enqueue_trial(
    study_id: StudyId,
    body: TrialEnqueue,
    request: Request,
    principal: Principal = Depends(authenticate),
    session: Session = Depends(get_session),
    url: str = Depends(get_url),
) -> TrialOut:
    """Optuna's ``enqueue_trial``: the study's next trial has these params; it counts in ``n_trials``."""
    coordinator = getattr(request.app.state, "coordinator", None)
    return service.enqueue_trial(session, url, coordinator, study_id, body, as_tenant=principal.tenant)


@router.post("/trials/{trial_id}/pruning", response_model=TrialOut, tags=["trials"], responses=CONFLICT)
def decide_pruning(
    trial_id: TrialId,
    body: PruningDecision,
    request: Request,
    principal: Principal = Depends(authenticate),
    session: Session = Depends(get_session),
    url: str = Depends(get_url),
) -> TrialOut:
    """A client-driven study's ``should_prune`` answer for the trial's value at ``step``;
    the trial's array goes on once each member has its answer."""
    coordinator = getattr(request.app.state, "coordinator", None)
    return service.decide_pruning(session, url, coordinator, trial_id, body, as_tenant=principal.tenant)


@router.put("/studies/{study_id}/user_attrs/{key}", response_model=StudyOut, tags=["studies"])
def set_study_user_attr(
    study_id: StudyId,
    body: AttrValue,
    key: str = Path(min_length=1, max_length=512),
    principal: Principal = Depends(authenticate),
    session: Session = Depends(get_session),
    url: str = Depends(get_url),
) -> StudyOut:
    """Optuna's ``study.set_user_attr(key, value)``."""
    return service.set_study_user_attr(session, url, study_id, key, body.value, as_tenant=principal.tenant)


@router.get("/arrays", response_model=list[ArrayOut], tags=["arrays"])
def list_arrays(
    study_id: int | None = Query(None, ge=1, le=MAX_ID),
    principal: Principal = Depends(authenticate),
    session: Session = Depends(get_session),
) -> list[ArrayOut]:
    """Fused arrays, optionally of one study: members, worker, progress and measured throughput."""
    return service.list_arrays(session, study_id, as_tenant=principal.tenant)


@health_router.get("/healthz", response_model=Health, tags=["health"], responses=UNAVAILABLE)
def healthz(request: Request, session: Session = Depends(get_session)) -> Health:
    """200 while the database answers; 503 naming the reason when it does not."""
    try:
        session.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        from fusetune.server.api.ops import _reason

        raise service.Unavailable(f"the database is unreachable: {_reason(exc)}") from exc  # whatever the error: 503
    pool = request.app.state.pool
    return Health(
        status="ok",
        database=session.get_bind().dialect.name,
        workers=len(pool.workers) if pool is not None else 0,
    )
