"""Trace-driven, round-based cluster simulator around the real :class:`Scheduler`.

The simulator owns only the clock and the devices: every round it hands the unfinished,
arrived trials and the previous placements to ``Scheduler.decide`` -- the same call the
live server makes -- and advances each array by one round at the *true* speed of the
calibrated curves.  The scheduler decides with the same curves (oracle throughputs, as in
Gavel's simulator).  A trial that finishes mid-round frees its slot at the next round
(an epoch boundary); preemption and restart are free, as in Gavel's default.

A decision takes effect at once, unless the trials carry their epochs' length
(``TraceTrial.epoch_steps``): then an array whose members are between epoch boundaries
goes on unchanged until its next one, as a live array does (members join, leave and are
preempted at its epoch boundaries), and the devices and trials it holds wait for it.

Every round the scheduler decides every placement again, as Gavel's simulator does. With
``live_loop=True`` the replay follows the live loop's rules instead (``server/loop/``): the
scheduler decides only in rounds where some trial waits for a device (running arrays
otherwise go on as they are); a device whose array ended keeps its class where that class
has trials waiting and the scheduler gave the device to no other tenant (the live loop's
chain: a study's trials follow each other on the device); and a study's trials arrive as the
live loop asks them (a group per idle device at once, the rest a round later).

Device time is charged to an array's members equally (each of B members is charged
``1/B`` of the device's time) and to a tenant as the sum over its members; since arrays
never mix tenants, a tenant is charged exactly the devices its arrays hold.

Everything comes in as plain data (:class:`TraceStudy`, :class:`TraceTrial`, curves,
device counts): the same call replays the Philly slice, a synthetic workload, or a
hand-written mini-trace that a live run is compared against.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from fusetune.scheduler._allocation import equal_share_utilities
from fusetune.scheduler._lp import AllocationProblem
from fusetune.scheduler._packing import PendingTrial
from fusetune.scheduler._scheduler import Scheduler, make_scheduler
from fusetune.scheduler._throughput import SpeedupCurve, ThroughputModel
from fusetune.scheduler._trace import TraceStudy, TraceTrial
from fusetune.scheduler._types import Decision, Device, Placement, Tenant

__all__ = ["RoundObserver", "SimResult", "simulate"]

# Called once per simulated round with the round's time (s), its decision, and the
# allocation instance of the trials waiting or running in it (its classes are the
# decision's, or sorted where the policy has none: fifo).
RoundObserver = Callable[[float, Decision, AllocationProblem], None]


@dataclass(frozen=True)
class SimResult:
    """The metrics of one policy on one trace and cluster (definitions in docs/scheduling.md).

    ``device_share`` is each tenant's fraction of all device-seconds its arrays held over
    the run, and ``jct_by_study`` each study's completion time in seconds: what a live
    run of the same trace is compared with.
    """

    policy: str
    norm_throughput: float
    avg_jct_h: float
    p99_jct_h: float
    makespan_h: float
    jain: float
    si_min: float
    si_by_tenant: Mapping[str, float]
    max_envy: float
    rho_max: float
    solver_ms_mean: float
    solver_ms_max: float
    rounds: int
    avg_trial_jct_h: float = 0.0
    jct_by_study: Mapping[int, float] = field(default_factory=dict)
    device_share: Mapping[str, float] = field(default_factory=dict)


def _jain(x: np.ndarray) -> float:
    return float(x.sum() ** 2 / (x.size * (x**2).sum())) if x.size and (x**2).sum() > 0 else 1.0


class _Replay:
    """One replay: the clock, the trials' remaining work and the metric accumulators."""

    def __init__(
        self,
        sched: Scheduler,
        trials: Sequence[TraceTrial],
        curves: Mapping[tuple[str, str], SpeedupCurve],
        devices: Sequence[Device],
        weights: Mapping[str, float],
        round_seconds: float,
        live_loop: bool = False,
        study_cap: int = 16,
        observe: RoundObserver | None = None,
    ) -> None:
        self.sched, self.curves, self.devices, self.dt = sched, curves, devices, round_seconds
        self.live_loop, self.study_cap, self.observe = live_loop, study_cap, observe
        self.device_type = {d.device_id: d.device_type for d in devices}
        self.names = sorted({t.tenant for t in trials})
        self.w = {n: weights.get(n, 1.0) for n in self.names}
        self.wv = np.array([self.w[n] for n in self.names])
        self.tenants = [Tenant(n, self.w[n]) for n in self.names]
        self.tix = {n: i for i, n in enumerate(self.names)}
        types = sorted({d.device_type for d in devices})
        self.best_solo = {j: max(curves[(j, g)].solo_steps_per_s for g in types) for j in {t.job_type for t in trials}}
        self.order = sorted(trials, key=lambda t: (t.arrival, t.trial_id))
        self.info = {t.trial_id: t for t in trials}
        self.left = {t.trial_id: t.steps for t in trials}
        self.done_at: dict[int, float] = {}
        self.to_boundary: set[int] = set()  # this round's members of arrays held to their epoch boundary
        self.last_arrival = max((t.arrival for t in trials), default=0.0)
        n_t = len(self.names)
        # Metric accumulators (all integrate over time in seconds).
        self.util, self.share, self.held = np.zeros(n_t), np.zeros(n_t), np.zeros(n_t)
        self.envy_own, self.envy_other = np.zeros((n_t, n_t)), np.zeros((n_t, n_t))
        self.jain_sum = self.jain_time = self.thr_sum = self.thr_time = 0.0
        self.solver_ms: list[float] = []
        self.active_weight_at_arrival: dict[int, float] = {}
        self.rounds = 0

    def run(self) -> None:
        """Replay rounds until every trial has finished."""
        now = self.order[0].arrival if self.order else 0.0
        nxt = 0
        arrived: list[int] = []
        later: list[int] = []  # trials the live loop asks once its first groups are placed
        running: tuple[Placement, ...] = ()
        while True:
            arrived += later
            later = []
            new: list[int] = []
            while nxt < len(self.order) and self.order[nxt].arrival <= now:
                new.append(self.order[nxt].trial_id)
                nxt += 1
            if self.live_loop:
                new, later = self._asked(new, running)
            arrived += new
            live = [i for i in arrived if i not in self.done_at]
            if not live and not later:
                if nxt >= len(self.order):
                    break
                now = max(now + self.dt, self.order[nxt].arrival)
                running = ()
                continue
            info = self.info
            pending = [PendingTrial(i, info[i].job_type, info[i].tenant, info[i].study_id, 0.0, 1) for i in live]
            kept = tuple(
                replace(p, trial_ids=ids) for p in running if (ids := tuple(i for i in p.trial_ids if i not in self.done_at))
            )
            if self.live_loop and len(live) == sum(len(p.trial_ids) for p in kept):
                decision = Decision(kept, (), (), None)  # nothing waits: the live loop decides nothing
            else:
                decision = self.sched.decide(now, pending, self.devices, self.tenants, running)
                if self.live_loop:
                    decision = self._chained(running, decision, live)
            running = self._at_boundaries(running, decision.placements)
            if running != decision.placements:
                decision = replace(decision, placements=running)
            self.rounds += 1
            if decision.allocation is not None:
                self.solver_ms.append(decision.solver_seconds * 1e3)
            self._account(now, pending, decision)
            self._advance(now, running)
            now += self.dt

    def _asked(self, arriving: Sequence[int], running: Sequence[Placement]) -> tuple[list[int], list[int]]:
        """Of the trials of studies arriving now, those the live loop asks at once and those it
        asks a round later. While devices are idle it asks each study one group (an array's
        worth, spread so that one batch fills every device) per idle device, places them, then
        asks the rest; with no device idle it asks them all (``server/loop/asking.py``)."""
        busy = {p.device_id for p in running if any(i not in self.done_at for i in p.trial_ids)}
        idle, devices = len(self.devices) - len(busy), max(1, len(self.devices))
        by_study: dict[int, list[int]] = {}
        for i in arriving:
            by_study.setdefault(self.info[i].study_id, []).append(i)
        now: list[int] = []
        later: list[int] = []
        for ids in by_study.values():
            group = max(1, min(self.study_cap, math.ceil(min(len(ids), devices * self.study_cap) / devices)))
            k = min(len(ids), idle * group) if idle else len(ids)
            now += ids[:k]
            later += ids[k:]
        return now, later

    def _chained(self, previous: Sequence[Placement], decision: Decision, live: Sequence[int]) -> Decision:
        """``decision``, where a device whose array ended since the last round goes on with its
        class's waiting trials (as many as it held) when the scheduler left it idle or gave it
        to another class of the same tenant: the live loop's chain. The trials the scheduler
        had put there wait instead."""
        placed = {i for p in decision.placements for i in p.trial_ids}
        queues: dict[str, list[int]] = {}
        for i in live:
            if i not in placed:
                queues.setdefault(self.info[i].job_type, []).append(i)
        given = {p.device_id: p for p in decision.placements}
        out = dict(given)
        for p in previous:
            if any(i not in self.done_at for i in p.trial_ids):
                continue  # the array goes on: the scheduler's backfill, not a chain
            q = given.get(p.device_id)
            queue = queues.get(p.signature)
            if not queue or (q is not None and (q.tenant != p.tenant or q.signature == p.signature)):
                continue
            ids = tuple(queue[: len(p.trial_ids)])
            del queue[: len(ids)]
            lease = q.lease_expires if q is not None else p.lease_expires
            out[p.device_id] = Placement(p.device_id, p.signature, p.tenant, ids, lease)
        if out == given:
            return decision
        return replace(decision, placements=tuple(out.values()))

    def _between_epochs(self, trial_id: int) -> bool:
        """Whether the trial is between two of its epoch boundaries (never without epochs)."""
        epoch = self.info[trial_id].epoch_steps
        if epoch <= 0:
            return False
        position = (self.info[trial_id].steps - self.left[trial_id]) % epoch
        return 1e-6 * epoch < position < epoch * (1 - 1e-6)

    def _at_boundaries(self, previous: Sequence[Placement], decided: Sequence[Placement]) -> tuple[Placement, ...]:
        """What runs this round: ``decided``, except that an array whose membership it changes
        while its members are between epoch boundaries goes on unchanged to the next one
        (:meth:`_advance` stops it there), its device and its members held until then."""
        wanted = {p.device_id: p for p in decided}
        held: list[Placement] = []
        for p in previous:
            ids = tuple(i for i in p.trial_ids if i not in self.done_at)
            q = wanted.get(p.device_id)
            unchanged = q is not None and q.signature == p.signature and set(q.trial_ids) == set(ids)
            if ids and not unchanged and any(self._between_epochs(i) for i in ids):
                held.append(replace(p, trial_ids=ids))
        if not held:
            return tuple(decided)
        devices = {p.device_id for p in held}
        busy = {i for p in held for i in p.trial_ids}
        self.to_boundary.update(busy)
        out = list(held)
        for q in decided:
            ids = tuple(i for i in q.trial_ids if i not in busy)
            if q.device_id not in devices and ids:
                out.append(replace(q, trial_ids=ids) if len(ids) != len(q.trial_ids) else q)
        return tuple(out)

    def _round_values(
        self, pending: Sequence[PendingTrial], decision: Decision
    ) -> tuple[AllocationProblem, tuple[np.ndarray, ...]]:
        """This round's instance, and its e_i, saturation, realised u_i, bundles, waiting
        flags and class values."""
        classes = decision.classes or tuple(sorted({(p.tenant, p.signature) for p in pending}))
        demand = {c: 0 for c in classes}
        for p in pending:
            demand[(p.tenant, p.signature)] += 1
        problem, ptypes, _ = self.sched.problem(classes, [demand[c] for c in classes], self.devices, self.w)
        if decision.allocation is not None:
            e, saturated = decision.allocation.equal_share, decision.allocation.saturated
        else:
            e, _, saturated, _ = equal_share_utilities(problem)
        n_t = len(self.names)
        u, bundle = np.zeros(n_t), np.zeros((n_t, len(ptypes)))
        placed: set[int] = set()
        for placement in decision.placements:
            g = self.device_type[placement.device_id]
            rate = self.curves[(placement.signature, g)].rate(len(placement.trial_ids))
            u[self.tix[placement.tenant]] += rate / self.best_solo[placement.signature]
            bundle[self.tix[placement.tenant], ptypes.index(g)] += 1
            placed.update(placement.trial_ids)
        waits = {(p.tenant, p.signature) for p in pending if p.trial_id not in placed}
        waiting_class = np.array([c in waits for c in classes], dtype=bool)
        # OEF's linear valuation per class, as in the LP: a device's best rate for it.
        value = np.where(problem.members > 0, problem.rate, 0.0).max(axis=2)
        owner = np.array([self.tix[c[0]] for c in classes], dtype=int)
        return problem, (e, saturated, u, bundle, waiting_class, value, owner)

    def _account(self, now: float, pending: Sequence[PendingTrial], decision: Decision) -> None:
        """Add this round to the fairness and throughput integrals."""
        problem, (e, saturated, u, bundle, waiting_class, value, owner) = self._round_values(pending, decision)
        if self.observe is not None:
            self.observe(now, decision, problem)
        active = np.zeros(len(self.names), dtype=bool)
        active[[self.tix[p.tenant] for p in pending]] = True
        waiting = np.zeros_like(active)
        waiting[owner[waiting_class]] = True
        dt = self.dt
        self.util[active] += u[active] * dt
        self.share[active] += e[active] * dt
        self.held += bundle.sum(axis=1) * dt
        # Envy, time-integrated like the sharing-incentive ratio: over the time both are
        # active, Σ_rounds max over i's waiting classes c of max(0, v_c·a_j·w_i/w_j − v_c·a_i),
        # divided by Σ_rounds of i's own best class value v_c·a_i.  A tenant with nothing
        # waiting beyond its equal share could not use another bundle and envies nothing.
        for i in np.flatnonzero(active & (e > 0)):
            mine = value[owner == i]
            own = float((mine @ bundle[i]).max()) if mine.size else 0.0
            can_envy = waiting[i] and not saturated[i]
            vw = value[(owner == i) & waiting_class]
            for j in np.flatnonzero(active):
                if j == i:
                    continue
                self.envy_own[i, j] += own * dt
                if can_envy and vw.size:
                    gap = vw @ (bundle[j] * self.wv[i] / self.wv[j] - bundle[i])
                    self.envy_other[i, j] += max(0.0, float(gap.max())) * dt
        contenders = np.flatnonzero(waiting & (e > 0))
        if contenders.size >= 2:
            self.jain_sum += _jain(u[contenders] / e[contenders]) * dt
            self.jain_time += dt
        if now <= self.last_arrival:
            self.thr_sum += u.sum() * dt
            self.thr_time += dt
        for p in pending:
            self.active_weight_at_arrival.setdefault(p.trial_id, float(self.wv[active].sum()))

    def _advance(self, now: float, running: Sequence[Placement]) -> None:
        """Advance every array by one round at the true speed of its curve; an array held to
        its epoch boundary (:meth:`_at_boundaries`) stops there."""
        for p in running:
            curve = self.curves[(p.signature, self.device_type[p.device_id])]
            per_member = curve.rate(len(p.trial_ids)) / len(p.trial_ids)
            for i in p.trial_ids:
                need = self.left[i] / per_member
                if need <= self.dt:
                    self.done_at[i] = now + need
                    self.left[i] = 0.0
                    continue
                work = per_member * self.dt
                if i in self.to_boundary:
                    epoch = self.info[i].epoch_steps
                    work = min(work, epoch - (self.info[i].steps - self.left[i]) % epoch)
                self.left[i] -= work
        self.to_boundary.clear()

    def result(self, policy: str, studies: Sequence[TraceStudy], trials: Sequence[TraceTrial]) -> SimResult:
        """The metrics (see docs/scheduling.md for every definition)."""
        jct: dict[int, float] = {}
        rho: dict[str, list[tuple[float, float]]] = {n: [] for n in self.names}
        n_dev = len(self.devices)
        for s in studies:
            jct[s.study_id] = max(self.done_at[i] for i in s.trial_ids) - s.arrival
            # Isolated time: every trial alone on its best GPU type, but no faster than the
            # study's normalised work spread over the tenant's equal share at arrival.
            solo = [self.info[i].steps / self.best_solo[s.job_type] for i in s.trial_ids]
            active_w = self.active_weight_at_arrival.get(s.trial_ids[0], self.w[s.tenant])
            share_devices = n_dev * self.w[s.tenant] / max(active_w, self.w[s.tenant])
            rho[s.tenant].append((jct[s.study_id], max(max(solo), sum(solo) / share_devices)))
        jcts = np.array(list(jct.values())) / 3600.0
        si = {n: float(self.util[k] / self.share[k]) if self.share[k] > 0 else math.inf for n, k in self.tix.items()}
        with np.errstate(divide="ignore", invalid="ignore"):
            envy = np.where(self.envy_own > 0, self.envy_other / self.envy_own, 0.0)
        first = min((s.arrival for s in studies), default=0.0)
        held = self.held.sum()
        return SimResult(
            policy=policy,
            norm_throughput=self.thr_sum / self.thr_time if self.thr_time else 0.0,
            avg_jct_h=float(jcts.mean()) if jcts.size else 0.0,
            p99_jct_h=float(np.percentile(jcts, 99)) if jcts.size else 0.0,
            makespan_h=(max(self.done_at.values(), default=first) - first) / 3600.0,
            jain=self.jain_sum / self.jain_time if self.jain_time else 1.0,
            si_min=min(si.values(), default=math.inf),
            si_by_tenant=si,
            max_envy=float(max(0.0, envy.max())) if envy.size else 0.0,
            # Per tenant Σ JCT / Σ isolated time, so a few tiny studies do not dominate.
            rho_max=max((sum(j for j, _ in v) / sum(i for _, i in v) for v in rho.values() if v), default=0.0),
            solver_ms_mean=float(np.mean(self.solver_ms)) if self.solver_ms else 0.0,
            solver_ms_max=float(np.max(self.solver_ms)) if self.solver_ms else 0.0,
            rounds=self.rounds,
            avg_trial_jct_h=float(np.mean([self.done_at[t.trial_id] - t.arrival for t in trials])) / 3600.0 if trials else 0.0,
            jct_by_study=jct,
            device_share={n: float(self.held[k] / held) if held else 0.0 for n, k in self.tix.items()},
        )


