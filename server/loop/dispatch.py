"""Dispatch: each round's decision turned into arrays on the devices.

Every round, the scheduler (``scheduler/``, pure decisions) sees every unfinished trial, every
worker as a device, the tenants' weights and the arrays running now, and places classes on
devices. Here a placement on an idle device starts an array (its trials packed to the size
the scheduler, the study and memory allow; the slowest array of a round first); a placement
that adds waiting trials to a running array offers them to it (backfill, and successors of
members on their last epochs, offered ahead so the worker never waits for a round); members
the scheduler preempts leave at their array's next boundary; and a device left idle with
nothing waiting takes half of a running array's members (or, of a faster type, all of them)
when the measured speeds say that ends them sooner (:func:`split_plan`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from fusetune.scheduler import Device, PendingTrial, Placement, Scheduler, pack
from fusetune.scheduler import Tenant as SchedulerTenant
from fusetune.server import events
from fusetune.server.db import Study, StudyState, Trial, TrialState
from fusetune.server.loop import rows
from fusetune.server.loop.context import LoopContext
from fusetune.server.loop.mirrors import training_seed
from fusetune.server.loop.state import Live, class_of, member_spec
from fusetune.server.loop.throughput import Throughput
from fusetune.server.settings import artifact_uri
from fusetune.workers.pool import WorkerHandle
from fusetune.workers.spec import ArraySpec

__all__ = ["Dispatcher", "offer_plan", "split_plan"]

log = logging.getLogger(__name__)

#: An array is split onto an idle device only when that is estimated to end its members this
#: much sooner (a fraction of their time left): see split_plan.
_SPLIT_MIN_GAIN = 0.25


@dataclass
class _Round:
    """What one round decided, and what its starts need of it."""

    dispatcher: Dispatcher
    placements: list[Placement]
    rows: list[tuple[Any, Study]]  # the unfinished trials (columns) with their studies
    waiting: dict[int, tuple[Any, Study]]  # trial id -> (trial, study), outside any array
    finishing: dict[int, int]  # members on their last epochs -> the boundary where they leave
    idle: dict[str, WorkerHandle]
    busy: dict[str, WorkerHandle]
    starts: Counter[str]  # class -> idle devices it gets this round
    queued: Counter[str]  # class -> its waiting trials

    def seconds(self, p: Placement) -> float:
        """An array's time to train, in its class's steps, from the class's curve (0: none starts)."""
        worker, ids = self.idle.get(p.device_id), [i for i in p.trial_ids if i in self.waiting]
        if worker is None or not ids:
            return 0.0
        study = self.waiting[ids[0]][1]
        limit = self.dispatcher.array_cap(study)
        curve = self.dispatcher.scheduler.throughput.curve(p.signature, worker.device_type)
        # The size it starts with (_start_placed), not the scheduler's: two classes of one sweep
        # start at their shares of the devices, whatever sizes the scheduler chose for them.
        share = math.ceil(self.queued[p.signature] / max(1, self.starts[p.signature]))
        b = max(min(len(p.trial_ids), limit), min(limit, share, curve.memory_cap(worker.memory_bytes)))
        rate = curve.rate(b)
        return study.epochs * b / rate if rate > 0 else math.inf  # unmeasured: assumed slow


