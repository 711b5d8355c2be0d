"""An Optuna study as the control plane holds it: in memory for its sampler and pruner,
written through to Optuna's tables in the caller's database transaction.

Why not Optuna's RDB storage directly: for every parameter it suggests, a sampler reads the
study's trials, and the RDB storage reads every *running* trial back from the database each
time. Asking TPE for 64 trials that way took 2.6 s on SQLite and 3.7 s on PostgreSQL on the
2-core machine of ``docs/benchmarks.md``, longer than fusion then needs to train them; in
memory it takes 20 ms. The control plane is the only writer of its studies' trials (workers
report to it, never to the database), so it can keep each running study in an
``InMemoryStorage`` that its sampler asks from and its pruner decides on, and write every
change to Optuna's tables itself, in the same transaction as fusetune's own rows: one
transaction per array-epoch, whatever the array's size.

The database stays the truth. A mirror is loaded from it (``StudyMirror(storage, id, ...)``)
when the service first drives a study, also after a restart, and ``optuna.load_study`` or
optuna-dashboard read the same trials, params, intermediate values, attributes and values.

Optuna's table models are private API (``server/db/optuna_tables.py``, their one importer);
they have kept their shape since Optuna 3.0, and ``tests/server/test_mirror.py`` reads every
write back through Optuna's own RDB storage. This module is their one writer: a new study's
rows (:func:`create_study_rows`), its trials (:class:`StudyMirror`), a failed study's reason
(:func:`set_study_system_attr`) and a deleted study's removal. So is ``optuna.study._tell._tell_with_warning``, ``Study.tell``
without the deep copy of the trial it returns (the mirror drops it; an array's last epoch
tells all its members, and the copies cost 5 ms of it).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, distribution_to_json
from optuna.study._tell import _tell_with_warning
from optuna.trial import FrozenTrial
from optuna.trial import TrialState as OptunaState
from sqlalchemy import delete, insert, select, update
from sqlalchemy.orm import Session

from fusetune.server.db import optuna_tables as rdb
from fusetune.server.db.bulk import add_rows, add_updates, insert_returning, insert_rows, rowcount, write_pending
from fusetune.server.db.models import table_of
from fusetune.server.db.text import dumps

__all__ = ["AskedTrial", "CreatedStudy", "StudyMirror", "create_study_rows", "set_study_system_attr"]


@dataclass(frozen=True)
class CreatedStudy:
    """An Optuna study's rows as ``POST /studies`` wrote them, before it has any trial.

    What :class:`StudyMirror` would read back of a study this process has just created:
    handed to the mirror (``created``), a new study's first ask reads nothing (five reads
    on a sweep's critical path, 4-9 ms on the 2-core machine's PostgreSQL).
    """

    study_id: int  # Optuna's id of the study
    name: str
    directions: tuple[optuna.study.StudyDirection, ...]
    system_attrs: Mapping[str, Any]


@dataclass(frozen=True)
class AskedTrial:
    """A trial the sampler suggested, now in the database."""

    trial_id: int  # Optuna's trial id in the database
    number: int
    params: dict[str, Any]  # what the workload's search space returned
    error: str | None = None  # the search space raised: the trial is FAIL already


def _as_stored(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """Attrs as reading them back gives them: through JSON (a tuple comes back a list)."""
    return {key: json.loads(json.dumps(value)) for key, value in attrs.items()}


def _read_study(
    storage: optuna.storages.RDBStorage, study_id: int
) -> tuple[str, list[optuna.study.StudyDirection], dict[str, Any], dict[str, Any], bool]:
    """An Optuna study's name, directions, system and user attrs, and whether it has trials."""
    # In one transaction on the storage's engine, not one per getter: a new study's first
    # array waited for four of them (11 ms on PostgreSQL).
    with Session(storage.engine) as session:
        name = session.scalar(select(rdb.StudyModel.study_name).where(rdb.StudyModel.study_id == study_id))
        if name is None:
            raise KeyError(f"no Optuna study with id {study_id}")
        directions = list(session.scalars(
            select(rdb.StudyDirectionModel.direction).where(rdb.StudyDirectionModel.study_id == study_id)
            .order_by(rdb.StudyDirectionModel.objective)
        ))
        system_attrs, user_attrs = (
            {k: json.loads(v) for k, v in session.execute(select(model.key, model.value_json).where(model.study_id == study_id))}
            for model in (rdb.StudySystemAttributeModel, rdb.StudyUserAttributeModel)
        )
        has_trials = session.scalar(select(rdb.TrialModel.trial_id).where(rdb.TrialModel.study_id == study_id).limit(1)) is not None
    return name, directions, system_attrs, user_attrs, has_trials


