"""The synthetic workload generator: tenants that differ in what they run, uneven load."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest

from fusetune.scheduler._workload import (
    backlog,
    offered_load,
    synthetic_workload,
    tenant_loads,
)
from tests.scheduler.gavel_speeds import JOB_TYPES, SOLO

P100 = {job: speeds[1] for job, speeds in SOLO.items()}


def test_loads_are_spaced_geometrically_from_half_to_ten() -> None:
    loads = tenant_loads(10)
    assert loads[0] == pytest.approx(0.5) and loads[-1] == pytest.approx(10.0)
    ratios = [b / a for a, b in itertools.pairwise(loads)]
    assert max(ratios) == pytest.approx(min(ratios))
    assert tenant_loads(1, 2.0, 3.0) == [2.0]
    with pytest.raises(ValueError):
        tenant_loads(3, 0.0, 1.0)


def _work_by_tenant(trials) -> dict[str, float]:  # type: ignore[no-untyped-def]
    work: dict[str, float] = defaultdict(float)
    for t in trials:
        work[t.tenant] += t.steps / P100[t.job_type] / 3600.0
    return work


def test_one_type_per_tenant_and_mixed_share_everything_but_the_job_types() -> None:
    one_s, one_t = synthetic_workload(JOB_TYPES, P100, 108, one_type_per_tenant=True, hours=12, seed=3)
    mix_s, mix_t = synthetic_workload(JOB_TYPES, P100, 108, one_type_per_tenant=False, hours=12, seed=3)
    assert [(s.tenant, s.arrival, len(s.trial_ids)) for s in one_s] == [(s.tenant, s.arrival, len(s.trial_ids)) for s in mix_s]
    types_one: dict[str, set[str]] = defaultdict(set)
    types_mix: dict[str, set[str]] = defaultdict(set)
    for s in one_s:
        types_one[s.tenant].add(s.job_type)
    for s in mix_s:
        types_mix[s.tenant].add(s.job_type)
    assert all(len(v) == 1 for v in types_one.values())
    assert len(set().union(*types_one.values())) == len(types_one)  # distinct types
    assert sum(len(v) > 1 for v in types_mix.values()) >= 8
    # Same P100 work per trial in both kinds: only the job type differs.
    assert [round(w, 6) for w in _work_by_tenant(one_t).values()] == [round(w, 6) for w in _work_by_tenant(mix_t).values()]
    assert all(0.05 <= t.steps / P100[t.job_type] / 3600.0 <= 12.0 + 1e-9 for t in one_t)


def test_tenants_offer_uneven_loads_around_the_mean() -> None:
    hours, devices = 48.0, 100
    studies, trials = synthetic_workload(JOB_TYPES, P100, devices, hours=hours, seed=0)
    mean = sum(tenant_loads(10)) / 10  # 3.17 P100 device-hours per hour per device
    assert offered_load(trials, P100, devices, hours) == pytest.approx(mean, rel=0.2)
    per_tenant = sorted(w / hours / (devices / 10) for w in _work_by_tenant(trials).values())
    assert per_tenant[0] < 1.0 and per_tenant[-1] > 5.0  # some under their share, some far over it
    assert all(0 <= s.arrival < hours * 3600 for s in studies)


def test_backlog_deals_loads_and_types_as_the_workload_does() -> None:
    waiting = backlog(JOB_TYPES, 108, seed=3)
    studies, _ = synthetic_workload(JOB_TYPES, P100, 108, one_type_per_tenant=True, seed=3)
    kind = {s.tenant: s.job_type for s in studies}
    assert [(t, j) for t, j, _ in waiting if t in kind] == [(t, kind[t]) for t, _, _ in waiting if t in kind]
    counts = sorted(n for _, _, n in waiting)
    assert counts[0] == max(1, round(0.5 * 10.8)) and counts[-1] == round(10 * 10.8)
    assert not math.isinf(offered_load([], P100, 1, 1.0))
