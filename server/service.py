"""The service layer: what the REST API does, independent of HTTP.

Routes validate the wire format with pydantic and call these functions; these functions own
the transactions over fusetune's tables and Optuna's storage.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import optuna
from optuna.study.study import _SYSTEM_ATTR_METRIC_NAMES
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fusetune.server import packages, reads
from fusetune.server.db import Array, ArrayState, Study, StudyState, Tenant, Trial, TrialState, get_optuna_storage
from fusetune.server.errors import Conflict, Invalid, NotFound, Unavailable
from fusetune.server.mirror import CreatedStudy, create_study_rows
from fusetune.server.optuna_specs import SpecError, build_for_study, check_for_study, default_limits
from fusetune.server.pagination import Page, PageParams
from fusetune.server.quotas import check_running_quota, check_trials_quota, lock_tenant
from fusetune.server.schemas import (
    FAILURE_ATTR,
    MAX_USER_ATTRS_BYTES,
    WARNINGS_ATTR,
    ArrayOut,
    Objectives,
    PruningDecision,
    StudyCreate,
    StudyOut,
    StudyUpdate,
    TrialEnqueue,
    TrialOut,
    user_attrs_bytes,
)
from fusetune.server.settings import Settings, get_settings
from fusetune.workers.spec import TrainingSpec
from fusetune.workers.workloads import UnknownWorkloadError, available_workloads, get_workload

if TYPE_CHECKING:
    from fusetune.server.loop import SchedulingLoop

_T = TypeVar("_T")

# Scoping: functions that read or change a tenant's resources take ``as_tenant``, the tenant
# the caller acts for (None: the admin, or an operator calling in-process, who see every
# tenant's). Another tenant's resource is NotFound, with the message a missing one gets, so
# ids leak nothing.


def _tenant_for_study(session: Session, request: StudyCreate, as_tenant: str | None) -> Tenant:
    """The tenant a new study belongs to, row-locked until the commit (quotas are per tenant)."""
    name = request.tenant or as_tenant or "default"
    tenant = None
    if as_tenant is None or name == as_tenant:  # another tenant's name reads as an unknown one
        tenant = lock_tenant(session, name)
    if tenant is None:
        raise Invalid("tenant", f"tenant {name!r} does not exist")
    check_trials_quota(tenant, request.n_trials)
    check_running_quota(session, tenant)
    return tenant


#: What a study's name may not hold (its pattern: letters, digits, '.', '_' and '-').
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9._-]+")


def default_study_name(workload: str) -> str:
    """A new study's name when its request gives none: its workload's, made to fit the name
    pattern (``mywl:WL`` -> ``mywl-WL``), and 8 hex digits."""
    stem = _NOT_IN_NAMES.sub("-", workload).strip("-._")[:200] or "study"
    return f"{stem}-{uuid.uuid4().hex[:8]}"


def create_study(
    session: Session, url: str, request: StudyCreate, *, as_tenant: str | None = None,
    allow_workload_imports: bool = False, settings: Settings | None = None,
    created: Callable[[int, CreatedStudy], None] | None = None,
) -> StudyOut:
    """Create the Optuna study and fusetune's record of it, or neither.

    The study belongs to ``request.tenant``, else to ``as_tenant``, else to ``default``; the
    tenant must exist, and its quotas hold. A workload given as a module path is imported only
    with ``allow_workload_imports`` (the server's ``FUSETUNE_ALLOW_WORKLOAD_IMPORTS``); one
    from a code package is never imported here (``_package_workload``). ``settings`` (the
    server's; read from the environment when omitted) locate the packages' artifact store.
    ``created`` is called once the study is committed, before its answer is built, with the
    study's id and its Optuna rows (the route hands them to the scheduling loop, which wakes:
    the asks start while the answer is read, and the loop need not read back what was written).
    """
    if request.package is not None:
        workload, request = _package_workload(session, settings or get_settings(), request, as_tenant)
    else:
        workload = _registered_workload(request.workload, allow_workload_imports)
    tenant = _tenant_for_study(session, request, as_tenant)
    name = request.name or default_study_name(request.workload)
    if session.scalar(select(Study.id).where(Study.name == name)) is not None:
        raise Conflict("name", f"a study named {name!r} already exists")
    if reads.optuna_study_named(session, name) is not None:
        raise Conflict("name", f"an Optuna study named {name!r} already exists")
    try:
        directions = request.objective_directions(workload)
    except KeyError as exc:  # a module-path workload: the schema could not check its metrics
        raise Invalid("metrics", str(exc.args[0])) from exc
    try:  # built as the loop will, off the event loop (this route runs on a thread), under a deadline
        build_for_study(request.sampler.model_dump(), request.pruner.model_dump() if request.pruner else None, default_limits())
    except SpecError as exc:
        raise Invalid(exc.loc[0], str(exc)) from exc
    get_optuna_storage(url)  # Optuna's tables exist (its storage creates them once per process)
    # The Optuna study's rows (name, directions, system attrs) go into this transaction with
    # fusetune's, through Optuna's table models as the mirror writes trials: both or neither
    # (optuna.create_study and its attrs were three transactions of their own before ours,
    # and a study our commit refused had to be deleted again).
    optuna_directions = [optuna.study.StudyDirection[d.upper()] for d in directions]
    attrs = _optuna_system_attrs(request)
    try:
        rows = create_study_rows(session, name, optuna_directions, attrs)
    except IntegrityError as exc:  # an Optuna study of this name committed since the check
        session.rollback()
        raise Conflict("name", f"an Optuna study named {name!r} already exists") from exc
    optuna_study_id = rows.study_id
    study = Study(
        name=name,
        tenant=tenant.name,
        workload=request.workload,
        n_trials=request.n_trials,
        epochs=request.epochs,
        direction=directions[0],  # the first objective's; the Optuna study holds them all
        search_space=request.search_space,
        sampler=request.sampler.model_dump(),
        pruner=request.pruner.model_dump() if request.pruner else None,
        fusion_sampler=request.fusion_sampler,
        training=_training_of(request),
        max_array_size=request.max_array_size,
        max_concurrent_trials=request.max_concurrent_trials,
        driver=request.driver,
        package=request.package,
        optuna_study_id=optuna_study_id,
    )
    session.add(study)
    try:
        session.commit()
    except IntegrityError as exc:  # a study of this name (fusetune's or Optuna's) committed meanwhile
        session.rollback()
        raise Conflict("name", f"a study named {name!r} already exists") from exc
    if created is not None:
        created(study.id, rows)
    # From what was written, not read back: the loop is asking the first trials by now, and
    # a read would take its time from theirs (the answer is the study as it was created).
    return _finish_out(reads.new_study_out(study, optuna_directions, attrs), study)


def _registered_workload(name: str, allow_imports: bool) -> Objectives:
    try:
        return get_workload(name, allow_imports=allow_imports)
    except UnknownWorkloadError as exc:
        raise Invalid("workload", str(exc)) from exc


def _package_workload(
    session: Session, settings: Settings, request: StudyCreate, as_tenant: str | None
) -> tuple[Objectives, StudyCreate]:
    """A package study's workload, as its manifest states it (nothing is imported), and the
    request as the study keeps it: the manifest's search space and first metric where the
    request names none. The tenant holds ``code_upload`` (Forbidden) and uploaded the package."""
    assert request.package is not None
    found = packages.for_study(session, settings, request.package, request.tenant or as_tenant or "default", as_tenant)
    info = found.workload
    if request.workload != info.name:
        raise Invalid("workload", f"package {request.package} holds the workload {info.name!r}, not {request.workload!r}")
    for i, metric in enumerate(request.metrics or ()):
        try:
            info.metric_named(metric)
        except KeyError as exc:
            raise Invalid(("metrics", i), str(exc.args[0])) from exc
    update: dict[str, Any] = {}
    if request.metrics is None:
        update["metrics"] = [info.metric_name]
    if request.search_space is None:
        update["search_space"] = dict(found.search_space)
        space = found.distributions()
        objectives = max(1, len(request.directions or ()))
        try:  # the sampler's caps that depend on the space, as the schema checks a request's own
            check_for_study(request.sampler.name, request.sampler.kwargs, space, objectives, default_limits())
        except SpecError as exc:
            raise Invalid(exc.loc, f"with the package's search space: {exc}") from exc
    return info, request.model_copy(update=update)


def _optuna_system_attrs(request: StudyCreate) -> dict[str, Any]:
    """The Optuna study's system attrs: its objectives' names, where ``Study.metric_names``
    reads them (so ``optuna.load_study`` shows them); nothing for a study of one metric."""
    return {_SYSTEM_ATTR_METRIC_NAMES: list(request.metrics)} if request.metrics else {}


def _training_of(request: StudyCreate) -> dict[str, Any] | None:
    """The study's training settings as its row keeps them (None: it sets none, the workload's)."""
    training = request.training_spec()
    return training.to_json() if training != TrainingSpec() else None


def list_studies(
    session: Session,
    url: str,
    tenant: str | None = None,
    name: str | None = None,
    *,
    states: Sequence[StudyState] | None = None,
    sort: str = "id",
    page: PageParams = PageParams(),
    as_tenant: str | None = None,
) -> Page[StudyOut]:
    """A page of studies, optionally of one tenant, by name or in ``states``; a tenant sees
    only its own. Counts and best trials come in SQL for the whole page (``reads.study_outs``)."""
    query = select(Study).where(Study.visible)
    if as_tenant is not None:
        query = query.where(Study.tenant == as_tenant)
    if tenant is not None:
        query = query.where(Study.tenant == tenant)
    if name is not None:
        query = query.where(Study.name == name)
    if states:
        query = query.where(Study.state.in_(list(states)))
    found = reads.id_page(session, query, Study.id, sort, page)
    return Page(_study_outs(session, url, found.items), found.next)


def get_study(session: Session, url: str, study_id: int, *, as_tenant: str | None = None) -> StudyOut:
    return _study_out(session, url, _study(session, study_id, as_tenant))


def _study(session: Session, study_id: int, as_tenant: str | None = None) -> Study:
    study = session.get(Study, study_id)
    if study is None or (as_tenant is not None and study.tenant != as_tenant) or not study.visible:
        raise NotFound(f"study {study_id} does not exist")
    return study


def _study_out(session: Session, url: str, study: Study) -> StudyOut:
    return _study_outs(session, url, [study])[0]


def _study_outs(session: Session, url: str, studies: Sequence[Study]) -> list[StudyOut]:
    """The studies as the API shows them: counts, best trial or Pareto front, Optuna's
    directions and attrs in a few queries for all of them (``reads.study_outs``), then each
    one's objectives and training settings."""
    return [_finish_out(out, study) for study, out in zip(studies, reads.study_outs(session, studies), strict=True)]


