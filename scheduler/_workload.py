"""Synthetic multi-tenant workloads where tenants differ in what they run.

The Philly slice (:mod:`scheduler._trace`) draws every study's job type uniformly, so
every tenant runs a bit of everything and all tenants look alike to a
heterogeneity-aware scheduler.  OEF's setting is the other extreme: each tenant runs one
job type (one speed-up vector), demand is uneven, and some tenants are far over their
share while others are under it.  :func:`synthetic_workload` generates both kinds from
one seed with identical arrivals, sizes and durations, so that only the job types differ:

* tenant ``i`` offers load ``l_i``: the P100 device-hours it submits per hour, divided by
  its equal share of the cluster's devices.  Loads are spaced geometrically from
  ``low`` to ``high`` (0.5 to 10 by default: under its share to ten times over it) and
  dealt to tenants in a seeded order;
* studies arrive as a Poisson process per tenant over ``hours``; a study has 1 to
  ``2·trials_per_study − 1`` trials (uniform), each needing an exponentially distributed
  time on a P100 (mean ``mean_trial_hours``, clipped to [3 min, 12 h]);
* ``one_type_per_tenant``: tenant ``i`` runs one job type (distinct types, drawn
  without replacement); otherwise every study draws its type uniformly (mixed).

:func:`backlog` is the static counterpart for allocation LPs: each tenant's waiting
trials at one moment, ``l_i`` times its equal share of devices, with the same dealing of
loads and job types.  Pure: plain data in, plain data out.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from fusetune.scheduler._trace import TraceStudy, TraceTrial

__all__ = ["backlog", "offered_load", "synthetic_workload", "tenant_loads"]


def tenant_loads(n: int, low: float = 0.5, high: float = 10.0) -> list[float]:
    """``n`` loads spaced geometrically from ``low`` to ``high`` (ascending)."""
    if n < 1 or not 0 < low <= high:
        raise ValueError(f"need n >= 1 and 0 < low <= high, got {n}, {low}, {high}")
    if n == 1:
        return [low]
    return [low * (high / low) ** (i / (n - 1)) for i in range(n)]


def _names(tenants: int) -> list[str]:
    return [f"tenant{i:02d}" for i in range(tenants)]


def _dealt_loads(rng: random.Random, tenants: int, low: float, high: float) -> list[float]:
    """The tenants' loads in a seeded order (the first draws of ``rng``)."""
    loads = tenant_loads(tenants, low, high)
    rng.shuffle(loads)
    return loads


def _job_types(
    names: Sequence[str], job_types: Sequence[str], n_studies: Sequence[int], one_type: bool, seed: int
) -> list[list[str]]:
    """Each tenant's study job types: one type per tenant, or uniform per study."""
    rng = random.Random(seed)
    types = sorted(job_types)
    if one_type:
        if len(names) > len(types):
            raise ValueError(f"{len(names)} tenants but only {len(types)} job types")
        picked = rng.sample(types, len(names))
        return [[picked[i]] * n_studies[i] for i in range(len(names))]
    return [[rng.choice(types) for _ in range(k)] for k in n_studies]


def synthetic_workload(
    job_types: Sequence[str],
    reference_steps_per_s: Mapping[str, float],
    devices: int,
    *,
    tenants: int = 10,
    one_type_per_tenant: bool = True,
    low: float = 0.5,
    high: float = 10.0,
    hours: float = 12.0,
    trials_per_study: int = 4,
    mean_trial_hours: float = 2.0,
    seed: int = 0,
) -> tuple[list[TraceStudy], list[TraceTrial]]:
    """Studies and trials of ``tenants`` tenants on a cluster of ``devices`` devices.

    ``reference_steps_per_s`` is each job type's P100 solo speed: a trial of ``h`` P100
    hours needs ``h · 3600 · speed`` steps.  The same ``seed`` gives the same arrivals,
    study sizes and durations for both tenant kinds (the job types come from their own
    seeded stream).
    """
    if devices < 1 or trials_per_study < 1 or hours <= 0 or mean_trial_hours <= 0:
        raise ValueError("devices, trials_per_study, hours and mean_trial_hours must be positive")
    rng = random.Random(seed)
    loads = _dealt_loads(rng, tenants, low, high)
    names = _names(tenants)
    share = devices / tenants
    mean_work = trials_per_study * mean_trial_hours  # P100 hours per study
    drafts: list[list[tuple[float, list[float]]]] = []  # per tenant: (arrival s, trial hours)
    for load in loads:
        rate = load * share / mean_work  # studies per hour
        t, draft = rng.expovariate(rate), []
        while t < hours:
            size = rng.randint(1, 2 * trials_per_study - 1)
            lengths = [min(12.0, max(0.05, rng.expovariate(1.0 / mean_trial_hours))) for _ in range(size)]
            draft.append((t * 3600.0, lengths))
            t += rng.expovariate(rate)
        drafts.append(draft)
    kinds = _job_types(names, job_types, [len(d) for d in drafts], one_type_per_tenant, seed + 1)
    flat = sorted(
        (arrival, i, k, lengths) for i, d in enumerate(drafts) for k, (arrival, lengths) in enumerate(d)
    )
    studies: list[TraceStudy] = []
    trials: list[TraceTrial] = []
    for sid, (arrival, i, k, lengths) in enumerate(flat):
        job = kinds[i][k]
        ids = []
        for h in lengths:
            ids.append(len(trials))
            trials.append(TraceTrial(len(trials), sid, names[i], job, arrival, h * 3600.0 * reference_steps_per_s[job]))
        studies.append(TraceStudy(sid, names[i], job, arrival, tuple(ids)))
    return studies, trials


def backlog(
    job_types: Sequence[str],
    devices: int,
    *,
    tenants: int = 10,
    low: float = 0.5,
    high: float = 10.0,
    seed: int = 0,
) -> list[tuple[str, str, int]]:
    """One moment's waiting trials: (tenant, job type, trials), one job type per tenant.

    Tenant ``i`` has ``round(l_i · devices / tenants)`` trials (at least one): its load
    times its equal share.  Loads and job types are dealt as :func:`synthetic_workload`
    deals them for the same ``seed``.
    """
    loads = _dealt_loads(random.Random(seed), tenants, low, high)
    names = _names(tenants)
    kinds = _job_types(names, job_types, [1] * tenants, True, seed + 1)
    return [(names[i], kinds[i][0], max(1, round(loads[i] * devices / tenants))) for i in range(tenants)]


def offered_load(trials: Sequence[TraceTrial], reference_steps_per_s: Mapping[str, float], devices: int, hours: float) -> float:
    """The cluster-wide offered load: P100 device-hours submitted per hour per device."""
    work = sum(t.steps / reference_steps_per_s[t.job_type] for t in trials) / 3600.0
    return work / hours / devices if devices and hours else math.inf
