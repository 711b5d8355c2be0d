"""Workloads whose errors hold a lone UTF-16 surrogate, text UTF-8 cannot encode
(``tests.surrogate_workload:UNBUILDABLE`` and ``:UNTRAINABLE``; tests/test_undecodable_text.py).

A tenant's code can raise any ``str``: the digits MLP's model factory raising one, and its
loss raising one while the array trains.
"""

import dataclasses
from typing import Any

from torch import nn

from fusetune.workers.workloads._digits import DIGITS_MLP


def unbuildable_model(params: Any) -> nn.Module:
    raise ValueError("no model of width \ud800 here")


def untrainable_loss(output: Any, target: Any) -> Any:
    raise RuntimeError("the loss \udcff broke")


UNBUILDABLE = dataclasses.replace(DIGITS_MLP, name="unbuildable-text", build_model=unbuildable_model)
UNTRAINABLE = dataclasses.replace(DIGITS_MLP, name="untrainable-text", loss=untrainable_loss)
