"""What a workload is: ordinary PyTorch pieces that fusetune trains as fused arrays."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import optuna
import torch
from torch import nn
from torch.utils.data import TensorDataset

Params = Mapping[str, Any]


@dataclass(frozen=True)
class Workload:
    """A trainable task, written as plain PyTorch with no fusion code.

    fusetune builds one model per trial with ``build_model(params)``, fuses the models of
    trials whose operator shapes agree, and trains them together. Trial parameters named
    like a hyper-parameter of the chosen ``torch.optim`` optimizer (``lr``, ``momentum``,
    ``weight_decay``, ``betas``, ...) go to that optimizer, per member; ``batch_size`` is
    array-wide; every other parameter is for ``build_model``.

    Attributes:
        name: registry name, e.g. ``"digits-mlp"``.
        build_model: model factory taking a trial's params.
        search_space: default define-by-run search space: suggests on an Optuna trial and
            returns the params.
        datasets: returns the (train, validation) datasets of (input, target) tensors.
        loss: a mean-reduced loss, ``loss(output, target)``.
        metric: validation metric over a whole validation set, ``metric(output, target)``.
        metric_name: what ``metric`` measures, shown in the API.
        direction: whether a larger metric is better.
        optimizer: the ``torch.optim`` optimizer name (array-wide).
        optimizer_defaults: hyper-parameters used when the trial does not set them.
        batch_size: default mini-batch size (a ``batch_size`` trial param overrides it).
        description: one line for listings.
    """

    name: str
    build_model: Callable[[Params], nn.Module]
    search_space: Callable[[optuna.Trial], dict[str, Any]]
    datasets: Callable[[], tuple[TensorDataset, TensorDataset]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metric: Callable[[torch.Tensor, torch.Tensor], float]
    metric_name: str = "accuracy"
    direction: Literal["maximize", "minimize"] = "maximize"
    optimizer: Literal["sgd", "adam"] = "sgd"
    optimizer_defaults: Mapping[str, Any] = field(default_factory=lambda: {"lr": 0.05})
    batch_size: int = 64
    description: str = ""

    def batch_size_for(self, params: Params) -> int:
        """The mini-batch size a trial with ``params`` trains with."""
        return int(params.get("batch_size", self.batch_size))


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    """Fraction of rows whose arg-max class equals the target class."""
    return float((output.argmax(dim=-1) == target).float().mean())
