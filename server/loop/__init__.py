"""The scheduling loop: ask Optuna for trials, fuse them into arrays, dispatch, record the ends.

It runs on one background thread of the server that holds the scheduler lock
(``server/leader.py``). :class:`SchedulingLoop` is the small facade the service, the routes
and the leadership call; its parts each own their state and say what they may call:

* ``thread`` runs the turns, keeps the inbox other threads hand work through, and backs off
  while the database is unreachable;
* ``state`` is the one object of the arrays it runs (live, awaiting a client, placed,
  halting, leaving, moving);
* ``mirrors`` holds each running study's Optuna study in memory, with its sampler and pruner;
* ``asking`` asks each running study's sampler for trials;
* ``describing`` learns each asked trial's fusion key and memory floor (a package's from its
  describer, in its own time);
* ``dispatch`` turns the scheduler's decisions into arrays on the devices (start, top up,
  preempt, split onto an idle device);
* ``recorder`` writes each array-epoch in one transaction and answers its worker;
* ``throughput`` keeps the measured speeds, out-of-memory caps and memory models;
* ``lifecycle`` pauses, resumes, cancels, deletes and extends studies;
* ``recovery`` puts right what an earlier scheduler left running;
* ``rows`` is their repository of fusetune's rows.

The scheduler itself (``scheduler/``) decides; this package only moves state between the
database, Optuna and the worker pool.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from fusetune.scheduler import ThroughputModel, make_scheduler
from fusetune.server import events
from fusetune.server.db import StudyState, get_loop_sessionmaker, get_optuna_storage
from fusetune.server.fencing import fence, take_epoch
from fusetune.server.loop import recovery, rows
from fusetune.server.loop.asking import Asker
from fusetune.server.loop.context import LoopContext
from fusetune.server.loop.describing import Descriptions
from fusetune.server.loop.dispatch import Dispatcher
from fusetune.server.loop.lifecycle import Lifecycle
from fusetune.server.loop.mirrors import Mirrors
from fusetune.server.loop.packages import PackageRuntime
from fusetune.server.loop.recorder import Recorder
from fusetune.server.loop.state import LoopState
from fusetune.server.loop.thread import LoopThread
from fusetune.server.loop.throughput import Throughput
from fusetune.server.mirror import CreatedStudy
from fusetune.server.purge import StudyPurger
from fusetune.server.settings import Settings, artifact_uri
from fusetune.workers.pool import Event, WorkerPool

__all__ = ["SchedulingLoop"]

_T = TypeVar("_T")
#: While a client's pruning decisions are awaited, the loop looks at its inbox this often.
_DECISION_POLL_S = 0.01

log = logging.getLogger(__name__)


class SchedulingLoop:
    """Drives every running study to completion on a :class:`~workers.pool.WorkerPool`.

    The control plane's one writer of trial results (see the package docstring). What other
    threads ask of it runs on its thread through :meth:`call`, which alone touches its state
    and the mirrors: a study's lifecycle (``loop.lifecycle.pause``, ...), an enqueued trial
    (``loop.asker.enqueue``), a client's pruning decision (``loop.recorder.decide``).
    """

    def __init__(self, settings: Settings, pool: WorkerPool) -> None:
        self.settings = settings
        self.pool = pool
        self.scheduler = make_scheduler(
            settings.scheduling_policy,
            ThroughputModel(prior_marginal_cost=settings.prior_marginal_cost),
            max_members=settings.max_array_size,
            min_member_efficiency=settings.min_member_efficiency,
            lease_seconds=settings.lease_s,
        )
        self.thread = LoopThread(self.turn, settings.poll_interval_s, settings.db_retry_s)
        storage = get_optuna_storage(settings.database_url)
        packages = PackageRuntime(settings)
        self.ctx = LoopContext(
            settings, pool, storage, LoopState(), Mirrors(storage, settings, lambda: len(pool.workers), packages),
            get_loop_sessionmaker(settings.database_url), self.thread.wake, packages,
        )
        self.throughput = Throughput(settings, pool, self.scheduler, packages)
        self.lifecycle = Lifecycle(self.ctx)
        self.recorder = Recorder(self.ctx, self.throughput, self.lifecycle)
        self.describing = Descriptions(self.ctx, self.lifecycle, self.recorder.notices, self.throughput)
        self.asker = Asker(self.ctx, self.lifecycle, self.describing)
        self.dispatcher = Dispatcher(self.ctx, self.scheduler, self.throughput)
        #: The fencing epoch this scheduler took (server/fencing.py), once set up.
        self.epoch: int | None = None
        self._next_refresh = time.monotonic() + settings.device_refresh_s
        self._next_prune = 0.0  # when old events are pruned next (monotonic)
        self._next_step = 0.0
        self._studies_running = 0  # as the last step saw them
        self._heap_settled = False  # see _settle_heap

    # -- its life ------------------------------------------------------------------------------------
    @property
    def state(self) -> LoopState:
        return self.ctx.state

    @property
    def mirrors(self) -> Mirrors:
        return self.ctx.mirrors

    @property
    def on_fenced(self) -> Callable[[], None] | None:
        """Called (on the loop's thread) when another server has become the scheduler of
        record and this loop has stopped: the server's leadership steps down."""
        return self.thread.fenced

    @on_fenced.setter
    def on_fenced(self, callback: Callable[[], None] | None) -> None:
        self.thread.fenced = callback

    @property
    def reports_ingested(self) -> int:
        """Array-epoch reports recorded by this process (GET /metrics: fusetune_epoch_reports_total)."""
        return self.recorder.reports_ingested

    def setup(self) -> None:
        """Become the scheduler of record (a new fencing epoch: every later commit checks it),
        register the pool's workers, load measured throughput, re-queue what a previous
        process left running, and hand the purger the deleted studies not gone yet."""
        plain = get_loop_sessionmaker(self.settings.database_url)
        self.epoch = take_epoch(plain)
        self.ctx.sessions = sessions = fence(plain, self.epoch)
        self.ctx.purger = StudyPurger(
            sessions, artifact_uri(self.settings), self.settings.delete_batch_trials,
            finish=lambda purge: self.thread.post(lambda: self.lifecycle.finish_delete(purge)),
        )
        recovery.register_workers(sessions, self.pool, self.state)
        with sessions() as session:
            self.throughput.load(session)
        recovery.recover(sessions)
        self._prune_events()
        for purge in recovery.hidden_studies(sessions):
            self.ctx.purge(purge)

    def start(self) -> None:
        """:meth:`setup`, then run the loop on its thread: worker reports as they come, a
        scheduling :meth:`step` every ``poll_interval_s`` or when woken."""
        self.setup()
        self.thread.start()

    def stop(self) -> None:
        self.thread.stop()
        if self.ctx.purger is not None:
            self.ctx.purger.stop()
        try:
            self.ctx.packages.shutdown()  # the describers: the loop's own actors, not the pool's
        except Exception as exc:  # Ray may be down already
            log.warning("the code packages' describers could not be stopped: %s", exc)

    def wake(self) -> None:
        """Run a scheduling step now (a study was created), not at the next poll."""
        self.thread.wake()

    def adopt(self, study_id: int, created: CreatedStudy) -> None:
        """A study this process has just created (``created``: its Optuna rows): its mirror is
        built from them, reading nothing back, and a scheduling step runs now. Any thread."""
        self.mirrors.adopt(study_id, created)
        self.wake()

    def call(self, fn: Callable[[], _T], timeout: float | None = None) -> _T:
        """Run ``fn`` on the loop's thread and return its result; a 503 (``Unavailable``) when
        the loop does not take it up within ``FUSETUNE_LOOP_CALL_TIMEOUT_S`` (it never runs then)."""
        return self.thread.call(fn, self.settings.loop_call_timeout_s if timeout is None else timeout)

    def post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the loop's thread at its next turn, without waiting for it (any thread)."""
        self.thread.post(fn)

    # -- its turns -------------------------------------------------------------------------------------
    def turn(self) -> None:
        """One turn of the loop's thread: the inbox, what the database refused earlier, a step
        when one is due or asked for, then the workers' next words (or a wait to be woken)."""
        self.pool.heartbeat()  # a hung worker, or one past its epoch deadline, is killed; its stream then says so
        if self.pool.renamed():  # restarted workers' new processes are up: their host:pid goes on their rows now
            self.recorder.workers_changed, self._next_step = True, 0.0
        self.thread.run_inbox()
        if self.recorder.backlog and self.handle(()):  # what the database refused earlier, in order, first
            self._next_step = 0.0
        if self.thread.woken() or time.monotonic() >= self._next_step:
            self.step()
            self._next_step = time.monotonic() + self.settings.poll_interval_s
        timeout = max(0.0, self._next_step - time.monotonic())
        if self.state.awaiting:
            timeout = min(timeout, _DECISION_POLL_S)
        timeout = min(timeout, self.settings.heartbeat_interval_s)
        if self.pool.idle() != self.pool.workers:
            if self.handle(self.pool.wait(timeout)):
                self._next_step = 0.0  # a worker or slots are free for waiting trials
        else:
            self._settle_heap()
            self.thread.wait(timeout)

    def handle(self, events_: Sequence[Event]) -> bool:
        """Record what workers said (``Recorder.handle``); whether a slot was freed."""
        return self.recorder.handle(events_)

    def step(self) -> None:
        """One round: take the workers' reports, start arrays on idle workers, ask for new trials."""
        self.thread.run_inbox()  # what other threads handed over (a purged study's last rows, ...)
        self._keep_up()
        self.handle(self.pool.wait(0))
        with self.ctx.sessions() as session:
            # One read a round (it runs after every array-epoch): the running studies, and the
            # stopping ones not settled yet (cancelled, failed, deleted: end what can end).
            listed = rows.round_studies(session)
            studies = [s for s in listed if s.state == StudyState.RUNNING and self._usable(session, s)]
            for study in [s for s in listed if s.state in rows.STOPPING]:
                self.lifecycle.settle(session, study)
            self.describing.settle(session)  # what the packages' describers have answered
            self.asker.prepare(session, studies)  # package studies' mirrors, once their packages load
            self._studies_running = len(studies)
            # A study whose last trials were recorded ends first: its stream says so before
            # anything else this round does.
            for study in studies:
                self.recorder.maybe_complete(session, study)
            self._ask_and_dispatch(session, listed, studies)
            for study in studies:  # trials a search space rejected ended as they were asked
                self.recorder.maybe_complete(session, study)
            if self._studies_running and self.pool.idle():
                self.dispatcher.split_for_idle(session)
            if self.pool.idle():  # what this round left idle may set up a package being loaded
                self.ctx.packages.warm(self.pool, studies)

    def _ask_and_dispatch(self, session: Session, listed: Sequence[Any], studies: Sequence[Any]) -> None:
        """Trials asked earlier go to free workers first; asking for more (TPE's cost grows with
        the study) then happens while they train, and only a worker still idle waits for it.
        While workers are idle, each running study is asked one group (one array's worth of
        FusionSampler trials) per idle worker, all in one batch, and the groups start together,
        the slowest class's array first. A sweep ends with its slowest array: asked group by
        group, it waited for every group asked and started before it (~45 ms a group on PostgreSQL)."""
        self.dispatcher.dispatch(session, listed)
        asking = [s for s in studies if s.state == StudyState.RUNNING]
        while asking:
            # One group per idle worker for each study: the scheduler then shares the workers
            # between the studies' tenants by weight, from trials that all wait.
            groups = len(self.pool.idle())
            asking = [s for s in asking if self.asker.ask_alone(session, s, groups)]
            # A device is kept for the groups still to come, not given to half of this one. One
            # round may start one class's array where its trials wait for two: the next round,
            # seeing that array, starts the other.
            while self.pool.idle() and self.dispatcher.dispatch(session, listed, asking={s.id for s in asking}):
                pass

    def _usable(self, session: Session, study: Any) -> bool:
        """Whether the study's stored sampler and pruner may be built; one that may not fails alone."""
        reason = self.mirrors.usable(session, study)
        if reason is not None:
            self.lifecycle.fail(session, study, reason)
            return False
        return True

    def _keep_up(self) -> None:
        """Follow the cluster's nodes, register replaced workers, prune old events: when due."""
        changed = self.recorder.workers_changed
        if time.monotonic() >= self._next_refresh:
            # Nodes may join or leave the Ray cluster after the service started.
            changed = bool(self.pool.refresh()) or changed
            self._next_refresh = time.monotonic() + self.settings.device_refresh_s
        if changed:  # new workers, or replacement actors in new processes
            recovery.register_workers(self.ctx.sessions, self.pool, self.state)
            self.recorder.workers_changed = False
        if time.monotonic() >= self._next_prune:
            self._prune_events()

    def _prune_events(self) -> None:
        """Drop events past FUSETUNE_EVENTS_RETENTION_S: at start-up, then hourly."""
        with self.ctx.sessions.begin() as session:
            events.prune(session, self.settings.events_retention_s)
        self._next_prune = time.monotonic() + min(3600.0, self.settings.events_retention_s)

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
