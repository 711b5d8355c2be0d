"""A workload whose training epoch never ends (``tests.endless_workload:WORKLOAD``).

Its model and search space are the digits MLP's, so the service accepts, asks and fuses its
trials. Its model sleeps for ever in its first training step: the worker still answers
heartbeats (a sleep holds no lock), so only the epoch deadline
(``FUSETUNE_EPOCH_TIMEOUT_S``) frees it. tests/test_faults_epoch.py checks that its trials fail
naming that setting and that the worker trains the next study.
"""

import dataclasses
import time
from typing import Any

from torch import nn

from fusetune.workers.workloads._digits import DIGITS_MLP


class Forever(nn.Module):
    """Sleeps for ever once it trains; passes its input through otherwise."""

    def forward(self, x: Any) -> Any:
        while self.training:
            time.sleep(0.05)
        return x


def build(params: Any) -> nn.Module:
    return nn.Sequential(Forever(), DIGITS_MLP.build_model(params))


WORKLOAD = dataclasses.replace(DIGITS_MLP, name="endless", build_model=build)
