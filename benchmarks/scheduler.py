"""Decision time of one scheduling round at service scale.

    python benchmarks/scheduler.py                      # 10,000 trials, 500 devices, 50 tenants
    python benchmarks/scheduler.py --studies-per-tenant 20 --policy gavel

Builds a random but realistic round: 50 tenants (weights 1-3), each running a few studies
whose trials share one signature drawn from a pool of model signatures; 500 devices of
three types with per-signature calibrated-like speed-up curves.  It then calls
``Scheduler.decide`` for several consecutive rounds (each round passes the previous
placements back in, as the live server does) and prints the wall time of each, split
into LP solve time and the rest.  Nothing here asserts a speed: it only measures.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusetune.scheduler import (  # noqa: E402  (path set up above for running as a script)
    POLICIES,
    Device,
    PendingTrial,
    Placement,
    SpeedupCurve,
    Tenant,
    ThroughputModel,
    make_scheduler,
)

TYPES = {"k80": (1.0, 12 << 30), "p100": (2.5, 16 << 30), "v100": (4.0, 16 << 30)}


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


if __name__ == "__main__":
    sys.exit(main())
