"""The recorder: the scheduling loop's one writer of what workers report.

Workers send one :class:`~workers.spec.EpochReport` per array-epoch and end with an
:class:`~workers.spec.ArrayOutcome`. The recorder writes each report in one database
transaction (every member's intermediate value and end, through the study's mirror to
Optuna's tables and through ``rows`` to fusetune's, the events, the measured throughput),
decides pruning with the study's own pruner, and answers the worker. The reports that arrive
together (one per busy worker) are written in one transaction: its fixed costs are paid once.

Nothing is lost to a database that cannot be reached: an event whose transaction fails so
stays at the head of the backlog, with every event after it, and is written again at the next
turn (its reply waits for it), each array's in order. An event that fails for another reason
(a malformed report) costs only itself: the batch is written again without it, and only the
trials it touched are read again into their studies' mirrors.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optuna.trial import TrialState as OptunaState
from sqlalchemy.orm import Session

from fusetune.server import events
from fusetune.server.db import Array, ArrayState, Study, StudyState, TrialState, utcnow
from fusetune.server.db.bulk import add_updates
from fusetune.server.db.models import table_of
from fusetune.server.db.revisions import touch_trials
from fusetune.server.errors import Conflict
from fusetune.server.loop import rows
from fusetune.server.loop.context import LoopContext
from fusetune.server.loop.lifecycle import Lifecycle
from fusetune.server.loop.notices import StudyWarnings
from fusetune.server.loop.rows import STOPPING
from fusetune.server.loop.state import LOOKAHEAD_EPOCHS, Awaiting, Live
from fusetune.server.loop.thread import database_unavailable
from fusetune.server.loop.throughput import Throughput
from fusetune.server.mirror import StudyMirror
from fusetune.workers.package import PackageError
from fusetune.workers.pool import EpochOverran, Event, WorkerHandle
from fusetune.workers.spec import ArrayOutcome, ArraySpec, EpochReply, EpochReport

__all__ = ["Recorder", "add_timings"]

log = logging.getLogger(__name__)

#: A trial whose workers keep dying fails instead of crashing workers forever.
_MAX_RESUMES = 3
#: Most array-epochs one transaction records: a bounded transaction (and rollback) when many
#: workers report at once.
_GROUP_COMMIT = 64
#: Epochs of small models are shorter than a scheduling round on a busy machine (the digits
#: MLP's take 10 ms; a round on PostgreSQL with a backlog, tens of ms), so the look-ahead of a
#: successor's offer covers at least this long of the array's epochs as last measured.
_LOOKAHEAD_S = 0.25


def add_timings(total: Mapping[str, float] | None, more: Mapping[str, float]) -> dict[str, float]:
    out = dict(total or {})
    for phase, seconds in more.items():
        out[phase] = out.get(phase, 0.0) + seconds
    return out


@dataclass(frozen=True)
class _LiveEpoch:
    """What an array-epoch's writes change of its :class:`Live`, kept to put back if they roll back."""

    epochs_done: int
    timings: dict[str, float]
    checkpoints: dict[int, int]
    announced: set[int]
    steps: dict[int, int]
    ended: set[int]

    @classmethod
    def of(cls, live: Live) -> _LiveEpoch:
        return cls(live.epochs_done, dict(live.timings), dict(live.checkpoints), set(live.announced), dict(live.steps), set(live.ended))

    def restore(self, live: Live) -> None:
        live.epochs_done, live.timings, live.checkpoints = self.epochs_done, self.timings, self.checkpoints
        live.announced, live.steps, live.ended = self.announced, self.steps, self.ended


