"""The scheduling loop: ask Optuna for trials, fuse them into arrays, dispatch, record the ends.

It runs in a background thread of the server. Decisions about which trials share an array
are the scheduler's (pure functions over plain data); this module only moves state between
the database, Optuna and the worker pool.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
import math
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

import optuna
from optuna.trial import TrialState as OptunaState
from sqlalchemy import and_, bindparam, delete, func, insert, or_, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from fusetune.workers.samplers import FusionSampler, non_fusible_params
from fusetune.scheduler import (
    Device,
    PendingTrial,
    Placement,
    ThroughputModel,
    fit_points,
    make_scheduler,
    pack,
)
from fusetune.scheduler import Tenant as SchedulerTenant
from fusetune.server.db import (
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
    get_loop_sessionmaker,
    utcnow,
)
from fusetune.server import events, reads
from fusetune.server.fencing import StaleScheduler, fence, take_epoch
from fusetune.server.lifecycle import STOPPING, StudyLifecycle
from fusetune.server.db.bulk import add_updates, insert_returning, insert_rows
from fusetune.server.db.revisions import inserting_trials, next_revision, touch_trials
from fusetune.server.mirror import CreatedStudy, StudyMirror
from fusetune.server.optuna_specs import SpecError, SpecLimits, check_stored, make_pruner, make_sampler, service_sampler_kwargs
from fusetune.server.purge import Purge, StudyPurger
from fusetune.server.schemas import TRAINING_ATTR, parse_search_space
from fusetune.server.errors import Conflict, Unavailable
from fusetune.server.settings import Settings, artifact_uri
from fusetune.workers.signature import trial_signature
from fusetune.workers.pool import Event, WorkerHandle, WorkerPool
from fusetune.workers.spec import ArrayOutcome, ArraySpec, EpochReply, EpochReport, MemberSpec, TrainingSpec
from fusetune.workers.workloads import get_workload

log = logging.getLogger(__name__)

_MAX_RESUMES = 3  # a trial whose workers keep dying fails instead of crashing workers forever
_T = TypeVar("_T")
# While a client's pruning decisions are awaited, the loop looks at its inbox this often.
_DECISION_POLL_S = 0.01
# While the database is unreachable the loop retries at most this far apart.
_MAX_DB_RETRY_S = 5.0
# Most array-epochs one transaction records: a bounded transaction (and rollback) when many
# workers report at once.
_GROUP_COMMIT = 64
# Members this many epochs (or fewer) from their last are offered a successor at once, to
# join where they leave: the offer must reach the worker before that boundary. Epochs of
# small models are shorter than a scheduling round on a busy machine (the digits MLP's take
# 10 ms; a round on PostgreSQL with a backlog, tens of ms), so the look-ahead covers at
# least _LOOKAHEAD_S of the array's epochs as last measured, and at least this many epochs.
_LOOKAHEAD_EPOCHS = 2
_LOOKAHEAD_S = 0.25
# An array is split onto an idle device only when that is estimated to end its members this
# much sooner (a fraction of their time left): see split_plan.
_SPLIT_MIN_GAIN = 0.25
# How long the rows of a study this process created are kept for its first mirror (adopt).
_CREATED_TTL_S = 60.0


def database_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it, e.g. under Optuna's StorageInternalError) says the
    database cannot be used now: worth retrying, unlike a bug or bad data. A scheduler that
    another has replaced (:class:`~fusetune.server.fencing.StaleScheduler`) counts too: like
    an outage, it is no study's fault, and the loop stops on it (see ``_loop``)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError, StaleScheduler)):
            return True
        if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _stale(exc: BaseException | None) -> bool:
    """Whether ``exc``, or what caused it, says another server is the scheduler of record now."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, StaleScheduler):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


@dataclass
class _Awaiting:
    """An array-epoch of a client-driven study whose reply waits for the client's decisions."""

    worker: WorkerHandle
    steps: dict[int, int]  # fusetune trial id -> the step its decision is for
    prune: set[int] = field(default_factory=set)


def group_size(study: Study, settings: Settings, devices: int) -> int:
    """How many trials FusionSampler gives one set of shape-changing values: one device's array.

    A batch of asks fills every device (``devices`` × the array size, at most ``n_trials`` and
    the study's ``max_concurrent_trials``);
    each group fills one device, so a sweep that fits on the devices at once still explores
    as many shapes as there are devices, instead of one shape in one group of the array size.
    """
    cap = study.max_array_size or settings.max_array_size
    batch = min(study.n_trials, settings.ask_batch or devices * cap, study.max_concurrent_trials or study.n_trials)
    return max(1, min(cap, math.ceil(batch / max(1, devices))))


_NON_FUSIBLE: dict[tuple[str, str], frozenset[str]] = {}  # (workload, search space) -> its non-fusible params


def study_sampler(study: Study, settings: Settings, devices: int = 1) -> optuna.samplers.BaseSampler:
    """The sampler the service asks a study's trials from, built from the study's spec.

    Unless the study opted out (``fusion_sampler``), it is a :class:`FusionSampler` around
    the named sampler: the parameters that change ``trial_signature`` (derived from the
    workload's space by that function) are sampled once per group of up to an array's size.
    """
    # Built once, with only the kwargs that are not Optuna's defaults (TPE's constant liar,
    # which batches of asks need, where Optuna does not default to it).
    name = study.sampler["name"]
    sampler = make_sampler(name, service_sampler_kwargs(name, study.sampler.get("kwargs") or {}), SpecLimits.of(settings))
    if not study.sampler.get("fusion", True):
        return sampler
    workload = get_workload(study.workload)
    # Deriving them probes ~150 signatures (0.5 s on the 2-core machine): once per workload
    # and space in a process, not once per study, or every study's first array waits for it.
    # A study's epochs are the same for all its trials, so they never change the answer.
    key = (study.workload, json.dumps(study.search_space, sort_keys=True))
    try:
        if key not in _NON_FUSIBLE:
            _NON_FUSIBLE[key] = non_fusible_params(
                workload,
                distributions=parse_search_space(study.search_space) if study.search_space else None,
                signature=lambda params: trial_signature(workload, params),
            )
        return FusionSampler(sampler, non_fusible=_NON_FUSIBLE[key], group_size=group_size(study, settings, devices))
    except ValueError as exc:
        # No probe of the space built a model: its trials will fail one by one with their
        # own errors, as they do without FusionSampler; the study must not stop asking.
        log.warning("study %s samples without FusionSampler: %s", study.name, exc)
        return sampler


def training_seed(study: Study) -> int:
    """The seed of a study's inits and data orders: its sampler's seed when it names one, so
    that the same study run twice, on SQLite or on PostgreSQL, trains the same models from
    the same asks; otherwise its id."""
    seed = (study.sampler.get("kwargs") or {}).get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else study.id


def _class_of(trial: Trial) -> str:
    """The scheduler's fusion key of a trial: its signature, within its study.

    An array trains the trials of one study (its epochs, pruner and reports are the study's),
    so equal signatures of different studies are different classes.
    """
    return f"{trial.signature}@{trial.study_id}"