class StudyMirror:
    """The control plane's view of one Optuna study (see the module docstring).

    Every method that changes the study takes the SQLAlchemy session of the caller's
    transaction and adds its writes to it; the caller commits.

    Args:
        storage: Optuna's RDB storage on the service's database, read once here.
        study_id: the study's id in that storage.
        sampler, pruner: the study's own.
        created: the study's rows, when this process has just created it: nothing to read.
    """

    def __init__(
        self,
        storage: optuna.storages.RDBStorage,
        study_id: int,
        sampler: optuna.samplers.BaseSampler,
        pruner: optuna.pruners.BasePruner,
        created: CreatedStudy | None = None,
    ) -> None:
        self._db_study_id = study_id
        self._memory = optuna.storages.InMemoryStorage()
        if created is not None and created.study_id == study_id:
            user_attrs: dict[str, Any] = {}
            name, directions, system_attrs, has_trials = created.name, list(created.directions), _as_stored(created.system_attrs), False
        else:
            name, directions, system_attrs, user_attrs, has_trials = _read_study(storage, study_id)
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # "a new study created in memory" is no news
        try:
            memory_study_id = self._memory.create_new_study(directions, name)
        finally:
            optuna.logging.set_verbosity(verbosity)
        for key, value in system_attrs.items():
            self._memory.set_study_system_attr(memory_study_id, key, value)
        for key, value in user_attrs.items():
            self._memory.set_study_user_attr(memory_study_id, key, value)
        self.study = optuna.Study(study_name=name, storage=self._memory, sampler=sampler, pruner=pruner)
        self._to_memory: dict[int, int] = {}  # database trial id -> mirror trial id
        # get_all_trials lists trials by number, so the mirror numbers them the same way.
        for frozen in storage.get_all_trials(study_id, deepcopy=False) if has_trials else ():
            self._to_memory[frozen._trial_id] = self._memory.create_new_trial(memory_study_id, template_trial=frozen)

    @property
    def system_attrs(self) -> dict[str, Any]:
        """The study's system attrs, as loaded (fusetune's training spec is one)."""
        return self._memory.get_study_system_attrs(self.study._study_id)

    @property
    def multi_objective(self) -> bool:
        return len(self.study.directions) > 1

    def trial(self, trial_id: int) -> FrozenTrial:
        """The trial (by database id) as the mirror holds it."""
        return self._memory.get_trial(self._to_memory[trial_id])

    def reload_trials(self, storage: optuna.storages.RDBStorage, trial_ids: Iterable[int]) -> None:
        """Bring these trials (database ids) back to what the database holds.

        A transaction that changed them in memory rolled back: only they are read again, not
        the study (whose mirror is about 1 GB at 100,000 trials x 100 epochs), so one failed
        report costs one study's few trials, not every study of its batch whole.
        """
        study_id = self.study._study_id
        reverted = False
        for trial_id in trial_ids:
            memory_id = self._to_memory.get(trial_id)
            if memory_id is None:
                continue
            stored = copy.copy(storage.get_trial(trial_id))
            stored._trial_id = memory_id
            with self._memory._lock:
                reverted |= self._memory._get_trial(memory_id).state != stored.state
                self._memory._set_trial(memory_id, stored)
        if reverted and not self.multi_objective:
            # The best trial is cached as trials complete: one that completed only in memory
            # may be it. (InMemoryStorage has no call that recomputes it.)
            with self._memory._lock:
                self._memory._studies[study_id].best_trial_id = None
                for trial in self._memory._studies[study_id].trials:
                    if trial.state == OptunaState.COMPLETE:
                        self._memory._update_cache(trial._trial_id, study_id)

    # -- asking --------------------------------------------------------------------------------
    def ask(
        self,
        session: Session,
        n: int,
        search_space: Callable[[optuna.Trial], Mapping[str, Any]],
        fixed_distributions: Mapping[str, BaseDistribution] | None = None,
    ) -> list[AskedTrial]:
        """Ask the sampler for ``n`` trials and add them to the database.

        Each trial's params come from ``search_space`` (a workload's define-by-run space),
        or from ``fixed_distributions`` alone when given. One that the search space rejects
        (it raised) is FAIL at once, with the error. Running trials the sampler asked
        before count as running while it samples (TPE's constant liar sees them), so a
        batch of asks spreads out instead of repeating itself.
        """
        asked: list[tuple[FrozenTrial, dict[str, Any], str | None]] = []
        for _ in range(n):
            trial = self.study.ask(fixed_distributions=dict(fixed_distributions) if fixed_distributions is not None else None)
            error = None
            try:
                params = dict(trial.params) if fixed_distributions is not None else dict(search_space(trial))
            except Exception as exc:  # the workload's own code rejected the sampled values
                params, error = dict(trial.params), f"{type(exc).__name__}: {exc}"
                self._memory.set_trial_state_values(trial._trial_id, OptunaState.FAIL)
            asked.append((self._memory.get_trial(trial._trial_id), params, error))
        ids = self._insert(session, [frozen for frozen, _, _ in asked])
        out = []
        for trial_id, (frozen, params, error) in zip(ids, asked, strict=True):
            self._to_memory[trial_id] = frozen._trial_id
            out.append(AskedTrial(trial_id, frozen.number, params, error))
        return out

    def _insert(self, session: Session, frozens: Sequence[FrozenTrial]) -> list[int]:
        """Add the trials to Optuna's tables; their database ids, in order.

        Core statements, one per table: the ORM's unit of work took 60% of asking 64 TPE
        trials (building and flushing 64 trials' graphs of params and attributes).
        """
        if not frozens:
            return []
        ids = insert_returning(session, table_of(rdb.TrialModel), [
            {
                "number": f.number,
                "study_id": self._db_study_id,
                "state": f.state,
                "datetime_start": f.datetime_start,
                "datetime_complete": f.datetime_complete,
            }
            for f in frozens
        ])
        params, system, user = [], [], []
        for trial_id, f in zip(ids, frozens, strict=True):
            for name, value in f.params.items():
                distribution = f.distributions[name]
                params.append({
                    "trial_id": trial_id,
                    "param_name": name,
                    "param_value": distribution.to_internal_repr(value),
                    "distribution_json": distribution_to_json(distribution),
                })
            system += [{"trial_id": trial_id, "key": k, "value_json": dumps(v)} for k, v in f.system_attrs.items()]
            user += [{"trial_id": trial_id, "key": k, "value_json": dumps(v)} for k, v in f.user_attrs.items()]
        for model, rows in (
            (rdb.TrialParamModel, params), (rdb.TrialSystemAttributeModel, system), (rdb.TrialUserAttributeModel, user)
        ):
            insert_rows(session, table_of(model), rows)
        return ids

    # -- reporting -----------------------------------------------------------------------------
    def report(self, session: Session, values: Iterable[tuple[int, int, float]]) -> None:
        """Record intermediate values ``(trial id, step, value)``, as ``Trial.report`` does.

        A step reported again (a trial that resumed from an earlier checkpoint trains it
        again) replaces the stored value, so each (trial, step) is stored once and the
        stored curve is the curve of the weights the trial goes on with. The mirror knows
        which steps are stored, so new ones need no read: they are held back and go in one bulk
        insert with the transaction's others (:func:`~fusetune.server.db.bulk.add_rows`).
        """
        model = rdb.TrialIntermediateValueModel
        table = table_of(model)  # Core statements: nothing to load or synchronise back
        new = []
        for trial_id, step, value in values:
            memory_id = self._to_memory[trial_id]
            again = step in self._memory.get_trial(memory_id).intermediate_values
            self._memory.set_trial_intermediate_value(memory_id, step, value)
            stored, kind = model.intermediate_value_to_stored_repr(value)
            if again:
                write_pending(session, table)  # the step's row may still be held back
                session.execute(
                    update(table)
                    .where(table.c.trial_id == trial_id, table.c.step == step)
                    .values(intermediate_value=stored, intermediate_value_type=kind)
                )
            else:
                new.append({"trial_id": trial_id, "step": step, "intermediate_value": stored, "intermediate_value_type": kind})
        add_rows(session, table, new)  # with the other array-epochs of the transaction, at its commit

    def truncate(self, session: Session, trial_id: int, from_step: int) -> int:
        """Drop the trial's intermediate values at ``from_step`` and later; returns how many.

        A trial that resumes from a checkpoint at epoch ``from_step`` (0: from scratch) goes
        on with the checkpoint's weights: what was reported after it came from weights that
        are gone, and it reports those steps again as it retrains them.
        """
        memory_id = self._to_memory[trial_id]
        stale = [s for s in self._memory.get_trial(memory_id).intermediate_values if s >= from_step]
        if not stale:
            return 0
        table = table_of(rdb.TrialIntermediateValueModel)
        write_pending(session, table)
        session.execute(delete(table).where(table.c.trial_id == trial_id, table.c.step >= from_step))
        # InMemoryStorage has no call that removes a value: replace the trial's copy as its
        # own setters do (under its lock, copy-on-write).
        with self._memory._lock:
            trial = copy.copy(self._memory._get_trial(memory_id))
            trial.intermediate_values = {s: v for s, v in trial.intermediate_values.items() if s < from_step}
            self._memory._set_trial(memory_id, trial)
        return len(stale)

    def should_prune(self, session: Session, trial_id: int) -> bool:
        """The study's pruner on the trial's reported values, as ``Trial.should_prune``.

        Pruners that keep state in the trial's system attrs (successive halving, Hyperband)
        write it to the mirror; those writes join the caller's transaction.
        """
        if self.multi_objective or isinstance(self.study.pruner, optuna.pruners.NopPruner):
            return False  # Optuna's pruners are single-objective
        memory_id = self._to_memory[trial_id]
        before = self._memory.get_trial(memory_id).system_attrs
        decision = bool(self.study.pruner.prune(self.study, self._memory.get_trial(memory_id)))
        after = self._memory.get_trial(memory_id).system_attrs
        changed = {k: v for k, v in after.items() if k not in before or before[k] != v}
        self._write_attrs(session, rdb.TrialSystemAttributeModel, trial_id, changed, set(before))
        return decision

    def set_user_attrs(self, session: Session, trial_id: int, attrs: Mapping[str, Any]) -> None:
        memory_id = self._to_memory[trial_id]
        existing = set(self._memory.get_trial(memory_id).user_attrs)
        for key, value in attrs.items():
            self._memory.set_trial_user_attr(memory_id, key, value)
        self._write_attrs(session, rdb.TrialUserAttributeModel, trial_id, attrs, existing)

    @staticmethod
    def _write_attrs(session: Session, model: Any, trial_id: int, attrs: Mapping[str, Any], existing: set[str]) -> None:
        table = table_of(model)
        new = [{"trial_id": trial_id, "key": k, "value_json": dumps(v)} for k, v in attrs.items() if k not in existing]
        add_rows(session, table, new)  # with the transaction's others, at its commit
        if existing & set(attrs):
            write_pending(session, table)  # the key's row may still be held back
        for key in existing & set(attrs):
            session.execute(
                update(table).where(table.c.trial_id == trial_id, table.c.key == key).values(value_json=dumps(attrs[key]))
            )

    # -- ending --------------------------------------------------------------------------------
    def tell(
        self,
        session: Session,
        trial_id: int,
        state: OptunaState,
        values: Sequence[float] | float | None = None,
    ) -> None:
        """End a running trial, as ``Study.tell``: the sampler's ``after_trial`` runs too.

        A value that is not finite ends the trial FAIL, as Optuna does. A trial that has
        already ended is left as it is.
        """
        memory_id = self._to_memory[trial_id]
        if self._memory.get_trial(memory_id).state.is_finished():
            return
        if isinstance(values, (int, float)):
            values = [float(values)]
        if state == OptunaState.COMPLETE and (values is None or not all(math.isfinite(v) for v in values)):
            state, values = OptunaState.FAIL, None
        try:
            _tell_with_warning(
                self.study, self._memory.get_trial(memory_id).number, values if state == OptunaState.COMPLETE else None, state=state
            )
        except RuntimeError:
            # A sampler may stop the study from after_trial (GridSampler, BruteForceSampler
            # call Study.stop, which raises outside Study.optimize); the trial has ended.
            pass
        frozen = self._memory.get_trial(memory_id)
        # Held back to the commit: an array's last epoch ends all its members, in one
        # statement per table instead of two or three per member.
        add_updates(session, table_of(rdb.TrialModel), "trial_id", [
            {"trial_id": trial_id, "state": frozen.state, "datetime_complete": frozen.datetime_complete or datetime.now()}
        ])
        if frozen.values is not None:
            rows = []
            for objective, value in enumerate(frozen.values):
                stored, kind = rdb.TrialValueModel.value_to_stored_repr(value)
                rows.append({"trial_id": trial_id, "objective": objective, "value": stored, "value_type": kind})
            add_rows(session, table_of(rdb.TrialValueModel), rows)


