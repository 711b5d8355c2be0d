"""A study's life after it is created: pause and resume, cancel, delete, more trials, failure.

All of it runs on the scheduling loop's thread (request threads hand it over with
``SchedulingLoop.call``; each of the loop's steps calls :meth:`Lifecycle.settle` for every
stopping study not settled yet), so the loop's state of the arrays it runs (``LoopState``:
live, awaiting a client, placed) and the studies' mirrors never disagree with the database.

Members leave a running array the way preempted members do (``WorkerPool.release``): at the
array's next epoch boundary, checkpointed. Then:

* a PAUSED study's members wait again (Optuna keeps them RUNNING) and resume from their
  checkpoints once the study is resumed; nothing of it is asked or started meanwhile;
* a stopping study's members (CANCELLED, FAILED, DELETING) end **PRUNED** at the step they
  left at, with the reason in ``error``: they stopped at an epoch boundary as a pruned trial
  does, and their intermediate values are real, so Optuna's samplers and pruners weigh them
  as they weigh pruned trials. Trials that wait outside any array end PRUNED at their last
  reported step if they reported one (preempted or paused earlier), else **FAIL**: they
  never trained, and Optuna records a trial interrupted before it reported, as by Ctrl-C in
  ``optimize``, as FAIL.

A stopping study's ``completed_at`` is set once none of its trials runs any more; then its
checkpoints are removed (a DELETING study is removed whole: its rows, its Optuna study and
its artifact folder; a large one is hidden at once and removed in batches, ``server/purge.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from optuna.trial import TrialState as OptunaState
from sqlalchemy.orm import Session

from fusetune.server import events, mirror
from fusetune.server.db import Study, StudyState, Tenant, TrialState, utcnow
from fusetune.server.errors import Conflict
from fusetune.server.loop import rows
from fusetune.server.loop.context import LoopContext
from fusetune.server.loop.rows import STOPPING
from fusetune.server.loop.state import Live
from fusetune.server.mirror import StudyMirror
from fusetune.server.purge import Purge
from fusetune.server.quotas import check_running_quota, check_trials_quota
from fusetune.server.schemas import FAILURE_ATTR
from fusetune.server.settings import artifact_uri
from fusetune.workers.pool import WorkerHandle
from fusetune.workers.spec import EpochReply, EpochReport
from fusetune.workers.store import get_store
from fusetune.workers.workloads import get_workload

log = logging.getLogger(__name__)



class Lifecycle:
    """Changes a study's state on the scheduling loop's thread: a collaborator of the loop,
    which hands it the requests (``SchedulingLoop.call``) and every stopping study each round."""

    def __init__(self, ctx: LoopContext) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.state = ctx.state
        self.mirrors = ctx.mirrors

    # -- what request threads ask for (through SchedulingLoop.call) ---------------------------
    def pause(self, study_id: int) -> None:
        """No new trials are asked or started; running members leave at their next epoch
        boundary, checkpointed, and wait. Pausing a PAUSED study changes nothing.

        Raises:
            Conflict: naming ``state`` when the study is not RUNNING or PAUSED.
        """
        with self.ctx.sessions() as session:
            study = rows.study(session, study_id)
            if study.state == StudyState.PAUSED:
                return
            if study.state != StudyState.RUNNING:
                raise Conflict(
                    "state", f"study {study_id} is {study.state.value}; only a RUNNING study can be paused", where="study"
                )
            study.state = StudyState.PAUSED
            session.commit()
            self.state.halting[study_id] = StudyState.PAUSED
            self._release_arrays(session, study_id)
        log.info("study %d paused", study_id)

    def resume(self, study_id: int) -> None:
        """A PAUSED study runs again: its waiting trials resume from their checkpoints.

        Raises:
            Conflict: naming ``state`` when the study is not PAUSED or RUNNING, or
                ``max_running_studies`` when its tenant already runs as many studies as that quota.
        """
        with self.ctx.sessions() as session:
            study = rows.study(session, study_id)
            if study.state == StudyState.RUNNING:
                return
            if study.state != StudyState.PAUSED:
                raise Conflict(
                    "state", f"study {study_id} is {study.state.value}; only a PAUSED study can be resumed", where="study"
                )
            check_running_quota(session, session.get_one(Tenant, study.tenant, with_for_update=True))
            study.state = StudyState.RUNNING
            session.commit()
        self.state.halting.pop(study_id, None)
        self.ctx.wake()
        log.info("study %d resumed", study_id)

    def cancel(self, study_id: int) -> None:
        """The study ends CANCELLED: waiting trials end now, running members at their array's
        next epoch boundary (see the module docstring). Cancelling it again changes nothing.

        Raises:
            Conflict: naming ``state`` when the study has ended otherwise (COMPLETE, FAILED) or
                is being deleted.
        """
        with self.ctx.sessions() as session:
            study = rows.study(session, study_id)
            if study.state == StudyState.CANCELLED:
                return
            if study.state not in (StudyState.RUNNING, StudyState.PAUSED):
                raise Conflict(
                    "state", f"study {study_id} is {study.state.value}; it cannot be cancelled", where="study"
                )
            study.state = StudyState.CANCELLED
            session.commit()
            self.settle(session, study)
        log.info("study %d cancelled", study_id)

    def extend(self, study_id: int, n_trials: int) -> None:
        """Set the study's ``n_trials``; a COMPLETE study given more trials runs again.

        Raises:
            Conflict: naming ``n_trials`` when it is below the trials asked already, ``state``
                when the study was cancelled, failed or is being deleted, or
                ``max_running_studies`` when a COMPLETE study would run again over that quota.
            Invalid: naming ``n_trials`` when it is over the tenant's ``max_trials_per_study``.
        """
        with self.ctx.sessions() as session:
            study = rows.study(session, study_id)
            if study.state in STOPPING:
                raise Conflict(
                    "state", f"study {study_id} is {study.state.value}; its n_trials cannot change", where="study"
                )
            asked = rows.asked(session, study_id)
            if n_trials < asked:
                raise Conflict("n_trials", f"study {study_id} has asked {asked} trials already; n_trials={n_trials} is below that")
            tenant = session.get_one(Tenant, study.tenant, with_for_update=True)  # quotas: as on creation
            check_trials_quota(tenant, n_trials)
            reopen = study.state == StudyState.COMPLETE and n_trials > asked
            if reopen:
                check_running_quota(session, tenant)
                study.state, study.completed_at = StudyState.RUNNING, None
            study.n_trials = n_trials
            session.commit()
        self.ctx.wake()

    def delete(self, study_id: int) -> bool:
        """Remove the study: fusetune's rows, its Optuna study and its artifact folder.

        A study with arrays still training is cancelled first (state DELETING, its trials end
        as a cancelled study's do) and removed once they have stopped, by a later step.
        Returns whether it is gone already.
        """
        with self.ctx.sessions() as session:
            study = rows.study(session, study_id)
            if study.state != StudyState.DELETING:
                study.state = StudyState.DELETING
                session.commit()
            return self.settle(session, study)

    # -- what the loop does every step ---------------------------------------------------------
    def settle(self, session: Session, study: Study) -> bool:
        """Drive a stopping study one step on (every round, also after a restart: a study
        cancelled or deleted while the previous process ran). End what of it can end now, ask
        its running members to leave, and, once nothing of it runs, set ``completed_at`` (or
        remove a DELETING study).

        Returns whether the study is gone (deleted).
        """
        self.state.halting[study.id] = study.state
        reason = self._end_reason(study)
        arrays = {array_id for array_id, live in self.state.live.items() if live.study_id == study.id}
        now = utcnow()
        try:
            # A client-driven array awaiting decisions for a stopping study would wait for
            # answers nobody owes it: its members end here, and the array goes on to stop.
            for array_id in [a for a in self.state.awaiting if a in arrays]:
                self._answer_awaiting(session, study, array_id, reason, now)
            unfinished = rows.unfinished_of(session, study.id)
            outside = [t for t in unfinished if t.array_id not in arrays]
            if outside:
                mirror = self.mirrors.stopping(study)
                for trial in outside:
                    values = mirror.trial(trial.optuna_trial_id).intermediate_values
                    state = TrialState.PRUNED if values else TrialState.FAIL
                    mirror.tell(session, trial.optuna_trial_id, OptunaState[state.value])
                    value = values[max(values)] if values else None
                    rows.finish(session, trial.id, state, now, value, reason, event={"tenant": study.tenant, "study_id": study.id})
            session.commit()
        except Exception:
            session.rollback()
            self.mirrors.drop(study.id)
            raise
        self._release_arrays(session, study.id, once=True)
        if arrays:
            return False  # it settles when its last array has stopped (its outcome recorded)
        if study.state == StudyState.DELETING:
            return self._delete_now(session, study)
        self._remove_artifacts(f"{study.name}/checkpoints")  # no trial of it will resume
        study.completed_at = now
        counts = rows.state_counts(session, study.id)
        events.record(
            session, "study.completed", tenant=study.tenant, study_id=study.id,
            trial_counts={s.value: n for s, n in counts.items()}, state=study.state.value,
        )
        session.commit()
        self._forget(study.id)
        log.info("study %d %s: no trial of it runs any more", study.id, study.state.value)
        return False

    def stop_report(self, session: Session, mirror: StudyMirror, live: Live, report: EpochReport, now: Any) -> bool:
        """In an array-epoch's transaction: end the members of a stopping study that left the
        array at this boundary (PRUNED at their step, with the reason). Returns False (nothing
        done) when the array's study is not stopping: they wait again, as preempted members do."""
        state = self.state.halting.get(live.study_id)
        if state not in STOPPING or not report.released:
            return False
        reason = self._end_reason(session.get_one(Study, live.study_id))
        value = {m.trial_id: m.value for m in report.members}
        where: dict[str, Any] = {"tenant": live.tenant, "study_id": live.study_id, "array_id": report.array_id}
        for trial_id in report.released:
            mirror.tell(session, live.optuna_ids[trial_id], OptunaState.PRUNED)
            rows.finish(session, trial_id, TrialState.PRUNED, now, value.get(trial_id), reason, event=where)
        return True

    def release_halted(self, worker: WorkerHandle, live: Live, report: EpochReport, prune: Collection[int]) -> None:
        """After an array-epoch of a halting study: members still going on leave at the next
        boundary. (Newcomers that joined at this one were not members when an earlier ask came.)"""
        if live.study_id not in self.state.halting:
            return
        going_on = [
            m.trial_id for m in report.members
            if m.state is None and m.trial_id not in report.released and m.trial_id not in prune
        ]
        if going_on:
            self._release(worker, going_on)

    def workload_loads(self, session: Session, study: Study) -> bool:
        """Whether the study's workload can be loaded; if not, the study ends FAILED with the error.
        (A code package's is loaded by its describer, never here: ``Asker._code_ready``.)"""
        if study.package is not None:
            return True
        try:
            get_workload(study.workload)
        except Exception as exc:  # unknown, an entry point or module that fails to import, ...
            self.fail(session, study, f"its workload {study.workload!r} cannot be loaded: {type(exc).__name__}: {exc}")
            return False
        return True

    def check_askable(self, session: Session, study: Study) -> None:
        """A trial may be enqueued into the study: Conflict naming ``state`` when it has been
        cancelled, has failed or is being deleted (or fails now: its workload cannot be loaded)."""
        if study.state in STOPPING or not self.workload_loads(session, study):
            raise Conflict(
                "state", f"study {study.id} is {study.state.value}; no more trials can be asked", where="study"
            )

    def fail_if_every_trial_failed(self, session: Session, study: Study, counts: Mapping[TrialState, int]) -> None:
        """A study whose trials have all ended, every one FAIL, ends FAILED, not COMPLETE
        (in the caller's transaction)."""
        if not counts or set(counts) != {TrialState.FAIL}:
            return
        first = rows.first_failure(session, study.id)
        study.state = StudyState.FAILED
        self._write_failure(session, study, f"every trial failed; the first: {first}")

    # -- helpers ---------------------------------------------------------------------------------
    def fail(self, session: Session, study: Study, reason: str) -> None:
        """The study ends FAILED with ``reason``; its trials end as a stopping study's do."""
        study.state = StudyState.FAILED
        self._write_failure(session, study, reason)
        session.commit()
        log.warning("study %d failed: %s", study.id, reason)
        self.settle(session, study)

    @staticmethod
    def _write_failure(session: Session, study: Study, reason: str) -> None:
        mirror.set_study_system_attr(session, study.optuna_study_id, FAILURE_ATTR, reason)

    def _end_reason(self, study: Study) -> str:
        """What a trial ended by its study's state says (its ``error``)."""
        if study.state == StudyState.FAILED:
            failure = self.ctx.storage.get_study_system_attrs(study.optuna_study_id).get(FAILURE_ATTR)
            return f"stopped: its study failed ({failure})"
        if study.state == StudyState.DELETING:
            return "cancelled: its study is being deleted"
        return "cancelled: its study was cancelled"

    def _answer_awaiting(self, session: Session, study: Study, array_id: int, reason: str, now: Any) -> None:
        waiting = self.state.awaiting.pop(array_id)
        live = self.state.live[array_id]
        mirror = self.mirrors.stopping(study)
        where: dict[str, Any] = {"tenant": study.tenant, "study_id": study.id, "array_id": array_id}
        for trial_id, step in waiting.steps.items():
            mirror.tell(session, live.optuna_ids[trial_id], OptunaState.PRUNED)
            value = mirror.trial(live.optuna_ids[trial_id]).intermediate_values.get(step)
            rows.finish(session, trial_id, TrialState.PRUNED, now, value, reason, event=where)
        session.commit()
        live.ended.update(waiting.steps)
        self.ctx.pool.reply(waiting.worker, EpochReply(prune=frozenset(waiting.prune | set(waiting.steps))))

    def _release_arrays(self, session: Session, study_id: int, once: bool = False) -> None:
        """Ask every running array of the study to let its members go at the next epoch
        boundary (those offered to it but not joined yet too); ``once``: skip members asked before."""
        arrays = {array_id for array_id, live in self.state.live.items() if live.study_id == study_id}
        for array_id in list(self.state.leaving):
            if array_id not in self.state.live:
                del self.state.leaving[array_id]  # ended
        if not arrays:
            return
        members: dict[int, list[int]] = {}
        for trial_id, in_array in rows.unfinished_in_arrays(session, arrays):
            if in_array is None or once and trial_id in self.state.leaving.get(in_array, ()):
                continue
            members.setdefault(in_array, []).append(trial_id)
        for worker in self.ctx.pool.workers:
            if worker.spec is not None and worker.spec.array_id in members:
                self._release(worker, members[worker.spec.array_id])

    def _release(self, worker: WorkerHandle, trial_ids: Iterable[int]) -> None:
        ids = list(trial_ids)
        if worker.spec is None:
            return  # its array has ended: its members left already
        self.ctx.pool.release(worker, ids)
        self.state.leaving.setdefault(worker.spec.array_id, set()).update(ids)
        current = self.state.running.get(worker.name)
        if current is not None:  # from now on the scheduler does not count them on this device
            self.state.running[worker.name] = dataclasses.replace(
                current, trial_ids=tuple(i for i in current.trial_ids if i not in ids)
            )

    def _delete_now(self, session: Session, study: Study) -> bool:
        """Remove a DELETING study of which nothing runs any more: at once when it has at most
        ``FUSETUNE_DELETE_BATCH_TRIALS`` trials (one batch's work on this thread); else hide
        it, have its rows removed in batches off this thread, and return False.

        Hiding is one short transaction: the study's ``completed_at`` is set (a DELETING study
        with one is hidden: the API answers 404 and lists it nowhere, and no round reads it)
        and its Optuna study is renamed (``optuna.load_study`` no longer finds it by its name).
        Its artifacts and rows then go on the purger's thread (``server/purge.py``), which
        hands the study's own rows back to the loop (:meth:`finish_delete`). Its name is
        taken until then: a new study of that name gets the usual 409.
        """
        purge = Purge(study.id, study.optuna_study_id, study.name)
        trials = rows.asked(session, study.id)
        # SQLite may give a later trial the same id: the resume counts of this study's go.
        gone = rows.ids_among(session, study.id, list(self.state.resumes))
        try:
            mirror.hide_study(session, study.optuna_study_id, f"fusetune:deleted:{study.optuna_study_id}")
            study.completed_at = utcnow()
            session.commit()
        except Exception:
            session.rollback()
            raise
        for trial_id in gone:
            self.state.resumes.pop(trial_id, None)
        self._forget(study.id)
        if trials > self.settings.delete_batch_trials:
            self.ctx.purge(purge)
            log.info("study %d (%s) deleted: its %d trials are being removed", study.id, study.name, trials)
            return False
        self.ctx.purge(purge, now=True)
        self.finish_delete(purge)
        return True

    def finish_delete(self, purge: Purge) -> None:
        """Remove a purged study's own rows (its trials, arrays and artifacts are gone) and
        record ``study.deleted``, on the loop's thread: it alone writes events."""
        with self.ctx.sessions.begin() as session:
            study = session.get(Study, purge.study_id)
            if study is None:
                return
            mirror.delete_study(session, purge.optuna_study_id)
            events.record(session, "study.deleted", tenant=study.tenant, study_id=study.id, name=study.name)
            rows.delete_study(session, purge.study_id)
        log.info("study %d (%s): removed", purge.study_id, purge.name)

    def _forget(self, study_id: int) -> None:
        """Drop what the loop holds of a study that no longer runs (SQLite may reuse its id)."""
        self.mirrors.forget(study_id)
        self.state.halting.pop(study_id, None)

    def _remove_artifacts(self, key: str) -> None:
        """Remove a study's folder (``<study>``) or part of it in the artifact store (the
        workers' saved members and checkpoints, ``workers/store.py``); a failure is logged."""
        study_name = key.split("/", 1)[0]
        if study_name in ("", ".", "..") or "\\" in study_name:  # one path component (StudyCreate.name)
            raise ValueError(f"study name {study_name!r} is not a folder of the artifact store")
        store = get_store(artifact_uri(self.settings))
        try:
            store.delete_dir(key)
        except OSError as exc:
            log.warning("could not remove %s: %s", store.location(key), exc)


__all__ = ["Lifecycle"]
