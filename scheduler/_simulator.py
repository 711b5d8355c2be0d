"""Trace-driven, round-based cluster simulator around the real :class:`Scheduler`.

The simulator owns only the clock and the devices: every round it hands the unfinished,
arrived trials and the previous placements to ``Scheduler.decide`` -- the same call the
live server makes -- and advances each array by one round at the *true* speed of the
calibrated curves.  The scheduler decides with the same curves (oracle throughputs, as in
Gavel's simulator).  A trial that finishes mid-round frees its slot at the next round
(an epoch boundary); preemption and restart are free, as in Gavel's default.

Device time is charged to an array's members equally (each of B members is charged
``1/B`` of the device's time) and to a tenant as the sum over its members; since arrays
never mix tenants, a tenant is charged exactly the devices its arrays hold.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fusetune.scheduler._allocation import equal_share_utilities
from fusetune.scheduler._packing import PendingTrial
from fusetune.scheduler._scheduler import make_scheduler
from fusetune.scheduler._throughput import SpeedupCurve, ThroughputModel
from fusetune.scheduler._trace import TraceStudy, TraceTrial
from fusetune.scheduler._types import Device, Placement, Tenant

__all__ = ["SimResult", "simulate"]


@dataclass(frozen=True)
class SimResult:
    """The metrics of one policy on one trace and cluster (definitions in docs/scheduling.md)."""

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


def _jain(x: np.ndarray) -> float:
    return float(x.sum() ** 2 / (x.size * (x**2).sum())) if x.size and (x**2).sum() > 0 else 1.0


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
    seed: int = 0,
) -> SimResult:
    """Replay ``trials`` on ``cluster`` under ``policy``; return its metrics."""
    model = ThroughputModel()
    for (job, gpu), curve in curves.items():
        model.set_curve(job, gpu, curve)
    sched = make_scheduler(policy, model, max_members=max_members, lease_seconds=round_seconds)
    devices = [
        Device(f"{g}-{i:03d}", g, memory_bytes=memory[g], node=f"{g}-node{i // 4}")
        for g in sorted(cluster)
        for i in range(cluster[g])
    ]
    # Type-blind policies take "the first free device"; a seeded shuffle makes that a
    # random type (as on a real Ray cluster) instead of always the slowest type first.
    random.Random(seed).shuffle(devices)
    device_type = {d.device_id: d.device_type for d in devices}
    tenant_names = sorted({t.tenant for t in trials})
    w = {name: (weights or {}).get(name, 1.0) for name in tenant_names}
    tenants = [Tenant(name, w[name]) for name in tenant_names]
    tix = {name: i for i, name in enumerate(tenant_names)}
    n_t, n_dev = len(tenant_names), len(devices)
    types = tuple(sorted(cluster))
    best_solo = {j: max(curves[(j, g)].solo_steps_per_s for g in types) for j in {t.job_type for t in trials}}

    order = sorted(trials, key=lambda t: (t.arrival, t.trial_id))
    left = {t.trial_id: t.steps for t in trials}
    info = {t.trial_id: t for t in trials}
    done_at: dict[int, float] = {}
    last_arrival = max((t.arrival for t in trials), default=0.0)

    # Metric accumulators (all integrate over time in seconds).
    util = np.zeros(n_t)
    share = np.zeros(n_t)
    envy_own = np.zeros((n_t, n_t))
    envy_other = np.zeros((n_t, n_t))
    jain_sum = jain_time = 0.0
    thr_sum = thr_time = 0.0
    solver_ms: list[float] = []
    active_at_arrival: dict[int, float] = {}

    now = order[0].arrival if order else 0.0
    nxt = 0
    arrived: list[int] = []
    running: tuple[Placement, ...] = ()
    rounds = 0
    while True:
        while nxt < len(order) and order[nxt].arrival <= now:
            arrived.append(order[nxt].trial_id)
            nxt += 1
        live = [i for i in arrived if i not in done_at]
        if not live:
            if nxt >= len(order):
                break
            now = max(now + round_seconds, order[nxt].arrival)
            running = ()
            continue
        pending = [
            PendingTrial(i, info[i].job_type, info[i].tenant, info[i].study_id, 0.0, 1) for i in live
        ]
        decision = sched.decide(now, pending, devices, tenants, running)
        running = decision.placements
        rounds += 1
        if decision.allocation is not None:
            solver_ms.append(decision.solver_seconds * 1e3)

        # --- fairness bookkeeping for this round ---------------------------------------
        classes = decision.classes or tuple(sorted({(p.tenant, p.signature) for p in pending}))
        demand = {c: 0 for c in classes}
        for p in pending:
            demand[(p.tenant, p.signature)] += 1
        problem, ptypes, _ = sched.problem(classes, [demand[c] for c in classes], devices, w)
        if decision.allocation is not None:
            e, saturated = decision.allocation.equal_share, decision.allocation.saturated
        else:
            e, _, saturated, _ = equal_share_utilities(problem)
        u = np.zeros(n_t)
        bundle = np.zeros((n_t, len(ptypes)))
        placed: set[int] = set()
        for p in running:
            g = device_type[p.device_id]
            curve = curves[(p.signature, g)]
            u[tix[p.tenant]] += curve.rate(len(p.trial_ids)) / best_solo[p.signature]
            bundle[tix[p.tenant], ptypes.index(g)] += 1
            placed.update(p.trial_ids)
        active = np.zeros(n_t, dtype=bool)
        waiting = np.zeros(n_t, dtype=bool)
        for p in pending:
            active[tix[p.tenant]] = True
            if p.trial_id not in placed:
                waiting[tix[p.tenant]] = True
        # A tenant's per-device value, OEF's linear valuation as in the LP: the best rate
        # any of its classes gets from a device of each type.
        value = np.zeros((n_t, len(ptypes)))
        for ci, c in enumerate(classes):
            value[tix[c[0]]] = np.maximum(value[tix[c[0]]], problem.rate[ci].max(axis=1))
        dt = round_seconds
        util[active] += u[active] * dt
        share[active] += e[active] * dt
        wv = np.array([w[n] for n in tenant_names])
        # Envy, time-integrated like the sharing-incentive ratio: over the time both are
        # active, Σ max(0, v_i·a_j·w_i/w_j − v_i·a_i) / Σ v_i·a_i, where a round adds envy
        # only if i had trials waiting beyond its equal share (otherwise it could not use
        # another bundle and envies nothing).
        for i in np.flatnonzero(active & (e > 0)):
            own = value[i] @ bundle[i]
            can_envy = waiting[i] and not saturated[i]
            for j in np.flatnonzero(active):
                if j != i:
                    envy_own[i, j] += own * dt
                    if can_envy:
                        envy_other[i, j] += max(0.0, (value[i] @ bundle[j]) * wv[i] / wv[j] - own) * dt
        contenders = np.flatnonzero(waiting & (e > 0))
        if contenders.size >= 2:
            jain_sum += _jain(u[contenders] / e[contenders]) * dt
            jain_time += dt
        if now <= last_arrival:
            thr_sum += u.sum() * dt
            thr_time += dt
        for i in live:
            if i not in active_at_arrival:
                active_at_arrival[i] = float(wv[active].sum())

        # --- advance the arrays by one round -------------------------------------------
        for p in running:
            curve = curves[(p.signature, device_type[p.device_id])]
            per_member = curve.rate(len(p.trial_ids)) / len(p.trial_ids)
            for i in p.trial_ids:
                need = left[i] / per_member
                if need <= dt:
                    done_at[i] = now + need
                    left[i] = 0.0
                else:
                    left[i] -= per_member * dt
        now += dt

    # --- study-level metrics -----------------------------------------------------------
    jct: dict[int, float] = {}
    rho_by_tenant: dict[str, list[tuple[float, float]]] = {n: [] for n in tenant_names}
    for s in studies:
        finish = max(done_at[i] for i in s.trial_ids)
        jct[s.study_id] = finish - s.arrival
        # Isolated time: every trial alone on its best GPU type, but no faster than the
        # study's normalised work spread over the tenant's equal share at arrival.
        solo_times = [info[i].steps / best_solo[s.job_type] for i in s.trial_ids]
        share_devices = n_dev * w[s.tenant] / max(active_at_arrival.get(s.trial_ids[0], w[s.tenant]), w[s.tenant])
        iso = max(max(solo_times), sum(solo_times) / share_devices)
        rho_by_tenant[s.tenant].append((jct[s.study_id], iso))
    jcts = np.array(list(jct.values())) / 3600.0
    si = {n: float(util[tix[n]] / share[tix[n]]) if share[tix[n]] > 0 else math.inf for n in tenant_names}
    with np.errstate(divide="ignore", invalid="ignore"):
        envy = np.where(envy_own > 0, envy_other / envy_own, 0.0)
    first = min((s.arrival for s in studies), default=0.0)
    return SimResult(
        policy=policy,
        norm_throughput=thr_sum / thr_time if thr_time else 0.0,
        avg_jct_h=float(jcts.mean()) if jcts.size else 0.0,
        p99_jct_h=float(np.percentile(jcts, 99)) if jcts.size else 0.0,
        makespan_h=(max(done_at.values(), default=first) - first) / 3600.0,
        jain=jain_sum / jain_time if jain_time else 1.0,
        si_min=min(si.values(), default=math.inf),
        si_by_tenant=si,
        max_envy=float(max(0.0, envy.max())) if envy.size else 0.0,
        # Per tenant Σ JCT / Σ isolated time, so a few tiny studies do not dominate.
        rho_max=max((sum(j for j, _ in v) / sum(i for _, i in v) for v in rho_by_tenant.values() if v), default=0.0),
        solver_ms_mean=float(np.mean(solver_ms)) if solver_ms else 0.0,
        solver_ms_max=float(np.max(solver_ms)) if solver_ms else 0.0,
        rounds=rounds,
        avg_trial_jct_h=float(np.mean([done_at[t.trial_id] - t.arrival for t in trials])) / 3600.0 if trials else 0.0,
        jct_by_study=jct,
    )
