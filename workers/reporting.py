"""Writing a running array's results to the database, member by member, as they happen.

Each member's validation metric is reported to its Optuna trial after every epoch (so Optuna
pruners and ``optuna.load_study`` see it), and the final value ends the trial through
``Study.tell``; fusetune's own trial and array rows follow along.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import optuna
from optuna.trial import TrialState as OptunaState
from sqlalchemy import update

from server.db import Array, Trial, TrialState, get_optuna_storage, get_sessionmaker, utcnow
from server.optuna_specs import make_pruner
from workers.spec import ArraySpec, MemberSpec


class Reporter:
    """Reports one array's progress to Optuna's storage and fusetune's tables."""

    def __init__(self, spec: ArraySpec) -> None:
        self.spec = spec
        pruner = (
            make_pruner(spec.pruner["name"], spec.pruner.get("kwargs"))
            if spec.pruner
            else optuna.pruners.NopPruner()
        )
        self.study = optuna.load_study(
            study_name=spec.study_name, storage=get_optuna_storage(spec.database_url), pruner=pruner
        )
        self.sessions = get_sessionmaker(spec.database_url)
        self._trials: dict[int, optuna.Trial] = {}

    def started(self, members: Sequence[MemberSpec]) -> None:
        """Mark ``members`` RUNNING (the array's first members, or newcomers joining it)."""
        for m in members:
            self._trials.setdefault(m.trial_id, optuna.Trial(self.study, m.optuna_trial_id))
        with self.sessions.begin() as session:
            session.execute(
                update(Trial)
                .where(Trial.id.in_([m.trial_id for m in members]))
                .values(state=TrialState.RUNNING, started_at=utcnow())
            )

    def epoch(self, members: Sequence[MemberSpec], steps: Sequence[int], values: Sequence[float]) -> list[bool]:
        """Report each member's metric at its own epoch ``step``; returns, per member, whether to prune it."""
        prune = []
        for member, step, value in zip(members, steps, values, strict=True):
            trial = self._trials[member.trial_id]
            trial.report(value, step=step)
            prune.append(trial.should_prune())
        with self.sessions.begin() as session:
            session.execute(
                update(Array).where(Array.id == self.spec.array_id).values(epochs_done=Array.epochs_done + 1)
            )
        return prune

    def saved(self, member: MemberSpec, path: str) -> None:
        """Record where the member's trained weights are, as the Optuna user attr ``state_dict``."""
        self._trials[member.trial_id].set_user_attr("state_dict", path)

    def resumed(self, member: MemberSpec, epochs_done: int) -> None:
        """Record that the member resumed from its checkpoint after ``epochs_done`` epochs
        (Optuna user attr ``resumed_at_epochs``: one entry per move or crash)."""
        trial = self._trials[member.trial_id]
        before = self.study._storage.get_trial(trial._trial_id).user_attrs.get("resumed_at_epochs", [])
        trial.set_user_attr("resumed_at_epochs", [*before, epochs_done])

    def released(self, member: MemberSpec) -> None:
        """The member left its array checkpointed (preempted): it waits for its next array.

        Its Optuna trial stays RUNNING; the array that takes it next resumes it.
        """
        with self.sessions.begin() as session:
            session.execute(
                update(Trial)
                .where(Trial.id == member.trial_id)
                .values(state=TrialState.WAITING, array_id=None, started_at=None)
            )

    def complete(self, member: MemberSpec, value: float) -> None:
        self.study.tell(self._trials[member.trial_id], value)
        self._finish(member, TrialState.COMPLETE, value=value)

    def pruned(self, member: MemberSpec, last_value: float | None) -> None:
        self.study.tell(self._trials[member.trial_id], state=OptunaState.PRUNED)
        self._finish(member, TrialState.PRUNED, value=last_value)

    def fail(self, member: MemberSpec, error: str) -> None:
        trial = self._trials[member.trial_id]
        if self.study._storage.get_trial(trial._trial_id).state == OptunaState.RUNNING:
            self.study.tell(trial, state=OptunaState.FAIL)
        self._finish(member, TrialState.FAIL, error=error)

    def _finish(
        self, member: MemberSpec, state: TrialState, value: float | None = None, error: str | None = None
    ) -> None:
        if value is not None and not math.isfinite(value):
            value = None
        with self.sessions.begin() as session:
            session.execute(
                update(Trial)
                .where(Trial.id == member.trial_id)
                .values(state=state, value=value, error=error, completed_at=utcnow())
            )