def simulate(
    policy: str,
    studies: Sequence[TraceStudy],
    trials: Sequence[TraceTrial],
    curves: Mapping[tuple[str, str], SpeedupCurve],
    cluster: Mapping[str, int],
    memory: Mapping[str, int],
    *,
    weights: Mapping[str, float] | None = None,
    round_seconds: float = 360.0,
    max_members: int = 16,
    seed: int | None = 0,
    backfill: bool = True,
    prices: Mapping[str, float] | None = None,
    lease_seconds: float | None = None,
    live_loop: bool = False,
    observe: RoundObserver | None = None,
) -> SimResult:
    """Replay ``trials`` on ``cluster`` under ``policy``; return its metrics.

    Args:
        policy: a name in ``POLICIES``.
        studies, trials: the workload (:mod:`scheduler._trace`, :mod:`scheduler._workload`,
            or written by hand).
        curves: the true speed-up curve per (job type = signature, device type).
        cluster: devices per type; ``memory``: bytes per device of each type.
        weights: tenant weights (1 when absent).
        round_seconds: the scheduling round; ``lease_seconds`` defaults to it.
        max_members: the cap on B for fusing policies.
        seed: shuffles the device list (type-blind policies take "the first free device");
            None keeps the types in ``cluster``'s order, each type's devices together, as a
            live service lists a node's workers (a replay compared with a live run).
        backfill: False leaves devices the allocation does not fill idle (Gavel's LP alone).
        prices: public device prices for ``oef-noncooperative``'s exchanges.
        live_loop: False (Gavel's simulator, the tables): the scheduler decides every
            placement again every round; True: ask and dispatch as the live loop does (decide
            only when a trial waits; a device whose array ended keeps its class; a study's
            trials asked a group per idle device: the module docstring), what a live run is
            compared with. ``max_members`` is then also the studies' array cap, which sizes
            the live loop's groups.
        observe: called every round with the time, the decision and the round's
            allocation instance: for analyses of a run, such as what any allocation could
            have reached on the backlog the policy left (``benchmarks/scheduler.py
            ceiling``).  It must not change what it is given.
    """
    model = ThroughputModel()
    for (job, gpu), curve in curves.items():
        model.set_curve(job, gpu, curve)
    lease = round_seconds if lease_seconds is None else lease_seconds
    sched = make_scheduler(policy, model, max_members=max_members, lease_seconds=lease, backfill=backfill, prices=prices)
    devices = [
        Device(f"{g}-{i:03d}", g, memory_bytes=memory[g], node=f"{g}-node{i // 4}")
        for g in (sorted(cluster) if seed is not None else cluster)
        for i in range(cluster[g])
    ]
    # Type-blind policies take "the first free device"; a seeded shuffle makes that a
    # random type (as on a real Ray cluster) instead of always the slowest type first.
    if seed is not None:
        random.Random(seed).shuffle(devices)
    replay = _Replay(sched, trials, curves, devices, weights or {}, round_seconds, live_loop, max_members, observe)
    replay.run()
    return replay.result(policy, studies, trials)