class Recorder:
    """Writes what workers report (see the module docstring)."""

    def __init__(self, ctx: LoopContext, throughput: Throughput, lifecycle: Lifecycle) -> None:
        self.ctx = ctx
        self.state = ctx.state
        self.mirrors = ctx.mirrors
        self.throughput = throughput
        self.lifecycle = lifecycle
        #: Worker events not yet written (the database was unreachable), oldest first.
        self.backlog: deque[Event] = deque()
        #: Array-epoch reports recorded by this process (GET /metrics: fusetune_epoch_reports_total).
        self.reports_ingested = 0
        #: A worker died (replacement actors run in new processes): the loop registers its workers again.
        self.workers_changed = False
        #: What fusion says a study's user should know (modules run once per member, models unfused).
        self.notices = StudyWarnings(ctx.storage)

    def handle(self, events: Sequence[Event]) -> bool:
        """Answer epoch reports and record ended arrays, in the order the workers said them.

        Returns whether a slot was freed (an array ended, or members left one), so that the
        next scheduling round comes at once: backfill then offers the freed slots to waiting
        trials before the array's next epoch boundary but one.

        An event whose transaction fails because the database is unreachable stays at the
        head of the backlog, with every event after it, and is written again by the next
        call (its reply waits for it): no report or outcome is lost, and each array's are
        written in order. An event that fails for another reason is logged and dropped.
        """
        self.backlog.extend(events)
        ended = False
        while self.backlog:
            run: list[tuple[WorkerHandle, EpochReport]] = []
            for worker, spec, item in itertools.islice(self.backlog, _GROUP_COMMIT):  # one report per array
                if not isinstance(item, EpochReport) or any(r.array_id == spec.array_id for _, r in run):
                    break
                run.append((worker, item))
            if len(run) > 1:  # reports that came together are written together
                try:
                    replies = self.record_epochs(run)
                except Exception as exc:
                    if database_unavailable(exc):
                        raise
                    # Written one at a time below, so that one bad report costs only itself.
                    log.warning("%d array-epochs could not be recorded together (%s): one at a time", len(run), exc)
                else:
                    for (worker, report), reply in zip(run, replies):
                        ended = self._answer(worker, report, reply) or ended
                        self.backlog.popleft()
                    continue
            worker, spec, event = self.backlog[0]
            try:
                ended = self._handle_one(worker, spec, event) or ended
            except Exception as exc:
                if database_unavailable(exc):
                    raise
                log.exception("array %d: could not record %s", spec.array_id, type(event).__name__)
            self.backlog.popleft()
        return ended

    def _answer(self, worker: WorkerHandle, report: EpochReport, reply: EpochReply | None) -> bool:
        """Send a recorded report's reply; returns whether members left the array, or have
        come within its look-ahead of their last epoch (see :meth:`_finishing`)."""
        live = self.state.live.get(report.array_id)
        replaced, nearing = 0, False
        if live is not None and worker.spec is not None:
            # Members that end where newcomers were offered to join free nothing a round could fill.
            replaced = live.ahead[live.epochs_done]
            for boundary in [b for b in live.ahead if b <= live.epochs_done]:
                del live.ahead[boundary]
            # A member comes within the look-ahead once: its successor is looked for then.
            near = {m.trial_id for m in report.members if not m.state and 0 < worker.spec.epochs - 1 - m.step <= live.lookahead}
            nearing = bool(near - live.near)
            live.near |= near
        freed = bool(report.released or sum(1 for m in report.members if m.state) > replaced or nearing)
        if reply is None:  # the client decides: the reply goes when it has
            return freed
        # The reply decides pruning (studies with a pruner wait for it) and acknowledges that
        # the report, and the checkpoints it named, are recorded. A worker that does not wait
        # needs it only to drop the checkpoints a new one replaces, and those of members that
        # ended in the report (it removes them once their end is recorded, and an array whose
        # last members ended waits for it): other reports are acknowledged together by the
        # next reply sent (a remote call saved per array-epoch).
        waits = worker.spec is None or worker.spec.prunes
        ended = any(m.state for m in report.members)
        if live is not None and not (waits or ended or reply.prune or report.released or live.new_checkpoint):
            live.unacked += 1
            return freed
        if live is not None:
            reply = dataclasses.replace(reply, acked=reply.acked + live.unacked)
            live.unacked, live.new_checkpoint = 0, False
        self.ctx.pool.reply(worker, reply)
        return bool(reply.prune) or freed

    def _handle_one(self, worker: WorkerHandle, spec: ArraySpec, item: EpochReport | ArrayOutcome | BaseException) -> bool:
        if isinstance(item, EpochReport):
            return self._answer(worker, item, self._record_epoch(worker, item))
        self.state.awaiting.pop(spec.array_id, None)
        self.record_outcome(worker, spec, item)
        if isinstance(item, BaseException):
            self.workers_changed = True  # replacement actors run in new processes
        return True

    def _record_epoch(self, worker: WorkerHandle, report: EpochReport) -> EpochReply | None:
        """Write one array-epoch in one transaction; decide pruning; return the reply (see :meth:`_record_epochs`)."""
        return self.record_epochs([(worker, report)])[0]

    def record_epochs(self, reports: Sequence[tuple[WorkerHandle, EpochReport]]) -> list[EpochReply | None]:
        """Write array-epochs in one transaction, in order; decide pruning; return each one's reply.

        The loop records together the reports that arrived together (one per busy worker):
        a transaction's fixed costs (the revision counter, the commit's flush to disk, a
        round trip per statement) are paid once for all of them. Either all are written or
        none is, and what the control plane keeps in memory goes back to what it was.

        A client-driven study's client decides pruning (:meth:`decide`): then the members
        still running await its decisions and the reply is None, for now.
        """
        restore: list[tuple[Live, EpochReport, _LiveEpoch]] = []
        decided: list[tuple[set[int], dict[int, int]]] = []
        with self.ctx.sessions() as session:
            try:
                for worker, report in reports:
                    live = self.state.live[report.array_id]
                    restore.append((live, report, _LiveEpoch.of(live)))
                    decided.append(self._write_epoch(session, worker, report, live))
                self.throughput.write(session)
                # A study whose last trials these epochs ended completes in the same
                # transaction: its study.completed is committed with their trial.ended (one
                # commit and one events write at a sweep's end, not two of each).
                ending = {self.state.live[r.array_id].study_id for (_, r), (prune, _) in zip(reports, decided) if prune or any(m.state for m in r.members)}
                completed = [i for i in sorted(ending) if self.complete_if_done(session, session.get(Study, i))]
                session.commit()
                self.reports_ingested += len(reports)
                for study_id in completed:
                    self.mirrors.drop(study_id)
            except Exception:
                session.rollback()
                self.throughput.rolled_back()
                self.notices.rolled_back()
                for live, report, before in reversed(restore):  # so that a retry writes the same
                    # The mirror ran ahead of the database for these members only.
                    touched = {m.trial_id for m in report.members} | {j.trial_id for j in report.joined} | set(report.released)
                    self.mirrors.mark_stale(live.study_id, [live.optuna_ids[i] for i in touched if i in live.optuna_ids])
                    before.restore(live)
                raise
        replies: list[EpochReply | None] = []
        for (worker, report), (prune, awaiting) in zip(reports, decided):
            self.lifecycle.release_halted(worker, self.state.live[report.array_id], report, prune)
            superseded = self.state.awaiting.pop(report.array_id, None)
            if superseded is not None:
                # The worker went on past its deadline without the client's decisions: the
                # undecided members continue, and the decisions made go with this answer.
                self.ctx.pool.reply(superseded.worker, EpochReply(prune=frozenset(superseded.prune)))
            if awaiting:
                self.state.awaiting[report.array_id] = Awaiting(worker, awaiting)
                replies.append(None)
            else:
                replies.append(EpochReply(prune=frozenset(prune)))
        return replies

    def _write_epoch(
        self, session: Session, worker: WorkerHandle, report: EpochReport, live: Live
    ) -> tuple[set[int], dict[int, int]]:
        """One array-epoch's writes, in the caller's transaction: the members it prunes, and
        those that await their client's decision (trial id -> step).

        Every member's intermediate value goes to its Optuna trial (so Optuna's pruners,
        ``optuna.load_study`` and optuna-dashboard see it); members that ended are told to
        Optuna (``Study.tell``, the sampler's ``after_trial`` included) and fusetune's rows
        follow. The study's pruner decides for the others, on the study as the control
        plane holds it. The measured throughput updates the class's curve. What the
        control plane knows of the array (:class:`Live`) spares the transaction any read.
        """
        if live.ended:
            report = dataclasses.replace(
                report,
                members=tuple(m for m in report.members if m.trial_id not in live.ended),
                released=tuple(i for i in report.released if i not in live.ended),
            )
        mirror = self.mirrors.of_id(session, live.study_id)
        now = utcnow()
        optuna_id = live.optuna_ids
        where: dict[str, Any] = {"tenant": live.tenant, "study_id": live.study_id, "array_id": report.array_id}
        self._joined(session, mirror, live, report, where, now)
        mirror.report(session, [(optuna_id[m.trial_id], m.step, m.value) for m in report.members])
        live.steps.update((m.trial_id, m.step) for m in report.members)
        # An epoch's own time: the first array-epoch's report also carries the array's build and
        # the class's solo probe, which no later epoch repeats.
        epoch_s = sum(v for k, v in report.timings.items() if isinstance(v, int | float) and k not in ("build_s", "probe_s"))
        live.lookahead = max(LOOKAHEAD_EPOCHS, math.ceil(_LOOKAHEAD_S / epoch_s) if epoch_s > 0 else 0)
        live.last_epoch = (epoch_s, report.size)
        # Their Optuna trials got a value: pollers (updated_since) read them again.
        touch_trials(session, [m.trial_id for m in report.members])
        self._note_checkpoints(session, live, report)
        for member in report.members:
            events.record(session, "trial.reported", **where, trial_id=member.trial_id, step=member.step, value=rows.json_number(member.value))
        prune, awaiting, ended = self._ends(session, mirror, live, report, where, now)
        if report.released and not self.lifecycle.stop_report(session, mirror, live, report, now):
            rows.wait_again(session, report.released)  # preempted or paused: Optuna keeps it RUNNING
        # An array's first epoch pays for warming up (allocations, lazy init): its speed
        # would say fusing pays less than it does. (The probe runs after it, warm.)
        assert worker.spec is not None  # a report comes from a worker that trains an array
        self.throughput.observe(worker.spec.signature, worker.device_type, report, warm=live.epochs_done > 0)
        if report.warnings:  # modules the fused model runs once per member
            self.notices.add(session, live.study_id, report.warnings)
        live.epochs_done += 1
        live.timings = add_timings(live.timings, report.timings)
        # Held back to the commit (bulk.add_updates): the transaction's array-epochs update
        # their arrays in one executemany, compiled once (a statement each, with the timings
        # inlined, cost a millisecond apiece in compiling alone).
        add_updates(session, table_of(Array), "id", [{"id": report.array_id, "epochs_done": live.epochs_done, "timings": live.timings}])
        if report.joined or report.released or ended:
            events.record(
                session, "array.changed", **where, offered=[], joined=[j.trial_id for j in report.joined],
                left=[*ended, *report.released], epochs_done=live.epochs_done,
            )
        return prune, awaiting

    def _joined(self, session: Session, mirror: StudyMirror, live: Live, report: EpochReport, where: dict[str, Any], now: Any) -> None:
        """The members that joined the array at this boundary: their events, their rows, and
        where each resumed (its curve dropped from there, :meth:`_truncate_resumed`)."""
        for joined in report.joined:
            if joined.trial_id in live.announced:  # a first member: its trial.started came with the array
                live.announced.discard(joined.trial_id)
                continue
            events.record(
                session, "trial.started", **where, trial_id=joined.trial_id, resumed_at_epoch=joined.resumed_at_epoch
            )
        if report.joined:
            rows.joined(session, [j.trial_id for j in report.joined], now)
        optuna_id = live.optuna_ids
        for joined in report.joined:
            if joined.resumed_at_epoch is not None:  # one entry per move or crash
                resumed = mirror.trial(optuna_id[joined.trial_id]).user_attrs.get("resumed_at_epochs")
                # A user attr a client may have set itself (enqueue_trial): not always a list.
                resumed = resumed if isinstance(resumed, list) else []
                mirror.set_user_attrs(session, optuna_id[joined.trial_id], {"resumed_at_epochs": [*resumed, joined.resumed_at_epoch]})
        self._truncate_resumed(session, mirror, report, optuna_id)

    def _ends(
        self, session: Session, mirror: StudyMirror, live: Live, report: EpochReport, where: dict[str, Any], now: Any,
    ) -> tuple[set[int], dict[int, int], list[int]]:
        """The members that end at this boundary (completed, failed, pruned by the study's
        pruner), told to Optuna and their rows ended in one statement; the members pruned,
        those awaiting their client's decision (trial id -> step), and every one that ended."""
        prune: set[int] = set()
        awaiting: dict[int, int] = {}
        ended: list[int] = []
        ends: list[dict[str, Any]] = []  # their rows' new columns (rows.ending)
        for member in report.members:
            trial_id = live.optuna_ids[member.trial_id]
            if member.state == "COMPLETE":
                if member.state_dict is not None:  # where its trained weights are
                    mirror.set_user_attrs(session, trial_id, {"state_dict": member.state_dict})
                # Every objective (a multi-objective study's list); the first is also fusetune's value.
                mirror.tell(session, trial_id, OptunaState.COMPLETE, list(member.values) or member.value)
                ends.append(rows.ending(session, member.trial_id, TrialState.COMPLETE, value=member.value, event=where))
                ended.append(member.trial_id)
            elif member.state == "FAIL":
                mirror.tell(session, trial_id, OptunaState.FAIL)
                ends.append(rows.ending(session, member.trial_id, TrialState.FAIL, error=member.error, event=where))
                ended.append(member.trial_id)
            elif member.trial_id in report.released or self.state.halting.get(live.study_id) in STOPPING:
                continue  # leaving at this boundary (its next array decides), or at the next: its study stops
            elif live.client_decides:
                awaiting[member.trial_id] = member.step
            elif mirror.should_prune(session, trial_id):
                mirror.tell(session, trial_id, OptunaState.PRUNED)
                ends.append(rows.ending(session, member.trial_id, TrialState.PRUNED, value=member.value, event=where))
                prune.add(member.trial_id)
                ended.append(member.trial_id)
        live.ended.update(ended)
        # An array's last epoch ends all of them: one executemany. touch_trials (above) stamps
        # their revisions.
        rows.end_all(session, ends, now)
        return prune, awaiting, ended

    def decide(self, trial_id: int, step: int, prune: bool) -> None:
        """A client-driven study's pruning decision for a trial's report at ``step``.

        The trial ends PRUNED at once if ``prune``; when every member of the array-epoch has
        its decision, the array goes on. Runs on the loop thread (``SchedulingLoop.call``).

        Raises:
            service.Conflict: naming ``step`` when no array waits for this trial's decision at it.
        """
        found = next(((a, w) for a, w in self.state.awaiting.items() if trial_id in w.steps), None)
        if found is None:
            raise Conflict("step", f"trial {trial_id} awaits no pruning decision (it is not between epochs)")
        array_id, waiting = found
        if waiting.steps[trial_id] != step:
            raise Conflict("step", f"trial {trial_id} awaits the decision for step {waiting.steps[trial_id]}, not {step}")
        live = self.state.live[array_id]
        if prune:
            with self.ctx.sessions() as session:
                mirror = self.mirrors.of_id(session, live.study_id)
                try:
                    mirror.tell(session, live.optuna_ids[trial_id], OptunaState.PRUNED)
                    value = mirror.trial(live.optuna_ids[trial_id]).intermediate_values.get(step)
                    where: dict[str, Any] = {"tenant": live.tenant, "study_id": live.study_id, "array_id": array_id}
                    rows.finish(session, trial_id, TrialState.PRUNED, utcnow(), value=value, event=where)
                    session.commit()
                except Exception:
                    session.rollback()
                    self.mirrors.mark_stale(live.study_id, [live.optuna_ids[trial_id]])
                    raise
            waiting.prune.add(trial_id)
            live.ended.add(trial_id)
        del waiting.steps[trial_id]
        if not waiting.steps:
            del self.state.awaiting[array_id]
            self.ctx.pool.reply(waiting.worker, EpochReply(prune=frozenset(waiting.prune)))
            if waiting.prune:
                self.ctx.wake()  # freed slots: backfill

    def _truncate_resumed(self, session: Session, mirror: StudyMirror, report: EpochReport, optuna_id: Mapping[int, int]) -> None:
        """Members that (re)started at an epoch drop the values stored from there on.

        Those steps were trained after the checkpoint it resumed from (or, from scratch, at
        all) by weights that are gone; the member reports them again as it retrains them.
        So each (trial, step) is stored once, and the stored curve is the curve of the
        weights the trial ends with, even if it ends (pruned) before reaching the old steps.
        How many such epochs each trial retrains adds up in its user attr ``epochs_retrained``.
        """
        for joined in report.joined:
            trial_id = optuna_id[joined.trial_id]
            dropped = mirror.truncate(session, trial_id, joined.resumed_at_epoch or 0)
            if dropped:
                done = mirror.trial(trial_id).user_attrs.get("epochs_retrained")
                done = done if isinstance(done, int) and not isinstance(done, bool) else 0  # a client may have set it
                mirror.set_user_attrs(session, trial_id, {"epochs_retrained": done + dropped})

    def _note_checkpoints(self, session: Session, live: Live, report: EpochReport) -> None:
        """Keep in ft_trials each member's newest complete checkpoint, as its worker reported it."""
        for member in report.members:
            epoch = member.checkpoint_epoch
            if epoch is not None and member.state is None and live.checkpoints.get(member.trial_id) != epoch:
                rows.note_checkpoint(session, member.trial_id, epoch)
                live.checkpoints[member.trial_id] = epoch
                live.new_checkpoint = True

    def record_outcome(self, worker: WorkerHandle, spec: ArraySpec, result: ArrayOutcome | BaseException) -> None:
        """An array ended: its outcome, or the error that ended it (its worker's death included)."""
        self.state.running.pop(worker.name, None)
        live = self.state.live.pop(spec.array_id, None)
        with self.ctx.sessions() as session:
            array = session.get(Array, spec.array_id)
            assert array is not None, spec.array_id  # its row is written before its worker starts
            try:
                if isinstance(result, ArrayOutcome):
                    array.state = ArrayState.FAIL if result.error else ArrayState.COMPLETE
                    array.error = result.error
                    array.models_steps_per_s = result.models_steps_per_s
                    array.timings = result.timings or (live.timings if live else None)
                else:
                    array.state, array.error = ArrayState.FAIL, f"worker {worker.name} failed: {result}"
                array.completed_at = now = utcnow()
                # Trials offered after the array's last epoch boundary never joined: re-queue them.
                rows.never_joined(session, array.id)
                # Members still running when the array ended: those whose worker died resume
                # from their checkpoint (at most _MAX_RESUMES times); the others fail with the error.
                # A code package whose env or code failed, or an epoch that overran its deadline:
                # the tenant's fault, not the worker's (resumed, it would do the same again).
                died = not isinstance(result, (ArrayOutcome, PackageError, EpochOverran))
                # Out of memory: the class's arrays on this device type are capped at half this
                # size from now on, and the members wait again for the halves. A model that fuses
                # by neither path: its class trains unfused from now on, one member per array.
                split = self.throughput.split_on_oom(session, worker, array, result) or self._unfuse(session, array, result)
                died = died or split
                tenant = live.tenant if live is not None else session.get_one(Study, array.study_id).tenant
                where: dict[str, Any] = {"tenant": tenant, "study_id": array.study_id, "array_id": array.id}
                requeued: list[int] = []
                for trial in rows.running_in(session, array.id):
                    # The worker reported a checkpoint of it (the store is never looked into); the
                    # halves of an array that ran out of memory take every member, from scratch if need be.
                    resumable = trial.checkpoint_epoch is not None or split
                    if died and resumable and self.state.resumes.get(trial.id, 0) < _MAX_RESUMES:
                        self.state.resumes[trial.id] = self.state.resumes.get(trial.id, 0) + 1
                        trial.state, trial.array_id, trial.started_at = TrialState.WAITING, None, None
                        requeued.append(trial.id)
                        continue
                    error = result.failed.get(trial.id, result.error) if isinstance(result, ArrayOutcome) else None
                    # Loaded only here: an array whose members all ended needs no mirror, and its
                    # study may have completed (and dropped its mirror) with their last epoch.
                    self.mirrors.of_id(session, array.study_id).tell(session, trial.optuna_trial_id, OptunaState.FAIL)
                    trial.state, trial.completed_at, trial.error = TrialState.FAIL, now, error or array.error
                    events.record(session, "trial.ended", **where, trial_id=trial.id, state="FAIL", value=None, error=trial.error)
                events.record(session, "array.ended", **where, state=array.state.value, error=array.error, requeued=requeued)
                session.commit()
                self._fail_package_study(session, array.study_id, result)
            except Exception:
                session.rollback()
                self.notices.rolled_back()
                if live is not None:  # its members were told FAIL in the mirror only
                    self.mirrors.mark_stale(array.study_id, live.optuna_ids.values())
                else:
                    self.mirrors.drop(array.study_id)
                raise
        log.info("array %d ended: %s", spec.array_id, array.state.value)

    def _fail_package_study(self, session: Session, study_id: int, result: ArrayOutcome | BaseException) -> None:
        """An array whose code package failed to set up or load fails its study with the error:
        every array of it would fail the same way."""
        failure = result.package_error if isinstance(result, ArrayOutcome) else str(result) if isinstance(result, PackageError) else None
        if failure is None:
            return
        study = session.get(Study, study_id)
        if study is not None and study.state in (StudyState.RUNNING, StudyState.PAUSED):
            self.lifecycle.fail(session, study, failure)

    def _unfuse(self, session: Session, array: Array, result: ArrayOutcome | BaseException) -> bool:
        """Whether the array ended because its model fuses by neither path (its members wait
        again, to train unfused); its study is told why, naming the module."""
        why = self.throughput.unfuse(session, array, result)
        if why is not None:
            self.notices.add(session, array.study_id, [f"its model fuses by neither path, so its trials train unfused, one per array: {why}"])
        return why is not None

    def maybe_complete(self, session: Session, study: Study) -> None:
        """End ``study`` (COMPLETE, or FAILED when every trial failed) once all its trials
        have, in a transaction of its own."""
        if self.complete_if_done(session, study):
            session.commit()
            self.mirrors.drop(study.id)

    def complete_if_done(self, session: Session, study: Study | None) -> bool:
        """:meth:`maybe_complete` in the caller's transaction: whether the study ended."""
        if study is None or study.state != StudyState.RUNNING:  # it failed in this step (its workload)
            return False
        counts = rows.state_counts(session, study.id)
        finished = sum(n for state, n in counts.items() if state.is_finished)
        if sum(counts.values()) >= study.n_trials and finished == sum(counts.values()):
            study.state, study.completed_at = StudyState.COMPLETE, utcnow()
            self.lifecycle.fail_if_every_trial_failed(session, study, counts)
            events.record(session, "study.completed", tenant=study.tenant, study_id=study.id, trial_counts={s.value: n for s, n in counts.items()})
            return True
        return False