class Dispatcher:
    """Turns each round's decision into arrays (see the module docstring)."""

    def __init__(self, ctx: LoopContext, scheduler: Scheduler, throughput: Throughput) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.state = ctx.state
        self.scheduler = scheduler
        self.throughput = throughput

    # -- a round ---------------------------------------------------------------------------------
    def dispatch(self, session: Session, listed: Sequence[Study], asking: Collection[int] = ()) -> bool:
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
        round_ = self._decide(session, listed, asking)
        if round_ is None:
            return False
        started, topped = False, set()
        for placement in sorted(round_.placements, key=round_.seconds, reverse=True):
            # The slowest array first: a sweep ends with its slowest class, whose start waits
            # for every array started before it in this round (its rows, its commit, its submit).
            ids = [i for i in placement.trial_ids if i in round_.waiting]
            if not ids:
                continue
            if placement.device_id in round_.idle:
                started = self._start_placed(session, round_, placement) or started
            elif placement.device_id in round_.busy and getattr(self.state.running.get(placement.device_id), "signature", None) == placement.signature:
                study = round_.waiting[ids[0]][1]
                cap = min(len(placement.trial_ids), self.array_cap(study))
                self._top_up(session, round_.busy[placement.device_id], ids, cap, round_.rows, round_.waiting, round_.finishing)
                topped.add(placement.device_id)
        self._chain(session, round_, topped)
        return started

    def array_cap(self, study: Study) -> int:
        """Most members an array of ``study`` holds: its cap, or the service's; 1 under a
        policy that does not fuse (``fifo``, ``gavel``, ``oef``, ...), which placed one trial
        per device and is compared, live and simulated, as it decided."""
        if not self.scheduler.fusion:
            return 1
        return study.max_array_size or self.settings.max_array_size

    def _decide(self, session: Session, listed: Sequence[Study], asking: Collection[int]) -> _Round | None:
        """The round's decision, from the unfinished trials, the devices and the tenants' weights
        (None: nothing waits). Preemptions are asked for and extended leases kept here."""
        idle = {w.name: w for w in self.ctx.pool.idle()}
        studies = {s.id: s for s in listed if s.state == StudyState.RUNNING}
        # A package's trial waits unsigned until its describer answers (describing.py): it
        # is nobody's class yet, so no round places it; nor, after a restart, one of a
        # package not loaded again yet (PackageRuntime.loaded).
        held = {s.id for s in studies.values() if not self._mirrored(s)}
        found = [(t, studies[t.study_id]) for t in rows.unfinished(session)
                 if t.study_id in studies and t.signature and not (t.study_id in held and t.state == TrialState.WAITING)]
        waiting = {t.id: (t, study) for t, study in found if t.array_id is None and t.state == TrialState.WAITING}
        self._start_moves(session, found, idle, waiting)
        if not waiting:
            return None
        finishing = self._finishing(found)
        pending = [
            PendingTrial(trial_id=t.id, signature=class_of(t), tenant=study.tenant, study_id=study.id, remaining_epochs=study.epochs)
            for t, study in found
            if t.id not in finishing
        ]
        weights = [SchedulerTenant(name, weight) for name, weight in rows.tenant_weights(session)]
        devices = [Device(w.name, w.device_type, w.memory_bytes, w.node) for w in self.ctx.pool.workers]
        self.throughput.curve_classes({p.signature for p in pending}, {d.device_type for d in devices})
        # Members on their last epochs are done as far as the scheduler is concerned: the
        # slots they free are offered now, to be taken where they leave (_top_up).
        running = [dataclasses.replace(p, trial_ids=tuple(i for i in p.trial_ids if i not in finishing)) for p in self.state.running.values()]
        decision = self.scheduler.decide(time.monotonic(), pending, devices, weights, running)
        busy = {w.name: w for w in self.ctx.pool.workers if not w.idle}
        self._preempt(decision.preempted, busy, found)
        for placement in decision.placements:  # leases the scheduler extended
            current = self.state.running.get(placement.device_id)
            if placement.device_id in busy and current is not None and current.signature == placement.signature:
                self.state.running[placement.device_id] = dataclasses.replace(current, lease_expires=placement.lease_expires)
        placements = self._spread_classes(decision.placements, idle, waiting, asking)
        starts = Counter(p.signature for p in placements if p.device_id in idle and any(i in waiting for i in p.trial_ids))
        queued = Counter(class_of(t) for t, _ in waiting.values())
        return _Round(self, placements, found, waiting, finishing, idle, busy, starts, queued)

    def _start_placed(self, session: Session, round_: _Round, placement: Placement) -> bool:
        """Start the array a placement puts on an idle device; whether it started.

        The scheduler chose the class for this device and a size; the class's waiting trials
        are then spread evenly over the idle devices it got this round, each array as large
        as the cap and memory allow: on one device, one array of n trials drains them faster
        than smaller arrays in turn (the rate grows with B), and what is left is spread evenly
        (9 trials at B=8: 5 now and 4 next, not 8 and 1).
        """
        worker = round_.idle[placement.device_id]
        ids = [i for i in placement.trial_ids if i in round_.waiting]
        study = round_.waiting[ids[0]][1]
        limit = self.array_cap(study)
        queue = [PendingTrial(trial_id=i, signature=placement.signature) for i, (t, _) in round_.waiting.items() if class_of(t) == placement.signature]
        share = math.ceil(len(queue) / max(1, round_.starts[placement.signature]))
        round_.starts[placement.signature] -= 1
        fits = self.scheduler.throughput.curve(placement.signature, worker.device_type).memory_cap(worker.memory_bytes)
        cap = max(min(len(placement.trial_ids), limit), min(limit, share, fits))
        # A model found to fuse by neither path (also by an earlier process: the study's attrs)
        # trains one member per array.
        mirror = self.ctx.mirrors.loaded(study.id)
        self.throughput.recall_unfusible(
            study, lambda: mirror.system_attrs if mirror is not None else self.ctx.storage.get_study_system_attrs(study.optuna_study_id)
        )
        cap = min(cap, self.throughput.size_cap(session, placement.signature, worker, queue[0].trial_id, round_.waiting))
        if cap == 0:
            return False  # its memory model is measured on a worker first: a later round starts it
        members = rows.trials(session, [round_.waiting.pop(i)[0].id for i in pack(queue, cap)[0].trial_ids])
        self.start_array(session, study, worker, members)
        self.state.running[worker.name] = Placement(
            worker.name, placement.signature, study.tenant, tuple(t.id for t in members), placement.lease_expires
        )
        return True

    def _chain(self, session: Session, round_: _Round, topped: set[str]) -> None:
        """A busy array whose members are on their last epochs keeps its class where they leave,
        when the scheduler gave the device to no other tenant and the class has trials waiting:
        the worker goes on with them instead of waiting for a round, an array and a build."""
        given = {p.device_id: p for p in round_.placements}
        for name, worker in round_.busy.items():
            current = self.state.running.get(name)
            if name in topped or current is None or worker.spec is None:
                continue
            if name in given and given[name].tenant != current.tenant:
                continue
            queue = [i for i, (t, _) in round_.waiting.items() if class_of(t) == current.signature]
            if queue:
                study = round_.waiting[queue[0]][1]
                cap = self.array_cap(study)
                self._top_up(session, worker, queue, cap, round_.rows, round_.waiting, round_.finishing, chain=True)

    # -- the parts of a round ----------------------------------------------------------------------
    def _top_up(
        self, session: Session, worker: WorkerHandle, ids: Sequence[int], cap: int, found: Sequence[Any],
        waiting: dict[int, tuple[Any, Study]], finishing: Mapping[int, int], chain: bool = False,
    ) -> None:
        """Offer waiting trials ``ids`` to the array ``worker`` trains: as many as its ended
        members freed (they join at its next boundary), and as many as its members on their
        last epoch will free (they join at the boundary after that epoch, where those
        members leave: an array of one goes on as a chain of trials on one worker). The
        array never holds more than the size it started with (or ``cap``). With ``chain``,
        only the places of members on their last epoch are offered."""
        spec = worker.spec
        if spec is None:
            return  # its array ended this round: nothing to offer it
        moving = {i for ids in self.state.moves.values() for i in ids}
        ids = [i for i in ids if i not in moving]  # they left for an idle device: they go there
        present = [t.id for t, _ in found if t.array_id == spec.array_id]
        if chain and not any(i in finishing for i in present):
            return
        if not present:
            # Every member has ended: the array stops at this boundary, and an offer would
            # arrive too late and wait for it to end. Its worker takes a new one.
            return
        # The boundaries (epochs of the array) where its members on their last epochs leave.
        ends = sorted(finishing[i] for i in present if i in finishing)
        now_free, places = offer_plan(min(cap, len(spec.members)), len(present), ends, chain)
        joining = rows.trials(session, [waiting.pop(i)[0].id for i in ids[: now_free + len(places)]])
        if not joining:
            return
        if joining[:now_free]:
            self._refill(session, worker, spec.array_id, joining[:now_free])
        # Fewer newcomers than places: they take the latest ones (see offer_plan).
        afters = places[len(places) - len(joining[now_free:]):]
        for after in sorted(set(afters)):
            group = [t for t, a in zip(joining[now_free:], afters, strict=True) if a == after]
            self._refill(session, worker, spec.array_id, group, after_epoch=after)
            self.state.live[spec.array_id].ahead[after] += len(group)
        current = self.state.running[worker.name]
        self.state.running[worker.name] = dataclasses.replace(current, trial_ids=tuple(present + [t.id for t in joining]))

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
            queues.setdefault(class_of(trial), []).append(trial_id)
        cap = {c: self.array_cap(waiting[ids[0]][1]) for c, ids in queues.items()}
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

    def split_for_idle(self, session: Session) -> None:
        """A device idle with nothing waiting takes half of a running array's members, when
        the measured speeds say both halves end sooner than the whole array would; or, under
        a fusing policy that weighs device types (``fusetune``), all of them, when it is of
        a faster type and that saves more.

        The classes of a sweep cost differently (a wider model takes longer per epoch), so
        the device of the cheaper class goes idle while the other class's array still has
        epochs to train. On a cluster of several device types, a fast device goes idle while
        a slow one still trains: the scheduler placed the array there while the fast one was
        busy, and it decides again only when trials wait. The members with the most epochs
        left leave at the array's next boundary with their checkpoints, as preempted members
        do (:meth:`_preempt`), and the next round starts them on the idle device
        (:func:`split_plan` weighs it, with the idle device type's curve). One move a round,
        and none while members it was asked to let go have not left yet.
        """
        if self.state.moves:
            return  # members on their way to an idle device: one move at a time
        idle = {w.device_type: w for w in self.ctx.pool.idle()}
        unfinished = rows.movable(session)
        if any(t.state == TrialState.WAITING for t in unfinished):
            return  # trials wait for a device, or for the array offered them: nothing moves
        # Moving members by device speed is a heterogeneity-aware policy's call; fifo and the
        # unfused policies are compared, live and simulated, as they decide.
        across_types = self.scheduler.fusion and self.scheduler.fairness is not None
        busy = {w.name: (w, w.spec) for w in self.ctx.pool.workers if w.spec is not None}
        best: tuple[float, str, str, list[int]] | None = None
        for name, (worker, spec) in busy.items():
            live, current = self.state.live.get(spec.array_id), self.state.running.get(name)
            if (
                live is None or current is None or live.client_decides
                or live.study_id in self.state.halting  # paused or stopping: its members leave anyway
            ):
                continue
            members = [t for t in unfinished if t.array_id == spec.array_id]
            if any(t.id not in current.trial_ids for t in members) or any(t.id not in live.steps for t in members):
                continue  # members are leaving already, or have not reported here yet
            # Epochs each has left after the one it trains now.
            remaining = {t.id: t.epochs - 2 - live.steps[t.id] for t in members}
            epoch_s, size = live.last_epoch
            curve = self.scheduler.throughput.curve(spec.signature, worker.device_type)
            build_s = live.timings.get("build_s", 0.0)
            # The fastest idle type for the class first: of moves that save as much, its.
            speed = {g: self.scheduler.throughput.curve(spec.signature, g).rate(1) for g in idle}
            for device_type, target in sorted(idle.items(), key=lambda kv: -speed[kv[0]]):
                if device_type == worker.device_type:
                    target_rate = None
                elif across_types:
                    target_rate = self.scheduler.throughput.curve(spec.signature, device_type).rate
                else:
                    continue
                movers, saved = split_plan(
                    remaining, epoch_s if size == len(members) else 0.0, build_s, curve.rate,
                    self.settings.move_latency_s, target_rate,
                )
                if movers and (best is None or saved > best[0]):
                    best = (saved, name, target.name, movers)
        if best is not None:
            saved, name, target_name, movers = best
            log.info("worker %s: %d members move to %s (%.2f s sooner, estimated)", name, len(movers), target_name, saved)
            self._preempt(movers, {n: w for n, (w, _) in busy.items()}, [(t, None) for t in unfinished])
            self.state.moves[target_name] = movers

    def _start_moves(
        self, session: Session, found: Sequence[Any], idle: dict[str, WorkerHandle], waiting: dict[int, tuple[Any, Study]]
    ) -> None:
        """Members that left an array for an idle device (:meth:`_split_for_idle`) start there as
        one array as soon as they have all left: the scheduler would see a class with a device
        already, and might offer them back to the array they left. A move whose device was
        taken meanwhile, or one of whose members ended instead, is the scheduler's again."""
        unfinished = {t.id for t, _ in found}
        for name, movers in list(self.state.moves.items()):
            worker = idle.get(name)
            if worker is not None and all(i in waiting for i in movers):
                del self.state.moves[name]
                study = waiting[movers[0]][1]
                members = rows.trials(session, [waiting.pop(i)[0].id for i in movers])
                self.start_array(session, study, worker, members)
                self.state.running[name] = Placement(
                    name, class_of(members[0]), study.tenant, tuple(movers), time.monotonic() + self.settings.lease_s
                )
                del idle[name]
            elif worker is None or any(i not in unfinished for i in movers):
                del self.state.moves[name]

    def _mirrored(self, study: Study) -> bool:
        """Whether the study's trials may be placed: a package study's once its mirror is built
        (``Asker.prepare``, from its describer's answers), so that recording their first epoch
        never waits for the describer; after a restart that is when its package has loaded again."""
        return study.package is None or self.ctx.mirrors.loaded(study.id) is not None

    def _finishing(self, found: Sequence[Any]) -> dict[int, int]:
        """Running members with at most their array's look-ahead of epochs left after their last
        recorded step, each with the boundary (its array's epoch count) where it leaves,
        unless it is pruned or its array stops first."""
        out = {}
        for trial, study in found:
            live = self.state.live.get(trial.array_id) if trial.state == TrialState.RUNNING else None
            step = live.steps.get(trial.id) if live is not None else None
            if live is not None and step is not None and 0 < study.epochs - 1 - step <= live.lookahead:
                out[trial.id] = live.epochs_done + study.epochs - 1 - step
        return out

    def _preempt(self, preempted: Sequence[int], busy: Mapping[str, WorkerHandle], found: Sequence[Any]) -> None:
        """Ask arrays to let go of the members the scheduler took off them.

        Each leaves at its array's next epoch boundary with a checkpoint, waiting again, and
        resumes in whichever array the scheduler gives it next (workers/checkpoints.py).
        """
        if not preempted:
            return
        worker_of = {w.spec.array_id: w for w in busy.values() if w.spec is not None}
        array_of = {t.id: t.array_id for t, _ in found if t.state == TrialState.RUNNING}
        asks: dict[str, list[int]] = {}
        for trial_id in preempted:
            array_id = array_of.get(trial_id)
            worker = worker_of.get(array_id) if array_id is not None else None
            if worker is not None:
                asks.setdefault(worker.name, []).append(trial_id)
        for name, ids in asks.items():
            self.ctx.pool.release(busy[name], ids)
            current = self.state.running.get(name)
            if current is not None:  # from now on the scheduler counts them as waiting
                self.state.running[name] = dataclasses.replace(
                    current, trial_ids=tuple(i for i in current.trial_ids if i not in ids)
                )
            log.info("worker %s: %d members leave at the next epoch boundary (preempted)", name, len(ids))

    def _refill(self, session: Session, worker: WorkerHandle, array_id: int, trials: list[Trial], after_epoch: int = 0) -> None:
        """Offer waiting trials to a running array: they join it at its first epoch boundary
        after ``after_epoch`` epochs of it (0: its next one)."""
        study_id = rows.offer(session, array_id, trials)
        events.record(
            session, "array.changed", tenant=self.state.live[array_id].tenant, study_id=study_id, array_id=array_id,
            offered=[t.id for t in trials], joined=[], left=[],
        )
        session.commit()
        self.state.live[array_id].optuna_ids.update({t.id: t.optuna_trial_id for t in trials})
        self.ctx.pool.offer(worker, [member_spec(t) for t in trials], after_epoch)
        log.info("array %d: %d trials join at the %s epoch boundary", array_id, len(trials), "next" if not after_epoch else f"{after_epoch}th")

    def start_array(self, session: Session, study: Study, worker: WorkerHandle, trials: list[Trial]) -> None:
        """Start ``trials`` as one array on the idle ``worker``: its rows, its events, then the
        worker's run (an array its worker does not take ends FAIL, its trials waiting again)."""
        signature = trials[0].signature
        array_id = rows.start_array(
            session, study.id, signature, self.state.worker_ids.get(worker.name), worker.node_id or None, [t.id for t in trials]
        )
        where: dict[str, Any] = {"tenant": study.tenant, "study_id": study.id, "array_id": array_id}
        events.record(session, "array.started", **where, trial_ids=[t.id for t in trials], worker=worker.name, signature=signature)
        for t in trials:
            events.record(session, "trial.started", **where, trial_id=t.id, number=t.number, resumed_at_epoch=None)
        # Everything that can raise comes before the commit: RUNNING trials committed with an
        # array that never starts would be orphans until a restart re-queued them.
        spec = ArraySpec(
            array_id=array_id,
            signature=class_of(trials[0]),
            study_name=study.name,
            workload=study.workload,
            epochs=study.epochs,
            members=tuple(member_spec(t) for t in trials),
            seed=training_seed(study),
            artifact_dir=artifact_uri(self.settings),
            checkpoint_frequency=self.settings.checkpoint_frequency,
            checkpoint_interval_s=self.settings.checkpoint_interval_s,
            # The class's solo speed is the B = 1 point of its curve: measured once per
            # signature and device type, by a short unfused probe in its first array.
            probe_solo=len(trials) > 1 and not self.throughput.solo_known(signature, worker.device_type),
            prunes=study.pruner is not None or study.driver == "client",
            training=study.config.training,
            reply_timeout_s=self.settings.prune_reply_timeout_s,
            fused=self.throughput.unfusible(class_of(trials[0])) is None,
            package=study.package,
        )
        # A code package's workers run in its runtime env (its zip put where Ray fetches it).
        env = self.ctx.packages.env(study.package) if study.package is not None else None
        session.commit()
        try:
            self.ctx.pool.submit(worker, spec, env)
        except Exception as exc:
            self._unstart(study, array_id, [t.id for t in trials], f"the array could not start on {worker.name}: {exc}")
            raise
        self.state.live[array_id] = Live(
            study.id, {t.id: t.optuna_trial_id for t in trials}, client_decides=study.driver == "client", tenant=study.tenant,
            announced={t.id for t in trials},
        )
        log.info("array %d: %d trials of study %s on %s", array_id, len(trials), study.name, worker.name)

    def _unstart(self, study: Study, array_id: int, trial_ids: list[int], error: str) -> None:
        """An array whose rows are committed but that its worker never took: it ends FAIL and
        its trials wait again, in a transaction of its own."""
        with self.ctx.sessions.begin() as session:
            rows.end_arrays(session, [array_id], error)
            rows.wait_again(session, trial_ids)
            events.record(
                session, "array.ended", tenant=study.tenant, study_id=study.id, array_id=array_id, state="FAIL",
                error=error, requeued=trial_ids,
            )
        log.warning("array %d: %s", array_id, error)


