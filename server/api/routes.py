"""REST routes, ``/api/v1``: thin wrappers that validate, call the service layer and serialise.

Every route of ``router`` authenticates (see :mod:`fusetune.server.api.deps` for the rules);
routes on tenant resources pass the caller's tenant to the service as ``as_tenant``.
"""

from __future__ import annotations

import pathlib
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response, status
from fastapi.encoders import jsonable_encoder
from fastapi.responses import FileResponse, JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from starlette.convertors import Convertor, register_url_convertor

from fusetune.server import service
from fusetune.server.api.deps import LoopDep, PrincipalDep, SessionDep, SessionRoute, SettingsDep, UrlDep, authenticate
from fusetune.server.api.errors import CODE_FORBIDDEN, CONFLICT, MAX_ID, UNAVAILABLE, StudyId, TrialId
from fusetune.server.api.links import answers, links
from fusetune.server.curves import MIN_POINTS
from fusetune.server.db import ArrayState, StudyState, TrialState
from fusetune.server.errors import Unavailable
from fusetune.server.pagination import ID_CURSOR, LINK_HEADER, TRIAL_CURSOR, PageParams, json_page, page_params, paged
from fusetune.server.params import DECIMAL
from fusetune.server.reads import ID_SORTS, TRIAL_SORTS
from fusetune.server.schemas import (
    ArrayOut,
    AttrValue,
    Health,
    PruningDecision,
    StudyCreate,
    StudyOut,
    StudyUpdate,
    TrialEnqueue,
    TrialOut,
)

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)], route_class=SessionRoute)
health_router = APIRouter(route_class=SessionRoute)


#: The links of an answer that is one study, and of one that is one trial.
STUDY_LINKS = {"links": links(study="$response.body#/id")}
TRIAL_LINKS = {"links": links(trial="$response.body#/id")}


@router.post(
    "/studies", status_code=status.HTTP_201_CREATED, response_model=StudyOut, tags=["studies"],
    responses=answers(CONFLICT, CODE_FORBIDDEN, {201: STUDY_LINKS}),
)
def create_study(
    loop: LoopDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    session: SessionDep,
    url: UrlDep,
    body: StudyCreate,
) -> StudyOut:
    """Start a tuning study; its trials are asked, fused into arrays and trained in the background.

    With `package`, the tenant's uploaded code package: 403 unless the admin granted the tenant `code_upload`."""
    return service.create_study(
        session, url, body, as_tenant=principal.tenant, allow_workload_imports=settings.allow_workload_imports,
        settings=settings, created=loop.adopt if loop is not None else None,  # schedule it now, not at the next poll
    )


#: How list routes answer: their rows, and the next page's Link header.
PAGED = {200: {"headers": LINK_HEADER}}
IdSort = Literal[ID_SORTS]  # type: ignore[valid-type]
TrialSort = Literal[TRIAL_SORTS]  # type: ignore[valid-type]
MaxPoints = Annotated[int | None, Query(
    ge=MIN_POINTS, le=100_000,
    description="Downsample each learning curve (intermediate values) to at most this many points for plots: "
    "the first and last epochs, and the lowest and highest value of each of (max_points - 2) / 2 buckets between.",
), DECIMAL]  # the FieldInfo before DECIMAL, in Annotated: as a default, FastAPI would drop the validator


@router.get(
    "/studies", response_model=list[StudyOut], tags=["studies"],
    responses=answers(PAGED, {200: {"links": links(study="$response.body#/0/id")}}),
)
def list_studies(
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    request: Request,
    response: Response,
    tenant: str | None = Query(
        None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Only this tenant's (a tenant's token sees only its own anyway).",
    ),
    name: str | None = Query(
        None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Only the study of this name."
    ),
    state: list[StudyState] | None = Query(None, description="Only studies in these states (repeat the parameter)."),
    sort: IdSort = Query("id", description="By id, oldest first (`id`) or newest first (`-id`)."),
    page: PageParams = Depends(page_params(ID_CURSOR)),
) -> list[StudyOut]:
    """A page of studies, with their trial counts and best trial (computed in SQL for the page)."""
    found = service.list_studies(session, url, tenant, name, states=state, sort=sort, page=page, as_tenant=principal.tenant)
    return paged(found, request, response)


@router.get("/studies/{study_id}", response_model=StudyOut, tags=["studies"], responses={200: STUDY_LINKS})
def get_study(
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    study_id: StudyId,
) -> StudyOut:
    return service.get_study(session, url, study_id, as_tenant=principal.tenant)