def _finish_out(out: StudyOut, study: Study) -> StudyOut:
    """A study's failure and warnings (its Optuna system attrs), objectives and training
    settings (its configuration) on its ``StudyOut``."""
    out.error = out.system_attrs.get(FAILURE_ATTR) if study.state == StudyState.FAILED else None
    out.package = study.package
    out.package_url = f"/api/v1/packages/{study.package}" if study.package else None
    warnings = out.system_attrs.get(WARNINGS_ATTR)
    out.warnings = [str(w) for w in warnings] if isinstance(warnings, list) else []
    _training_out(out, study, study.config.training)
    return out


def _training_out(out: StudyOut, study: Study, training: TrainingSpec) -> None:
    """The study's objectives and training settings on its ``StudyOut``."""
    stored = training.to_json()
    out.optimizer, out.lr_scheduler = stored["optimizer"], stored["lr_scheduler"]
    out.warmup_epochs, out.max_norm, out.amp = training.warmup_epochs, training.max_norm, training.amp
    out.loader = dict(training.loader)
    out.metrics = list(training.metrics)
    if not out.metrics and study.workload in available_workloads():  # never imports a module-path workload
        out.metrics = [get_workload(study.workload).metric_name]


def list_trials(
    session: Session,
    url: str,
    study_id: int,
    *,
    states: Sequence[TrialState] | None = None,
    sort: str | None = None,
    updated_since: int | None = None,
    page: PageParams = PageParams(),
    max_points: int | None = None,
    as_tenant: str | None = None,
) -> Page[TrialOut]:
    """A page of a study's trials with their per-epoch validation metric, from fusetune's and
    Optuna's tables (``reads.trials_page``).

    ``updated_since``: only the trials changed after that revision, in revision order (the
    default sort then, and the only one: Invalid naming ``sort`` otherwise). A poller passes
    the highest ``revision`` it has read.
    """
    study = _study(session, study_id, as_tenant)
    if sort is None:
        sort = "revision" if updated_since is not None else "number"
    if updated_since is not None and sort != "revision":
        raise Invalid(
            "sort", f"updated_since pages the changes in revision order: sort={sort!r} cannot go with it", where="query"
        )
    return reads.trials_page(
        session, study, states=states, sort=sort, updated_since=updated_since, page=page, max_points=max_points
    )