# -- removing a deleted study's rows (server/purge.py) ------------------------------------------
#: Optuna's tables of a trial's parts, each with a ``trial_id``: removed before the trials.
_TRIAL_PARTS = (
    rdb.TrialIntermediateValueModel, rdb.TrialParamModel, rdb.TrialValueModel, rdb.TrialUserAttributeModel,
    rdb.TrialSystemAttributeModel, rdb.TrialHeartbeatModel,
)
#: Optuna's tables of a study's parts, each with a ``study_id``: removed before the study.
_STUDY_PARTS = (rdb.StudyDirectionModel, rdb.StudyUserAttributeModel, rdb.StudySystemAttributeModel)


def hide_study(session: Session, study_id: int, hidden_name: str) -> None:
    """Rename an Optuna study that is being deleted, in the caller's transaction:
    ``optuna.load_study`` no longer finds it by its name while its rows go in batches."""
    session.execute(update(rdb.StudyModel).where(rdb.StudyModel.study_id == study_id).values(study_name=hidden_name))


def some_trial_ids(session: Session, study_id: int, limit: int) -> list[int]:
    """Up to ``limit`` of the Optuna study's trial ids: the next batch to remove."""
    model = rdb.TrialModel
    return list(session.scalars(select(model.trial_id).where(model.study_id == study_id).order_by(model.trial_id).limit(limit)))


