"""The scheduling loop: ask Optuna for trials, fuse them into arrays, dispatch, record the ends.

It runs in a background thread of the server. Decisions about which trials share an array
are the scheduler's (pure functions over plain data); this module only moves state between
the database, Optuna and the worker pool.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
import torch
from optuna.trial import TrialState as OptunaState
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from scheduler import (
    Device,
    PendingTrial,
    Placement,
    ThroughputModel,
    fit_points,
    make_scheduler,
    pack,
    shape_signature,
)
from scheduler import Tenant as SchedulerTenant
from server.db import (
    Array,
    ArrayMember,
    ArrayState,
    Study,
    StudyState,
    Tenant,
    Throughput,
    Trial,
    TrialState,
    Worker,
    get_optuna_storage,
    get_sessionmaker,
    utcnow,
)
from server.mirror import StudyMirror
from server.optuna_specs import make_pruner, make_sampler
from server.schemas import parse_search_space
from server.settings import Settings
from workers.checkpoints import checkpoint_path
from workers.pool import Event, WorkerHandle, WorkerPool
from workers.spec import ArrayOutcome, ArraySpec, EpochReply, EpochReport, MemberSpec
from workers.workloads import Workload, get_workload

log = logging.getLogger(__name__)

_MAX_RESUMES = 3  # a trial whose workers keep dying fails instead of crashing workers forever


def array_settings(workload: Workload, study: Study, params: Mapping[str, Any]) -> dict[str, Any]:
    """The settings every member of an array must share, beyond its operator shapes."""
    return {
        "workload": workload.name,
        "optimizer": workload.optimizer,
        "batch_size": workload.batch_size_for(params),
        "epochs": study.epochs,
    }


def trial_signature(workload: Workload, study: Study, params: Mapping[str, Any]) -> str:
    """The shape signature of a trial's model, built on the meta device (no memory, no init cost)."""
    with torch.device("meta"):
        model = workload.build_model(params)
    return shape_signature(model, array_settings(workload, study, params)).digest


def _class_of(trial: Trial) -> str:
    """The scheduler's fusion key of a trial: its signature, within its study.

    An array trains the trials of one study (its epochs, pruner and reports are the study's),
    so equal signatures of different studies are different classes.
    """
    return f"{trial.signature}@{trial.study_id}"