def get_trial(
    session: Session, url: str, trial_id: int, *, max_points: int | None = None, as_tenant: str | None = None
) -> TrialOut:
    """One trial, with what Optuna's tables hold of it (``max_points``: its learning curve downsampled)."""
    return reads.trial_outs(session, [_trial(session, trial_id, as_tenant)], max_points=max_points)[0]


def trial_state_dict(
    session: Session, trial_id: int, artifact_roots: Sequence[Path], *, as_tenant: str | None = None
) -> Path:
    """The file of the plain state_dict a COMPLETE trial was saved with: the trial's Optuna
    user attr ``state_dict``, which its worker wrote.

    Only a file under ``<artifact root>/<study name>/`` is served, since the service saves
    there: a user attr can also come from a client (``enqueue_trial``'s user_attrs), and must
    not make the service hand out any other file. NotFound when there is none.
    """
    trial = _trial(session, trial_id, as_tenant)
    missing = NotFound(f"trial {trial_id} has no saved state_dict")
    location = reads.trial_user_attr(session, trial.optuna_trial_id, "state_dict")
    if not isinstance(location, str) or not location:
        raise missing
    if location.startswith("file://"):
        location = location[len("file://"):]
    elif "://" in location:
        raise NotFound(f"trial {trial_id}'s state_dict is in a remote artifact store: {location}")
    path = Path(location).resolve()
    folders = [(Path(root).resolve() / trial.study.name) for root in artifact_roots]
    if not any(path.is_relative_to(folder) for folder in folders) or not path.is_file():
        raise missing
    return path