@router.get(
    "/studies/{study_id}/trials", response_model=list[TrialOut], tags=["trials"],
    responses=answers(PAGED, {200: {"links": links(trial="$response.body#/0/id")}}),
)
def list_trials(
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    study_id: StudyId,
    request: Request,
    state: list[TrialState] | None = Query(None, description="Only trials in these states (repeat the parameter)."),
    sort: TrialSort | None = Query(
        None,
        description="`number` (the default), `-number`, `value`, `-value` (trials without a value last) or "
        "`revision` (the order of their last changes; the default and only order with updated_since).",
    ),
    updated_since: Annotated[int | None, Query(
        ge=0, le=2**63 - 1,
        description="Only the trials changed after this revision: pass the highest `revision` of the trials read "
        "so far, and a poll downloads only what changed since (0: every trial).",
    ), DECIMAL] = None,
    max_points: MaxPoints = None,
    page: PageParams = Depends(page_params(TRIAL_CURSOR)),
) -> Response:
    """A page of the study's trials: params, state, per-epoch validation metric, final value, array, revision."""
    found = service.list_trials(
        session, url, study_id, states=state, sort=sort, updated_since=updated_since, page=page, max_points=max_points,
        as_tenant=principal.tenant,
    )
    return json_page(found, request, TrialOut)  # the pollers' route: serialised once


@router.get("/trials/{trial_id}", response_model=TrialOut, tags=["trials"], responses={200: TRIAL_LINKS})
def get_trial(
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    trial_id: TrialId,
    max_points: MaxPoints = None,
) -> TrialOut:
    """One trial: params and their distributions, state, values, intermediate values, attrs."""
    return service.get_trial(session, url, trial_id, max_points=max_points, as_tenant=principal.tenant)


@router.get(
    "/trials/{trial_id}/state_dict",
    response_class=FileResponse,
    tags=["trials"],
    responses={
        200: {
            "content": {"application/octet-stream": {}},
            "description": "The trained weights: torch.save of the workload model's plain state_dict "
            "(`model.load_state_dict(torch.load(f), strict=True)`).",
        }
    },
)
def download_state_dict(
    principal: PrincipalDep,
    settings: SettingsDep,
    session: SessionDep,
    trial_id: TrialId,
) -> FileResponse:
    """The state_dict a COMPLETE trial was saved with (404 when it has none)."""
    roots = [settings.artifact_dir]
    store = getattr(settings, "artifact_store", None)
    if isinstance(store, str) and store.startswith("file://"):
        roots.append(pathlib.Path(store[len("file://"):]))
    path = service.trial_state_dict(session, trial_id, roots, as_tenant=principal.tenant)
    return FileResponse(path, media_type="application/octet-stream", filename=path.name)


@router.post(
    "/studies/{study_id}/trials", status_code=status.HTTP_201_CREATED, response_model=TrialOut, tags=["trials"],
    responses=answers(CONFLICT, {201: TRIAL_LINKS}),
)
def enqueue_trial(
    loop: LoopDep,
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    study_id: StudyId,
    body: TrialEnqueue,
) -> TrialOut:
    """Optuna's ``enqueue_trial``: the study's next trial has these params; it counts in ``n_trials``."""
    return service.enqueue_trial(session, url, loop, study_id, body, as_tenant=principal.tenant)


@router.post("/trials/{trial_id}/pruning", response_model=TrialOut, tags=["trials"], responses=answers(CONFLICT, {200: TRIAL_LINKS}))
def decide_pruning(
    loop: LoopDep,
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    trial_id: TrialId,
    body: PruningDecision,
) -> TrialOut:
    """A client-driven study's ``should_prune`` answer for the trial's value at ``step``;
    the trial's array goes on once each member has its answer."""
    return service.decide_pruning(session, url, loop, trial_id, body, as_tenant=principal.tenant)


class TextConvertor(Convertor[str]):
    """A path parameter that is any text, ``/`` and line breaks included: a user attr's key
    (sent percent-encoded; the server decodes it before routing). Starlette's ``path`` is
    ``.*``, which stops at a line break, so a key "\\n" read as an empty one."""

    regex = r"[\s\S]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("text", TextConvertor())


@router.put("/studies/{study_id}/user_attrs/{key:text}", response_model=StudyOut, tags=["studies"], responses={200: STUDY_LINKS})
def set_study_user_attr(
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    study_id: StudyId,
    body: AttrValue,
    key: str = Path(
        min_length=1, max_length=512, pattern=r"^[^\x00]+$",
        description="Any text but NUL, percent-encoded as one path segment (a `/` as `%2F`).",
    ),
) -> StudyOut:
    """Optuna's ``study.set_user_attr(key, value)``."""
    return service.set_study_user_attr(session, url, study_id, key, body.value, as_tenant=principal.tenant)


# The study's lifecycle: the scheduling loop changes the state (it owns the running arrays),
# so these answer 503 where no loop runs (an API alone).