class Coordinator:
    """Drives every running study to completion on a :class:`~workers.pool.WorkerPool`.

    It is the control plane's one writer of trial results: workers send it one
    :class:`~workers.spec.EpochReport` per array-epoch, and it writes each in one database
    transaction (every member's intermediate value and end, fusetune's rows, the measured
    throughput), decides pruning with the study's own pruner, and replies.
    """

    def __init__(self, settings: Settings, pool: WorkerPool) -> None:
        self.settings = settings
        self.url = settings.database_url
        self.pool = pool
        self.sessions = get_sessionmaker(self.url)
        self.storage = get_optuna_storage(self.url)
        self._mirrors: dict[int, StudyMirror] = {}  # fusetune study id -> its Optuna study, in memory
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._worker_ids: dict[str, int] = {}
        self._running: dict[str, Placement] = {}  # device -> the array the scheduler placed there
        self._resumes: dict[int, int] = {}  # trial id -> times re-queued from a checkpoint
        # Measured models·steps/s by (signature, device type) and B: ft_throughput, in memory.
        self._points: dict[tuple[str, str], dict[int, float]] = {}
        self.scheduler = make_scheduler(
            settings.scheduling_policy,
            ThroughputModel(prior_marginal_cost=settings.prior_marginal_cost),
            max_members=settings.max_array_size,
            min_member_efficiency=settings.min_member_efficiency,
            lease_seconds=settings.lease_s,
        )
        self._next_refresh = time.monotonic() + settings.device_refresh_s

    # -- lifecycle -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Register the pool's workers, load measured throughput, re-queue what a previous process left running."""
        self._register_workers()
        self._load_throughput()
        self._recover()

    def start(self) -> None:
        """:meth:`setup`, then run the loop in a background thread: worker reports as they
        come, a scheduling :meth:`step` every ``poll_interval_s`` or when woken."""
        self.setup()
        self._thread = threading.Thread(target=self._loop, name="fusetune-coordinator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def wake(self) -> None:
        """Run a scheduling step now (a study was created), not at the next poll."""
        self._wake.set()

    def _loop(self) -> None:
        next_step = 0.0
        while not self._stop.is_set():
            try:
                if self._wake.is_set() or time.monotonic() >= next_step:
                    self._wake.clear()
                    self.step()
                    next_step = time.monotonic() + self.settings.poll_interval_s
                timeout = max(0.0, next_step - time.monotonic())
                if self.pool.idle() != self.pool.workers:
                    if self._handle(self.pool.wait(timeout)):
                        next_step = 0.0  # an array ended: its worker is free for the next one
                else:
                    self._wake.wait(timeout)
            except Exception:  # keep scheduling; the error is in the log and the next step retries
                log.exception("scheduling step failed")
                self._stop.wait(self.settings.poll_interval_s)

    def step(self) -> None:
        """One round: take the workers' reports, ask for new trials, start arrays on idle workers."""
        if time.monotonic() >= self._next_refresh:
            # Accelerator nodes may join the Ray cluster after the service started.
            if self.pool.refresh():
                self._register_workers()
            self._next_refresh = time.monotonic() + self.settings.device_refresh_s
        self._handle(self.pool.wait(0))
        with self.sessions() as session:
            studies = session.scalars(
                select(Study).where(Study.state == StudyState.RUNNING).order_by(Study.id)
            ).all()
            for study in studies:
                self._ask(session, study)
            self._dispatch(session)
            for study in studies:
                self._maybe_complete(session, study)

    def _handle(self, events: Sequence[Event]) -> bool:
        """Answer epoch reports and record ended arrays; returns whether an array ended."""
        ended = False
        for worker, spec, item in events:
            if isinstance(item, EpochReport):
                self.pool.reply(worker, self._record_epoch(worker, item))
            else:
                self._record(worker, spec, item)
                ended = True
                if isinstance(item, BaseException):
                    self._register_workers()  # replacement actors run in new processes
        return ended

    # -- workers -------------------------------------------------------------------------------
    def _register_workers(self) -> None:
        with self.sessions.begin() as session:
            for w in self.pool.workers:
                row = session.scalar(select(Worker).where(Worker.name == w.name))
                if row is None:
                    row = Worker(name=w.name, device_type=w.device_type, node=w.node)
                    session.add(row)
                row.device_type, row.node, row.state, row.last_seen = w.device_type, w.node, "IDLE", utcnow()
                session.flush()
                self._worker_ids[w.name] = row.id

    def _recover(self) -> None:
        """Arrays left RUNNING by a previous server process are gone: re-queue their live trials."""
        with self.sessions.begin() as session:
            orphans = session.scalars(select(Array.id).where(Array.state == ArrayState.RUNNING)).all()
            if not orphans:
                return
            session.execute(
                update(Array)
                .where(Array.id.in_(orphans))
                .values(state=ArrayState.FAIL, error="the service restarted while this array trained", completed_at=utcnow())
            )
            session.execute(
                update(Trial)
                .where(Trial.array_id.in_(orphans), Trial.state.in_([TrialState.WAITING, TrialState.RUNNING]))
                .values(state=TrialState.WAITING, array_id=None, started_at=None)
            )

    # -- asking --------------------------------------------------------------------------------
    def _mirror(self, study: Study) -> StudyMirror:
        """The study's Optuna study in memory, loaded from the database once per process.

        One sampler instance per study and process: a seeded sampler rebuilt for every ask
        would repeat its first suggestion.
        """
        if study.id not in self._mirrors:
            kwargs = dict(study.sampler.get("kwargs") or {})
            sampler = make_sampler(study.sampler["name"], kwargs)
            if isinstance(sampler, optuna.samplers.TPESampler) and "constant_liar" not in kwargs:
                # Trials are asked in batches that fill arrays: the constant liar makes TPE
                # count the running ones, so a batch spreads out instead of repeating itself.
                sampler = make_sampler(study.sampler["name"], {**kwargs, "constant_liar": True})
            pruner = (
                make_pruner(study.pruner["name"], study.pruner.get("kwargs")) if study.pruner else optuna.pruners.NopPruner()
            )
            self._mirrors[study.id] = StudyMirror(self.storage, study.optuna_study_id, sampler, pruner)
        return self._mirrors[study.id]

    def _capacity(self) -> int:
        """How many trials the devices can train at once: the most waiting trials worth asking for."""
        return max(1, len(self.pool.workers)) * self.settings.max_array_size

    def _ask(self, session: Session, study: Study) -> None:
        """Ask the study's sampler for enough trials to fill every device, in one transaction."""
        asked = session.scalar(select(func.count()).where(Trial.study_id == study.id))
        waiting = session.scalar(
            select(func.count()).where(Trial.study_id == study.id, Trial.state == TrialState.WAITING)
        )
        wanted = min(study.n_trials - asked, (self.settings.ask_batch or self._capacity()) - waiting)
        if wanted <= 0:
            return
        workload = get_workload(study.workload)
        mirror = self._mirror(study)
        distributions = parse_search_space(study.search_space) if study.search_space else None
        try:
            for trial in mirror.ask(session, wanted, workload.search_space, distributions):
                row = Trial(study_id=study.id, optuna_trial_id=trial.trial_id, number=trial.number, params=trial.params, signature="")
                error = trial.error
                if error is None:
                    try:
                        row.signature = trial_signature(workload, study, trial.params)
                    except Exception as exc:  # the workload's model rejected these params
                        error = f"{type(exc).__name__}: {exc}"
                        mirror.tell(session, trial.trial_id, OptunaState.FAIL)
                if error is not None:
                    row.state, row.error, row.completed_at = TrialState.FAIL, error, utcnow()
                session.add(row)
            session.commit()
        except Exception:
            session.rollback()
            self._mirrors.pop(study.id, None)  # what it asked was not written: reload from the database
            raise

    # -- dispatching ---------------------------------------------------------------------------
    def _dispatch(self, session: Session) -> None:
        """One scheduling round: the scheduler decides, arrays start on the idle devices it fills.

        The scheduler sees every unfinished trial, every device and the running arrays, and
        returns the placements fair across tenants (by weight) and across device types. A
        placement on an idle device starts an array; waiting trials the scheduler adds to a
        running array's placement (slots its ended members freed) are offered to that array
        and join it at its next epoch boundary. Members the scheduler preempts (their lease ran
        out and their class is over its share) leave at their array's next epoch boundary.
        """
        idle = {w.name: w for w in self.pool.idle()}
        rows = session.execute(
            select(Trial, Study)
            .join(Study, Trial.study_id == Study.id)
            .where(Study.state == StudyState.RUNNING, Trial.state.in_([TrialState.WAITING, TrialState.RUNNING]))
            .order_by(Study.id, Trial.number)
        ).all()
        waiting = {t.id: (t, study) for t, study in rows if t.array_id is None and t.state == TrialState.WAITING}
        if not waiting:
            return
        pending = [
            PendingTrial(trial_id=t.id, signature=_class_of(t), tenant=study.tenant, study_id=study.id, remaining_epochs=study.epochs)
            for t, study in rows
        ]
        weights = [SchedulerTenant(name, weight) for name, weight in session.execute(select(Tenant.name, Tenant.weight))]
        devices = [Device(w.name, w.device_type, w.memory_bytes, w.node) for w in self.pool.workers]
        self._curve_classes({p.signature for p in pending}, {d.device_type for d in devices})
        decision = self.scheduler.decide(time.monotonic(), pending, devices, weights, list(self._running.values()))
        busy = {w.name: w for w in self.pool.workers if not w.idle}
        self._preempt(decision.preempted, busy, rows)
        for placement in decision.placements:  # leases the scheduler extended
            current = self._running.get(placement.device_id)
            if placement.device_id in busy and current is not None and current.signature == placement.signature:
                self._running[placement.device_id] = dataclasses.replace(current, lease_expires=placement.lease_expires)
        for placement in decision.placements:
            ids = [i for i in placement.trial_ids if i in waiting]
            if not ids:
                continue
            study = waiting[ids[0]][1]
            cap = min(len(placement.trial_ids), study.max_array_size or self.settings.max_array_size)
            worker = idle.get(placement.device_id)
            if worker is not None:
                # The scheduler sizes the array; its class's waiting trials are then spread
                # evenly over the arrays they need (9 trials at B=8: 5 now and 4 next, not 8 and 1).
                queue = [PendingTrial(trial_id=i, signature=placement.signature) for i, (t, _) in waiting.items() if _class_of(t) == placement.signature]
                members = [waiting.pop(i)[0] for i in pack(queue, cap)[0].trial_ids]
                self._start_array(session, study, worker, members)
                self._running[worker.name] = Placement(
                    worker.name, placement.signature, study.tenant, tuple(t.id for t in members), placement.lease_expires
                )
            elif placement.device_id in busy and getattr(self._running.get(placement.device_id), "signature", None) == placement.signature:
                # Only slots its ended members freed: the array keeps the size it started with.
                spec = busy[placement.device_id].spec
                present = [t.id for t, _ in rows if t.array_id == spec.array_id]
                joining = [waiting.pop(i)[0] for i in ids[: max(0, min(cap, len(spec.members)) - len(present))]]
                if joining:
                    self._refill(session, busy[placement.device_id], spec.array_id, joining)
                    self._running[placement.device_id] = Placement(
                        placement.device_id, placement.signature, study.tenant,
                        tuple(present + [t.id for t in joining]), placement.lease_expires,
                    )

    def _preempt(self, preempted: Sequence[int], busy: Mapping[str, WorkerHandle], rows: Sequence[Any]) -> None:
        """Ask arrays to let go of the members the scheduler took off them.

        Each leaves at its array's next epoch boundary with a checkpoint, waiting again, and
        resumes in whichever array the scheduler gives it next (workers/checkpoints.py).
        """
        if not preempted:
            return
        worker_of = {w.spec.array_id: w for w in busy.values() if w.spec is not None}
        array_of = {t.id: t.array_id for t, _ in rows if t.state == TrialState.RUNNING}
        asks: dict[str, list[int]] = {}
        for trial_id in preempted:
            worker = worker_of.get(array_of.get(trial_id))
            if worker is not None:
                asks.setdefault(worker.name, []).append(trial_id)
        for name, ids in asks.items():
            self.pool.release(busy[name], ids)
            current = self._running.get(name)
            if current is not None:  # from now on the scheduler counts them as waiting
                self._running[name] = dataclasses.replace(
                    current, trial_ids=tuple(i for i in current.trial_ids if i not in ids)
                )
            log.info("worker %s: %d members leave at the next epoch boundary (preempted)", name, len(ids))

    def _refill(self, session: Session, worker: WorkerHandle, array_id: int, trials: list[Trial]) -> None:
        """Offer waiting trials to a running array: they join it at its next epoch boundary."""
        array = session.get(Array, array_id)
        first = len(array.members)
        array.members.extend(ArrayMember(slot=first + k, trial_id=t.id) for k, t in enumerate(trials))
        for t in trials:
            t.array_id = array_id
        session.commit()
        self.pool.offer(worker, [MemberSpec(t.id, t.optuna_trial_id, t.number, dict(t.params)) for t in trials])
        log.info("array %d: %d trials join at the next epoch boundary", array_id, len(trials))

    def _start_array(self, session: Session, study: Study, worker: WorkerHandle, trials: list[Trial]) -> None:
        array = Array(study_id=study.id, signature=trials[0].signature, worker_id=self._worker_ids.get(worker.name))
        array.members = [ArrayMember(slot=i, trial_id=t.id) for i, t in enumerate(trials)]
        session.add(array)
        session.flush()
        now = utcnow()
        for t in trials:
            t.array_id, t.state, t.started_at = array.id, TrialState.RUNNING, now
        session.commit()
        spec = ArraySpec(
            array_id=array.id,
            signature=_class_of(trials[0]),
            study_name=study.name,
            workload=study.workload,
            epochs=study.epochs,
            members=tuple(MemberSpec(t.id, t.optuna_trial_id, t.number, dict(t.params)) for t in trials),
            seed=array.id,
            artifact_dir=str(self.settings.artifact_dir.resolve()),
            checkpoint_frequency=self.settings.checkpoint_frequency,
            checkpoint_interval_s=self.settings.checkpoint_interval_s,
            # The class's solo speed is the B = 1 point of its curve: measured once per
            # signature and device type, by a short unfused probe in its first array.
            probe_solo=len(trials) > 1 and 1 not in self._points.get((array.signature, worker.device_type), {}),
        )
        self.pool.submit(worker, spec)
        log.info("array %d: %d trials of study %s on %s", array.id, len(trials), study.name, worker.name)

    # -- recording -----------------------------------------------------------------------------
    def _record_epoch(self, worker: WorkerHandle, report: EpochReport) -> EpochReply:
        """Write one array-epoch in one transaction; decide pruning; return the reply.

        Every member's intermediate value goes to its Optuna trial (so Optuna's pruners,
        ``optuna.load_study`` and optuna-dashboard see it); members that ended are told to
        Optuna (``Study.tell``, the sampler's ``after_trial`` included) and fusetune's rows
        follow. The study's pruner decides for the others, on the study as the control
        plane holds it. The measured throughput updates the class's curve.
        """
        with self.sessions() as session:
            array = session.get(Array, report.array_id)
            study = session.get(Study, array.study_id)
            mirror = self._mirror(study)
            prune: set[int] = set()
            try:
                ids = {m.trial_id for m in report.members} | {j.trial_id for j in report.joined} | set(report.released)
                trials = {t.id: t for t in session.scalars(select(Trial).where(Trial.id.in_(ids)))}
                now = utcnow()
                for joined in report.joined:
                    trial = trials[joined.trial_id]
                    trial.state, trial.started_at = TrialState.RUNNING, trial.started_at or now
                    if joined.resumed_at_epoch is not None:  # one entry per move or crash
                        before = mirror.trial(trial.optuna_trial_id).user_attrs.get("resumed_at_epochs", [])
                        mirror.set_user_attrs(session, trial.optuna_trial_id, {"resumed_at_epochs": [*before, joined.resumed_at_epoch]})
                mirror.report(session, [(trials[m.trial_id].optuna_trial_id, m.step, m.value) for m in report.members])
                for member in report.members:
                    trial = trials[member.trial_id]
                    if member.state == "COMPLETE":
                        if member.state_dict is not None:  # where its trained weights are
                            mirror.set_user_attrs(session, trial.optuna_trial_id, {"state_dict": member.state_dict})
                        mirror.tell(session, trial.optuna_trial_id, OptunaState.COMPLETE, member.value)
                        self._finish(trial, TrialState.COMPLETE, now, value=member.value)
                    elif member.state == "FAIL":
                        mirror.tell(session, trial.optuna_trial_id, OptunaState.FAIL)
                        self._finish(trial, TrialState.FAIL, now, error=member.error)
                    elif mirror.should_prune(session, trial.optuna_trial_id):
                        mirror.tell(session, trial.optuna_trial_id, OptunaState.PRUNED)
                        self._finish(trial, TrialState.PRUNED, now, value=member.value)
                        prune.add(member.trial_id)
                for trial_id in report.released:  # preempted: waits for its next array, Optuna keeps it RUNNING
                    trials[trial_id].state, trials[trial_id].array_id, trials[trial_id].started_at = TrialState.WAITING, None, None
                array.epochs_done += 1
                array.timings = _add_timings(array.timings, report.timings)
                self._observe(session, worker.spec.signature, worker.device_type, report)
                session.commit()
            except Exception:
                session.rollback()
                self._mirrors.pop(study.id, None)  # the mirror ran ahead of the database: reload it
                raise
        return EpochReply(prune=frozenset(prune))

    @staticmethod
    def _finish(trial: Trial, state: TrialState, now: Any, value: float | None = None, error: str | None = None) -> None:
        trial.state, trial.completed_at, trial.error = state, now, error
        trial.value = value if value is not None and math.isfinite(value) else None

    def _load_throughput(self) -> None:
        """The speeds measured by earlier arrays, also by an earlier process: no new dry runs."""
        with self.sessions() as session:
            for row in session.scalars(select(Throughput)):
                self._points.setdefault((row.signature, row.device_type), {})[row.members] = row.models_steps_per_s

    def _observe(self, session: Session, cls: str, device_type: str, report: EpochReport) -> None:
        """Fold an array-epoch's measured speed into ft_throughput and the class's curve."""
        signature = cls.split("@", 1)[0]
        measured = []
        if report.train_seconds > 0 and report.size > 0:
            measured.append((report.size, report.member_steps / report.train_seconds))
        if report.solo_steps_per_s:
            measured.append((1, report.solo_steps_per_s))
        if not measured:
            return
        points = self._points.setdefault((signature, device_type), {})
        smoothing = self.settings.throughput_smoothing
        for members, rate in measured:
            row = session.get(Throughput, (signature, device_type, members))
            if row is None:
                session.add(Throughput(signature=signature, device_type=device_type, members=members, models_steps_per_s=rate, samples=1))
            else:
                row.models_steps_per_s = (1 - smoothing) * row.models_steps_per_s + smoothing * rate
                row.samples += 1
                rate = row.models_steps_per_s
            points[members] = rate
        self.scheduler.throughput.set_curve(cls, device_type, fit_points(points, self.settings.prior_marginal_cost))

    def _curve_classes(self, classes: set[str], device_types: set[str]) -> None:
        """Give the scheduler each class's curve fitted to its signature's measured points."""
        for cls in classes:
            signature = cls.split("@", 1)[0]
            for device_type in device_types:
                points = self._points.get((signature, device_type))
                if points:
                    self.scheduler.throughput.set_curve(cls, device_type, fit_points(points, self.settings.prior_marginal_cost))

    def _record(self, worker: WorkerHandle, spec: ArraySpec, result: ArrayOutcome | BaseException) -> None:
        """An array ended: its outcome, or the error that ended it (its worker's death included)."""
        self._running.pop(worker.name, None)
        with self.sessions() as session:
            array = session.get(Array, spec.array_id)
            study = session.get(Study, array.study_id)
            mirror = self._mirror(study)
            try:
                if isinstance(result, ArrayOutcome):
                    array.state = ArrayState.FAIL if result.error else ArrayState.COMPLETE
                    array.error = result.error
                    array.models_steps_per_s = result.models_steps_per_s
                    array.timings = result.timings or array.timings
                else:
                    array.state, array.error = ArrayState.FAIL, f"worker {worker.name} failed: {result}"
                array.completed_at = now = utcnow()
                # Trials offered after the array's last epoch boundary never joined: re-queue them.
                for trial in session.scalars(select(Trial).where(Trial.array_id == array.id, Trial.state == TrialState.WAITING)):
                    trial.array_id = None
                    session.execute(delete(ArrayMember).where(ArrayMember.array_id == array.id, ArrayMember.trial_id == trial.id))
                # Members still running when the array ended: those whose worker died resume
                # from their checkpoint (at most _MAX_RESUMES times); the others fail with the error.
                died = not isinstance(result, ArrayOutcome)
                for trial in session.scalars(select(Trial).where(Trial.array_id == array.id, Trial.state == TrialState.RUNNING)):
                    resumable = spec.artifact_dir is not None and checkpoint_path(spec.artifact_dir, spec.study_name, trial.number).exists()
                    if died and resumable and self._resumes.get(trial.id, 0) < _MAX_RESUMES:
                        self._resumes[trial.id] = self._resumes.get(trial.id, 0) + 1
                        trial.state, trial.array_id, trial.started_at = TrialState.WAITING, None, None
                        continue
                    error = result.failed.get(trial.id, result.error) if isinstance(result, ArrayOutcome) else None
                    mirror.tell(session, trial.optuna_trial_id, OptunaState.FAIL)
                    self._finish(trial, TrialState.FAIL, now, error=error or array.error)
                session.commit()
            except Exception:
                session.rollback()
                self._mirrors.pop(study.id, None)
                raise
        log.info("array %d ended: %s", spec.array_id, array.state.value)

    def _maybe_complete(self, session: Session, study: Study) -> None:
        counts = dict(
            session.execute(
                select(Trial.state, func.count()).where(Trial.study_id == study.id).group_by(Trial.state)
            ).all()
        )
        finished = sum(n for state, n in counts.items() if state.is_finished)
        if sum(counts.values()) >= study.n_trials and finished == sum(counts.values()):
            study.state, study.completed_at = StudyState.COMPLETE, utcnow()
            session.commit()
            self._mirrors.pop(study.id, None)


def _add_timings(total: Mapping[str, float] | None, more: Mapping[str, float]) -> dict[str, float]:
    out = dict(total or {})
    for phase, seconds in more.items():
        out[phase] = out.get(phase, 0.0) + seconds
    return out
