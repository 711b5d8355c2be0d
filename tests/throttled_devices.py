"""A test-only device: CPU workers slowed to a throughput matrix, so that a live cluster runs
at the speeds a simulator is given (tests/test_live_vs_sim.py).

Each Ray node declares what its CPU workers are with the ``fusetune-device:<type>`` resource
(``workers/pool.py``) and, for this module, the same type in :data:`DEVICE_ENV`, which its
worker processes inherit from ``ray start``. A job type is a width of the workload's MLP
(trials of one width fuse). Its :class:`Throttle` layer, parameter-free, sleeps while it
trains so that an array of ``B`` members of job ``j`` on a device of type ``g`` takes
``(1 + c (B - 1)) / T1`` seconds per step, ``(T1, c) = MATRIX[j, g]``: the speed-up curve that
the simulator is given, whatever the CPU computes besides (a few small matmuls).

Production code never sees this module: the service loads it by path
(``allow_workload_imports``), as tests/paced_workload.py's workload is.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import optuna
import torch
import torch.nn.functional as F
from torch import nn

from fusetune.workers.workloads import Workload, accuracy

# The paced workload's data: STEPS batches of BATCH random points per epoch, FEATURES wide.
from tests.paced_workload import BATCH, CLASSES, FEATURES, data
from tests.paced_workload import STEPS as STEPS  # training batches per epoch, read by the live test

#: The environment variable naming a node's device type, set on its ``ray start``.
DEVICE_ENV = "FUSETUNE_TEST_DEVICE"
#: Job type -> the MLP width that makes it (its trials' shape signature).
WIDTHS = {"a": 8, "b": 16}
#: (job type, device type) -> its true speed, ``(T1, c)``: solo steps/s and the marginal cost
#: of a member (``scheduler.SpeedupCurve``'s two numbers; kept plain, since importing the
#: scheduler would bring scipy into every worker's first array, half a second the simulator
#: does not charge). ``a`` gains 3x on the fast device and fuses well, ``b`` gains little
#: there and fuses less well (the heterogeneity a policy can use).
MATRIX = {
    ("a", "fast"): (9.0, 0.3),
    ("a", "slow"): (3.0, 0.3),
    ("b", "fast"): (4.5, 0.5),
    ("b", "slow"): (3.75, 0.5),
}


class Throttle(nn.Module):
    """Holds each training step of ``job`` to the time one step of its array takes on this
    node's device type, for the array size its (folded, ``[B * BATCH, ...]``) input says.

    It paces the whole step, not only itself: it sleeps until one step's time after the
    previous step's pacing ended, so the step's own compute (the matmuls, the optimizer, the
    batch) is inside that time, not added to it, for as long as it is shorter. A step that
    comes later than that (an array's first, after a build or an idle device) sleeps the
    whole time.
    """

    def __init__(self, job: str) -> None:
        super().__init__()
        self.job = job

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only training steps of whole batches: not the few-sample calls in which the worker
        # proves a fused model before its first step (a device does those in no time).
        if self.training and x.shape[0] >= BATCH and x.shape[0] % BATCH == 0:
            solo, c = MATRIX[(self.job, os.environ[DEVICE_ENV])]
            members = x.shape[0] // BATCH
            step = (1 + c * (members - 1)) / solo
            now = time.monotonic()
            due = _paced[0] + step if now - _paced[0] <= step else now + step
            time.sleep(max(0.0, due - now))
            _paced[0] = due
        return x


#: When this process's last paced step ended (a worker trains one array at a time).
_paced = [-math.inf]


def build(params: Any) -> nn.Module:
    hidden = int(params["hidden"])
    (job,) = [j for j, w in WIDTHS.items() if w == hidden]
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), Throttle(job), nn.Linear(hidden, CLASSES))


def space(trial: optuna.Trial) -> dict[str, Any]:
    return {"hidden": trial.suggest_categorical("hidden", sorted(WIDTHS.values())), "lr": trial.suggest_float("lr", 0.01, 0.1)}


WORKLOAD = Workload(
    name="throttled-devices",
    build_model=build,
    search_space=space,
    datasets=data,
    loss=F.cross_entropy,
    metric=accuracy,
    optimizer="SGD",
    optimizer_defaults={"lr": 0.05},
    batch_size=BATCH,
    description="MLP whose training steps take the time a throughput matrix gives its device type",
)
