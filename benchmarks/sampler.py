"""FusionSampler against plain TPE: how many arrays a sweep packs into, and the best value.

    python benchmarks/sampler.py                 # 64 trials, 5 seeds, 10 epochs each
    python benchmarks/sampler.py --seeds 1 --epochs 2   # a quick look

The sweep: the ``digits-mlp`` workload (scikit-learn's digits, SGD) over the hidden width
(32, 64 or 128) and the batch size (32 or 64), the two parameters that change a trial's
shape signature, plus the learning rate, momentum and weight decay, which fuse. 64 trials
are asked 8 at a time, ask-and-tell, as 8 parallel workers would, and told when the batch
has trained. Each trial's model really trains (plain PyTorch, one trial after another, one
thread), and its value is the validation accuracy after its last epoch, as the service
reports it.

Arrays: the trials of one batch that the service's own ``trial_signature`` gives equal
signatures share arrays of at most 8, as ``scheduler.pack`` splits them. The sampler is
TPE seeded as the service seeds it (``constant_liar=True``), alone or inside
``FusionSampler`` with ``group_size`` 8 and the non-fusible parameters derived from the
workload. The script prints a table and checks the targets: FusionSampler's sweeps pack into
at most 12 arrays, and its best value (mean over seeds) is no worse than TPE's by more than
TPE's standard deviation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import optuna  # noqa: E402  (path set up above for running as a script)
import torch  # noqa: E402
from optuna.distributions import CategoricalDistribution, FloatDistribution  # noqa: E402

from fusetune.client.samplers import FusionSampler, fusion_group, non_fusible_params  # noqa: E402
from fusetune.scheduler import PendingTrial, pack  # noqa: E402
from fusetune.workers.signature import trial_signature  # noqa: E402
from fusetune.workers.workloads import Workload, get_workload  # noqa: E402

SPACE = {
    "hidden": CategoricalDistribution([32, 64, 128]),
    "batch_size": CategoricalDistribution([32, 64]),
    "lr": FloatDistribution(1e-3, 0.3, log=True),
    "momentum": FloatDistribution(0.0, 0.95),
    "weight_decay": FloatDistribution(1e-6, 1e-2, log=True),
}
ARRAY_SIZE = 8


def train(workload: Workload, params: Mapping[str, Any], epochs: int, seed: int) -> float:
    """Train one trial's model alone (SGD, as digits-mlp does); its final validation accuracy."""
    torch.manual_seed(seed)
    model = workload.build_model(params)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=params["lr"], momentum=params["momentum"], weight_decay=params["weight_decay"]
    )
    (x, y), (vx, vy) = (d.tensors for d in workload.datasets())
    batch = int(params["batch_size"])
    order = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(y), generator=order).split(batch):
            loss = workload.loss(model(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        value = float(workload.metric(model(vx), vy))
    return value if value == value else 0.0  # a diverged model's NaN counts as learning nothing


@dataclass
class Sweep:
    """One seeded sweep's outcome."""

    arrays: int
    best: float
    groups: int
    seconds: float


def sweep(
    make_sampler: Callable[[int], optuna.samplers.BaseSampler], seed: int, trials: int, batch: int, epochs: int
) -> Sweep:
    workload = get_workload("digits-mlp")
    study = optuna.create_study(direction="maximize", sampler=make_sampler(seed))
    arrays = 0
    start = time.perf_counter()
    for first in range(0, trials, batch):
        asked = [study.ask(fixed_distributions=SPACE) for _ in range(min(batch, trials - first))]
        pending = [
            PendingTrial(trial_id=t.number, signature=trial_signature(workload, t.params)) for t in asked
        ]
        arrays += len(pack(pending, ARRAY_SIZE))
        values = [train(workload, t.params, epochs, seed=1000 * seed + t.number) for t in asked]
        for t, value in zip(asked, values, strict=True):
            study.tell(t, value)
    groups = {fusion_group(t) for t in study.trials}
    return Sweep(arrays, study.best_value, len(groups - {None}), time.perf_counter() - start)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}, "
        f"optuna {optuna.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="trials asked at a time (parallel workers)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--json", type=Path, help="also write the per-seed results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    non_fusible = non_fusible_params("digits-mlp", distributions=SPACE)
    print(f"machine: {machine()}")
    print(f"non-fusible (derived from the service's trial_signature): {sorted(non_fusible)}")
    samplers: dict[str, Callable[[int], optuna.samplers.BaseSampler]] = {
        "TPE": lambda s: optuna.samplers.TPESampler(seed=s, constant_liar=True),
        "FusionSampler(TPE)": lambda s: FusionSampler(
            optuna.samplers.TPESampler(seed=s, constant_liar=True), non_fusible=non_fusible, group_size=ARRAY_SIZE
        ),
    }
    results: dict[str, list[Sweep]] = {name: [] for name in samplers}
    for seed in range(args.seeds):
        for name, make in samplers.items():
            results[name].append(sweep(make, seed, args.trials, args.batch, args.epochs))

    print(
        f"\n{args.trials} trials asked {args.batch} at a time, {args.epochs} epochs each, arrays of at most "
        f"{ARRAY_SIZE}, {args.seeds} seeds"
    )
    header = f"{'sampler':<20}{'arrays mean':>12}{'min-max':>10}{'groups':>8}{'best mean':>11}{'sd':>8}{'min-max':>16}{'s/seed':>8}"
    print(header)
    print("-" * len(header))
    summary: dict[str, dict[str, float]] = {}
    for name, sweeps in results.items():
        arrays = [s.arrays for s in sweeps]
        best = [s.best for s in sweeps]
        sd = statistics.stdev(best) if len(best) > 1 else 0.0
        summary[name] = {"arrays": statistics.mean(arrays), "best": statistics.mean(best), "sd": sd, "max_arrays": max(arrays)}
        print(
            f"{name:<20}{statistics.mean(arrays):>12.1f}{f'{min(arrays)}-{max(arrays)}':>10}"
            f"{(f'{statistics.mean(s.groups for s in sweeps):.1f}' if any(s.groups for s in sweeps) else '-'):>8}"
            f"{statistics.mean(best):>11.4f}{sd:>8.4f}"
            f"{f'{min(best):.4f}-{max(best):.4f}':>16}{statistics.mean(s.seconds for s in sweeps):>8.1f}"
        )
    fused, plain = summary["FusionSampler(TPE)"], summary["TPE"]
    packs = fused["max_arrays"] <= 12
    close = fused["best"] >= plain["best"] - plain["sd"]
    print(f"\nFusionSampler packs into <= 12 arrays in every seed: {'yes' if packs else 'NO'} (at most {fused['max_arrays']:.0f})")
    print(
        f"FusionSampler's best is no worse than TPE's beyond one sd: {'yes' if close else 'NO'} "
        f"({fused['best']:.4f} vs {plain['best']:.4f} - {plain['sd']:.4f})"
    )
    if args.json:
        args.json.write_text(json.dumps({k: [s.__dict__ for s in v] for k, v in results.items()}, indent=2))
    return 0 if packs and close else 1


if __name__ == "__main__":
    raise SystemExit(main())