#: Writers of a study's user attrs in this process, one at a time (see set_study_user_attr).
_USER_ATTRS_WRITES = threading.Lock()


def set_study_user_attr(
    session: Session, url: str, study_id: int, key: str, value: Any, *, as_tenant: str | None = None
) -> StudyOut:
    """Optuna's ``study.set_user_attr``, on the service's study; 422 past MAX_USER_ATTRS_BYTES.

    The bound holds for concurrent writers too: they take turns from the read to the write, in
    this process by a lock, across PostgreSQL servers by the study's row (``FOR UPDATE``, held
    to the end of the request; Optuna writes its own tables through its own connection). On
    SQLite a row lock would be the database's one write lock, which Optuna's write then waits for.
    """
    study = _study(session, study_id, as_tenant)
    storage = get_optuna_storage(url)
    with _USER_ATTRS_WRITES:
        if session.get_bind().dialect.name == "postgresql":
            session.execute(select(Study.id).where(Study.id == study.id).with_for_update())
        attrs = {**storage.get_study_user_attrs(study.optuna_study_id), key: value}
        size = user_attrs_bytes(attrs)
        if size > MAX_USER_ATTRS_BYTES:
            raise Invalid("value", f"the study's user attrs would take {size} bytes as JSON, more than {MAX_USER_ATTRS_BYTES}")
        storage.set_study_user_attr(study.optuna_study_id, key, value)
    return _study_out(session, url, study)


def enqueue_trial(
    session: Session,
    url: str,
    loop: SchedulingLoop | None,
    study_id: int,
    request: TrialEnqueue,
    *,
    as_tenant: str | None = None,
) -> TrialOut:
    """Optuna's ``study.enqueue_trial``: the study's next trial, with these params, asked at once."""
    _study(session, study_id, as_tenant)
    if loop is None:
        raise Unavailable("the scheduling loop is not running; trials cannot be asked")
    trial = _call(session, loop, lambda: loop.asker.enqueue(study_id, request.params, request.user_attrs))
    return _trial_out(trial, get_optuna_storage(url).get_trial(trial.optuna_trial_id))


def decide_pruning(
    session: Session,
    url: str,
    loop: SchedulingLoop | None,
    trial_id: int,
    decision: PruningDecision,
    *,
    as_tenant: str | None = None,
) -> TrialOut:
    """A client-driven study's pruning decision on the trial's report at ``decision.step``."""
    trial = _trial(session, trial_id, as_tenant)
    if trial.study.driver != "client":
        raise Conflict("trial_id", f"trial {trial_id} belongs to a study whose own pruner decides", where="path")
    if loop is None:
        raise Unavailable("the scheduling loop is not running; no array awaits decisions")
    _call(session, loop, lambda: loop.recorder.decide(trial_id, decision.step, decision.prune))
    return get_trial(session, url, trial_id, as_tenant=as_tenant)


def _call(session: Session, loop: SchedulingLoop, fn: Callable[[], _T]) -> _T:
    """``loop.call(fn)``, with the request's database connection given back to the pool first:
    the loop's thread needs the pool too, and requests that each held a connection while they
    waited for it starved it (one tenant's 16 enqueues at once stalled every study for a
    minute). The request has only read so far (its checks); it reads afresh afterwards."""
    session.rollback()
    return loop.call(fn)


def _on_loop(loop: SchedulingLoop | None, what: str) -> SchedulingLoop:
    """The scheduling loop, which alone changes a running study's state (it owns the arrays)."""
    if loop is None:
        raise Unavailable(f"the scheduling loop is not running; a study cannot be {what} here")
    return loop