class Coordinator(StudyLifecycle):
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
        self.sessions = get_loop_sessionmaker(self.url)
        self.storage = get_optuna_storage(self.url)
        self._mirrors: dict[int, StudyMirror] = {}  # fusetune study id -> its Optuna study, in memory
        # Study id -> Optuna trial ids whose mirrored state ran ahead of a transaction that
        # rolled back: read again before the mirror is next used (StudyMirror.reload_trials).
        self._stale: dict[int, set[int]] = {}
        # Studies created in this process, not mirrored yet: their Optuna rows, and when (adopt).
        self._created: dict[int, tuple[CreatedStudy, float]] = {}
        self._created_lock = threading.Lock()
        self._training: dict[int, TrainingSpec] = {}  # fusetune study id -> its training settings (fixed)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._worker_ids: dict[str, int] = {}
        self._running: dict[str, Placement] = {}  # device -> the array the scheduler placed there
        self._moves: dict[str, list[int]] = {}  # idle device -> members leaving an array for it (_split_for_idle)
        self._resumes: dict[int, int] = {}  # trial id -> times re-queued from a checkpoint
        # Worker events not yet written (the database was unreachable), oldest first.
        self._backlog: deque[Event] = deque()
        self._reregister = False  # workers changed: write them to ft_workers at the next step
        # Largest array of a class on a device type since an array of it ran out of memory there.
        self._oom_caps: dict[tuple[str, str], int] = {}
        self._memory_models: dict[str, tuple[int, int]] = {}  # signature -> (base, member) bytes
        self._memory_pending: dict[str, tuple[Any, float]] = {}  # signature -> (its measurement on a worker, since)
        self._specs_usable: set[int] = set()  # studies whose stored sampler and pruner passed the caps
        self._live: dict[int, _Live] = {}  # array id -> what reports need of the arrays running now
        # Measured models·steps/s by (signature, device type) and B: ft_throughput, in memory.
        self._points: dict[tuple[str, str], dict[int, float]] = {}
        # Speeds observed in the transaction being written, written once each at its end:
        # (signature, device type, B) -> (smoothed rate, samples added, whether its row is new).
        self._observed: dict[tuple[str, str, int], tuple[float, int, bool]] = {}
        self.scheduler = make_scheduler(
            settings.scheduling_policy,
            ThroughputModel(prior_marginal_cost=settings.prior_marginal_cost),
            max_members=settings.max_array_size,
            min_member_efficiency=settings.min_member_efficiency,
            lease_seconds=settings.lease_s,
        )
        self._next_refresh = time.monotonic() + settings.device_refresh_s
        # Calls from request threads (enqueue, pruning decisions) run on the loop thread,
        # which alone touches the mirrors.
        self._inbox: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._awaiting: dict[int, _Awaiting] = {}  # array id -> its epoch waiting for a client
        self._halting: dict[int, StudyState] = {}  # paused or stopping studies: their members leave (lifecycle.py)
        self._leaving: dict[int, set[int]] = {}  # array id -> members asked to leave it
        #: Array-epoch reports recorded by this process (GET /metrics: fusetune_epoch_reports_total).
        self.reports_ingested = 0
        self._next_prune = 0.0  # when old events are pruned next (monotonic)
        self._studies_running = 0  # as the last step saw them
        self._heap_settled = False  # see _settle_heap
        #: The fencing epoch this scheduler took (server/fencing.py), once set up.
        self.epoch: int | None = None
        #: Called (on the loop thread) when another server has become the scheduler of record
        #: and this loop has stopped: the server's leadership steps down (server/leader.py).
        self.on_fenced: Callable[[], None] | None = None
        self._purger: StudyPurger | None = None  # removes deleted studies' rows, once set up

    # -- lifecycle -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Become the scheduler of record (a new fencing epoch: every later commit checks it),
        register the pool's workers, load measured throughput, re-queue what a previous
        process left running."""
        plain = get_loop_sessionmaker(self.url)
        self.epoch = take_epoch(plain)
        self.sessions = fence(plain, self.epoch)
        self._purger = StudyPurger(
            self.sessions, artifact_uri(self.settings), self.settings.delete_batch_trials,
            finish=lambda purge: self.post(lambda: self._finish_delete(purge)),
        )
        self._register_workers()
        self._load_throughput()
        self._recover()
        self._prune_events()
        with self.sessions() as session:  # studies deleted before a restart that are not gone yet
            hidden = session.execute(
                select(Study.id, Study.optuna_study_id, Study.name)
                .where(Study.state == StudyState.DELETING, Study.completed_at.is_not(None))
            ).all()
        for study_id, optuna_study_id, name in hidden:
            self._purge(Purge(study_id, optuna_study_id, name))

    def _purge(self, purge: Purge) -> None:
        """Have a hidden study's artifacts and rows removed, off this thread (server/purge.py)."""
        if self._purger is None:
            raise RuntimeError("the coordinator is not set up")
        self._purger.submit(purge)

    def _purge_now(self, purge: Purge) -> None:
        """Remove a small hidden study's artifacts and rows on this thread."""
        if self._purger is None:
            raise RuntimeError("the coordinator is not set up")
        self._purger.purge(purge)

    def post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the loop thread at its next turn, without waiting for it (any thread).
        With no loop running (tests drive :meth:`step` themselves), the next step runs it."""
        self._inbox.put((fn, Future()))
        self._wake.set()

    def _prune_events(self) -> None:
        """Drop events past FUSETUNE_EVENTS_RETENTION_S: at start-up, then hourly."""
        with self.sessions.begin() as session:
            events.prune(session, self.settings.events_retention_s)
        self._next_prune = time.monotonic() + min(3600.0, self.settings.events_retention_s)

    def start(self) -> None:
        """:meth:`setup`, then run the loop in a background thread: worker reports as they
        come, a scheduling :meth:`step` every ``poll_interval_s`` or when woken."""
        self.setup()
        self._thread = threading.Thread(target=self._loop, name="fusetune-coordinator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if self._purger is not None:
            self._purger.stop()

    def wake(self) -> None:
        """Run a scheduling step now (a study was created), not at the next poll."""
        self._wake.set()

    def adopt(self, study_id: int, created: CreatedStudy) -> None:
        """A study this process has just created (``created``: its Optuna rows): its mirror is
        built from them, reading nothing back, and a scheduling step runs now. Any thread."""
        with self._created_lock:
            now = time.monotonic()
            # Kept for the loop's next steps only: a study no step mirrors soon (a client-driven
            # one whose client has not enqueued yet) is read from the database as ever. Only
            # this leader's loop writes the study's trials, so until it mirrors the study the
            # rows are all there is.
            for stale in [i for i, (_, at) in self._created.items() if now - at > _CREATED_TTL_S]:
                del self._created[stale]
            self._created[study_id] = (created, now)
        self.wake()

    def call(self, fn: Callable[[], _T], timeout: float | None = None) -> _T:
        """Run ``fn`` on the loop thread, which owns the studies' mirrors, and return its result.

        Raises:
            service.Unavailable: the loop did not take ``fn`` up within ``timeout`` seconds
                (``FUSETUNE_LOOP_CALL_TIMEOUT_S``); ``fn`` is withdrawn and never runs, so
                a request answered 503 changed nothing. One the loop has begun is waited for.
        """
        if self._stop.is_set():
            raise Unavailable("this server's scheduling loop has stopped; another server may schedule now")
        if self._thread is None or not self._thread.is_alive():
            return fn()  # no loop (tests drive step() themselves): this thread is the only one
        future: Future[_T] = Future()
        self._inbox.put((fn, future))
        self._wake.set()
        try:
            return future.result(self.settings.loop_call_timeout_s if timeout is None else timeout)
        except FutureTimeout:
            if not future.cancel():
                return future.result()  # the loop is running it: its answer is the request's
            raise Unavailable("the scheduling loop is busy and did not take this request up; nothing was done") from None

    def _run_inbox(self) -> None:
        while True:
            try:
                fn, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue  # its caller stopped waiting and was told nothing was done
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller's thread raises it
                future.set_exception(exc)

    def _loop(self) -> None:
        next_step = 0.0
        failures = 0  # database errors in a row
        while not self._stop.is_set():
            try:
                self.pool.heartbeat()  # a hung worker is killed; its stream then says so
                self._run_inbox()
                if self._backlog and self._handle(()):  # what the database refused earlier, in order, first
                    next_step = 0.0
                if self._wake.is_set() or time.monotonic() >= next_step:
                    self._wake.clear()
                    self.step()
                    next_step = time.monotonic() + self.settings.poll_interval_s
                failures = 0
                timeout = max(0.0, next_step - time.monotonic())
                if self._awaiting:
                    timeout = min(timeout, _DECISION_POLL_S)
                timeout = min(timeout, self.settings.heartbeat_interval_s)
                if self.pool.idle() != self.pool.workers:
                    if self._handle(self.pool.wait(timeout)):
                        next_step = 0.0  # a worker or slots are free for waiting trials
                else:
                    self._settle_heap()
                    self._wake.wait(timeout)
            except Exception as exc:  # keep scheduling; the error is in the log and the next step retries
                if _stale(exc):
                    # Another server schedules now: nothing this loop writes would land. It
                    # stops, and its server steps down to a standby (its workers go too).
                    log.error("%s: this server stops scheduling", exc)
                    self._stop.set()
                    if self.on_fenced is not None:
                        self.on_fenced()
                    return
                if not database_unavailable(exc):
                    log.exception("scheduling step failed")
                    self._stop.wait(self.settings.poll_interval_s)
                    continue
                # The database is unreachable: workers train on, their reports wait in the
                # backlog (nothing is lost), and the loop retries with a growing delay.
                failures += 1
                delay = min(_MAX_DB_RETRY_S, self.settings.db_retry_s * 2 ** min(failures - 1, 10))
                log.warning("database unavailable (%s): %d reports wait; retrying in %.1f s",
                            type(exc).__name__, len(self._backlog), delay)
                self._stop.wait(delay)

    #: A round's read of its studies (see :meth:`step`).
    _round_studies = (
        select(Study)
        .where(or_(Study.state == StudyState.RUNNING, and_(Study.state.in_(STOPPING), Study.completed_at.is_(None))))
        .order_by(Study.id)
    )

    def _settle_heap(self) -> None:
        """Once, the first time nothing runs after a study ran: collect and freeze the heap.

        The first sweep imports what later ones reuse (sympy and more, through torch's meta
        device: 130,000 objects), after the freeze at start-up (server/app.py); frozen too,
        the collector's full passes stop walking them (they stalled this loop 40-70 ms).
        """
        if not self._heap_settled and self._studies_running == 0 and self.reports_ingested:
            self._heap_settled = True
            gc.collect()
            gc.freeze()

    def step(self) -> None:
        """One round: take the workers' reports, start arrays on idle workers, ask for new trials."""
        self._run_inbox()  # what other threads handed over (a purged study's last rows, ...)
        if time.monotonic() >= self._next_refresh:
            # Nodes may join or leave the Ray cluster after the service started.
            self._reregister = bool(self.pool.refresh()) or self._reregister
            self._next_refresh = time.monotonic() + self.settings.device_refresh_s
        if self._reregister:  # new workers, or replacement actors in new processes
            self._register_workers()
            self._reregister = False
        if time.monotonic() >= self._next_prune:
            self._prune_events()
        self._handle(self.pool.wait(0))
        with self.sessions() as session:
            # One read a round (it runs after every array-epoch): the running studies, and the
            # stopping ones not settled yet (cancelled, failed, deleted: end what can end).
            listed = session.scalars(self._round_studies).all()
            studies = [s for s in listed if s.state == StudyState.RUNNING and self._spec_usable(session, s)]
            for study in [s for s in listed if s.state in STOPPING]:
                self._settle_study(session, study)
            self._studies_running = len(studies)
            # A study whose last trials were recorded ends first: its stream says so before
            # anything else this round does.
            for study in studies:
                self._maybe_complete(session, study)
            # Trials asked earlier go to free workers first; asking for more (TPE's cost grows
            # with the study) then happens while they train, and only a worker still idle
            # waits for it. While workers are idle, each running study is asked one group (one
            # array's worth of FusionSampler trials) per idle worker, all in one batch, and the
            # groups start together, the slowest class's array first. A sweep ends with its
            # slowest array: asked group by group, it waited for every group asked and started
            # before it (on PostgreSQL ~45 ms a group).
            self._dispatch(session, listed)
            asking = [s for s in studies if s.state == StudyState.RUNNING]
            while asking:
                # One group per idle worker for each study: the scheduler then shares the
                # workers between the studies' tenants by weight, from trials that all wait.
                groups = len(self.pool.idle())
                asking = [s for s in asking if self._ask_alone(session, s, groups)]
                # A device is kept for the groups still to come, not given to half of this one.
                # One round may start one class's array where its trials wait for two: the
                # next round, seeing that array, starts the other.
                while self.pool.idle() and self._dispatch(session, listed, asking={s.id for s in asking}):
                    pass
            for study in studies:  # trials a search space rejected ended as they were asked
                self._maybe_complete(session, study)
            if self._studies_running and self.pool.idle():
                self._split_for_idle(session)

    def _handle(self, events: Sequence[Event]) -> bool:
        """Answer epoch reports and record ended arrays, in the order the workers said them.

        Returns whether a slot was freed (an array ended, or members left one), so that the
        next scheduling round comes at once: backfill then offers the freed slots to waiting
        trials before the array's next epoch boundary but one.

        An event whose transaction fails because the database is unreachable stays at the
        head of the backlog, with every event after it, and is written again by the next
        call (its reply waits for it): no report or outcome is lost, and each array's are
        written in order. An event that fails for another reason is logged and dropped.
        """
        self._backlog.extend(events)
        ended = False
        while self._backlog:
            run: list[Event] = []
            for event in itertools.islice(self._backlog, _GROUP_COMMIT):  # one report per array
                if not isinstance(event[2], EpochReport) or any(e[1].array_id == event[1].array_id for e in run):
                    break
                run.append(event)
            if len(run) > 1:  # reports that came together are written together
                try:
                    replies = self._record_epochs([(worker, report) for worker, _, report in run])
                except Exception as exc:
                    if database_unavailable(exc):
                        raise
                    # Written one at a time below, so that one bad report costs only itself.
                    log.warning("%d array-epochs could not be recorded together (%s): one at a time", len(run), exc)
                else:
                    for (worker, _, report), reply in zip(run, replies):
                        ended = self._answer(worker, report, reply) or ended
                        self._backlog.popleft()
                    continue
            worker, spec, item = self._backlog[0]
            try:
                ended = self._handle_one(worker, spec, item) or ended
            except Exception as exc:
                if database_unavailable(exc):
                    raise
                log.exception("array %d: could not record %s", spec.array_id, type(item).__name__)
            self._backlog.popleft()
        return ended

    def _answer(self, worker: WorkerHandle, report: EpochReport, reply: EpochReply | None) -> bool:
        """Send a recorded report's reply; returns whether members left the array, or have
        come within its look-ahead of their last epoch (see :meth:`_finishing`)."""
        live = self._live.get(report.array_id)
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
        # needs it only to drop the checkpoints a new one replaces: other reports are
        # acknowledged together by the next reply sent (a remote call saved per array-epoch).
        waits = worker.spec is None or worker.spec.prunes
        if live is not None and not (waits or reply.prune or report.released or live.new_checkpoint):
            live.unacked += 1
            return freed
        if live is not None:
            reply = dataclasses.replace(reply, acked=reply.acked + live.unacked)
            live.unacked, live.new_checkpoint = 0, False
        self.pool.reply(worker, reply)
        return bool(reply.prune) or freed

    def _handle_one(self, worker: WorkerHandle, spec: ArraySpec, item: EpochReport | ArrayOutcome | BaseException) -> bool:
        if isinstance(item, EpochReport):
            return self._answer(worker, item, self._record_epoch(worker, item))
        self._awaiting.pop(spec.array_id, None)
        self._record(worker, spec, item)
        if isinstance(item, BaseException):
            self._reregister = True  # replacement actors run in new processes
        return True

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
            found = session.execute(
                select(Array.id, Array.study_id, Study.tenant)
                .join(Study, Array.study_id == Study.id)
                .where(Array.state == ArrayState.RUNNING)
            ).all()
            orphans = [array_id for array_id, _, _ in found]
            if not orphans:
                return
            error = "the service restarted while this array trained"
            for array_id, study_id, tenant in found:
                events.record(session, "array.ended", tenant=tenant, study_id=study_id, array_id=array_id, state="FAIL", error=error)
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
    def _spec_usable(self, session: Session, study: Study) -> bool:
        """Whether the study's stored sampler and pruner pass this process's allow-list and caps
        (checked once per study, before anything is built from them). One that does not, stored
        before the caps or under larger ones, ends FAILED with the reason: rebuilt, it would
        fail or stall every round, everyone's (server/optuna_specs.py check_stored)."""
        if study.id in self._specs_usable:
            return True
        try:
            check_stored(
                study.sampler, study.pruner, limits=SpecLimits.of(self.settings), objectives=lambda: reads.objectives(session, study.optuna_study_id),
                search_space=(lambda: parse_search_space(study.search_space)) if study.search_space else None,
            )
        except (SpecError, KeyError, TypeError, ValueError) as exc:  # a spec this version refuses, however stored
            self._fail(session, study, f"its stored sampler or pruner is refused: {exc}")
            return False
        self._specs_usable.add(study.id)
        return True

    def _mirror(self, study: Study) -> StudyMirror:
        """The study's Optuna study in memory, loaded from the database once per process.

        One sampler instance per study and process: a seeded sampler rebuilt for every ask
        would repeat its first suggestion.
        """
        if study.id not in self._mirrors:
            sampler = study_sampler(study, self.settings, len(self.pool.workers))
            pruner = (
                make_pruner(study.pruner["name"], study.pruner.get("kwargs"), SpecLimits.of(self.settings))
                if study.pruner else optuna.pruners.NopPruner()
            )
            with self._created_lock:
                created, _ = self._created.pop(study.id, (None, 0.0))
            self._mirrors[study.id] = StudyMirror(self.storage, study.optuna_study_id, sampler, pruner, created=created)
            self._stale.pop(study.id, None)  # loaded whole: nothing of it is stale
        return self._fresh(study.id)

    def _fresh(self, study_id: int) -> StudyMirror:
        """The study's mirror, its stale trials read again first."""
        mirror = self._mirrors[study_id]
        stale = self._stale.get(study_id)
        if stale:
            mirror.reload_trials(self.storage, stale)  # a database error leaves them stale, to retry
            del self._stale[study_id]
        return mirror

    def _mark_stale(self, study_id: int, optuna_trial_ids: Iterable[int]) -> None:
        """A transaction that changed these trials in the study's mirror rolled back: they are
        read again before the mirror is next used; the rest of the mirror stays."""
        if study_id in self._mirrors:
            self._stale.setdefault(study_id, set()).update(optuna_trial_ids)

    def _training_of(self, study: Study) -> TrainingSpec:
        """The study's optimizer, schedule, clipping, AMP and objectives, as its request set them.

        They are kept in the Optuna study's system attrs (``optuna.load_study`` shows them),
        read once per process, from the study's mirror (which loaded them): they never change.
        """
        if study.id not in self._training:
            stored = self._mirror(study).system_attrs.get(TRAINING_ATTR)
            self._training[study.id] = TrainingSpec.from_json(stored)
        return self._training[study.id]

    def _capacity(self) -> int:
        """How many trials the devices can train at once: the most waiting trials worth asking for."""
        return max(1, len(self.pool.workers)) * self.settings.max_array_size

    def _ask(self, session: Session, study: Study, groups: int = 0) -> bool:
        """Ask the study's sampler for enough trials to fill every device, in one transaction;
        with ``groups``, for at most that many arrays' worth (FusionSampler's groups). Returns
        whether the study wanted more than it asked."""
        if study.driver == "client":
            return False  # its client asks the trials and enqueues them
        # One read for the three counts (a round asks every running study, every round).
        asked, waiting, unfinished = session.execute(
            select(
                func.count(),
                func.count().filter(Trial.state == TrialState.WAITING),
                func.count().filter(Trial.state.in_([TrialState.WAITING, TrialState.RUNNING])),
            ).where(Trial.study_id == study.id)
        ).one()
        wanted = min(study.n_trials - asked, (self.settings.ask_batch or self._capacity()) - waiting)
        if study.max_concurrent_trials is not None:
            wanted = min(wanted, study.max_concurrent_trials - unfinished)
        if wanted <= 0 or not self._workload_loads(session, study):
            return False
        asking = min(wanted, groups * group_size(study, self.settings, len(self.pool.workers))) if groups else wanted
        try:
            self._ask_into(session, study, asking)
            session.commit()
        except Exception:
            session.rollback()
            self._mirrors.pop(study.id, None)  # what it asked was not written: reload from the database
            raise
        return wanted > asking

    def _ask_alone(self, session: Session, study: Study, groups: int = 0) -> bool:
        """:meth:`_ask`, so that a study whose sampler (or workload) raises fails alone, with its
        error, while the others go on; the database being unreachable stops the round as ever."""
        try:
            return self._ask(session, study, groups)
        except Exception as exc:
            if database_unavailable(exc):
                raise
            reason = f"asking for trials failed: {type(exc).__name__}: {exc}"
            log.warning("study %d: %s", study.id, reason, exc_info=True)
            fail = getattr(self, "_fail", None)  # server/lifecycle.py: the study ends FAILED with the reason
            if fail is not None:
                fail(session, study, reason)
            return False

    def enqueue(self, study_id: int, params: Mapping[str, Any], user_attrs: Mapping[str, Any]) -> Trial:
        """Optuna's ``enqueue_trial``, asked at once: the study's next trial has these params.

        The trial counts in the study's ``n_trials``. Runs on the loop thread (see :meth:`call`).

        Raises:
            service.Conflict: naming ``n_trials`` when the study has asked all its trials.
        """
        with self.sessions() as session:
            study = session.get(Study, study_id)
            self._check_askable(session, study)
            asked = session.scalar(select(func.count()).where(Trial.study_id == study.id))
            if asked >= study.n_trials:
                raise Conflict("n_trials", f"study {study.id} has asked all its n_trials={study.n_trials} trials")
            mirror = self._mirror(study)
            try:
                mirror.study.enqueue_trial(dict(params), user_attrs=dict(user_attrs), skip_if_exists=False)
                (trial_id,) = self._ask_into(session, study, 1)
                if study.state == StudyState.COMPLETE:  # more trials for a study that had ended
                    study.state, study.completed_at = StudyState.RUNNING, None
                session.commit()
            except Exception:
                session.rollback()
                self._mirrors.pop(study.id, None)
                raise
            row = session.get(Trial, trial_id)
            session.expunge(row)
        self.wake()
        return row

    def _ask_into(self, session: Session, study: Study, wanted: int) -> list[int]:
        """Ask ``wanted`` trials (enqueued ones first, as Optuna does) into the caller's
        transaction; returns their fusetune ids, in order."""
        workload = get_workload(study.workload)
        mirror = self._mirror(study)
        distributions = parse_search_space(study.search_space) if study.search_space else None
        rows = []
        for trial in mirror.ask(session, wanted, workload.search_space, distributions):
            row = {"study_id": study.id, "optuna_trial_id": trial.trial_id, "number": trial.number, "params": trial.params,
                   "signature": "", "state": TrialState.WAITING, "error": trial.error, "completed_at": None}
            if trial.error is None:
                try:
                    row["signature"] = trial_signature(workload, trial.params, self._training_of(study))
                except Exception as exc:  # the workload's model rejected these params
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    mirror.tell(session, trial.trial_id, OptunaState.FAIL)
            if row["error"] is not None:
                row["state"], row["completed_at"] = TrialState.FAIL, utcnow()
            rows.append(row)
        if not rows:
            return []
        # One statement for the batch (the unit of work's flush of 64 trials cost more than
        # their signatures), stamped like any trial write.
        inserting_trials(session)
        ids = insert_returning(session, Trial.__table__, rows)
        for trial_id, row in zip(ids, rows, strict=True):
            where = {"tenant": study.tenant, "study_id": study.id, "trial_id": trial_id}
            events.record(session, "trial.asked", **where, number=row["number"], params=row["params"], state=row["state"].value)
            if row["state"] == TrialState.FAIL:
                events.record(session, "trial.ended", **where, state="FAIL", value=None, error=row["error"])
        return ids

    # -- dispatching ---------------------------------------------------------------------------
    def _dispatch(self, session: Session, listed: Sequence[Study], asking: Collection[int] = ()) -> bool:
        """One scheduling round: the scheduler decides, arrays start on the idle devices it fills.

        ``listed``: the studies the step read (those still RUNNING are scheduled; a study
        this step ended or failed is not). ``asking``: studies that this step asks more
        trials of next; an idle device their classes do not need yet is kept for those (see
        :meth:`_spread_classes`).

        The scheduler sees every unfinished trial, every device and the running arrays, and
        returns the placements fair across tenants (by weight) and across device types. A
        placement on an idle device starts an array; waiting trials the scheduler adds to a
        running array's placement (slots its ended members freed) are offered to that array
        and join it at its next epoch boundary; those that take the places of members on
        their last epochs (the array's look-ahead) join at the boundary where those leave. Members
        the scheduler preempts (their lease ran out and their class is over its share) leave
        at their array's next epoch boundary. Of the arrays a round starts, the slowest
        (estimated from its class's curve) starts first. Returns whether it started one.
        """
        idle = {w.name: w for w in self.pool.idle()}
        # The columns a decision needs, not ORM trials (their params are JSON to decode):
        # a round reads every unfinished trial, and runs after every array-epoch that frees
        # a slot. The trials an array takes are loaded as objects (_trials).
        studies = {s.id: s for s in listed if s.state == StudyState.RUNNING}
        rows = [
            (t, studies[t.study_id])
            for t in session.execute(
                select(Trial.id, Trial.study_id, Trial.number, Trial.signature, Trial.state, Trial.array_id)
                .join(Study, Trial.study_id == Study.id)
                .where(Study.state == StudyState.RUNNING, Trial.state.in_([TrialState.WAITING, TrialState.RUNNING]))
                .order_by(Study.id, Trial.number)
            )
            if t.study_id in studies
        ]
        waiting = {t.id: (t, study) for t, study in rows if t.array_id is None and t.state == TrialState.WAITING}
        self._start_moves(session, rows, idle, waiting)
        if not waiting:
            return False
        finishing = self._finishing(rows)
        pending = [
            PendingTrial(trial_id=t.id, signature=_class_of(t), tenant=study.tenant, study_id=study.id, remaining_epochs=study.epochs)
            for t, study in rows
            if t.id not in finishing
        ]
        weights = [SchedulerTenant(name, weight) for name, weight in session.execute(select(Tenant.name, Tenant.weight))]
        devices = [Device(w.name, w.device_type, w.memory_bytes, w.node) for w in self.pool.workers]
        self._curve_classes({p.signature for p in pending}, {d.device_type for d in devices})
        # Members on their last epochs are done as far as the scheduler is concerned: the
        # slots they free are offered now, to be taken where they leave (_top_up).
        running = [dataclasses.replace(p, trial_ids=tuple(i for i in p.trial_ids if i not in finishing)) for p in self._running.values()]
        decision = self.scheduler.decide(time.monotonic(), pending, devices, weights, running)
        busy = {w.name: w for w in self.pool.workers if not w.idle}
        self._preempt(decision.preempted, busy, rows)
        for placement in decision.placements:  # leases the scheduler extended
            current = self._running.get(placement.device_id)
            if placement.device_id in busy and current is not None and current.signature == placement.signature:
                self._running[placement.device_id] = dataclasses.replace(current, lease_expires=placement.lease_expires)
        placements = self._spread_classes(decision.placements, idle, waiting, asking)

        starts = Counter(p.signature for p in placements if p.device_id in idle and any(i in waiting for i in p.trial_ids))
        queued = Counter(_class_of(t) for t, _ in waiting.values())

        def seconds(p: Placement) -> float:  # an array's time to train, in its class's steps, from the class's curve
            worker, ids = idle.get(p.device_id), [i for i in p.trial_ids if i in waiting]
            if worker is None or not ids:
                return 0.0
            study = waiting[ids[0]][1]
            limit = study.max_array_size or self.settings.max_array_size
            curve = self.scheduler.throughput.curve(p.signature, worker.device_type)
            # The size it starts with (below), not the scheduler's: two classes of one sweep
            # start at their shares of the devices, whatever sizes the scheduler chose for them.
            share = math.ceil(queued[p.signature] / max(1, starts[p.signature]))
            b = max(min(len(p.trial_ids), limit), min(limit, share, curve.memory_cap(worker.memory_bytes)))
            rate = curve.rate(b)
            return study.epochs * b / rate if rate > 0 else math.inf  # unmeasured: assumed slow

        # The slowest array first: a sweep ends with its slowest class, whose start waits for
        # every array started before it in this round (its rows, its commit, its submit).
        placements = sorted(placements, key=seconds, reverse=True)
        started = False
        topped: set[str] = set()
        for placement in placements:
            ids = [i for i in placement.trial_ids if i in waiting]
            if not ids:
                continue
            study = waiting[ids[0]][1]
            limit = study.max_array_size or self.settings.max_array_size
            cap = min(len(placement.trial_ids), limit)
            worker = idle.get(placement.device_id)
            if worker is not None:
                # The scheduler chose the class for this device and a size; the class's waiting
                # trials are then spread evenly over the idle devices it got this round, each
                # array as large as the cap and memory allow: on one device, one array of n
                # trials drains them faster than smaller arrays in turn (the rate grows with B),
                # and what is left is spread evenly (9 trials at B=8: 5 now and 4 next, not 8 and 1).
                queue = [PendingTrial(trial_id=i, signature=placement.signature) for i, (t, _) in waiting.items() if _class_of(t) == placement.signature]
                share = math.ceil(len(queue) / max(1, starts[placement.signature]))
                starts[placement.signature] -= 1
                fits = self.scheduler.throughput.curve(placement.signature, worker.device_type).memory_cap(worker.memory_bytes)
                cap = max(cap, min(limit, share, fits))
                cap = min(cap, self._size_cap(session, placement.signature, worker, queue[0].trial_id, waiting))
                if cap == 0:
                    continue  # its memory model is measured on a worker first: a later round starts it
                members = self._trials(session, [waiting.pop(i)[0].id for i in pack(queue, cap)[0].trial_ids])
                self._start_array(session, study, worker, members)
                started = True
                self._running[worker.name] = Placement(
                    worker.name, placement.signature, study.tenant, tuple(t.id for t in members), placement.lease_expires
                )
            elif placement.device_id in busy and getattr(self._running.get(placement.device_id), "signature", None) == placement.signature:
                self._top_up(session, busy[placement.device_id], ids, cap, rows, waiting, finishing)
                topped.add(placement.device_id)
        # A busy array whose members are on their last epochs keeps its class where they leave,
        # when the scheduler gave the device to no other tenant and the class has trials
        # waiting: the worker goes on with them instead of waiting for a round, an array and
        # a build.
        given = {p.device_id: p for p in placements}
        for name, worker in busy.items():
            current = self._running.get(name)
            if name in topped or current is None or worker.spec is None:
                continue
            if name in given and given[name].tenant != current.tenant:
                continue
            queue = [i for i, (t, _) in waiting.items() if _class_of(t) == current.signature]
            if queue:
                study = waiting[queue[0]][1]
                self._top_up(session, worker, queue, study.max_array_size or self.settings.max_array_size, rows, waiting, finishing, chain=True)
        return started

    def _top_up(
        self, session: Session, worker: WorkerHandle, ids: Sequence[int], cap: int, rows: Sequence[Any],
        waiting: dict[int, tuple[Any, Study]], finishing: Mapping[int, int], chain: bool = False,
    ) -> None:
        """Offer waiting trials ``ids`` to the array ``worker`` trains: as many as its ended
        members freed (they join at its next boundary), and as many as its members on their
        last epoch will free (they join at the boundary after that epoch, where those
        members leave: an array of one goes on as a chain of trials on one worker). The
        array never holds more than the size it started with (or ``cap``). With ``chain``,
        only the places of members on their last epoch are offered."""
        spec = worker.spec
        moving = {i for ids in self._moves.values() for i in ids}
        ids = [i for i in ids if i not in moving]  # they left for an idle device: they go there
        present = [t.id for t, _ in rows if t.array_id == spec.array_id]
        if chain and not any(i in finishing for i in present):
            return
        if not present:
            # Every member has ended: the array stops at this boundary, and an offer would
            # arrive too late and wait for it to end. Its worker takes a new one.
            return
        # The boundaries (epochs of the array) where its members on their last epochs leave.
        ends = sorted(finishing[i] for i in present if i in finishing)
        now_free, places = offer_plan(min(cap, len(spec.members)), len(present), ends, chain)
        joining = self._trials(session, [waiting.pop(i)[0].id for i in ids[: now_free + len(places)]])
        if not joining:
            return
        if joining[:now_free]:
            self._refill(session, worker, spec.array_id, joining[:now_free])
        # Fewer newcomers than places: they take the latest ones (see offer_plan).
        afters = places[len(places) - len(joining[now_free:]):]
        for after in sorted(set(afters)):
            group = [t for t, a in zip(joining[now_free:], afters, strict=True) if a == after]
            self._refill(session, worker, spec.array_id, group, after_epoch=after)
            self._live[spec.array_id].ahead[after] += len(group)
        current = self._running[worker.name]
        self._running[worker.name] = dataclasses.replace(current, trial_ids=tuple(present + [t.id for t in joining]))

    def _spread_classes(
        self, placements: Sequence[Placement], idle: Mapping[str, WorkerHandle], waiting: Mapping[int, tuple[Any, Study]],
        asking: Collection[int] = (),
    ) -> list[Placement]:
        """Give an idle device the scheduler put a class on that needs no more arrays to
        another waiting class of the same tenant that got no device this round.

        Classes of one tenant tie in the scheduler's allocation when their curves are equal
        (the two widths of one sweep), and the tie may put one class on every idle device:
        its trials then train in half-size arrays while the other class waits for a device.
        A class needs ``ceil(waiting / array cap)`` arrays; devices beyond that go to a
        waiting class that got fewer than it needs (one with none first), so both classes
        train at once in full arrays: 8 trials of each of two classes at a cap of 4 on four
        devices make two arrays of 4 each, not 3, 3 and 2 of one class and 4 of the other,
        whose other 4 then wait for a device.
        When none is waiting yet but the class's study is being asked for more (``asking``),
        the device stays idle for the next group instead.
        """
        queues: dict[str, list[int]] = {}
        for trial_id, (trial, _) in waiting.items():
            queues.setdefault(_class_of(trial), []).append(trial_id)
        cap = {c: waiting[ids[0]][1].max_array_size or self.settings.max_array_size for c, ids in queues.items()}
        needed = {c: math.ceil(len(ids) / cap[c]) for c, ids in queues.items()}
        given: Counter[str] = Counter()
        out = []
        for p in placements:
            if p.device_id in idle and p.signature in queues:
                if given[p.signature] >= needed[p.signature]:
                    short = [
                        c for c in queues
                        if c != p.signature and given[c] < needed[c] and waiting[queues[c][0]][1].tenant == p.tenant
                    ]
                    if short:  # the class furthest from its devices: none yet comes first
                        spare = min(short, key=lambda c: given[c])
                        p = Placement(p.device_id, spare, p.tenant, tuple(queues[spare]), p.lease_expires)
                    elif waiting[queues[p.signature][0]][1].id in asking:
                        continue
                given[p.signature] += 1
            out.append(p)
        return out

    def _split_for_idle(self, session: Session) -> None:
        """A device idle with nothing waiting takes half of a running array's members, when
        the measured speeds say both halves end sooner than the whole array would.

        The classes of a sweep cost differently (a wider model takes longer per epoch), so
        the device of the cheaper class goes idle while the other class's array still has
        epochs to train. Its members with the most epochs left leave at the array's next
        boundary with their checkpoints, as preempted members do (:meth:`_preempt`), and
        the next round starts them on the idle device (:func:`split_plan` weighs it). One
        array a round, and none while members it was asked to let go have not left yet.
        """
        if self._moves:
            return  # members on their way to an idle device: one move at a time
        idle = {w.device_type: w for w in self.pool.idle()}
        rows = session.execute(
            select(Trial.id, Trial.state, Trial.array_id, Study.epochs)
            .join(Study, Trial.study_id == Study.id)
            .where(Study.state == StudyState.RUNNING, Trial.state.in_([TrialState.WAITING, TrialState.RUNNING]))
        ).all()
        if any(t.state == TrialState.WAITING for t in rows):
            return  # trials wait for a device, or for the array offered them: nothing moves
        busy = {w.name: w for w in self.pool.workers if not w.idle and w.spec is not None}
        best: tuple[float, str, list[int]] | None = None
        for name, worker in busy.items():
            live, current = self._live.get(worker.spec.array_id), self._running.get(name)
            if (
                worker.device_type not in idle or live is None or current is None or live.client_decides
                or live.study_id in self._halting  # paused or stopping: its members leave anyway
            ):
                continue
            members = [t for t in rows if t.array_id == worker.spec.array_id]
            if any(t.id not in current.trial_ids for t in members) or any(t.id not in live.steps for t in members):
                continue  # members are leaving already, or have not reported here yet
            # Epochs each has left after the one it trains now.
            remaining = {t.id: t.epochs - 2 - live.steps[t.id] for t in members}
            epoch_s, size = live.last_epoch
            curve = self.scheduler.throughput.curve(worker.spec.signature, worker.device_type)
            build_s = live.timings.get("build_s", 0.0)
            movers, saved = split_plan(
                remaining, epoch_s if size == len(members) else 0.0, build_s, curve.rate, self.settings.move_latency_s
            )
            if movers and (best is None or saved > best[0]):
                best = (saved, name, movers)
        if best is not None:
            saved, name, movers = best
            target = idle[busy[name].device_type].name
            log.info("worker %s: %d members move to %s (%.2f s sooner, estimated)", name, len(movers), target, saved)
            self._preempt(movers, busy, [(t, None) for t in rows])
            self._moves[target] = movers

    def _start_moves(
        self, session: Session, rows: Sequence[Any], idle: dict[str, WorkerHandle], waiting: dict[int, tuple[Any, Study]]
    ) -> None:
        """Members that left an array for an idle device (:meth:`_split_for_idle`) start there as
        one array as soon as they have all left: the scheduler would see a class with a device
        already, and might offer them back to the array they left. A move whose device was
        taken meanwhile, or one of whose members ended instead, is the scheduler's again."""
        unfinished = {t.id for t, _ in rows}
        for name, movers in list(self._moves.items()):
            worker = idle.get(name)
            if worker is not None and all(i in waiting for i in movers):
                del self._moves[name]
                study = waiting[movers[0]][1]
                members = self._trials(session, [waiting.pop(i)[0].id for i in movers])
                self._start_array(session, study, worker, members)
                self._running[name] = Placement(
                    name, _class_of(members[0]), study.tenant, tuple(movers), time.monotonic() + self.settings.lease_s
                )
                del idle[name]
            elif worker is None or any(i not in unfinished for i in movers):
                del self._moves[name]

    @staticmethod
    def _trials(session: Session, ids: Sequence[int]) -> list[Trial]:
        """The trials ``ids`` as ORM objects, in that order (one query)."""
        if not ids:
            return []
        found = {t.id: t for t in session.scalars(select(Trial).where(Trial.id.in_(ids)))}
        return [found[i] for i in ids]

    def _finishing(self, rows: Sequence[Any]) -> dict[int, int]:
        """Running members with at most their array's look-ahead of epochs left after their last
        recorded step, each with the boundary (its array's epoch count) where it leaves,
        unless it is pruned or its array stops first."""
        out = {}
        for trial, study in rows:
            live = self._live.get(trial.array_id) if trial.state == TrialState.RUNNING else None
            step = live.steps.get(trial.id) if live is not None else None
            if step is not None and 0 < study.epochs - 1 - step <= live.lookahead:
                out[trial.id] = live.epochs_done + study.epochs - 1 - step
        return out

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

    def _refill(self, session: Session, worker: WorkerHandle, array_id: int, trials: list[Trial], after_epoch: int = 0) -> None:
        """Offer waiting trials to a running array: they join it at its first epoch boundary
        after ``after_epoch`` epochs of it (0: its next one)."""
        array = session.get(Array, array_id)
        first = len(array.members)
        array.members.extend(ArrayMember(slot=first + k, trial_id=t.id) for k, t in enumerate(trials))
        for t in trials:
            t.array_id = array_id
        events.record(
            session, "array.changed", tenant=self._live[array_id].tenant, study_id=array.study_id, array_id=array_id,
            offered=[t.id for t in trials], joined=[], left=[],
        )
        session.commit()
        self._live[array_id].optuna_ids.update({t.id: t.optuna_trial_id for t in trials})
        self.pool.offer(worker, [_member_spec(t) for t in trials], after_epoch)
        log.info("array %d: %d trials join at the %s epoch boundary", array_id, len(trials), "next" if not after_epoch else f"{after_epoch}th")

    def _start_array(self, session: Session, study: Study, worker: WorkerHandle, trials: list[Trial]) -> None:
        # Three statements, not the unit of work's flush of an array, its members and every
        # trial (a third of the time from a group's asks to its array's start).
        signature = trials[0].signature
        array_id = session.execute(
            insert(Array).returning(Array.id),
            [{"study_id": study.id, "signature": signature, "worker_id": self._worker_ids.get(worker.name), "node": worker.node_id or None}],
        ).scalar_one()
        insert_rows(session, ArrayMember.__table__, [{"array_id": array_id, "slot": i, "trial_id": t.id} for i, t in enumerate(trials)])
        now = utcnow()
        session.execute(  # the loaded trials are updated too (synchronize_session)
            update(Trial).where(Trial.id.in_([t.id for t in trials])).values(array_id=array_id, state=TrialState.RUNNING, started_at=now)
        )
        where = {"tenant": study.tenant, "study_id": study.id, "array_id": array_id}
        events.record(session, "array.started", **where, trial_ids=[t.id for t in trials], worker=worker.name, signature=signature)
        for t in trials:
            events.record(session, "trial.started", **where, trial_id=t.id, number=t.number, resumed_at_epoch=None)
        # Everything that can raise comes before the commit: RUNNING trials committed with an
        # array that never starts would be orphans until a restart re-queued them.
        spec = ArraySpec(
            array_id=array_id,
            signature=_class_of(trials[0]),
            study_name=study.name,
            workload=study.workload,
            epochs=study.epochs,
            members=tuple(_member_spec(t) for t in trials),
            seed=training_seed(study),
            artifact_dir=artifact_uri(self.settings),
            checkpoint_frequency=self.settings.checkpoint_frequency,
            checkpoint_interval_s=self.settings.checkpoint_interval_s,
            # The class's solo speed is the B = 1 point of its curve: measured once per
            # signature and device type, by a short unfused probe in its first array.
            probe_solo=len(trials) > 1 and 1 not in self._points.get((signature, worker.device_type), {}),
            prunes=study.pruner is not None or study.driver == "client",
            training=self._training_of(study),
            reply_timeout_s=self.settings.prune_reply_timeout_s,
        )
        session.commit()
        try:
            self.pool.submit(worker, spec)
        except Exception as exc:
            self._unstart(study, array_id, [t.id for t in trials], f"the array could not start on {worker.name}: {exc}")
            raise
        self._live[array_id] = _Live(
            study.id, {t.id: t.optuna_trial_id for t in trials}, client_decides=study.driver == "client", tenant=study.tenant,
            announced={t.id for t in trials},
        )
        log.info("array %d: %d trials of study %s on %s", array_id, len(trials), study.name, worker.name)

    def _unstart(self, study: Study, array_id: int, trial_ids: list[int], error: str) -> None:
        """An array whose rows are committed but that its worker never took: it ends FAIL and
        its trials wait again, in a transaction of its own."""
        with self.sessions.begin() as session:
            session.execute(
                update(Array).where(Array.id == array_id).values(state=ArrayState.FAIL, error=error, completed_at=utcnow())
            )
            session.execute(
                update(Trial).where(Trial.id.in_(trial_ids)).values(state=TrialState.WAITING, array_id=None, started_at=None)
            )
            events.record(
                session, "array.ended", tenant=study.tenant, study_id=study.id, array_id=array_id, state="FAIL",
                error=error, requeued=trial_ids,
            )
        log.warning("array %d: %s", array_id, error)

    # -- recording -----------------------------------------------------------------------------
    def _record_epoch(self, worker: WorkerHandle, report: EpochReport) -> EpochReply | None:
        """Write one array-epoch in one transaction; decide pruning; return the reply (see :meth:`_record_epochs`)."""
        return self._record_epochs([(worker, report)])[0]

    def _record_epochs(self, reports: Sequence[tuple[WorkerHandle, EpochReport]]) -> list[EpochReply | None]:
        """Write array-epochs in one transaction, in order; decide pruning; return each one's reply.

        The loop records together the reports that arrived together (one per busy worker):
        a transaction's fixed costs (the revision counter, the commit's flush to disk, a
        round trip per statement) are paid once for all of them. Either all are written or
        none is, and what the control plane keeps in memory goes back to what it was.

        A client-driven study's client decides pruning (:meth:`decide`): then the members
        still running await its decisions and the reply is None, for now.
        """
        restore = []
        decided: list[tuple[set[int], dict[int, int]]] = []
        with self.sessions() as session:
            try:
                for worker, report in reports:
                    live = self._live[report.array_id]
                    restore.append((
                        live, report, live.epochs_done, dict(live.timings), dict(live.checkpoints), set(live.announced),
                        dict(live.steps), set(live.ended),
                    ))
                    decided.append(self._write_epoch(session, worker, report, live))
                self._write_observed(session)
                # A study whose last trials these epochs ended completes in the same
                # transaction: its study.completed is committed with their trial.ended (one
                # commit and one events write at a sweep's end, not two of each).
                ending = {self._live[r.array_id].study_id for (_, r), (prune, _) in zip(reports, decided) if prune or any(m.state for m in r.members)}
                completed = [i for i in sorted(ending) if self._complete_if_done(session, session.get(Study, i))]
                session.commit()
                self.reports_ingested += len(reports)
                for study_id in completed:
                    self._mirrors.pop(study_id, None)
            except Exception:
                session.rollback()
                for signature, device_type, members in [k for k, (_, _, new) in self._observed.items() if new]:
                    del self._points[(signature, device_type)][members]  # its row was not written after all
                self._observed.clear()
                for live, report, *before in reversed(restore):  # so that a retry writes the same
                    # The mirror ran ahead of the database for these members only.
                    touched = {m.trial_id for m in report.members} | {j.trial_id for j in report.joined} | set(report.released)
                    self._mark_stale(live.study_id, [live.optuna_ids[i] for i in touched if i in live.optuna_ids])
                    live.epochs_done, live.timings, live.checkpoints, live.announced, live.steps, live.ended = before
                raise
        replies: list[EpochReply | None] = []
        for (worker, report), (prune, awaiting) in zip(reports, decided):
            self._release_halted(worker, self._live[report.array_id], report, prune)
            superseded = self._awaiting.pop(report.array_id, None)
            if superseded is not None:
                # The worker went on past its deadline without the client's decisions: the
                # undecided members continue, and the decisions made go with this answer.
                self.pool.reply(superseded.worker, EpochReply(prune=frozenset(superseded.prune)))
            if awaiting:
                self._awaiting[report.array_id] = _Awaiting(worker, awaiting)
                replies.append(None)
            else:
                replies.append(EpochReply(prune=frozenset(prune)))
        return replies

    def _write_epoch(
        self, session: Session, worker: WorkerHandle, report: EpochReport, live: _Live
    ) -> tuple[set[int], dict[int, int]]:
        """One array-epoch's writes, in the caller's transaction: the members it prunes, and
        those that await their client's decision (trial id -> step).

        Every member's intermediate value goes to its Optuna trial (so Optuna's pruners,
        ``optuna.load_study`` and optuna-dashboard see it); members that ended are told to
        Optuna (``Study.tell``, the sampler's ``after_trial`` included) and fusetune's rows
        follow. The study's pruner decides for the others, on the study as the control
        plane holds it. The measured throughput updates the class's curve. What the
        control plane knows of the array (:class:`_Live`) spares the transaction any read.
        """
        prune: set[int] = set()
        awaiting: dict[int, int] = {}
        if live.ended:
            report = dataclasses.replace(
                report,
                members=tuple(m for m in report.members if m.trial_id not in live.ended),
                released=tuple(i for i in report.released if i not in live.ended),
            )
        mirror = self._mirror_of(session, live.study_id)
        client_decides = live.client_decides
        now = utcnow()
        optuna_id = live.optuna_ids
        where = {"tenant": live.tenant, "study_id": live.study_id, "array_id": report.array_id}
        ended: list[int] = []
        ends: list[dict[str, Any]] = []  # their rows' new columns (_ending)
        for joined in report.joined:
            if joined.trial_id in live.announced:  # a first member: its trial.started came with the array
                live.announced.discard(joined.trial_id)
                continue
            events.record(
                session, "trial.started", **where, trial_id=joined.trial_id, resumed_at_epoch=joined.resumed_at_epoch
            )
        if report.joined:
            session.execute(
                update(Trial)
                .where(Trial.id.in_([j.trial_id for j in report.joined]))
                .values(state=TrialState.RUNNING, started_at=func.coalesce(Trial.started_at, now))
            )
        for joined in report.joined:
            if joined.resumed_at_epoch is not None:  # one entry per move or crash
                resumed = mirror.trial(optuna_id[joined.trial_id]).user_attrs.get("resumed_at_epochs")
                # A user attr a client may have set itself (enqueue_trial): not always a list.
                resumed = resumed if isinstance(resumed, list) else []
                mirror.set_user_attrs(session, optuna_id[joined.trial_id], {"resumed_at_epochs": [*resumed, joined.resumed_at_epoch]})
        self._truncate_resumed(session, mirror, report, optuna_id)
        mirror.report(session, [(optuna_id[m.trial_id], m.step, m.value) for m in report.members])
        live.steps.update((m.trial_id, m.step) for m in report.members)
        # An epoch's own time: the first array-epoch's report also carries the array's build and
        # the class's solo probe, which no later epoch repeats.
        epoch_s = sum(v for k, v in report.timings.items() if isinstance(v, int | float) and k not in ("build_s", "probe_s"))
        live.lookahead = max(_LOOKAHEAD_EPOCHS, math.ceil(_LOOKAHEAD_S / epoch_s) if epoch_s > 0 else 0)
        live.last_epoch = (epoch_s, report.size)
        # Their Optuna trials got a value: pollers (updated_since) read them again.
        touch_trials(session, [m.trial_id for m in report.members])
        self._note_checkpoints(session, live, report)
        for member in report.members:
            events.record(session, "trial.reported", **where, trial_id=member.trial_id, step=member.step, value=_json_number(member.value))
        for member in report.members:
            trial_id = optuna_id[member.trial_id]
            if member.state == "COMPLETE":
                if member.state_dict is not None:  # where its trained weights are
                    mirror.set_user_attrs(session, trial_id, {"state_dict": member.state_dict})
                # Every objective (a multi-objective study's list); the first is also fusetune's value.
                mirror.tell(session, trial_id, OptunaState.COMPLETE, list(member.values) or member.value)
                ends.append(_ending(session, member.trial_id, TrialState.COMPLETE, value=member.value, event=where))
                ended.append(member.trial_id)
            elif member.state == "FAIL":
                mirror.tell(session, trial_id, OptunaState.FAIL)
                ends.append(_ending(session, member.trial_id, TrialState.FAIL, error=member.error, event=where))
                ended.append(member.trial_id)
            elif member.trial_id in report.released or self._halting.get(live.study_id) in STOPPING:
                continue  # leaving at this boundary (its next array decides), or at the next: its study stops
            elif client_decides:
                awaiting[member.trial_id] = member.step
            elif mirror.should_prune(session, trial_id):
                mirror.tell(session, trial_id, OptunaState.PRUNED)
                ends.append(_ending(session, member.trial_id, TrialState.PRUNED, value=member.value, event=where))
                prune.add(member.trial_id)
                ended.append(member.trial_id)
        live.ended.update(ended)
        if ends:
            # The members that ended, in one executemany: an array's last epoch ends all of
            # them. touch_trials above stamps their revision; the counter is taken first, as
            # before any trial row is written (server/db/revisions.py: no deadlocks).
            next_revision(session)
            trials = Trial.__table__
            session.connection().execute(
                update(trials)
                .where(trials.c.id == bindparam("ended_id"))
                .values(state=bindparam("ended_state"), value=bindparam("ended_value"), error=bindparam("ended_error"), completed_at=now),
                ends,
            )
        if report.released and not self._stop_report(session, mirror, live, report, now):
            # preempted or paused: waits for its next array, Optuna keeps it RUNNING
            session.execute(
                update(Trial)
                .where(Trial.id.in_(report.released))
                .values(state=TrialState.WAITING, array_id=None, started_at=None)
            )
        # An array's first epoch pays for warming up (allocations, lazy init): its speed
        # would say fusing pays less than it does. (The probe runs after it, warm.)
        self._observe(worker.spec.signature, worker.device_type, report, warm=live.epochs_done > 0)
        live.epochs_done += 1
        live.timings = _add_timings(live.timings, report.timings)
        # Held back to the commit (bulk.add_updates): the transaction's array-epochs update
        # their arrays in one executemany, compiled once (a statement each, with the timings
        # inlined, cost a millisecond apiece in compiling alone).
        add_updates(session, Array.__table__, "id", [{"id": report.array_id, "epochs_done": live.epochs_done, "timings": live.timings}])
        if report.joined or report.released or ended:
            events.record(
                session, "array.changed", **where, offered=[], joined=[j.trial_id for j in report.joined],
                left=[*ended, *report.released], epochs_done=live.epochs_done,
            )
        return prune, awaiting

    def decide(self, trial_id: int, step: int, prune: bool) -> None:
        """A client-driven study's pruning decision for a trial's report at ``step``.

        The trial ends PRUNED at once if ``prune``; when every member of the array-epoch has
        its decision, the array goes on. Runs on the loop thread (see :meth:`call`).

        Raises:
            service.Conflict: naming ``step`` when no array waits for this trial's decision at it.
        """
        for array_id, waiting in self._awaiting.items():
            if trial_id in waiting.steps:
                break
        else:
            raise Conflict("step", f"trial {trial_id} awaits no pruning decision (it is not between epochs)")
        if waiting.steps[trial_id] != step:
            raise Conflict("step", f"trial {trial_id} awaits the decision for step {waiting.steps[trial_id]}, not {step}")
        live = self._live[array_id]
        if prune:
            with self.sessions() as session:
                mirror = self._mirror_of(session, live.study_id)
                try:
                    mirror.tell(session, live.optuna_ids[trial_id], OptunaState.PRUNED)
                    value = mirror.trial(live.optuna_ids[trial_id]).intermediate_values.get(step)
                    where = {"tenant": live.tenant, "study_id": live.study_id, "array_id": array_id}
                    _finish(session, trial_id, TrialState.PRUNED, utcnow(), value=value, event=where)
                    session.commit()
                except Exception:
                    session.rollback()
                    self._mark_stale(live.study_id, [live.optuna_ids[trial_id]])
                    raise
            waiting.prune.add(trial_id)
            live.ended.add(trial_id)
        del waiting.steps[trial_id]
        if not waiting.steps:
            del self._awaiting[array_id]
            self.pool.reply(waiting.worker, EpochReply(prune=frozenset(waiting.prune)))
            if waiting.prune:
                self.wake()  # freed slots: backfill

    def _mirror_of(self, session: Session, study_id: int) -> StudyMirror:
        if study_id in self._mirrors:
            return self._fresh(study_id)
        return self._mirror(session.get(Study, study_id))

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

    def _note_checkpoints(self, session: Session, live: _Live, report: EpochReport) -> None:
        """Keep in ft_trials each member's newest complete checkpoint, as its worker reported it."""
        for member in report.members:
            epoch = member.checkpoint_epoch
            if epoch is not None and member.state is None and live.checkpoints.get(member.trial_id) != epoch:
                session.execute(update(Trial).where(Trial.id == member.trial_id).values(checkpoint_epoch=epoch))
                live.checkpoints[member.trial_id] = epoch
                live.new_checkpoint = True

    def _split_on_oom(self, session: Session, worker: WorkerHandle, array: Array, result: ArrayOutcome | BaseException) -> bool:
        """An array that ran out of memory with more than one member is split: True.

        Its class's arrays on this device type are capped at half its size from now on,
        and its members wait again, to train in the halves (from their checkpoints).
        """
        if not isinstance(result, ArrayOutcome) or not result.oom:
            return False
        running = session.scalar(
            select(func.count()).where(Trial.array_id == array.id, Trial.state == TrialState.RUNNING)
        )
        if running < 2:
            return False  # one member alone does not fit: it fails with the error
        key = (f"{array.signature}@{array.study_id}", worker.device_type)
        self._oom_caps[key] = min(self._oom_caps.get(key, running), max(1, running // 2))
        log.warning("array %d ran out of memory with %d members: retrying in arrays of %d", array.id, running, self._oom_caps[key])
        return True

    def _size_cap(
        self, session: Session, cls: str, worker: WorkerHandle, trial_id: int, waiting: Mapping[int, tuple[Any, Study]]
    ) -> int:
        """The most members an array of ``cls`` may have on ``worker``: half of the size that ran out
        of memory there, and with a memory budget, what the fusion engine's memory model fits in it.
        0 while that model is being measured on a worker (:meth:`_memory_model`): start none yet."""
        cap = self._oom_caps.get((cls, worker.device_type), self.settings.max_array_size)
        budget = self.settings.worker_memory_bytes
        if budget is None:
            return cap
        trial, study = waiting[trial_id]
        model = self._memory_model(session, trial.signature, worker, trial_id, study)
        if model is None:
            return 0
        base, member = model
        return max(1, min(cap, (budget - base) // max(member, 1)))

    def _memory_model(self, session: Session, signature: str, worker: WorkerHandle, trial_id: int, study: Study) -> tuple[int, int] | None:
        """The memory model of ``signature``'s arrays, ``(base, member)`` bytes, measured on a
        worker (``workers/memory.py``): a tenant's model is never built or stepped in this
        process, which is also the API and the Ray driver. None while the measurement runs
        (asked of ``worker``, idle; polled each round). One that fails or outlasts
        ``FUSETUNE_RAY_TIMEOUT_S`` leaves the class one member per array, which fits if anything does."""
        if signature in self._memory_models:
            return self._memory_models[signature]
        pending = self._memory_pending.get(signature)
        if pending is None:
            params = session.scalar(select(Trial.params).where(Trial.id == trial_id))
            ref = self.pool.measure_memory(worker, study.workload, params, self._training_of(study))
            self._memory_pending[signature] = (ref, time.monotonic())
            return None
        ref, since = pending
        try:
            model = self.pool.measured(ref)
        except LookupError as exc:  # the worker died: measure again, on another
            log.warning("study %d: measuring its arrays' memory: %s; again", study.id, exc)
            del self._memory_pending[signature]
            return None
        except RuntimeError as exc:
            log.warning("study %d: no memory model for its arrays (%s): one member each", study.id, exc)
            model = (0, self.settings.worker_memory_bytes or 1)
        if model is None:
            if time.monotonic() - since < self.settings.ray_timeout_s:
                return None
            log.warning("study %d: its arrays' memory model took over %.0f s: one member each", study.id, self.settings.ray_timeout_s)
            model = (0, self.settings.worker_memory_bytes or 1)
        del self._memory_pending[signature]
        self._memory_models[signature] = model
        return model

    def _load_throughput(self) -> None:
        """The speeds measured by earlier arrays, also by an earlier process: no new dry runs."""
        with self.sessions() as session:
            for row in session.scalars(select(Throughput)):
                self._points.setdefault((row.signature, row.device_type), {})[row.members] = row.models_steps_per_s

    def _observe(self, cls: str, device_type: str, report: EpochReport, warm: bool) -> None:
        """Fold an array-epoch's measured speed into the class's curve; :meth:`_write_observed`
        writes it to ft_throughput."""
        signature = cls.split("@", 1)[0]
        measured = []
        if warm and report.train_seconds > 0 and report.size > 0:
            measured.append((report.size, report.member_steps / report.train_seconds))
        if report.solo_steps_per_s:
            measured.append((1, report.solo_steps_per_s))
        if not measured:
            return
        points = self._points.setdefault((signature, device_type), {})
        smoothing = self.settings.throughput_smoothing
        for members, rate in measured:
            key = (signature, device_type, members)
            _, samples, new = self._observed.get(key, (0.0, 0, members not in points))
            if members in points:
                rate = (1 - smoothing) * points[members] + smoothing * rate
            points[members] = rate
            self._observed[key] = (rate, samples + 1, new)
        self.scheduler.throughput.set_curve(cls, device_type, fit_points(points, self.settings.prior_marginal_cost))

    def _write_observed(self, session: Session) -> None:
        """Write the speeds :meth:`_observe` folded in since the last call: one row each, however
        many of the transaction's array-epochs measured it."""
        observed, self._observed = self._observed, {}
        for (signature, device_type, members), (rate, samples, new) in observed.items():
            if new:
                session.add(Throughput(signature=signature, device_type=device_type, members=members, models_steps_per_s=rate, samples=samples))
            else:
                rows = Throughput.__table__
                session.connection().execute(
                    update(rows)
                    .where(rows.c.signature == signature, rows.c.device_type == device_type, rows.c.members == members)
                    .values(models_steps_per_s=rate, samples=rows.c.samples + samples, updated_at=utcnow())
                )

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
        live = self._live.pop(spec.array_id, None)
        with self.sessions() as session:
            array = session.get(Array, spec.array_id)
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
                for trial in session.scalars(select(Trial).where(Trial.array_id == array.id, Trial.state == TrialState.WAITING)):
                    trial.array_id = None
                    session.execute(delete(ArrayMember).where(ArrayMember.array_id == array.id, ArrayMember.trial_id == trial.id))
                # Members still running when the array ended: those whose worker died resume
                # from their checkpoint (at most _MAX_RESUMES times); the others fail with the error.
                died = not isinstance(result, ArrayOutcome)
                # Out of memory: the class's arrays on this device type are capped at half this
                # size from now on, and the members wait again for the halves.
                split = self._split_on_oom(session, worker, array, result)
                died = died or split
                tenant = live.tenant if live is not None else session.get(Study, array.study_id).tenant
                where = {"tenant": tenant, "study_id": array.study_id, "array_id": array.id}
                requeued: list[int] = []
                for trial in session.scalars(select(Trial).where(Trial.array_id == array.id, Trial.state == TrialState.RUNNING)):
                    # The worker reported a checkpoint of it (the store is never looked into); the
                    # halves of an array that ran out of memory take every member, from scratch if need be.
                    resumable = trial.checkpoint_epoch is not None or split
                    if died and resumable and self._resumes.get(trial.id, 0) < _MAX_RESUMES:
                        self._resumes[trial.id] = self._resumes.get(trial.id, 0) + 1
                        trial.state, trial.array_id, trial.started_at = TrialState.WAITING, None, None
                        requeued.append(trial.id)
                        continue
                    error = result.failed.get(trial.id, result.error) if isinstance(result, ArrayOutcome) else None
                    # Loaded only here: an array whose members all ended needs no mirror, and its
                    # study may have completed (and dropped its mirror) with their last epoch.
                    self._mirror_of(session, array.study_id).tell(session, trial.optuna_trial_id, OptunaState.FAIL)
                    trial.state, trial.completed_at, trial.error = TrialState.FAIL, now, error or array.error
                    events.record(session, "trial.ended", **where, trial_id=trial.id, state="FAIL", value=None, error=trial.error)
                events.record(session, "array.ended", **where, state=array.state.value, error=array.error, requeued=requeued)
                session.commit()
            except Exception:
                session.rollback()
                if live is not None:  # its members were told FAIL in the mirror only
                    self._mark_stale(array.study_id, live.optuna_ids.values())
                else:
                    self._mirrors.pop(array.study_id, None)
                raise
        log.info("array %d ended: %s", spec.array_id, array.state.value)

    def _maybe_complete(self, session: Session, study: Study) -> None:
        """End ``study`` (COMPLETE, or FAILED when every trial failed) once all its trials
        have, in a transaction of its own."""
        if self._complete_if_done(session, study):
            session.commit()
            self._mirrors.pop(study.id, None)

    def _complete_if_done(self, session: Session, study: Study | None) -> bool:
        """:meth:`_maybe_complete` in the caller's transaction: whether the study ended."""
        if study is None or study.state != StudyState.RUNNING:  # it failed in this step (its workload)
            return False
        counts = dict(
            session.execute(
                select(Trial.state, func.count()).where(Trial.study_id == study.id).group_by(Trial.state)
            ).all()
        )
        finished = sum(n for state, n in counts.items() if state.is_finished)
        if sum(counts.values()) >= study.n_trials and finished == sum(counts.values()):
            study.state, study.completed_at = StudyState.COMPLETE, utcnow()
            self._fail_if_every_trial_failed(session, study, counts)
            events.record(session, "study.completed", tenant=study.tenant, study_id=study.id, trial_counts={s.value: n for s, n in counts.items()})
            return True
        return False


def split_plan(
    remaining: Mapping[int, int], epoch_s: float, build_s: float, rate: Callable[[int], float], latency_s: float = 0.05
) -> tuple[list[int], float]:
    """Which members of a running array move to an idle device, and the seconds that saves.

    ``remaining``: each member's epochs left after the one it trains now; ``epoch_s``: the
    array's last epoch with these members (0: unknown); ``build_s``: the seconds its first
    build took; ``rate(b)``: the class's models·steps/s in an array of ``b`` on this device
    type (scheduler.ThroughputModel). Of the members that go on after this epoch, half
    move, those with the most epochs left; each half then trains at the speed of its size.
    A move costs the movers' checkpoints, their build and their resume (a build each, about)
    and ``latency_s`` (the rest: the wait for the boundary, a scheduling round, the new
    array's start, both halves sharing the machine; ``Settings.move_latency_s``). Returns
    ``([], 0.0)`` unless both halves are estimated to end at least _SPLIT_MIN_GAIN of the
    time left sooner: the estimate is rough, and a move of little gain may lose.
    """
    size = len(remaining)
    # Those on their last epoch end at this boundary: the split is of the others.
    going_on = sorted((i for i in remaining if remaining[i] >= 1), key=lambda i: (-remaining[i], i))
    k = len(going_on) // 2
    if k < 1 or epoch_s <= 0 or rate(size) <= 0:
        return [], 0.0
    movers, stayers = going_on[:k], going_on[k:]

    def epoch(b: int) -> float:  # the time of an epoch of b members, from the measured one
        return epoch_s * (b / rate(b)) / (size / rate(size))

    keep = remaining[going_on[0]] * epoch(len(going_on))
    stay = remaining[stayers[0]] * epoch(len(stayers))
    move = 3 * build_s * k / size + latency_s + remaining[movers[0]] * epoch(k)
    saved = keep - max(stay, move)
    return (movers, saved) if saved >= _SPLIT_MIN_GAIN * keep else ([], 0.0)


def offer_plan(size: int, present: int, ends: Sequence[int], chain: bool = False) -> tuple[int, list[int]]:
    """Where an array of ``size`` places takes waiting trials of its class.

    ``present``: its members and the trials offered to it already; ``ends``: sorted, the
    boundaries (epochs of the array) where those of them on their last epochs leave.
    Returns how many join at its next boundary (the places ended members freed; none with
    ``chain``, which offers only the places of members on their last epoch) and, for each
    newcomer that joins later, the boundary whose leaving member it replaces: the latest
    ones, so that the array never holds more than ``size``, even where earlier places were
    offered before. There are never more of those than members that leave.
    """
    now_free = 0 if chain else max(0, size - present)
    # Offered newcomers count as staying: what is left to fill is size less the stayers.
    later = min(len(ends), max(0, size - (present - len(ends)) - now_free))
    return now_free, list(ends[len(ends) - later:])


def _member_spec(trial: Trial) -> MemberSpec:
    """A trial as a worker trains it: from the checkpoint its workers last reported, or from scratch."""
    return MemberSpec(trial.id, trial.optuna_trial_id, trial.number, dict(trial.params), resume_epoch=trial.checkpoint_epoch or 0)


def _add_timings(total: Mapping[str, float] | None, more: Mapping[str, float]) -> dict[str, float]:
    out = dict(total or {})
    for phase, seconds in more.items():
        out[phase] = out.get(phase, 0.0) + seconds
    return out


def _finish(
    session: Session, trial_id: int, state: TrialState, now: Any, value: float | None = None, error: str | None = None,
    event: Mapping[str, Any] | None = None,
) -> None:
    """End fusetune's row of a trial (Optuna's is the mirror's) with its ``trial.ended``
    event (``event``: its tenant, study and array), in the same transaction."""
    ending = _ending(session, trial_id, state, value=value, error=error, event=event or {})
    session.execute(
        update(Trial).where(Trial.id == trial_id)
        .values(state=state, completed_at=now, error=ending["ended_error"], value=ending["ended_value"])
    )


def _ending(
    session: Session, trial_id: int, state: TrialState, *, value: float | None = None, error: str | None = None,
    event: Mapping[str, Any],
) -> dict[str, Any]:
    """A trial's ``trial.ended`` event (``event``: its tenant, study and array; none if
    empty), and the parameters of its row's update: an array-epoch ends all its members'
    rows in one statement, :func:`_finish` one trial's."""
    value = value if value is not None and math.isfinite(value) else None
    if event:
        events.record(session, "trial.ended", **event, trial_id=trial_id, state=state.value, value=value, error=error)
    return {"ended_id": trial_id, "ended_state": state, "ended_value": value, "ended_error": error}


def _json_number(value: float | None) -> float | None:
    """A metric as JSON carries it: NaN and infinities are null."""
    return value if value is not None and math.isfinite(value) else None


@dataclass
class _Live:
    """What the control plane keeps of an array it started, so that its reports need no reads."""

    study_id: int
    optuna_ids: dict[int, int]  # fusetune trial id -> Optuna trial id, members and newcomers
    client_decides: bool = False  # a client-driven study: its client decides pruning
    tenant: str = "default"  # the study's, for its events
    announced: set[int] = field(default_factory=set)  # first members whose trial.started is written, until they join
    epochs_done: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    checkpoints: dict[int, int] = field(default_factory=dict)  # trial id -> checkpoint epoch stored in ft_trials
    steps: dict[int, int] = field(default_factory=dict)  # trial id -> the last step recorded of it in this array
    ahead: Counter[int] = field(default_factory=Counter)  # boundary -> newcomers offered to join there
    lookahead: int = _LOOKAHEAD_EPOCHS  # epochs ahead a successor is offered (_LOOKAHEAD_S of the last epoch's)
    near: set[int] = field(default_factory=set)  # members that came within the look-ahead
    unacked: int = 0  # recorded reports of a worker that does not wait, not acknowledged yet
    new_checkpoint: bool = False  # a recorded report named a checkpoint not acknowledged yet
    last_epoch: tuple[float, int] = (0.0, 0)  # the last epoch's seconds (training to report) and its members
    # Members whose trials the control plane ended while the worker went on: pruned by a
    # reply that came after the worker's deadline (workers/actor.py). Their later results are
    # the worker's, not the trial's any more, and are not recorded.
    ended: set[int] = field(default_factory=set)
