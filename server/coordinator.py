"""The scheduling loop: ask Optuna for trials, fuse them into arrays, dispatch, record the ends.

It runs in a background thread of the server. Decisions about which trials share an array
are the scheduler's (pure functions over plain data); this module only moves state between
the database, Optuna and the worker pool.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
import torch
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from scheduler import (
    Device,
    PendingTrial,
    Placement,
    SpeedupCurve,
    ThroughputModel,
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
    Trial,
    TrialState,
    Worker,
    get_optuna_storage,
    get_sessionmaker,
    utcnow,
)
from server.optuna_specs import make_sampler
from server.schemas import parse_search_space
from server.settings import Settings
from workers.checkpoints import checkpoint_path
from workers.pool import WorkerHandle, WorkerPool
from workers.spec import ArrayOutcome, ArraySpec, MemberSpec
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
    """Drives every running study to completion on a :class:`~workers.pool.WorkerPool`."""

    def __init__(self, settings: Settings, pool: WorkerPool) -> None:
        self.settings = settings
        self.url = settings.database_url
        self.pool = pool
        self.sessions = get_sessionmaker(self.url)
        self.storage = get_optuna_storage(self.url)
        self._optuna_studies: dict[int, optuna.Study] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._worker_ids: dict[str, int] = {}
        self._running: dict[str, Placement] = {}  # device -> the array the scheduler placed there
        self._resumes: dict[int, int] = {}  # trial id -> times re-queued from a checkpoint
        self._sized: set[tuple[str, str]] = set()  # (class, device type) with a measured curve
        self.scheduler = make_scheduler(
            settings.scheduling_policy,
            ThroughputModel(prior_marginal_cost=settings.prior_marginal_cost),
            max_members=settings.max_array_size,
            lease_seconds=settings.lease_s,
        )
        self._next_refresh = time.monotonic() + settings.device_refresh_s

    # -- lifecycle -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Register the pool's workers and re-queue what a previous process left running."""
        self._register_workers()
        self._recover()

    def start(self) -> None:
        """:meth:`setup`, then run :meth:`step` every ``poll_interval_s`` in a background thread."""
        self.setup()
        self._thread = threading.Thread(target=self._loop, name="fusetune-coordinator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # keep scheduling; the error is in the log and the next step retries
                log.exception("scheduling step failed")
            self._stop.wait(self.settings.poll_interval_s)

    def step(self) -> None:
        """One round: record finished arrays, ask for new trials, start arrays on idle workers."""
        if time.monotonic() >= self._next_refresh:
            # Accelerator nodes may join the Ray cluster after the service started.
            if self.pool.refresh():
                self._register_workers()
            self._next_refresh = time.monotonic() + self.settings.device_refresh_s
        finished = self.pool.poll()
        for worker, spec, result in finished:
            self._record(worker, spec, result)
        if any(isinstance(result, BaseException) for _, _, result in finished):
            self._register_workers()  # replacement actors run in new processes
        with self.sessions() as session:
            studies = session.scalars(
                select(Study).where(Study.state == StudyState.RUNNING).order_by(Study.id)
            ).all()
            for study in studies:
                self._ask(session, study)
            self._dispatch(session)
            for study in studies:
                self._maybe_complete(session, study)

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
    def _optuna_study(self, study: Study) -> optuna.Study:
        # One sampler instance per study and process: a seeded sampler rebuilt for every ask
        # would repeat its first suggestion.
        if study.id not in self._optuna_studies:
            self._optuna_studies[study.id] = optuna.load_study(
                study_name=study.name,
                storage=self.storage,
                sampler=make_sampler(study.sampler["name"], study.sampler.get("kwargs")),
            )
        return self._optuna_studies[study.id]

    def _ask(self, session: Session, study: Study) -> None:
        asked = session.scalar(select(func.count()).where(Trial.study_id == study.id))
        waiting = session.scalar(
            select(func.count()).where(Trial.study_id == study.id, Trial.state == TrialState.WAITING)
        )
        wanted = min(study.n_trials - asked, self.settings.ask_batch - waiting)
        if wanted <= 0:
            return
        workload = get_workload(study.workload)
        optuna_study = self._optuna_study(study)
        distributions = parse_search_space(study.search_space) if study.search_space else None
        for _ in range(wanted):
            trial = optuna_study.ask(fixed_distributions=distributions)
            row = Trial(study_id=study.id, optuna_trial_id=trial._trial_id, number=trial.number, params={}, signature="")
            try:
                params = trial.params if distributions else workload.search_space(trial)
                row.params = dict(params)
                row.signature = trial_signature(workload, study, params)
            except Exception as exc:  # the workload's own code rejected these params
                # Straight to the storage: a sampler's after_trial hook may raise outside an
                # objective (BruteForceSampler calls Study.stop), which would lose the FAIL.
                self.storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)
                row.state, row.error, row.completed_at = TrialState.FAIL, f"{type(exc).__name__}: {exc}", utcnow()
            session.add(row)
            session.commit()

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
        for t in trials:
            t.array_id = array.id
        session.commit()
        spec = ArraySpec(
            array_id=array.id,
            signature=_class_of(trials[0]),
            database_url=self.url,
            study_name=study.name,
            workload=study.workload,
            epochs=study.epochs,
            members=tuple(MemberSpec(t.id, t.optuna_trial_id, t.number, dict(t.params)) for t in trials),
            pruner=study.pruner,
            seed=array.id,
            artifact_dir=str(self.settings.artifact_dir.resolve()),
        )
        self.pool.submit(worker, spec)
        log.info("array %d: %d trials of study %s on %s", array.id, len(trials), study.name, worker.name)

    # -- recording -----------------------------------------------------------------------------
    def _record(self, worker: WorkerHandle, spec: ArraySpec, result: ArrayOutcome | BaseException) -> None:
        self._running.pop(worker.name, None)
        if isinstance(result, ArrayOutcome):
            self._learn(spec.signature, worker.device_type, result)
        # Optuna writes through its own connection: end its trials before opening our write
        # transaction, which on SQLite would hold the only write lock while Optuna waits.
        with self.sessions() as session:
            running = session.execute(
                select(Trial.id, Trial.optuna_trial_id, Trial.number)
                .where(Trial.array_id == spec.array_id, Trial.state == TrialState.RUNNING)
            ).all()
        # Members whose worker died mid-array: those checkpointed at an epoch boundary go back
        # to the queue and resume there (at most _MAX_RESUMES times); the others fail.
        resumed, orphaned = [], []
        for trial_id, optuna_trial_id, number in running:
            resumable = spec.artifact_dir is not None and checkpoint_path(spec.artifact_dir, spec.study_name, number).exists()
            if resumable and self._resumes.get(trial_id, 0) < _MAX_RESUMES:
                self._resumes[trial_id] = self._resumes.get(trial_id, 0) + 1
                resumed.append(trial_id)
            else:
                orphaned.append(optuna_trial_id)
        for optuna_trial_id in orphaned:
            if self.storage.get_trial(optuna_trial_id).state == optuna.trial.TrialState.RUNNING:
                self.storage.set_trial_state_values(optuna_trial_id, optuna.trial.TrialState.FAIL)
        with self.sessions.begin() as session:
            array = session.get(Array, spec.array_id)
            if isinstance(result, ArrayOutcome):
                array.state = ArrayState.FAIL if result.error else ArrayState.COMPLETE
                array.error = result.error
                array.models_steps_per_s = result.models_steps_per_s
            else:
                array.state, array.error = ArrayState.FAIL, f"worker {worker.name} failed: {result}"
            array.completed_at = utcnow()
            # Trials offered after the array's last epoch boundary never joined: re-queue them.
            never_joined = session.scalars(
                select(Trial).where(Trial.array_id == array.id, Trial.state == TrialState.WAITING)
            ).all()
            for trial in never_joined:
                trial.array_id = None
                session.execute(delete(ArrayMember).where(ArrayMember.array_id == array.id, ArrayMember.trial_id == trial.id))
            session.execute(
                update(Trial).where(Trial.id.in_(resumed)).values(state=TrialState.WAITING, array_id=None, started_at=None)
            )
            if resumed:
                log.info("array %d: %d trials resume from their checkpoints", spec.array_id, len(resumed))
            # Members the worker could not end itself (it died) fail with the array's error.
            for trial in session.scalars(select(Trial).where(Trial.optuna_trial_id.in_(orphaned))):
                trial.state, trial.error, trial.completed_at = TrialState.FAIL, array.error, utcnow()

    def _learn(self, signature: str, device_type: str, outcome: ArrayOutcome) -> None:
        """Learn a class's curve on a device type from what its worker measured.

        The first array's dry runs replace the prior: the fusion engine's sizing decides
        whether fusing pays on this device at all (if not, the marginal cost is 1 and the
        scheduler runs the class unfused), how many members fit in memory, and the solo
        speed. How fast the array grows with B keeps the prior marginal cost: on shared CPUs,
        per-B timings of millisecond steps are too noisy to shrink arrays by
        (``docs/scheduling.md``). Every finished array's measured models·steps/s then
        updates the class's speed on the device type (an exponential average), which is what
        placement across device types decides with; it leaves the array size alone.
        """
        if outcome.sizing is not None and (signature, device_type) not in self._sized:
            self._seed(signature, device_type, outcome.sizing)
        if outcome.models_steps_per_s and outcome.members >= 1 and (signature, device_type) in self._sized:
            self.scheduler.throughput.observe(
                signature, device_type, outcome.members, outcome.models_steps_per_s, learn_marginal_cost=False
            )

    def _seed(self, signature: str, device_type: str, sizing: dict[str, Any]) -> None:
        """Replace the class's prior curve on the device type with the dry runs' verdict."""
        if sizing["solo_steps_per_s"] <= 0:
            return
        self.scheduler.throughput.set_curve(
            signature,
            device_type,
            SpeedupCurve(
                sizing["solo_steps_per_s"],
                self.settings.prior_marginal_cost if sizing["fusion_pays"] else 1.0,
                sizing["base_bytes"],
                sizing["member_bytes"],
            ),
        )
        self._sized.add((signature, device_type))
        log.info(
            "class %s on %s: fusion %s (speed-ups by B %s)",
            signature, device_type, "pays" if sizing["fusion_pays"] else "does not pay", sizing["speedup"],
        )

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
            self._optuna_studies.pop(study.id, None)