@router.post("/studies/{study_id}/pause", response_model=StudyOut, tags=["studies"], responses=answers(CONFLICT, {200: STUDY_LINKS}))
def pause_study(
    loop: LoopDep,
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    study_id: StudyId,
) -> StudyOut:
    """Pause a RUNNING study: nothing new is asked or started, and its running trials leave their
    arrays at the next epoch boundary, checkpointed, to wait (409 naming `state` otherwise)."""
    return service.pause_study(session, url, loop, study_id, as_tenant=principal.tenant)


@router.post("/studies/{study_id}/resume", response_model=StudyOut, tags=["studies"], responses=answers(CONFLICT, {200: STUDY_LINKS}))
def resume_study(
    loop: LoopDep,
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    study_id: StudyId,
) -> StudyOut:
    """Run a PAUSED study again; its trials resume from their checkpoints (409 naming `state`, or
    the tenant's `max_running_studies`)."""
    return service.resume_study(session, url, loop, study_id, as_tenant=principal.tenant)


@router.post("/studies/{study_id}/cancel", response_model=StudyOut, tags=["studies"], responses=answers(CONFLICT, {200: STUDY_LINKS}))
def cancel_study(
    loop: LoopDep,
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    study_id: StudyId,
) -> StudyOut:
    """Cancel a RUNNING or PAUSED study: it ends CANCELLED; waiting trials end now, running ones at
    their array's next epoch boundary, PRUNED (or FAIL if they never reported) with the reason in
    `error`; `completed_at` is set once none runs."""
    return service.cancel_study(session, url, loop, study_id, as_tenant=principal.tenant)


@router.patch("/studies/{study_id}", response_model=StudyOut, tags=["studies"], responses=answers(CONFLICT, {200: STUDY_LINKS}))
def update_study(
    loop: LoopDep,
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    study_id: StudyId,
    body: StudyUpdate,
) -> StudyOut:
    """Set `n_trials`: more trials for a running, paused or COMPLETE study (which runs again), never
    fewer than it has asked (409), within the tenant's `max_trials_per_study` (422)."""
    return service.update_study(session, url, loop, study_id, body, as_tenant=principal.tenant)


@router.delete(
    "/studies/{study_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    response_model=None,
    tags=["studies"],
    responses={
        204: {
            "description": "Deleted: its rows, its Optuna study and its artifacts are gone.",
            "links": {"GetStudy": links(study="$request.path.study_id")["GetStudy"]},  # now a 404
        },
        202: {"model": StudyOut, "description": "Arrays of it still train: it is DELETING, cancelled, and goes "
              "(GET answers 404) once they stop at their next epoch boundary.", **STUDY_LINKS},
    },
)
def delete_study(
    loop: LoopDep,
    principal: PrincipalDep,
    session: SessionDep,
    url: UrlDep,
    study_id: StudyId,
) -> Response:
    """Delete a study: fusetune's rows, the Optuna study and its artifact folder."""
    study = service.delete_study(session, url, loop, study_id, as_tenant=principal.tenant)
    if study is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return JSONResponse(jsonable_encoder(study), status_code=status.HTTP_202_ACCEPTED)


@router.get(
    "/arrays", response_model=list[ArrayOut], tags=["arrays"],
    responses=answers(PAGED, {200: {"links": links(study="$response.body#/0/study_id", trial="$response.body#/0/trial_ids/0")}}),
)
def list_arrays(
    principal: PrincipalDep,
    session: SessionDep,
    request: Request,
    response: Response,
    study_id: Annotated[int | None, Query(ge=1, le=MAX_ID), DECIMAL] = None,
    state: list[ArrayState] | None = Query(None, description="Only arrays in these states (repeat the parameter)."),
    tenant: str | None = Query(
        None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Only this tenant's (a tenant's token sees only its own anyway).",
    ),
    sort: IdSort = Query("id", description="By id, oldest first (`id`) or newest first (`-id`)."),
    page: PageParams = Depends(page_params(ID_CURSOR)),
) -> list[ArrayOut]:
    """A page of fused arrays, optionally of one study: members, worker, progress and measured throughput."""
    found = service.list_arrays(
        session, study_id, states=state, tenant=tenant, sort=sort, page=page, as_tenant=principal.tenant
    )
    return paged(found, request, response)


@health_router.get("/healthz", response_model=Health, tags=["health"], responses=UNAVAILABLE)
def healthz(request: Request, session: SessionDep) -> Health:
    """200 while the database answers; 503 naming the reason when it does not."""
    try:
        session.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        from fusetune.server.api.ops import _reason

        raise Unavailable(f"the database is unreachable: {_reason(exc)}") from exc  # whatever the error: 503
    pool = request.app.state.pool
    return Health(
        status="ok",
        database=session.get_bind().dialect.name,
        workers=len(pool.workers) if pool is not None else 0,
    )
