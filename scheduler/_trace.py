"""Philly trace → tuning studies and trials, the simulator's workload (plain data in and out).

Reading ``philly_jobs.csv`` is the caller's job (``fusetune.server.simulate``): this module
takes its rows as :class:`PhillyJob` values and does no I/O.

Mapping (documented in docs/scheduling.md):

* the slice is every Philly job submitted in ``[start, start + hours)`` whose duration is
  in ``[min_duration, max_duration]`` seconds (drops crashed sub-minute jobs and the
  multi-day tail that would make a run take hours);
* each job becomes one tuning *study* of its virtual cluster (the *tenant*), arriving at
  the job's submission time (relative to the slice start);
* the study has ``trials_per_study × num_gpus`` trials of one job type, drawn uniformly
  at random (seeded) from Gavel's 26 job types, as Gavel's own trace generator does.  All
  trials of the type share one signature (same model, same array-wide settings,
  different lr/...).  A k-GPU job contributes k single-device trials per repetition, so
  the study's GPU time is ``trials_per_study × gpu_time``;
* each trial repeats one GPU's share of the job: it needs ``duration × P100 solo
  steps/s`` steps (Philly's fleet was P100/P40-class), i.e. the job's duration on a P100.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["PhillyJob", "TraceStudy", "TraceTrial", "gavel_trace_lines", "per_trial_tenants", "philly_studies"]


@dataclass(frozen=True)
class PhillyJob:
    """One row of the Philly trace: when a job was submitted, how long it ran, on how many GPUs, by whom."""

    submitted: dt.datetime
    duration: float
    num_gpus: int
    cluster: str


@dataclass(frozen=True)
class TraceTrial:
    """One simulated trial: the work it needs in steps of its job type.

    ``epoch_steps`` is the length of its epochs in steps: with it, the simulator changes the
    trial's array only at its epoch boundaries, as the live loop does (members join, leave
    and are preempted there). 0 (the Philly slice's, whose epochs are unknown): anywhere.
    """

    trial_id: int
    study_id: int
    tenant: str
    job_type: str
    arrival: float
    steps: float
    epoch_steps: float = 0.0


@dataclass(frozen=True)
class TraceStudy:
    """One simulated tuning study (one Philly job)."""

    study_id: int
    tenant: str
    job_type: str
    arrival: float
    trial_ids: tuple[int, ...]


def philly_studies(
    jobs: Iterable[PhillyJob],
    job_types: Sequence[str],
    reference_steps_per_s: Mapping[str, float],
    *,
    start: str = "2017-11-01",
    hours: float = 24.0,
    trials_per_study: int = 4,
    min_duration: float = 60.0,
    max_duration: float = 86_400.0,
    seed: int = 0,
) -> tuple[list[TraceStudy], list[TraceTrial]]:
    """A slice of the Philly trace as studies and trials (see module docstring)."""
    if trials_per_study < 1:
        raise ValueError(f"trials_per_study must be >= 1, got {trials_per_study}")
    t0 = dt.datetime.fromisoformat(start)
    t1 = t0 + dt.timedelta(hours=hours)
    rows = [
        (j.submitted, j.cluster, j.duration, max(1, j.num_gpus))
        for j in jobs
        if t0 <= j.submitted < t1 and min_duration <= j.duration <= max_duration
    ]
    rows.sort()
    rng = random.Random(seed)
    types = sorted(job_types)
    studies: list[TraceStudy] = []
    trials: list[TraceTrial] = []
    for sid, (ts, tenant, duration, gpus) in enumerate(rows):
        job_type = rng.choice(types)
        arrival = (ts - t0).total_seconds()
        ids = []
        for _ in range(trials_per_study * gpus):
            tid = len(trials)
            ids.append(tid)
            trials.append(
                TraceTrial(tid, sid, tenant, job_type, arrival, duration * reference_steps_per_s[job_type])
            )
        studies.append(TraceStudy(sid, tenant, job_type, arrival, tuple(ids)))
    return studies, trials


def per_trial_tenants(
    studies: Sequence[TraceStudy], trials: Sequence[TraceTrial]
) -> tuple[list[TraceStudy], list[TraceTrial]]:
    """Make every trial its own one-trial study and tenant.

    Tenant-level fairness then becomes job-level fairness, the unit Gavel's policies use,
    which is what the cross-check against Gavel's own simulator needs.
    """
    new_trials = [
        TraceTrial(t.trial_id, t.trial_id, f"job{t.trial_id}", t.job_type, t.arrival, t.steps) for t in trials
    ]
    new_studies = [TraceStudy(t.trial_id, t.tenant, t.job_type, t.arrival, (t.trial_id,)) for t in new_trials]
    return new_studies, new_trials


def gavel_trace_lines(trials: Sequence[TraceTrial]) -> list[str]:
    """``trials`` in Gavel's trace format (``scheduler/utils.py: parse_trace``), one line each.

    Tab-separated: job type, command, working directory, step argument, needs-data-dir,
    total steps, scale factor, priority weight, SLO, arrival time.  The command fields
    name this simulator: Gavel's simulator only reads type, steps, scale and arrival.
    """
    return [
        f"{t.job_type}\tfusetune-sim\t.\t-n\t0\t{max(1, round(t.steps))}\t1\t1\t-1\t{t.arrival:.6f}"
        for t in sorted(trials, key=lambda t: (t.arrival, t.trial_id))
    ]
