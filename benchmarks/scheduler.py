"""Decision time of one scheduling round at service scale, and the policy comparison table.

    python benchmarks/scheduler.py                      # 10,000 trials, 500 devices, 50 tenants
    python benchmarks/scheduler.py --studies-per-tenant 20 --policy gavel
    python benchmarks/scheduler.py table                # docs/scheduling.md's policy table
    python benchmarks/scheduler.py ceiling              # fusetune against fused throughput without fairness

``table`` replays synthetic workloads (scheduler._workload: ten tenants, loads from 0.5 to
10 times their share, mixed job types or one job type per tenant) on three cluster mixes
under every policy in the simulator, and solves static backlogs over a load sweep; it
prints Markdown tables with the machine and the commit.  Nothing in it is timed but the
runs themselves.

``ceiling`` asks how much of fusetune's distance from a throughput target is the price of
fairness, on the same synthetic workloads and on the Philly slice of ``fusetune simulate``:
* *best at SI ≥ 1*: in every round of fusetune's run, the most fused throughput that any
  allocation of that round's backlog reaches while every tenant keeps its equal-share
  utility (the sharing incentive alone, no envy constraint), averaged as the throughput
  metric is;
* *no-fairness ceiling*: the workload replayed with every tenant's classes handed to one
  tenant, so each round's LP maximises the cluster's total fused throughput with no
  fairness constraint at all (classes stay per tenant: no trials fuse across tenants that
  would not fuse under fusetune).
A second table sets ``oef`` and ``gavel-paper`` on the one-type-per-tenant workloads against
the same ceiling unfused (``gavel``'s LP with one tenant): the most any unfused policy's
allocation LP reaches there.

Builds a random but realistic round: 50 tenants (weights 1-3), each running a few studies
whose trials share one signature drawn from a pool of model signatures; 500 devices of
three types with per-signature calibrated-like speed-up curves.  It then calls
``Scheduler.decide`` for several consecutive rounds (each round passes the previous
placements back in, as the live server does) and prints the wall time of each, split
into LP solve time and the rest.  Nothing here asserts a speed: it only measures.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy import sparse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusetune.scheduler import (
    POLICIES,
    AllocationProblem,
    Decision,
    Device,
    PendingTrial,
    Placement,
    SpeedupCurve,
    Tenant,
    ThroughputModel,
    make_scheduler,
    solve_allocation,
)
from fusetune.scheduler._calibration import GPU_MEMORY_BYTES, PEAK_TFLOPS, JobTypeCurves
from fusetune.scheduler._lp import base_constraints, equal_share, solve_lp, utility_matrix, variables
from fusetune.scheduler._simulator import SimResult, simulate
from fusetune.scheduler._trace import TraceStudy, TraceTrial, philly_studies
from fusetune.scheduler._workload import backlog, offered_load, synthetic_workload
from fusetune.server.simulate import DEFAULT_DATA, read_job_type_curves, read_philly_jobs

TYPES = {"k80": (1.0, 12 << 30), "p100": (2.5, 16 << 30), "v100": (4.0, 16 << 30)}
MIXES = ("36:36:36", "60:30:18", "24:24:60")  # K80:P100:V100
# (label, policy, backfill): gavel-paper runs twice, with the simulator's backfill (Gavel's
# round mechanism also hands leftover workers to waiting jobs) and with its LP alone.
TABLE_POLICIES = (
    ("fifo", "fifo", True),
    ("gavel-paper", "gavel-paper", True),
    ("gavel-paper, LP only", "gavel-paper", False),
    ("gavel", "gavel", True),
    ("oef", "oef", True),
    ("fusetune", "fusetune", True),
)


def build_round(
    n_trials: int, n_devices: int, n_tenants: int, studies_per_tenant: int, n_signatures: int, seed: int
) -> tuple[list[PendingTrial], list[Device], list[Tenant], ThroughputModel]:
    """A random round of the requested size (deterministic for a seed)."""
    rng = random.Random(seed)
    model = ThroughputModel()
    signatures = [f"sig{i:03d}" for i in range(n_signatures)]
    for sig in signatures:
        base = rng.uniform(0.5, 20.0)
        for g, (speed, _) in TYPES.items():
            c = min(1.0, rng.uniform(0.05, 1.0) * (1.5 if g == "k80" else 1.0))
            model.set_curve(sig, g, SpeedupCurve(base * speed * rng.uniform(0.7, 1.3), c))
    per_type = n_devices // len(TYPES)
    devices = [
        Device(f"{g}-{i:03d}", g, memory_bytes=mem, node=f"{g}-node{i // 8}")
        for k, (g, (_, mem)) in enumerate(TYPES.items())
        for i in range(per_type + (1 if k < n_devices - per_type * len(TYPES) else 0))
    ]
    tenants = [Tenant(f"tenant{i:02d}", float(rng.choice([1, 1, 2, 3]))) for i in range(n_tenants)]
    studies = [
        (t.name, sid, rng.choice(signatures)) for t in tenants for sid in range(studies_per_tenant)
    ]
    trials = []
    for tid in range(n_trials):
        tenant, sid, sig = studies[rng.randrange(len(studies))]
        trials.append(
            PendingTrial(tid, sig, tenant, study_id=hash((tenant, sid)) & 0xFFFF, remaining_epochs=rng.randint(1, 20))
        )
    return trials, devices, tenants, model


def main() -> int:
    if sys.argv[1:2] == ["table"]:
        return table_main(sys.argv[2:])
    if sys.argv[1:2] == ["ceiling"]:
        return ceiling_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--devices", type=int, default=500)
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--studies-per-tenant", type=int, default=4)
    parser.add_argument("--signatures", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--policy", default="fusetune", choices=sorted(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    trials, devices, tenants, model = build_round(
        args.trials, args.devices, args.tenants, args.studies_per_tenant, args.signatures, args.seed
    )
    sched = make_scheduler(args.policy, model)
    classes = len({(t.tenant, t.signature) for t in trials})
    print(
        f"{args.policy}: {len(trials)} pending trials, {len(devices)} devices "
        f"({', '.join(f'{g}={sum(d.device_type == g for d in devices)}' for g in TYPES)}), "
        f"{len(tenants)} tenants, {classes} (tenant, signature) classes"
    )
    running: tuple[Placement, ...] = ()
    times = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        decision = sched.decide(r * 360.0, trials, devices, tenants, running)
        wall = time.perf_counter() - t0
        times.append(wall)
        running = decision.placements
        placed = sum(len(p.trial_ids) for p in decision.placements)
        print(
            f"round {r}: decide {wall * 1e3:7.1f} ms (LP {decision.solver_seconds * 1e3:6.1f} ms), "
            f"{len(decision.placements)} arrays holding {placed} trials, "
            f"{len(decision.started)} (re)started, {len(decision.preempted)} preempted"
        )
    warm = times[1:] or times
    print(f"median over rounds 1..{len(times) - 1}: {statistics.median(warm) * 1e3:.1f} ms; max {max(warm) * 1e3:.1f} ms")
    return 0


def _mix(spec: str) -> dict[str, int]:
    """``"36:36:36"`` -> ``{"k80": 36, "p100": 36, "v100": 36}``."""
    return dict(zip(("k80", "p100", "v100"), (int(n) for n in spec.split(":")), strict=True))


def _provenance() -> str:
    """The commit and the machine, for the recorded output."""
    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "scheduler"], capture_output=True, text=True, check=False)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    state = " (scheduler/ modified)" if dirty.stdout.strip() else ""
    return f"commit {commit.stdout.strip() or '?'}{state}; {cpu}, Python {platform.python_version()}"


def _row(label: str, kind: str, r: SimResult, ref: dict[str, SimResult]) -> str:
    """One Markdown row of the policy table."""
    def ratio(name: str) -> str:
        base = ref[name].norm_throughput if name in ref else 0.0
        return f"{r.norm_throughput / base:.2f}" if base else "-"

    return (
        f"| {kind} | {label} | {r.norm_throughput:.2f} | {ratio('fifo')} | {ratio('gavel-paper')} | {ratio('gavel')} "
        f"| {r.avg_jct_h:.2f} | {r.si_min:.3f} | {r.max_envy:.3f} | {r.jain:.3f} |"
    )


def _simulated(calib: JobTypeCurves, mix: dict[str, int], hours: float, seed: int) -> list[str]:
    """The simulated table rows of one mix: both tenant kinds, every policy."""
    reference = {j: calib.curves[(j, "p100")].solo_steps_per_s for j in calib.job_types}
    rows = []
    for one in (False, True):
        kind = "one type each" if one else "mixed types"
        studies, trials = synthetic_workload(
            calib.job_types, reference, sum(mix.values()), one_type_per_tenant=one, hours=hours, seed=seed
        )
        load = offered_load(trials, reference, sum(mix.values()), hours)
        print(f"  {kind}: {len(studies)} studies, {len(trials)} trials, offered load {load:.2f}", file=sys.stderr)
        ref: dict[str, SimResult] = {}
        for label, policy, backfill in TABLE_POLICIES:
            t0 = time.perf_counter()
            ref[label] = simulate(policy, studies, trials, calib.curves, mix, GPU_MEMORY_BYTES, seed=seed, backfill=backfill)
            print(f"    {label}: {ref[label].rounds} rounds in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        rows += [_row(label, kind, ref[label], ref) for label, _, _ in TABLE_POLICIES]
        rows.append("| " + kind + " | fusetune's SI by tenant | " + ", ".join(
            f"{t[-2:]}={v:.3f}" for t, v in sorted(ref["fusetune"].si_by_tenant.items())) + " | | | | | | | |")
    return rows


def _backlog_problem(calib: JobTypeCurves, mix: dict[str, int], scale: float, seed: int) -> AllocationProblem:
    """A one-type-per-tenant backlog (loads 0.5·scale to 10·scale) as an unfused LP instance."""
    model = ThroughputModel()
    for (job, gpu), curve in calib.curves.items():
        model.set_curve(job, gpu, curve)
    sched = make_scheduler("oef", model, prices=PEAK_TFLOPS)
    waiting = backlog(calib.job_types, sum(mix.values()), low=0.5 * scale, high=10.0 * scale, seed=seed)
    devices = [Device(f"{g}-{i}", g, GPU_MEMORY_BYTES[g]) for g, n in mix.items() for i in range(n)]
    classes = sorted((t, j) for t, j, _ in waiting)
    demand = {(t, j): n for t, j, n in waiting}
    return sched.problem(classes, [demand[c] for c in classes], devices, {t: 1.0 for t, _, _ in waiting})[0]


def _static_sweep(calib: JobTypeCurves, seeds: int) -> list[str]:
    """Total throughput ratios of the fractional allocations over a load sweep."""
    rows = [
        (
            "| mean tenant load | mix | oef ÷ gavel-paper (LP) | oef ÷ gavel | oef-noncooperative ÷ gavel-paper | "
            "gavel-paper devices used |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for scale in (0.5 / 3.17, 1 / 3.17, 2 / 3.17, 1.0, 5 / 3.17, 10 / 3.17):
        for spec in MIXES:
            tot = dict.fromkeys(("max_min_paper", "max_min", "oef", "oef_noncooperative"), 0.0)
            used = 0.0
            for seed in range(seeds):
                p = _backlog_problem(calib, _mix(spec), scale, seed)
                for pol in tot:
                    alloc = solve_allocation(p, pol)  # type: ignore[arg-type]
                    tot[pol] += float(alloc.utility.sum())
                    used += float(alloc.devices.sum()) / p.capacity.sum() / seeds if pol == "max_min_paper" else 0.0
            paper = tot["max_min_paper"]
            rows.append(
                f"| {3.17 * scale:.1f} | {spec} | {tot['oef'] / paper:.3f} | {tot['oef'] / tot['max_min']:.3f} "
                f"| {tot['oef_noncooperative'] / paper:.3f} | {used:.0%} |"
            )
    return rows


def table_main(argv: Sequence[str]) -> int:
    """``table``: print the policy table and the static sweep (docs/scheduling.md)."""
    parser = argparse.ArgumentParser(prog="benchmarks/scheduler.py table")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--hours", type=float, default=12.0, help="arrival window of the synthetic workloads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep-seeds", type=int, default=5)
    args = parser.parse_args(argv)
    calib = read_job_type_curves(args.data)
    print(_provenance())
    print()
    print("| tenants | policy | norm. throughput | × fifo | × gavel-paper | × gavel | avg JCT (h) | min SI | max envy | Jain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec in args.mixes.split(","):
        print(f"mix {spec}:", file=sys.stderr)
        print(f"| **{spec}** | | | | | | | | | |")
        for row in _simulated(calib, _mix(spec), args.hours, args.seed):
            print(row, flush=True)
    print()
    for row in _static_sweep(calib, args.sweep_seeds):
        print(row, flush=True)
    return 0


def _without_fairness(
    studies: Sequence[TraceStudy], trials: Sequence[TraceTrial], curves: dict[tuple[str, str], SpeedupCurve]
) -> tuple[list[TraceStudy], list[TraceTrial], dict[tuple[str, str], SpeedupCurve]]:
    """The workload as one tenant's, each class keeping its own signature.

    With one tenant the allocation LP is the max-throughput LP over the whole cluster (its
    equal share is every device), so fusetune's machinery then places fused arrays for
    throughput alone.  Each signature is renamed ``tenant|job type`` with the job type's
    curves, so trials of different tenants still never share an array.
    """
    sig = {t.trial_id: f"{t.tenant}|{t.job_type}" for t in trials}
    renamed = {(f"{t}|{j}", g): curves[(j, g)] for t, j in {(t.tenant, t.job_type) for t in trials} for g in
               {g for _, g in curves}}
    one_trials = [TraceTrial(t.trial_id, t.study_id, "all", sig[t.trial_id], t.arrival, t.steps, t.epoch_steps)
                  for t in trials]
    one_studies = [TraceStudy(s.study_id, "all", sig[s.trial_ids[0]], s.arrival, s.trial_ids) for s in studies]
    return one_studies, one_trials, renamed


def _max_throughput_at_sharing_incentive(p: AllocationProblem) -> float:
    """The most total throughput any allocation of ``p`` reaches with every tenant at or
    above its equal-share utility (the sharing incentive alone: no envy constraint)."""
    v = variables(p)
    if not v.size:
        return 0.0
    e = equal_share(p, v).utility
    a, b = base_constraints(p, v, p.capacity.astype(float), per_tenant_caps=False)
    held = np.flatnonzero(e > 1e-7)
    sol, _ = solve_lp(
        -v.rate, sparse.vstack([a, -utility_matrix(p, v)[held]]).tocsr(), np.concatenate([b, -e[held] * (1 - 1e-8)])
    )
    return float(v.rate @ sol) if sol is not None else 0.0


def _ceiling_row(
    label: str, spec: str, studies: Sequence[TraceStudy], trials: Sequence[TraceTrial], calib: JobTypeCurves
) -> str:
    """fifo, fusetune and the two ceilings on one workload, as a Markdown row."""
    mix = _mix(spec)
    curves = dict(calib.curves)
    last_arrival = max(t.arrival for t in trials)
    at_si: list[float] = []  # over the rounds the throughput metric averages (to the last arrival)

    def bound(now: float, decision: Decision, problem: AllocationProblem) -> None:
        if now <= last_arrival:
            at_si.append(_max_throughput_at_sharing_incentive(problem))

    fifo = simulate("fifo", studies, trials, curves, mix, GPU_MEMORY_BYTES, seed=0).norm_throughput
    fused = simulate("fusetune", studies, trials, curves, mix, GPU_MEMORY_BYTES, seed=0, observe=bound).norm_throughput
    one_studies, one_trials, one_curves = _without_fairness(studies, trials, curves)
    ceiling = simulate("fusetune", one_studies, one_trials, one_curves, mix, GPU_MEMORY_BYTES, seed=0).norm_throughput
    si = statistics.fmean(at_si)
    return (
        f"| {label} | {spec} | {fifo:.2f} | {fused:.2f} | {fused / fifo:.2f} | {si / fifo:.2f} "
        f"| {ceiling:.2f} | {ceiling / fifo:.2f} | {fused / ceiling:.2f} |"
    )


def ceiling_main(argv: Sequence[str]) -> int:
    """``ceiling``: fusetune against fused throughput with no fairness constraint."""
    parser = argparse.ArgumentParser(prog="benchmarks/scheduler.py ceiling")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--hours", type=float, default=12.0, help="arrival window of the synthetic workloads")
    parser.add_argument("--philly-hours", type=float, default=24.0, help="the Philly slice, as fusetune simulate's")
    args = parser.parse_args(argv)
    calib = read_job_type_curves(args.data)
    reference = {j: calib.curves[(j, "p100")].solo_steps_per_s for j in calib.job_types}
    philly = philly_studies(
        read_philly_jobs(args.data / "philly_jobs.csv"), calib.job_types, reference, hours=args.philly_hours, seed=0
    )
    print(_provenance())
    print()
    print("| workload | mix | fifo | fusetune | fusetune × fifo | best at SI ≥ 1 × fifo | no-fairness ceiling "
          "| ceiling × fifo | fusetune ÷ ceiling |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.mixes.split(","):
        devices = sum(_mix(spec).values())
        for one in (False, True):
            studies, trials = synthetic_workload(calib.job_types, reference, devices, one_type_per_tenant=one,
                                                 hours=args.hours, seed=0)
            label = "synthetic, one type each" if one else "synthetic, mixed types"
            print(_ceiling_row(label, spec, studies, trials, calib), flush=True)
        print(_ceiling_row("Philly slice", spec, *philly, calib), flush=True)
    print()
    print("| one type each | gavel-paper | gavel-paper, LP only | oef | unfused no-fairness ceiling "
          "| oef ÷ gavel-paper | ceiling ÷ gavel-paper | ceiling ÷ LP only |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.mixes.split(","):
        print(_unfused_ceiling_row(spec, calib, args.hours), flush=True)
    return 0


def _unfused_ceiling_row(spec: str, calib: JobTypeCurves, hours: float) -> str:
    """oef and gavel-paper against the most unfused throughput, one job type per tenant."""
    mix = _mix(spec)
    curves = dict(calib.curves)
    reference = {j: calib.curves[(j, "p100")].solo_steps_per_s for j in calib.job_types}
    studies, trials = synthetic_workload(calib.job_types, reference, sum(mix.values()), one_type_per_tenant=True,
                                         hours=hours, seed=0)
    paper = simulate("gavel-paper", studies, trials, curves, mix, GPU_MEMORY_BYTES, seed=0).norm_throughput
    lp_only = simulate("gavel-paper", studies, trials, curves, mix, GPU_MEMORY_BYTES, seed=0,
                       backfill=False).norm_throughput
    oef = simulate("oef", studies, trials, curves, mix, GPU_MEMORY_BYTES, seed=0).norm_throughput
    # ``gavel`` with one tenant: the unfused max-throughput LP over the whole cluster.
    ceiling = simulate("gavel", *_without_fairness(studies, trials, curves), mix, GPU_MEMORY_BYTES, seed=0).norm_throughput
    return (
        f"| {spec} | {paper:.2f} | {lp_only:.2f} | {oef:.2f} | {ceiling:.2f} | {oef / paper:.3f} "
        f"| {ceiling / paper:.3f} | {ceiling / lp_only:.3f} |"
    )


if __name__ == "__main__":
    sys.exit(main())