def delete_trials(session: Session, trial_ids: Sequence[int]) -> int:
    """Remove these Optuna trials with all their parts, table by table, in the caller's
    transaction (Optuna's ORM cascade would load every row first); returns the rows removed."""
    removed = 0
    for model in (*_TRIAL_PARTS, rdb.TrialModel):
        removed += rowcount(session.execute(delete(model).where(model.trial_id.in_(trial_ids))))
    return removed


def delete_study(session: Session, study_id: int) -> None:
    """Remove an Optuna study whose trials are gone, with its directions and attrs."""
    for model in (*_STUDY_PARTS, rdb.StudyModel):
        session.execute(delete(model).where(model.study_id == study_id))


# -- a study's own rows ---------------------------------------------------------------------------
def create_study_rows(
    session: Session, name: str, directions: Sequence[optuna.study.StudyDirection], system_attrs: Mapping[str, Any]
) -> CreatedStudy:
    """An Optuna study's rows (name, directions, system attrs), in the caller's transaction:
    what ``optuna.create_study`` writes, in fusetune's transaction instead of three of its own.

    Raises:
        sqlalchemy.exc.IntegrityError: an Optuna study of this name exists.
    """
    studies = table_of(rdb.StudyModel)
    study_id = session.execute(insert(studies).returning(studies.c.study_id), {"study_name": name}).scalar_one()
    session.execute(insert(table_of(rdb.StudyDirectionModel)), [
        {"study_id": study_id, "objective": k, "direction": d} for k, d in enumerate(directions)
    ])
    if system_attrs:
        session.execute(insert(table_of(rdb.StudySystemAttributeModel)), [
            {"study_id": study_id, "key": k, "value_json": dumps(v)} for k, v in system_attrs.items()
        ])
    return CreatedStudy(study_id, name, tuple(directions), dict(system_attrs))


def set_study_system_attr(session: Session, study_id: int, key: str, value: Any) -> None:
    """Optuna's ``set_study_system_attr``, in the caller's transaction."""
    table = table_of(rdb.StudySystemAttributeModel)
    where = (table.c.study_id == study_id, table.c.key == key)
    session.execute(delete(table).where(*where))
    session.execute(insert(table).values(study_id=study_id, key=key, value_json=dumps(value)))
