"""End-to-end checks of the trace-driven simulator on a small Philly slice."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fusetune.scheduler._calibration import GPU_MEMORY_BYTES, marginal_cost_floor
from fusetune.scheduler._simulator import simulate
from fusetune.scheduler._trace import per_trial_tenants, philly_studies
from fusetune.server.simulate import (
    format_table,
    main,
    parse_cluster,
    read_job_type_curves,
    read_philly_jobs,
    write_gavel_trace,
)

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
pytestmark = pytest.mark.skipif(not (DATA / "philly_jobs.csv").exists(), reason="shared trace data not present")


@pytest.fixture(scope="module")
def workload():
    calib = read_job_type_curves(DATA)
    reference = {j: calib.curves[(j, "p100")].solo_steps_per_s for j in calib.job_types}
    studies, trials = philly_studies(
        read_philly_jobs(DATA / "philly_jobs.csv"), calib.job_types, reference, start="2017-11-01", hours=3,
        trials_per_study=2,
    )
    return calib, studies, trials


def test_calibration_floors_and_pairs(workload) -> None:
    calib, _, _ = workload
    assert len(calib.job_types) == 26
    assert marginal_cost_floor("v100") == pytest.approx(0.1)
    for (job, gpu), curve in calib.curves.items():
        assert marginal_cost_floor(gpu) <= curve.marginal_cost <= 1.0
        if calib.pair_speedup[(job, gpu)] == 0:  # the co-located pair ran out of memory
            assert curve.memory_cap(GPU_MEMORY_BYTES[gpu]) == 1


def test_trace_slice_mapping(workload) -> None:
    _, studies, trials = workload
    assert studies and all(s.arrival >= 0 for s in studies)
    assert sum(len(s.trial_ids) for s in studies) == len(trials)
    assert all(len(s.trial_ids) % 2 == 0 for s in studies)  # 2 trials per GPU of the job
    by_id = {t.trial_id: t for t in trials}
    for s in studies:
        assert {by_id[i].job_type for i in s.trial_ids} == {s.job_type}


@pytest.mark.parametrize("policy", ["fifo", "gavel", "oef", "fusion-greedy", "fusetune"])
def test_every_policy_completes_the_slice(workload, policy: str) -> None:
    calib, studies, trials = workload
    res = simulate(policy, studies, trials, calib.curves, {"k80": 4, "p100": 4, "v100": 4}, GPU_MEMORY_BYTES)
    assert len(res.jct_by_study) == len(studies)
    assert all(j > 0 for j in res.jct_by_study.values())
    assert res.norm_throughput > 0 and res.makespan_h > 0
    assert 0 < res.jain <= 1.0 + 1e-9
    if policy in ("gavel", "oef", "fusetune"):
        # The fair policies keep every tenant at (or, within rounding, near) its share.
        assert res.si_min >= 0.95


def test_an_observer_sees_every_round_with_the_backlog_the_policy_decided_on(workload) -> None:
    calib, studies, trials = workload
    seen: list[tuple[float, int, int]] = []

    def observe(now, decision, problem) -> None:
        # The instance holds the round's classes (the decision's) and every trial of them.
        assert problem.n_classes == len(decision.classes)
        seen.append((now, int(problem.demand.sum()), sum(len(p.trial_ids) for p in decision.placements)))

    res = simulate("fusetune", studies, trials, calib.curves, {"k80": 4, "p100": 4, "v100": 4}, GPU_MEMORY_BYTES,
                   observe=observe)
    assert len(seen) == res.rounds
    assert [now for now, _, _ in seen] == sorted(now for now, _, _ in seen)
    assert all(0 < placed <= backlog for _, backlog, placed in seen)


def test_gavel_export_round_trips(workload, tmp_path: Path) -> None:
    _, studies, trials = workload
    s2, t2 = per_trial_tenants(studies, trials)
    assert len({t.tenant for t in t2}) == len(t2) == len(s2)
    out = tmp_path / "trace.txt"
    write_gavel_trace(t2, out)
    lines = out.read_text().splitlines()
    assert len(lines) == len(t2)
    fields = lines[0].split("\t")
    assert len(fields) == 10 and int(fields[5]) >= 1 and int(fields[6]) == 1


def test_cli_prints_one_row_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cluster", "k80=2,p100=2,v100=2", "--hours", "1", "--policies", "fifo,fusetune"]) == 0
    out = capsys.readouterr().out
    assert out.count("| fifo |") == 1 and out.count("| fusetune |") == 1
    with pytest.raises(argparse.ArgumentTypeError):
        parse_cluster("tpu=3")
    assert "| policy |" in format_table([])


def test_fusetune_doubles_fifo_fairly_on_the_philly_day_at_36_36_36() -> None:
    """docs/scheduling.md's claim on the 24 h Philly slice, 36 K80 + 36 P100 + 36 V100:
    fusetune's normalised throughput is at least 2x fifo's with every tenant at or above
    its equal share over time, envy at most 0.05 and Jain at least 0.9.  Deterministic
    (seeded trace mapping and device order); one to three minutes on two shared cores.  On the K80-heavy
    60:30:18 it is 1.93x (documented, not asserted)."""
    calib = read_job_type_curves(DATA)
    reference = {j: calib.curves[(j, "p100")].solo_steps_per_s for j in calib.job_types}
    studies, trials = philly_studies(read_philly_jobs(DATA / "philly_jobs.csv"), calib.job_types, reference)
    cluster = {"k80": 36, "p100": 36, "v100": 36}
    fifo = simulate("fifo", studies, trials, calib.curves, cluster, GPU_MEMORY_BYTES)
    fusetune = simulate("fusetune", studies, trials, calib.curves, cluster, GPU_MEMORY_BYTES)
    assert fusetune.norm_throughput >= 2.0 * fifo.norm_throughput
    assert fusetune.si_min >= 1.0 - 1e-9
    assert fusetune.max_envy <= 0.05
    assert fusetune.jain >= 0.9
