"""Asking: each running study's sampler asked for the trials its devices can take next.

A round asks every running study (the scheduling loop's step) for enough waiting trials to
fill every worker's array, never more trials asked and not finished than the study's
``max_concurrent_trials`` (Ray Tune's name): FusionSampler's groups then shrink to fit, so
the sampler asks later trials after earlier ones ended and learns from them. The sampler runs
on the study's mirror, and the trials it asks are inserted in one transaction, each with its
fusion key (``workers/signature.py``); a model that cannot be built with a trial's params, or
a recipe that cannot be used, fails that trial there, with its error. A study whose sampler
or workload raises fails alone (:meth:`Asker.ask_alone`).

A study of a tenant's code package is asked from its manifest's static distributions, and
its trials' fusion keys come from the package's describer (``server/loop/packages.py``), in
its own time (``describing.py``): its code never runs here, and the loop never waits for it.
It is not asked until its describer has loaded the package, nor again while its last trials
are being described; a package that fails to load fails its study, with the traceback.

What a trial's description decides (its fusion key, a model that cannot be built, one that
no worker's memory fits, params nothing reads) is ``describing.py``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from sqlalchemy.orm import Session

from fusetune.server import events
from fusetune.server.db import Study, StudyState, Trial, TrialState, utcnow
from fusetune.server.db.bulk import insert_returning
from fusetune.server.db.models import table_of
from fusetune.server.db.revisions import inserting_trials
from fusetune.server.errors import Conflict
from fusetune.server.loop import rows
from fusetune.server.loop.context import LoopContext
from fusetune.server.loop.describing import Descriptions, Undescribed
from fusetune.server.loop.lifecycle import Lifecycle
from fusetune.server.loop.mirrors import group_size
from fusetune.server.loop.thread import database_unavailable
from fusetune.server.mirror import AskedTrial
from fusetune.server.schemas import parse_search_space
from fusetune.workers.describer import Described
from fusetune.workers.package import PackageError
from fusetune.workers.signature import trial_model, unused_params
from fusetune.workers.workloads import Workload, get_workload

__all__ = ["Asker"]

log = logging.getLogger(__name__)


def _not_run(trial: Any) -> Mapping[str, Any]:
    raise RuntimeError("a package study is asked from its static distributions: its space never runs here")


class Asker:
    """Asks the studies' samplers for trials (see the module docstring)."""

    def __init__(self, ctx: LoopContext, lifecycle: Lifecycle, describing: Descriptions) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.mirrors = ctx.mirrors
        self.lifecycle = lifecycle
        self.describing = describing
        # Asked trials of package studies, to send to their describers once their rows have committed.
        self._unsent: list[tuple[Study, list[Undescribed]]] = []
        # A registered workload's unused params, per study and set of param names: the model
        # is built again to find them, once per shape of trial rather than per trial.
        self._unused: dict[tuple[int, frozenset[str]], list[str]] = {}

    def capacity(self) -> int:
        """How many trials the devices can train at once: the most waiting trials worth asking for."""
        return max(1, len(self.ctx.pool.workers)) * self.settings.max_array_size

    def ask(self, session: Session, study: Study, groups: int = 0) -> bool:
        """Ask the study's sampler for enough trials to fill every device, in one transaction;
        with ``groups``, for at most that many arrays' worth (FusionSampler's groups). Returns
        whether the study wanted more than it asked."""
        if study.driver == "client":
            return False  # its client asks the trials and enqueues them
        # One read for the three counts (a round asks every running study, every round).
        asked, waiting, unfinished = rows.ask_counts(session, study.id)
        wanted = min(study.n_trials - asked, (self.settings.ask_batch or self.capacity()) - waiting)
        if study.max_concurrent_trials is not None:
            wanted = min(wanted, study.max_concurrent_trials - unfinished)
        if wanted <= 0 or self.describing.describing(study.id):
            return False
        if not self.lifecycle.workload_loads(session, study) or not self._code_ready(session, study):
            return False
        asking = min(wanted, groups * group_size(study, self.settings, len(self.ctx.pool.workers))) if groups else wanted
        try:
            self._ask_into(session, study, asking)
            session.commit()
        except Exception:
            session.rollback()
            self._unsent.clear()
            self.mirrors.drop(study.id)  # what it asked was not written: reload from the database
            raise
        self._send()
        return wanted > asking

    def _code_ready(self, session: Session, study: Study) -> bool:
        """Whether the study's code package has loaded in its describer (a registered
        workload's is always ready); one that failed to load fails the study, with its error."""
        try:
            return self.ctx.packages.ready(study)
        except PackageError as exc:
            self.lifecycle.fail(session, study, str(exc))
            return False

    def prepare(self, session: Session, studies: Sequence[Study]) -> None:
        """Build the mirror of each running package study whose package has loaded, failing
        one whose package cannot load: its trials are placed only then (``Dispatcher._mirrored``),
        and after a restart its package loads again here, whether or not it asks for more."""
        for study in studies:
            if study.package is None or self.mirrors.loaded(study.id) is not None or not self._code_ready(session, study):
                continue
            try:
                self.mirrors.of(study)  # from answers already in: FusionSampler's non-fusible params
            except PackageError as exc:
                self.lifecycle.fail(session, study, str(exc))

    def ask_alone(self, session: Session, study: Study, groups: int = 0) -> bool:
        """:meth:`_ask`, so that a study whose sampler (or workload) raises fails alone, with its
        error, while the others go on; the database being unreachable stops the round as ever."""
        try:
            return self.ask(session, study, groups)
        except Exception as exc:
            if database_unavailable(exc):
                raise
            reason = f"asking for trials failed: {type(exc).__name__}: {exc}"
            log.warning("study %d: %s", study.id, reason, exc_info=True)
            self.lifecycle.fail(session, study, reason)
            return False

    def enqueue(self, study_id: int, params: Mapping[str, Any], user_attrs: Mapping[str, Any]) -> Trial:
        """Optuna's ``enqueue_trial``, asked at once: the study's next trial has these params.

        The trial counts in the study's ``n_trials``. Runs on the loop thread (``SchedulingLoop.call``).

        Raises:
            service.Conflict: naming the study's ``n_trials`` when it has asked all its trials.
        """
        with self.ctx.sessions() as session:
            study = rows.study(session, study_id)
            self.lifecycle.check_askable(session, study)
            asked = rows.asked(session, study.id)
            if asked >= study.n_trials:
                # The study's field, not the request's (an enqueue's body has no n_trials).
                raise Conflict("n_trials", f"study {study.id} has asked all its n_trials={study.n_trials} trials", where="study")
            mirror = self.mirrors.of(study)
            try:
                mirror.study.enqueue_trial(dict(params), user_attrs=dict(user_attrs), skip_if_exists=False)
                # A client-driven study's trial is the client's trial, whose space ran there
                # (conditional or not): it trains with exactly its params, none sampled here.
                (trial_id,) = self._ask_into(session, study, 1, exactly=set(params) if study.driver == "client" else None)
                if study.state == StudyState.COMPLETE:  # more trials for a study that had ended
                    study.state, study.completed_at = StudyState.RUNNING, None
                session.commit()
            except Exception:
                session.rollback()
                self._unsent.clear()
                self.mirrors.drop(study.id)
                raise
            self._send()
            row = session.get_one(Trial, trial_id)
            session.expunge(row)
        self.ctx.wake()
        return row

    def _ask_into(self, session: Session, study: Study, wanted: int, exactly: Collection[str] | None = None) -> list[int]:
        """Ask ``wanted`` trials (enqueued ones first, as Optuna does) into the caller's
        transaction; returns their fusetune ids, in order. With ``exactly``, the study's
        distributions of those params alone are asked (an enqueued trial's: the rest of a
        conditional space stays unsampled)."""
        workload = None if study.package is not None else get_workload(study.workload)
        mirror = self.mirrors.of(study)
        distributions = parse_search_space(study.search_space) if study.search_space else None
        if exactly is not None and distributions is not None:
            distributions = {name: d for name, d in distributions.items() if name in exactly}
        asked = mirror.ask(session, wanted, workload.search_space if workload is not None else _not_run, distributions)
        # A registered workload's trials are described here and now; a package's by its
        # describer, once they are written (describing.py): until then they wait unsigned.
        described = iter(self._describe(workload, study, [t for t in asked if t.error is None])) if workload is not None else None
        new: list[dict[str, Any]] = []  # the trials' rows
        unused: set[str] = set()
        for trial in asked:
            row = {"study_id": study.id, "optuna_trial_id": trial.trial_id, "number": trial.number, "params": trial.params,
                   "signature": "", "state": TrialState.WAITING, "error": trial.error, "completed_at": None}
            if trial.error is None and described is not None:
                row["signature"], row["error"] = self.describing.judge(session, mirror, trial.trial_id, next(described), unused)
            if row["error"] is not None:
                row["state"], row["completed_at"] = TrialState.FAIL, utcnow()
            new.append(row)
        self.describing.warn_unused(session, study.id, unused)
        if not new:
            return []
        # One statement for the batch (the unit of work's flush of 64 trials cost more than
        # their signatures), stamped like any trial write.
        inserting_trials(session)
        ids = insert_returning(session, table_of(Trial), new)
        for trial_id, row in zip(ids, new, strict=True):
            where: dict[str, Any] = {"tenant": study.tenant, "study_id": study.id, "trial_id": trial_id}
            events.record(session, "trial.asked", **where, number=row["number"], params=row["params"], state=TrialState(row["state"]).value)
            if row["state"] == TrialState.FAIL:
                events.record(session, "trial.ended", **where, state="FAIL", value=None, error=row["error"])
        if described is None:
            self._unsent.append((study, [Undescribed(i, row["optuna_trial_id"], row["params"])
                                         for i, row in zip(ids, new, strict=True) if row["state"] == TrialState.WAITING]))
        return ids

    def _send(self) -> None:
        """Send the package trials just committed to their describers."""
        unsent, self._unsent = self._unsent, []
        for study, trials in unsent:
            self.describing.send(study, trials)

    def _describe(self, workload: Workload, study: Study, trials: list[AskedTrial]) -> list[Described]:
        """Each trial's fusion key, the error its model's factory raised, its unused params and
        its memory floor, built here on the meta device (a registered workload: the service's code)."""
        training = study.config.training
        out: list[Described] = []
        for trial in trials:
            try:
                model = trial_model(workload, trial.params, training)
            except Exception as exc:  # the workload's model rejected these params
                out.append(("", f"{type(exc).__name__}: {exc}", [], 0))
                continue
            key = (study.id, frozenset(trial.params))
            if key not in self._unused:
                if len(self._unused) > 4096:  # studies come and go: a bound, not an eviction policy
                    self._unused.clear()
                self._unused[key] = unused_params(workload, trial.params, training)
            out.append((model.signature, None, self._unused[key], model.least_bytes))
        return out