def split_plan(
    remaining: Mapping[int, int],
    epoch_s: float,
    build_s: float,
    rate: Callable[[int], float],
    latency_s: float = 0.05,
    target_rate: Callable[[int], float] | None = None,
) -> tuple[list[int], float]:
    """Which members of a running array move to an idle device, and the seconds that saves.

    ``remaining``: each member's epochs left after the one it trains now; ``epoch_s``: the
    array's last epoch with these members (0: unknown); ``build_s``: the seconds its first
    build took; ``rate(b)``: the class's models·steps/s in an array of ``b`` on this device
    type (scheduler.ThroughputModel); ``target_rate``: the same on the idle device's type
    where that is another one (None: the same type). Of the members that go on after this
    epoch, half move, those with the most epochs left, and each half then trains at the speed
    of its size on its device; to a device of another type all of them may move instead, where
    that saves more (a faster device idles while a slower one trains). A move costs the
    movers' checkpoints, their build and their resume (a build each, about) and ``latency_s``
    (the rest: the wait for the boundary, a scheduling round, the new array's start, both
    halves sharing the machine; ``Settings.move_latency_s``). Returns ``([], 0.0)`` unless
    the members are estimated to end at least _SPLIT_MIN_GAIN of the time left sooner: the
    estimate is rough, and a move of little gain may lose.
    """
    size = len(remaining)
    # Those on their last epoch end at this boundary: the split is of the others.
    going_on = sorted((i for i in remaining if remaining[i] >= 1), key=lambda i: (-remaining[i], i))
    if not going_on or epoch_s <= 0 or rate(size) <= 0:
        return [], 0.0
    there = rate if target_rate is None else target_rate
    # Seconds per epoch of an array of b on each device, scaled from the measured one by the curves.
    per_model_s = epoch_s * rate(size) / size

    def epoch(b: int, speed: Callable[[int], float]) -> float:
        r = speed(b)
        return per_model_s * b / r if r > 0 else math.inf

    keep = remaining[going_on[0]] * epoch(len(going_on), rate)
    best: tuple[list[int], float] = ([], 0.0)
    sizes = {len(going_on) // 2} | ({len(going_on)} if target_rate is not None else set())
    for k in sorted(sizes - {0}):
        movers, stayers = going_on[:k], going_on[k:]
        stay = remaining[stayers[0]] * epoch(len(stayers), rate) if stayers else 0.0
        move = 3 * build_s * k / size + latency_s + remaining[movers[0]] * epoch(k, there)
        saved = keep - max(stay, move)
        if saved >= _SPLIT_MIN_GAIN * keep and saved > best[1]:
            best = (movers, saved)
    return best


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
