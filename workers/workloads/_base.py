"""What a workload is: ordinary PyTorch pieces that fusetune trains as fused arrays."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import optuna
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

Params = Mapping[str, Any]
Direction = Literal["maximize", "minimize"]
#: One mini-batch as the data yields it: a tuple or list ``(x, y, ...)``, a dict of tensors
#: (``{"input_ids": ..., "labels": ...}``), or one tensor (a language model's tokens).
Batch = Any


def feed_model(model: nn.Module, batch: Batch) -> Any:
    """The default ``Workload.forward``: how a batch feeds the model.

    A tuple or list ``(x, y, ...)`` calls ``model(x)``; a dict calls the model with its
    entries as keyword arguments, all but ``labels`` (``model(input_ids=...,
    attention_mask=...)``); a tensor calls ``model(batch)``.
    """
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**{k: v for k, v in batch.items() if k != "labels"})
    return model(batch[0])


def labels_of(batch: Batch) -> Any:
    """The default ``Workload.target_of``: what a batch's outputs are compared with.

    A tuple or list ``(x, y, ...)`` gives ``y``; a dict its ``labels``; a tensor, or a tuple
    of one tensor (a ``TensorDataset`` of one tensor), itself: a language model's loss and
    metrics take the tokens and shift them.
    """
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise KeyError(f"a dict batch's target is its 'labels', and this one has {sorted(batch)}: "
                           "set the workload's target_of")
        return batch["labels"]
    return batch[1] if len(batch) > 1 else batch[0]


@dataclass(frozen=True)
class Metric:
    """Something a workload measures about a trained member, and which way is better.

    A study chooses one or several of its workload's metrics as its objectives.

    Attributes:
        name: what the API and Optuna call it (``"accuracy"``, ``"n_params"``).
        fn: with ``of="outputs"``, ``fn(output, target) -> float`` (or a 0-d tensor): one
            member's model outputs and the target (``Workload.target_of``) of the whole
            validation set, or of one validation batch with ``per_batch``; with
            ``of="model"``, ``fn(model) -> float`` of the member's trained model as its own
            class (a parameter count, a sparsity).
        direction: whether a larger value is better.
        of: what ``fn`` takes. Metrics of the outputs are computed every epoch from the
            array's one fused validation pass; metrics of the model export the member, so
            they are computed when they are needed (the study's objectives, at a member's
            last epoch; every epoch only when a model metric is the first objective).
        per_batch: ``fn`` is a mean over the samples of what it is given, so its value over
            the validation set is the mean of its values over the validation batches,
            weighted by each batch's samples (the first axis of its target). A validation
            set read through a ``DataLoader`` is then measured batch by batch, and its
            outputs are never held together (a language model's ``[B, N, L, vocab]``
            logits). Without it (the default), that set's outputs and targets are
            concatenated along the sample axis and ``fn`` sees them whole, which suits a
            classifier's outputs. A ``TensorDataset`` validation set is one batch: either way
            ``fn`` sees it whole.
    """

    name: str
    fn: Callable[..., float]
    direction: Direction = "maximize"
    of: Literal["outputs", "model"] = "outputs"
    per_batch: bool = False
    # Added by Workload from its ``metric`` field (not declared among its ``metrics``): a copy
    # made with dataclasses.replace recomputes it from the copy's own ``metric``.
    _implied: bool = field(default=False, init=False, repr=False, compare=False)


@dataclass(frozen=True)
class Workload:
    r"""A trainable task, written as plain PyTorch with no fusion code.

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

    **Data.** ``datasets()`` returns any ``torch.utils.data.Dataset``\s, map-style or
    iterable, with their transforms and augmentation in Python (``__getitem__`` drawing a
    random flip and crop). An array reads one stream of mini-batches and every member sees
    each batch (``workers/data.py``):

    * A ``TensorDataset`` (not a subclass with its own ``__getitem__``) stays on the device
      and is indexed by a permutation drawn from the array's seed: no ``DataLoader``. Its
      validation set is one batch, the whole set in one fused pass.
    * Any other dataset is read through one ``torch.utils.data.DataLoader`` per array,
      built as ``DataLoader(train, batch_size=<the array's>, shuffle=True,
      generator=torch.Generator().manual_seed(<the array's seed>), **loader)``: the order
      and the loader's worker seeds (``base_seed``, so augmentation drawn with ``torch``'s
      RNG in its worker processes too) follow from the array's seed. An iterable dataset
      is not shuffled (a ``DataLoader`` cannot): its order is its own, one pass of its
      iterator is an epoch (it must end), and with ``num_workers > 1`` each worker process
      yields the whole stream unless the dataset splits it by
      ``torch.utils.data.get_worker_info()``, as torch documents. The validation set's
      loader reads in order, with the same options.

    A batch is whatever the loader collates: a tuple or list, a dict, or a tensor.
    ``forward(model, batch)`` feeds it to the model and ``target_of(batch)`` says what the
    loss and the metrics compare the outputs with; the fused model gets the batch with
    every tensor broadcast to the members (``fusion.broadcast``), so ``forward`` should
    only route the batch's values into the model's call. The loss is
    ``loss(output, target)`` per member (``fusion.per_member_loss``); a loss that needs
    more than the labels (a padding mask, the next tokens) gets it through ``target_of``
    (a dict, or the whole batch).

    Attributes:
        name: registry name, e.g. ``"digits-mlp"``.
        build_model: model factory taking a trial's params (a read-only mapping). Its
            shapes must depend on nothing but the params it reads: the service memoises
            signatures by them (``workers/signature.py``).
        search_space: default define-by-run search space: suggests on an Optuna trial and
            returns the params.
        datasets: returns the (train, validation) datasets: ``TensorDataset``\s of (input,
            target) tensors, or any map-style or iterable ``Dataset`` (above).
        loss: a mean-reduced loss, ``loss(output, target)``, with ``target`` as ``target_of``
            gives it.
        metric: the default objective, a validation metric over a whole validation set,
            ``metric(output, target)`` (list it among ``metrics`` under ``metric_name`` to
            declare it ``per_batch``, with this same function). A copy made with
            ``dataclasses.replace(workload, metric=...)`` optimises its own ``metric``; one
            whose ``metric_name`` is declared among ``metrics`` as another function is
            refused (a ``ValueError``: which would count?).
        metric_name: what ``metric`` measures, shown in the API.
        direction: whether a larger ``metric`` is better.
        metrics: every metric a study may choose as an objective; ``metric`` is added
            first when not among them. A study's first objective is its intermediate value.
        optimizer: the default ``torch.optim`` optimizer name.
        optimizer_defaults: hyper-parameters of ``optimizer`` used when the study and the
            trial do not set them (torch's names; an unknown name or a value torch refuses
            is refused when the workload is packaged, and fails a registered workload's trials).
        lr_scheduler: the default ``torch.optim.lr_scheduler`` name, or None for none.
        lr_scheduler_defaults: arguments of ``lr_scheduler`` used when not set otherwise.
        warmup_epochs: default warm-up epochs (0: none).
        max_norm: default gradient clipping norm (None: no clipping).
        amp: train under CUDA autocast (float16) with a per-member gradient scaler when
            the worker's device is a GPU; CPU workers ignore it and train in float32.
        batch_size: default mini-batch size (a ``batch_size`` trial param overrides it).
        description: one line for listings.
        forward: ``forward(model, batch) -> output``, how a batch feeds the model
            (default :func:`feed_model`: ``model(x)`` for ``(x, y)``, the dict's entries
            but ``labels`` as keyword arguments, ``model(tokens)`` for a tensor).
        target_of: ``target_of(batch) -> target``, what the loss and the metrics compare
            the outputs with: a tensor, or a tuple or dict of them (default
            :func:`labels_of`: ``y`` of ``(x, y)``, a dict's ``labels``, a tensor itself).
        loader: keyword arguments of the ``DataLoader`` of a dataset that is not a
            ``TensorDataset``: ``num_workers``, ``persistent_workers``,
            ``prefetch_factor``, ``pin_memory``, ``collate_fn``, ``drop_last``,
            ``worker_init_fn``, ``shuffle`` (False: a map-style dataset in its own order),
            ... A study's ``TrainingSpec.loader`` overrides them one by one. The array sets
            ``batch_size`` and ``generator`` (``sampler`` and ``batch_sampler`` are
            refused; so is a name ``DataLoader`` does not take, when the workload is defined). ``pin_memory`` defaults to True on a CUDA worker and is dropped on
            others; ``prefetch_factor`` and ``persistent_workers`` are dropped without
            worker processes (``num_workers`` 0, the default: the batches are read in the
            training process).
    """

    name: str
    build_model: Callable[[Params], nn.Module]
    search_space: Callable[[optuna.Trial], dict[str, Any]]
    datasets: Callable[[], tuple[Dataset[Any], Dataset[Any]]]
    loss: Callable[[Any, Any], torch.Tensor]
    metric: Callable[[Any, Any], float]
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
    forward: Callable[[nn.Module, Batch], Any] = feed_model
    target_of: Callable[[Batch], Any] = labels_of
    loader: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A copy made with dataclasses.replace gets the metrics this one implied from its
        # metric field: they go, so that the copy's own metric, name and direction count.
        declared = tuple(m for m in self.metrics if not m._implied)
        names = [m.name for m in declared]
        if len(set(names)) != len(names):
            raise ValueError(f"workload {self.name!r}: metrics {names} repeat a name")
        named = next((m for m in declared if m.name == self.metric_name), None)
        if named is not None and named.fn is not self.metric:  # which one counts? (a copy's new metric, say)
            raise ValueError(
                f"workload {self.name!r}: its metric is {_name_of(self.metric)}, but its metrics declare "
                f"{self.metric_name!r} as {_name_of(named.fn)}: give metric a metric_name of its own, or "
                "change that entry of metrics"
            )
        _check_loader(self.name, self.loader)
        if named is None:
            primary = Metric(self.metric_name, self.metric, self.direction)
            object.__setattr__(primary, "_implied", True)
            declared = (primary, *declared)
        object.__setattr__(self, "metrics", declared)

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


#: ``DataLoader`` arguments an array sets itself: its dataset, batch size and seeded order.
LOADER_OWNED = frozenset({"dataset", "batch_size", "generator", "sampler", "batch_sampler"})


def _check_loader(name: str, loader: Mapping[str, Any]) -> None:
    """A workload's ``loader`` names ``DataLoader`` arguments the array leaves to it: a slip
    (``shufle``) is refused where the workload is defined, not in every trial it trains."""
    takes = [p for p in inspect.signature(DataLoader.__init__).parameters if p not in ("self", *LOADER_OWNED)]
    unknown = sorted(k for k in loader if k not in takes)
    if unknown:
        owned = [k for k in unknown if k in LOADER_OWNED]
        why = "are the array's own (its dataset, batch size and seeded order)" if owned == unknown else (
            f"are not arguments of torch.utils.data.DataLoader, which takes: {', '.join(takes)}"
        )
        raise ValueError(f"workload {name!r}: loader options {unknown} {why}")


def _name_of(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    """Fraction of rows whose arg-max class equals the target class."""
    return float((output.argmax(dim=-1) == target).float().mean())


def n_params(model: nn.Module) -> float:
    """How many parameters (scalars) a model has: a size objective to minimise."""
    return float(sum(p.numel() for p in model.parameters()))
