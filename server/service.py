"""The service layer: what the REST API does, independent of HTTP.

Routes validate the wire format with pydantic and call these functions; these functions own
the transactions over fusetune's tables and Optuna's storage.
"""

from __future__ import annotations

import uuid

import optuna
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fusetune.server.db import Array, Study, Tenant, Trial, TrialState, get_optuna_storage
from fusetune.server.optuna_specs import make_sampler
from fusetune.server.schemas import ArrayOut, BestTrial, StudyCreate, StudyOut, TenantOut, TenantUpdate, TrialOut
from fusetune.workers.workloads import get_workload


class NotFound(LookupError):
    """The named resource does not exist."""


class Conflict(ValueError):
    """The request clashes with existing state; ``field`` names the clashing field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def create_study(session: Session, url: str, request: StudyCreate) -> StudyOut:
    """Create the Optuna study and fusetune's record of it, or neither."""
    workload = get_workload(request.workload)
    name = request.name or f"{request.workload}-{uuid.uuid4().hex[:8]}"
    if session.scalar(select(Study.id).where(Study.name == name)) is not None:
        raise Conflict("name", f"a study named {name!r} already exists")
    storage = get_optuna_storage(url)
    direction = request.direction or workload.direction
    try:
        optuna_study = optuna.create_study(
            study_name=name,
            storage=storage,
            direction=direction,
            sampler=make_sampler(request.sampler.name, request.sampler.kwargs),
        )
    except optuna.exceptions.DuplicatedStudyError as exc:
        raise Conflict("name", f"an Optuna study named {name!r} already exists") from exc
    study = Study(
        name=name,
        tenant=request.tenant,
        workload=request.workload,
        n_trials=request.n_trials,
        epochs=request.epochs,
        direction=direction,
        search_space=request.search_space,
        # The FusionSampler opt-out rides in the sampler spec, so no column: absent means on.
        sampler={**request.sampler.model_dump(), **({} if request.fusion_sampler else {"fusion": False})},
        pruner=request.pruner.model_dump() if request.pruner else None,
        max_array_size=request.max_array_size,
        optuna_study_id=optuna_study._study_id,
    )
    if session.get(Tenant, request.tenant) is None:
        session.add(Tenant(name=request.tenant, weight=1.0))
        session.flush()
    session.add(study)
    try:
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        optuna.delete_study(study_name=name, storage=storage)
        raise Conflict("name", f"a study named {name!r} already exists") from exc
    return _study_out(session, url, study)


def list_studies(session: Session, url: str, tenant: str | None = None) -> list[StudyOut]:
    query = select(Study).order_by(Study.id)
    if tenant is not None:
        query = query.where(Study.tenant == tenant)
    return [_study_out(session, url, s) for s in session.scalars(query)]


def get_study(session: Session, url: str, study_id: int) -> StudyOut:
    return _study_out(session, url, _study(session, study_id))


def _study(session: Session, study_id: int) -> Study:
    study = session.get(Study, study_id)
    if study is None:
        raise NotFound(f"study {study_id} does not exist")
    return study


def _study_out(session: Session, url: str, study: Study) -> StudyOut:
    counts = dict(
        session.execute(
            select(Trial.state, func.count()).where(Trial.study_id == study.id).group_by(Trial.state)
        ).all()
    )
    out = StudyOut.model_validate(study)
    out.trial_counts = {state.value: counts.get(state, 0) for state in TrialState}
    complete = session.scalars(
        select(Trial).where(Trial.study_id == study.id, Trial.state == TrialState.COMPLETE)
    ).all()
    if complete:
        pick = max if study.direction == "maximize" else min
        best = pick(complete, key=lambda t: t.value)
        out.best_trial = BestTrial(number=best.number, value=best.value, params=best.params)
    return out


def list_trials(session: Session, url: str, study_id: int) -> list[TrialOut]:
    """Every trial of a study, with its per-epoch validation metric from Optuna's storage."""
    study = _study(session, study_id)
    frozen = {
        t._trial_id: t
        for t in get_optuna_storage(url).get_all_trials(study.optuna_study_id, deepcopy=False)
    }
    trials = session.scalars(select(Trial).where(Trial.study_id == study_id).order_by(Trial.number))
    out = []
    for t in trials:
        trial = TrialOut.model_validate(t)
        if t.optuna_trial_id in frozen:
            trial.intermediate_values = dict(frozen[t.optuna_trial_id].intermediate_values)
        out.append(trial)
    return out


def list_arrays(session: Session, study_id: int | None = None) -> list[ArrayOut]:
    query = select(Array).order_by(Array.id)
    if study_id is not None:
        _study(session, study_id)
        query = query.where(Array.study_id == study_id)
    return [ArrayOut.model_validate(a) for a in session.scalars(query)]


def list_tenants(session: Session) -> list[TenantOut]:
    return [TenantOut.model_validate(t) for t in session.scalars(select(Tenant).order_by(Tenant.name))]


def put_tenant(session: Session, name: str, update: TenantUpdate) -> TenantOut:
    """Create the tenant or change its weight; the scheduler uses it from its next round."""
    tenant = session.get(Tenant, name)
    if tenant is None:
        tenant = Tenant(name=name)
        session.add(tenant)
    tenant.weight = update.weight
    session.commit()
    return TenantOut.model_validate(tenant)
