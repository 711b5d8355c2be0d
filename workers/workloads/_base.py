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
Direction = Literal["maximize", "minimize"]


@dataclass(frozen=True)
class Metric:
    """Something a workload measures about a trained member, and which way is better.

    A study chooses one or several of its workload's metrics as its objectives.

    Attributes:
        name: what the API and Optuna call it (``"accuracy"``, ``"n_params"``).
        fn: with ``of="outputs"``, ``fn(output, target) -> float`` over the whole validation
            set; with ``of="model"``, ``fn(model) -> float`` of the member's trained model as
            its own class (a parameter count, a sparsity).
        direction: whether a larger value is better.
        of: what ``fn`` takes. Metrics of the outputs are computed every epoch from the
            array's one fused validation pass; metrics of the model export the member, so
            they are computed when they are needed (the study's objectives, at a member's
            last epoch; every epoch only when a model metric is the first objective).
    """

    name: str
    fn: Callable[..., float]
    direction: Direction = "maximize"
    of: Literal["outputs", "model"] = "outputs"


@dataclass(frozen=True)
class Workload:
    """A trainable task, written as plain PyTorch with no fusion code.

    fusetune builds one model per trial with ``build_model(params)``, fuses the models of
    trials whose operator shapes agree, and trains them together. Every param goes to
    ``build_model``; besides, a trial's params configure its training, named as torch names
    things (``workers/optimization.py``):

    * ``optimizer``: a ``torch.optim`` class name the fusion engine fuses (``"SGD"``,
      ``"Adam"``, ``"AdamW"``, ``"RMSprop"``, ``"Adagrad"``, ``"Adadelta"``; lower case is
      accepted). It is array-wide: trials with different optimizers never share an array.
    * that optimizer's hyper-parameters, named as in its signature (``lr``, ``momentum``,
      ``weight_decay``, ``eps``, ``alpha``, ...). The numeric ones are per member; the
      flags (``nesterov``, ``amsgrad``, ``centered``, ``maximize``) are array-wide.
      ``betas`` is a pair (a list from a define-by-run space), or ``beta1``/``beta2``, two
      floats Optuna can suggest (it cannot suggest a tuple); a ``betas`` that is not a
      pair is an error naming ``betas``.
    * ``lr_scheduler``: a ``torch.optim.lr_scheduler`` class name (array-wide), with its
      arguments per member as torch names them (``gamma``, ``step_size``, ``T_max``, ...;
      a name the optimizer also takes, like ``eps``, goes to the optimizer).
    * ``warmup_epochs`` (per member): the learning rate ramps up linearly over that many
      epochs, as torch's ``LinearLR(start_factor=1 / (warmup_epochs + 1),
      total_iters=warmup_epochs)`` chained with the scheduler.
    * ``max_norm`` (per member): clip the gradient norm, as ``clip_grad_norm_``.
    * ``batch_size`` (array-wide).

    A trial's param overrides the study's setting, which overrides the workload's below.

    Attributes:
        name: registry name, e.g. ``"digits-mlp"``.
        build_model: model factory taking a trial's params (a read-only mapping). Its
            shapes must depend on nothing but the params it reads: the service memoises
            signatures by them (``workers/signature.py``).
        search_space: default define-by-run search space: suggests on an Optuna trial and
            returns the params.
        datasets: returns the (train, validation) datasets of (input, target) tensors.
        loss: a mean-reduced loss, ``loss(output, target)``.
        metric: the default objective, a validation metric over a whole validation set,
            ``metric(output, target)``.
        metric_name: what ``metric`` measures, shown in the API.
        direction: whether a larger ``metric`` is better.
        metrics: every metric a study may choose as an objective; ``metric`` is added
            first when not among them. A study's first objective is its intermediate value.
        optimizer: the default ``torch.optim`` optimizer name.
        optimizer_defaults: hyper-parameters of ``optimizer`` used when the study and the
            trial do not set them (torch's names; unknown names fail the trial).
        lr_scheduler: the default ``torch.optim.lr_scheduler`` name, or None for none.
        lr_scheduler_defaults: arguments of ``lr_scheduler`` used when not set otherwise.
        warmup_epochs: default warm-up epochs (0: none).
        max_norm: default gradient clipping norm (None: no clipping).
        amp: train under CUDA autocast (float16) with a per-member gradient scaler when
            the worker's device is a GPU; CPU workers ignore it and train in float32.
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
    direction: Direction = "maximize"
    metrics: tuple[Metric, ...] = ()
    optimizer: str = "SGD"
    optimizer_defaults: Mapping[str, Any] = field(default_factory=lambda: {"lr": 0.05})
    lr_scheduler: str | None = None
    lr_scheduler_defaults: Mapping[str, Any] = field(default_factory=dict)
    warmup_epochs: int = 0
    max_norm: float | None = None
    amp: bool = False
    batch_size: int = 64
    description: str = ""

    def __post_init__(self) -> None:
        names = [m.name for m in self.metrics]
        if len(set(names)) != len(names):
            raise ValueError(f"workload {self.name!r}: metrics {names} repeat a name")
        if self.metric_name not in names:
            primary = Metric(self.metric_name, self.metric, self.direction)
            object.__setattr__(self, "metrics", (primary, *self.metrics))

    def batch_size_for(self, params: Params) -> int:
        """The mini-batch size a trial with ``params`` trains with."""
        return int(params.get("batch_size", self.batch_size))

    def metric_named(self, name: str) -> Metric:
        """The declared metric called ``name``; raises ``KeyError`` naming the known ones."""
        for metric in self.metrics:
            if metric.name == name:
                return metric
        known = ", ".join(m.name for m in self.metrics)
        raise KeyError(f"workload {self.name!r} has no metric {name!r}; it declares: {known}")


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    """Fraction of rows whose arg-max class equals the target class."""
    return float((output.argmax(dim=-1) == target).float().mean())


def n_params(model: nn.Module) -> float:
    """How many parameters (scalars) a model has: a size objective to minimise."""
    return float(sum(p.numel() for p in model.parameters()))
