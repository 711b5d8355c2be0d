"""FusionSampler in plain Optuna: 32 trials asked 8 at a time, as 8 parallel workers would.

    python client/samplers/example.py

The objective stands in for training a network whose hidden width and batch size change its
shapes (non-fusible) and whose learning rate and momentum do not (fusible). With
FusionSampler the trials asked together share the width and the batch size in groups of up
to 8, so a fusion engine trains each group as one array; TPE still chooses the width and
the batch size (once per group) and the learning rate and momentum (for every trial).
"""

from __future__ import annotations

import math
from collections import Counter

import optuna

from fusetune.client.samplers import FusionSampler, fusion_group


def objective(trial: optuna.Trial) -> float:
    hidden = trial.suggest_categorical("hidden", [32, 64, 128])
    batch_size = trial.suggest_categorical("batch_size", [32, 64])
    lr = trial.suggest_float("lr", 1e-3, 0.3, log=True)
    momentum = trial.suggest_float("momentum", 0.0, 0.95)
    # A made-up validation loss: best near lr 0.05, momentum 0.9, a wide net, small batches.
    return (math.log10(lr / 0.05)) ** 2 + (momentum - 0.9) ** 2 + 32 / hidden + batch_size / 640


def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = FusionSampler(
        optuna.samplers.TPESampler(seed=0, constant_liar=True),
        non_fusible=["hidden", "batch_size"],
        group_size=8,
    )
    study = optuna.create_study(sampler=sampler)
    for _ in range(4):  # four rounds of eight parallel workers, ask-and-tell
        trials = [study.ask() for _ in range(8)]
        values = [objective(t) for t in trials]
        for trial, value in zip(trials, values):
            study.tell(trial, value)

    shapes = Counter((_group(t), t.params["hidden"], t.params["batch_size"]) for t in study.trials)
    for (group, hidden, batch_size), n in sorted(shapes.items(), key=lambda kv: int(kv[0][0].split(".")[0])):
        print(f"group {group:>3}: {n} trials, hidden={hidden}, batch_size={batch_size}")
    print(f"best value {study.best_value:.4f} with {study.best_params}")


def _group(trial: optuna.trial.FrozenTrial) -> str:
    group = fusion_group(trial)
    if group is None:  # every trial here was asked through FusionSampler, which places each
        raise RuntimeError(f"trial {trial.number} has no fusion group")
    return group


if __name__ == "__main__":
    main()