def _changed(session: Session, url: str, study_id: int, as_tenant: str | None) -> StudyOut:
    session.rollback()  # the loop's thread changed the study: read it afresh
    return get_study(session, url, study_id, as_tenant=as_tenant)


def pause_study(
    session: Session, url: str, loop: SchedulingLoop | None, study_id: int, *, as_tenant: str | None = None
) -> StudyOut:
    """Pause a RUNNING study: nothing new is asked or started; its running members leave their
    arrays at the next epoch boundary, checkpointed, and wait (Conflict naming ``state`` otherwise)."""
    _study(session, study_id, as_tenant)
    loop = _on_loop(loop, "paused")
    _call(session, loop, lambda: loop.lifecycle.pause(study_id))
    return _changed(session, url, study_id, as_tenant)


def resume_study(
    session: Session, url: str, loop: SchedulingLoop | None, study_id: int, *, as_tenant: str | None = None
) -> StudyOut:
    """Run a PAUSED study again, within its tenant's ``max_running_studies``."""
    _study(session, study_id, as_tenant)
    loop = _on_loop(loop, "resumed")
    _call(session, loop, lambda: loop.lifecycle.resume(study_id))
    return _changed(session, url, study_id, as_tenant)


def cancel_study(
    session: Session, url: str, loop: SchedulingLoop | None, study_id: int, *, as_tenant: str | None = None
) -> StudyOut:
    """Cancel a RUNNING or PAUSED study: it ends CANCELLED, its trials PRUNED or FAIL with the reason."""
    _study(session, study_id, as_tenant)
    loop = _on_loop(loop, "cancelled")
    _call(session, loop, lambda: loop.lifecycle.cancel(study_id))
    return _changed(session, url, study_id, as_tenant)


def update_study(
    session: Session,
    url: str,
    loop: SchedulingLoop | None,
    study_id: int,
    request: StudyUpdate,
    *,
    as_tenant: str | None = None,
) -> StudyOut:
    """Change a study's ``n_trials`` (see ``Lifecycle.extend``)."""
    _study(session, study_id, as_tenant)
    loop = _on_loop(loop, "changed")
    _call(session, loop, lambda: loop.lifecycle.extend(study_id, request.n_trials))
    return _changed(session, url, study_id, as_tenant)


def delete_study(
    session: Session, url: str, loop: SchedulingLoop | None, study_id: int, *, as_tenant: str | None = None
) -> StudyOut | None:
    """Delete a study: its rows, its Optuna study and its artifacts. None when it is gone
    already; else the study, DELETING until its running arrays stop at their next epoch boundary."""
    _study(session, study_id, as_tenant)
    loop = _on_loop(loop, "deleted")
    if _call(session, loop, lambda: loop.lifecycle.delete(study_id)):
        return None
    try:
        return _changed(session, url, study_id, as_tenant)
    except NotFound:  # its last array stopped in the meantime: gone already
        return None


def _trial(session: Session, trial_id: int, as_tenant: str | None = None) -> Trial:
    trial = session.get(Trial, trial_id)
    if trial is None or (as_tenant is not None and trial.study.tenant != as_tenant) or not trial.study.visible:
        raise NotFound(f"trial {trial_id} does not exist")
    return trial


def _trial_out(trial: Trial, frozen: optuna.trial.FrozenTrial | None) -> TrialOut:
    out = TrialOut.model_validate(trial)
    if frozen is not None:
        out.intermediate_values = dict(frozen.intermediate_values)
        out.values = frozen.values
        out.distributions = {
            name: json.loads(optuna.distributions.distribution_to_json(d)) for name, d in frozen.distributions.items()
        }
        out.user_attrs = frozen.user_attrs
        out.system_attrs = frozen.system_attrs
    return out


def list_arrays(
    session: Session,
    study_id: int | None = None,
    *,
    states: Sequence[ArrayState] | None = None,
    tenant: str | None = None,
    sort: str = "id",
    page: PageParams = PageParams(),
    as_tenant: str | None = None,
) -> Page[ArrayOut]:
    """A page of arrays, optionally of one study, one tenant or in ``states``; a tenant sees only its own."""
    query = select(Array).join(Study, Array.study_id == Study.id).where(Study.visible)
    if as_tenant is not None:
        query = query.where(Study.tenant == as_tenant)
    if tenant is not None:
        query = query.where(Study.tenant == tenant)
    if study_id is not None:
        _study(session, study_id, as_tenant)
        query = query.where(Array.study_id == study_id)
    if states:
        query = query.where(Array.state.in_(list(states)))
    return reads.arrays_page(session, query, sort, page)
