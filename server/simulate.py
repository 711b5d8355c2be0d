"""``fusetune simulate``: replay a Philly slice on a cluster, one table row per policy.

Example::

    fusetune simulate --cluster k80=36,p100=36,v100=36 --start 2017-11-01 --hours 24

This module is the simulator's I/O: it reads the Philly trace and Gavel's throughput
files, hands them as plain data to the scheduler (``fusetune.scheduler``, which reads no
files), and prints the table.  The workload mapping, the fused speed-up calibration and
every metric are defined in docs/scheduling.md.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fusetune.scheduler._calibration import (
    GPU_MEMORY_BYTES,
    JobTypeCurves,
    job_type_curves,
)
from fusetune.scheduler._scheduler import POLICIES
from fusetune.scheduler._simulator import SimResult, simulate
from fusetune.scheduler._trace import (
    PhillyJob,
    TraceTrial,
    gavel_trace_lines,
    per_trial_tenants,
    philly_studies,
)

__all__ = ["DEFAULT_DATA", "main", "read_job_type_curves", "read_philly_jobs", "write_gavel_trace"]

# The data folder (docs/scheduling.md): $FUSETUNE_SIM_DATA, else a checkout's ../shared/data.
DEFAULT_DATA = Path(os.environ.get("FUSETUNE_SIM_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
DEFAULT_POLICIES = ("fifo", "gavel-paper", "gavel", "oef", "fusion-greedy", "fusetune")


def read_philly_jobs(trace_csv: Path) -> list[PhillyJob]:
    """Every row of ``philly_jobs.csv`` (``timestamp,duration,num_gpus,gpu_time,cluster``)."""
    with trace_csv.open() as fh:
        return [
            PhillyJob(dt.datetime.fromisoformat(r["timestamp"]), float(r["duration"]), int(r["num_gpus"]), r["cluster"])
            for r in csv.DictReader(fh)
        ]


def read_job_type_curves(data_dir: Path) -> JobTypeCurves:
    """The calibrated curves from ``gavel_simulation_throughputs.json`` and the isolated CSV."""
    raw = json.loads((data_dir / "gavel_simulation_throughputs.json").read_text())
    solo: dict[tuple[str, str], float] = {}
    with (data_dir / "gavel_isolated_throughputs.csv").open() as fh:
        for row in csv.DictReader(fh):
            if int(row["scale_factor"]) != 1:
                continue  # trials are single-device
            for gpu in ("k80", "p100", "v100"):
                solo[(row["job_type"], gpu)] = float(row[f"{gpu}_steps_per_s"])
    return job_type_curves(raw, solo)


def write_gavel_trace(trials: Sequence[TraceTrial], path: Path) -> None:
    """Write ``trials`` as a Gavel trace file (one line per trial)."""
    path.write_text("".join(line + "\n" for line in gavel_trace_lines(trials)))


def parse_cluster(spec: str) -> dict[str, int]:
    """``"k80=36,p100=36,v100=36"`` -> ``{"k80": 36, ...}``."""
    cluster: dict[str, int] = {}
    for part in spec.split(","):
        name, _, count = part.partition("=")
        name = name.strip().lower()
        if name not in GPU_MEMORY_BYTES or not count.strip().isdigit():
            raise argparse.ArgumentTypeError(f"bad cluster entry {part!r} (known types: {sorted(GPU_MEMORY_BYTES)})")
        cluster[name] = int(count)
    return cluster


def format_table(results: Sequence[SimResult], baseline: str = "gavel") -> str:
    """A Markdown table, one row per policy."""
    ref = {r.policy: r for r in results}
    head = (
        "| policy | norm. eff. throughput | × gavel | × fifo | avg JCT (h) | p99 JCT (h) | makespan (h) "
        "| Jain | min SI ratio | max envy | max ρ | solver ms/round (mean / max) |"
    )
    rows = [head, "|" + "---|" * 12]

    def ratio(r: SimResult, other: str) -> str:
        base = ref[other].norm_throughput if other in ref else 0.0
        return f"{r.norm_throughput / base:.2f}" if base else "-"

    for r in results:
        rows.append(
            f"| {r.policy} | {r.norm_throughput:.2f} | {ratio(r, baseline)} | {ratio(r, 'fifo')} | {r.avg_jct_h:.2f} "
            f"| {r.p99_jct_h:.2f} | {r.makespan_h:.1f} | {r.jain:.3f} | {r.si_min:.4f} | {r.max_envy:.3f} "
            f"| {r.rho_max:.2f} | {r.solver_ms_mean:.1f} / {r.solver_ms_max:.1f} |"
        )
    return "\n".join(rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusetune simulate", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cluster", type=parse_cluster, default=parse_cluster("k80=36,p100=36,v100=36"))
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with philly_jobs.csv and the Gavel files")
    parser.add_argument("--start", default="2017-11-01", help="slice start (trace time, ISO date)")
    parser.add_argument("--hours", type=float, default=24.0, help="slice length: jobs submitted within this window")
    parser.add_argument("--trials-per-study", type=int, default=4)
    parser.add_argument("--min-duration", type=float, default=60.0)
    parser.add_argument("--max-duration", type=float, default=86_400.0)
    parser.add_argument("--round", type=float, default=360.0, help="round length in seconds")
    parser.add_argument("--max-members", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    parser.add_argument("--no-backfill", action="store_true", help="leave devices the allocation does not fill idle")
    parser.add_argument(
        "--fair-share-per",
        choices=("tenant", "trial"),
        default="tenant",
        help="fairness unit: the trace's virtual clusters, or every trial (Gavel's job-level unit)",
    )
    parser.add_argument("--export-gavel", type=Path, help="also write the workload as a Gavel trace file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command (``argv`` without the program name); prints the table."""
    parser = _parser()
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; choose from {sorted(POLICIES)}")
    calib = read_job_type_curves(args.data)
    reference = {j: calib.curves[(j, "p100")].solo_steps_per_s for j in calib.job_types}
    studies, trials = philly_studies(
        read_philly_jobs(args.data / "philly_jobs.csv"), calib.job_types, reference,
        start=args.start, hours=args.hours, trials_per_study=args.trials_per_study,
        min_duration=args.min_duration, max_duration=args.max_duration, seed=args.seed,
    )
    if args.fair_share_per == "trial":
        studies, trials = per_trial_tenants(studies, trials)
    if args.export_gavel is not None:
        write_gavel_trace(trials, args.export_gavel)
    cluster_txt = ",".join(f"{g}={n}" for g, n in args.cluster.items())
    print(
        f"trace: {len(studies)} studies / {len(trials)} trials from philly_jobs.csv, "
        f"{args.start} + {args.hours:g} h, durations in [{args.min_duration:g}, {args.max_duration:g}] s, "
        f"{len({s.tenant for s in studies})} tenants; cluster {cluster_txt}; round {args.round:g} s",
        file=sys.stderr,
    )
    results = []
    for policy in policies:
        t0 = time.perf_counter()
        res = simulate(
            policy, studies, trials, calib.curves, args.cluster, GPU_MEMORY_BYTES,
            round_seconds=args.round, max_members=args.max_members, seed=args.seed, backfill=not args.no_backfill,
        )
        print(f"  {policy}: {res.rounds} rounds in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        results.append(res)
    print(format_table(results))
    if args.fair_share_per == "tenant":
        print("\nsharing-incentive ratio per tenant (u_i / u_i(equal share)):")
        for r in results:
            print(f"  {r.policy}: " + ", ".join(f"{t}={v:.4f}" for t, v in sorted(r.si_by_tenant.items())))
    print("\naverage trial (job) completion time, h: " + ", ".join(f"{r.policy}={r.avg_trial_jct_h:.3f}" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
