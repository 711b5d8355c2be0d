"""A workload whose members cost a set time per training step: a test device whose speed
does not depend on the CPU's (``tests.paced_workload:WIDTHS``, resolved by path with
``allow_workload_imports``, as tests/people_workloads.py's are).

An MLP whose ``hidden`` width sets its class (trials of one width fuse). Its ``Pace`` layer, a
parameter-free module, sleeps while it trains: ``MEMBER_STEP_S`` per member and step at the
``WIDE`` width, nothing at any other. Fused, it runs once on the members' folded batch
(``[B*N, ...]``), so an array of B sleeps B times as long per step: each wide member costs
what a model alone does (marginal cost 1), however fast the machine computes the rest.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any

import optuna
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from fusetune.workers.workloads import Workload, accuracy

FEATURES, CLASSES, BATCH = 8, 4, 16
#: Training batches per epoch.
STEPS = 4
#: The width whose members sleep, and for how long per member and training step.
WIDE, MEMBER_STEP_S = 32, 0.02


@lru_cache(maxsize=1)
def data() -> tuple[TensorDataset, TensorDataset]:
    """(train, validation): STEPS batches of random points, and one, labelled by their
    largest feature modulo CLASSES."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((STEPS + 1) * BATCH, FEATURES, generator=generator)
    y = x.argmax(dim=1) % CLASSES
    return TensorDataset(x[: STEPS * BATCH], y[: STEPS * BATCH]), TensorDataset(x[STEPS * BATCH :], y[STEPS * BATCH :])


class Pace(nn.Module):
    """Sleeps ``seconds`` per sample batch of ``BATCH`` it is given while training."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.seconds > 0:
            time.sleep(self.seconds * max(1, x.shape[0] // BATCH))
        return x


def build(params: Any) -> nn.Module:
    hidden = int(params["hidden"])
    return nn.Sequential(
        nn.Linear(FEATURES, hidden), nn.ReLU(), Pace(MEMBER_STEP_S if hidden == WIDE else 0.0), nn.Linear(hidden, CLASSES)
    )


def space(trial: optuna.Trial) -> dict[str, Any]:
    return {"hidden": trial.suggest_categorical("hidden", [8, WIDE]), "lr": trial.suggest_float("lr", 0.01, 0.1)}


WIDTHS = Workload(
    name="paced-widths",
    build_model=build,
    search_space=space,
    datasets=data,
    loss=F.cross_entropy,
    metric=accuracy,
    optimizer="SGD",
    optimizer_defaults={"lr": 0.05},
    batch_size=BATCH,
    description="MLP whose wide members sleep a set time per training step (a test device)",
)
