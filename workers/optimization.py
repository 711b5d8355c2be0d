"""How a member trains: its optimizer, learning-rate schedule, warm-up, clipping and AMP.

Each is chosen per workload (the :class:`~workers.workloads.Workload`'s fields), per study
(the request's settings, a :class:`~workers.spec.TrainingSpec`) or per trial (its params),
a later one overriding an earlier one. Everything is named as torch names it: optimizers
and schedulers by their ``torch.optim`` / ``torch.optim.lr_scheduler`` class names (the
lower-case ``"sgd"``, ``"adam"``, ... are accepted too), hyper-parameters by their
constructor arguments. Which arguments an optimizer or scheduler takes comes from the fused
optimizer's and the torch scheduler's signatures, never from a list kept here; which of an
optimizer's hyper-parameters are per member is the fusion engine's (``member_hparams``,
``pair_hparams``), the others (``nesterov``, ``amsgrad``, ...) are array-wide.

:func:`resolve` turns (workload, study settings, trial params) into a member's
:class:`Recipe`, checked by constructing torch's own optimizer and scheduler with it, and
raises :class:`OptionError` naming the parameter at fault; the control plane calls it for
every trial it asks, so a trial with bad settings fails alone, before any array trains it.
:class:`ArrayOptimizer` trains an array's members with their recipes and follows the
array's membership changes.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import fusetune.fusion as fusion
from fusetune.fusion.lr_scheduler import FusedLRScheduler
from fusetune.fusion.optim import FusedOptimizer
from fusetune.workers.spec import TrainingSpec
from fusetune.workers.workloads import Workload

__all__ = [
    "LR_SCHEDULERS",
    "OPTIMIZERS",
    "ArrayOptimizer",
    "OptionError",
    "Recipe",
    "TRAINING_PARAMS",
    "lr_scheduler_arguments",
    "lr_scheduler_name",
    "optimizer_arguments",
    "optimizer_kwargs",
    "optimizer_name",
    "resolve",
]

#: Every optimizer the fusion engine fuses, by its ``torch.optim`` class name.
OPTIMIZERS: dict[str, type[FusedOptimizer]] = {
    name: getattr(fusion.optim, name) for name in fusion.optim.__all__ if name != "FusedOptimizer"
}

# LambdaLR and MultiplicativeLR take functions, SequentialLR and ChainedScheduler take other
# schedulers: a JSON request or a trial param cannot carry either.
_NOT_FROM_JSON = {"FusedLRScheduler", "LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler"}

#: Every fused LR scheduler whose arguments can come from a request, by its torch class name.
LR_SCHEDULERS: dict[str, type[FusedLRScheduler]] = {
    name: getattr(fusion.lr_scheduler, name) for name in fusion.lr_scheduler.__all__ if name not in _NOT_FROM_JSON
}

#: Trial params that configure training rather than naming an optimizer or scheduler argument.
TRAINING_PARAMS = ("optimizer", "lr_scheduler", "warmup_epochs", "max_norm", "beta1", "beta2")

# Scheduler arguments a request never sets: fusetune steps the schedule itself.
_SCHEDULER_INTERNAL = frozenset({"self", "optimizer", "last_epoch", "verbose"})

_REQUIRED = inspect.Parameter.empty


class OptionError(ValueError):
    """A training setting that cannot be used; ``param`` names it (``"betas"``, ``"optimizer"``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _canonical(kind: str, table: Mapping[str, Any], name: object) -> str:
    if isinstance(name, str):
        if name in table:
            return name
        for known in table:
            if known.lower() == name.lower():
                return known
    raise OptionError(kind, f"unknown {kind} {name!r}; use one of: {', '.join(table)}")


def optimizer_name(name: object) -> str:
    """The ``torch.optim`` name of a fused optimizer (``"sgd"`` -> ``"SGD"``); raises :class:`OptionError`."""
    return _canonical("optimizer", OPTIMIZERS, name)


def lr_scheduler_name(name: object) -> str:
    """The ``torch.optim.lr_scheduler`` name of a fused scheduler; raises :class:`OptionError`."""
    return _canonical("lr_scheduler", LR_SCHEDULERS, name)


def optimizer_arguments(name: str) -> dict[str, Any]:
    """The fused optimizer's constructor arguments after ``params``, with their defaults."""
    return dict(_arguments(OPTIMIZERS[optimizer_name(name)].__init__, ("self", "params")))


def lr_scheduler_arguments(name: str) -> dict[str, Any]:
    """The torch scheduler's constructor arguments, with their defaults (``inspect.Parameter.empty``: required)."""
    return dict(_arguments(LR_SCHEDULERS[lr_scheduler_name(name)].torch_cls.__init__, _SCHEDULER_INTERNAL))


@functools.cache
def _arguments(init: Callable[..., Any], internal: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    # Read once per class: every trial the control plane asks resolves its recipe, and
    # inspect.signature was a fifth of that.
    return tuple((p.name, p.default) for p in inspect.signature(init).parameters.values() if p.name not in internal)


def _member_hparams(name: str) -> tuple[str, ...]:
    cls = OPTIMIZERS[name]
    return (*cls.member_hparams, *cls.pair_hparams)


@dataclass(frozen=True)
class Recipe:
    """How one member trains, resolved from its workload, its study and its params.

    Attributes:
        optimizer: the ``torch.optim`` class name.
        hparams: its per-member hyper-parameters (floats; ``betas`` a pair).
        options: its array-wide arguments (``nesterov``, ``amsgrad``, ``maximize``, ...).
        lr_scheduler: the ``torch.optim.lr_scheduler`` class name, or None.
        lr_scheduler_kwargs: the scheduler's arguments for this member.
        warmup_epochs: epochs of linear warm-up (0: none).
        max_norm: the gradient norm this member is clipped to, or None.
        amp: whether its study or workload asks for CUDA mixed precision (array-wide).
    """

    optimizer: str
    hparams: dict[str, Any]
    options: dict[str, Any]
    lr_scheduler: str | None = None
    lr_scheduler_kwargs: dict[str, Any] | None = None
    warmup_epochs: int = 0
    max_norm: float | None = None
    amp: bool = False

    def array_settings(self) -> dict[str, Any]:
        """What every member of one array must share: they enter the trial's shape signature."""
        return {
            "optimizer": self.optimizer,
            "optimizer_options": dict(self.options),
            "lr_scheduler": self.lr_scheduler,
            "amp": self.amp,
        }

    def torch_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """This member's optimizer as plain torch builds it (unfused)."""
        return getattr(torch.optim, self.optimizer)(params, **self.hparams, **self.options)


def _pair(name: str, value: object) -> tuple[float, float]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise OptionError(name, f"{name} must be a pair of two floats ({name}[0], {name}[1]), got {value!r}")
    return float(value[0]), float(value[1])


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionError(name, f"{name} must be a number, got {value!r}")
    return float(value)


def _layer(
    kind: str, name: str, arguments: Mapping[str, Any], values: dict[str, Any], given: Mapping[str, Any], source: str
) -> None:
    """Apply one source's settings (``source`` says whose) over ``values``, refusing unknown names."""
    for key, value in given.items():
        if key not in arguments:
            takes = ", ".join(arguments) or "nothing"
            raise OptionError(key, f"{kind} {name} has no argument {key!r} ({source}); it takes: {takes}")
        values[key] = value


#: What torch raises for arguments it cannot use (a step of 0 divides by it).
_REJECTED = (TypeError, ValueError, RuntimeError, ArithmeticError)


def _blame(build: Callable[[dict[str, Any]], Any], values: Mapping[str, Any], defaults: Mapping[str, Any], whole: str) -> None:
    """Build with ``values``; when torch rejects them, raise :class:`OptionError` naming the
    argument that alone makes it fail (else ``whole``), with torch's message."""
    try:
        build(dict(values))
        return
    except _REJECTED as exc:
        error = exc
    required = {k: v for k, v in values.items() if defaults.get(k, _REQUIRED) is _REQUIRED}
    optional = {k: d for k, d in defaults.items() if d is not _REQUIRED and k in values}
    culprit = whole
    try:
        build({**optional, **required})
    except _REJECTED:
        culprit = next(iter(required)) if len(required) == 1 else whole
    else:
        for key, value in values.items():
            if key in optional and value != optional[key]:
                try:
                    build({**optional, **required, key: value})
                except _REJECTED:
                    culprit = key
                    break
    raise OptionError(culprit, f"{culprit}: {error}") from error


def _dummy_parameter() -> torch.Tensor:
    return torch.zeros(1, 1, requires_grad=True)


def _check_optimizer(name: str, kwargs: Mapping[str, Any]) -> None:
    """Torch's optimizer, then the fused one, accept ``kwargs`` (each checks its own ranges)."""
    defaults = optimizer_arguments(name)

    fusion.import_torch_dynamo()  # not from inside a caller's frames (see there)

    def build(values: dict[str, Any]) -> None:
        getattr(torch.optim, name)([_dummy_parameter()], **values)
        OPTIMIZERS[name]([_dummy_parameter()], **values)

    _blame(build, kwargs, defaults, "optimizer")


def _check_lr_scheduler(name: str, kwargs: Mapping[str, Any], recipe: Recipe | None) -> None:
    defaults = lr_scheduler_arguments(name)
    torch_cls = LR_SCHEDULERS[name].torch_cls

    def build(values: dict[str, Any]) -> None:
        opt = recipe.torch_optimizer([_dummy_parameter()]) if recipe else torch.optim.SGD([_dummy_parameter()], lr=0.1)
        scheduler = torch_cls(opt, **values)
        # Constructors check little (StepLR takes step_size=0): a step past the first, as the
        # first epoch makes, raises what training would (ZeroDivisionError there).
        opt.step()
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step(0.0)
        else:
            scheduler.step()

    _blame(build, kwargs, defaults, "lr_scheduler")


def check_optimizer_spec(name: str, kwargs: Mapping[str, Any], where: str = "optimizer.kwargs") -> str:
    """A study's optimizer spec (or a workload's optimizer and its ``optimizer_defaults``,
    named by ``where``): its canonical name; raises :class:`OptionError` naming the
    argument (``"optimizer"`` for the name) that torch or the fusion engine rejects."""
    name = optimizer_name(name)
    arguments = optimizer_arguments(name)
    values = dict(kwargs)
    _layer("optimizer", name, arguments, {}, values, where)
    for key in OPTIMIZERS[name].pair_hparams:
        if key in values:
            values[key] = _pair(key, values[key])
    for key in OPTIMIZERS[name].member_hparams:
        if key in values:
            values[key] = _number(key, values[key])
    _check_optimizer(name, values)
    return name


def check_lr_scheduler_spec(name: str, kwargs: Mapping[str, Any], where: str = "lr_scheduler.kwargs") -> str:
    """A study's LR scheduler spec: its canonical name; raises :class:`OptionError`.

    Required arguments may come per trial instead (``step_size`` from the search space), so
    values are checked by torch only when every required argument is here.
    """
    name = lr_scheduler_name(name)
    arguments = lr_scheduler_arguments(name)
    _layer("lr_scheduler", name, arguments, {}, kwargs, where)
    if all(k in kwargs for k, d in arguments.items() if d is _REQUIRED):
        _check_lr_scheduler(name, kwargs, None)
    return name


def resolve(workload: Workload, study: TrainingSpec | None, params: Mapping[str, Any]) -> Recipe:
    """How a trial with ``params`` trains: its params, else its study's settings, else its workload's.

    An optimizer's or scheduler's defaults (the workload's ``optimizer_defaults``, the
    study's ``optimizer.kwargs``) apply when that optimizer or scheduler is the one chosen.
    ``betas`` comes as a pair (param ``betas``) and/or as the floats ``beta1``/``beta2``,
    which replace its elements. A param named like an argument of both the optimizer and
    the scheduler (``eps``) goes to the optimizer.

    Raises:
        OptionError: naming the parameter at fault: an unknown optimizer or scheduler, an
            argument its class does not take, a ``betas`` that is not a pair, a value torch
            rejects, a required scheduler argument nobody set.
    """
    study = study or TrainingSpec()
    chosen = params["optimizer"] if "optimizer" in params else study.optimizer or workload.optimizer
    name = optimizer_name(chosen)
    arguments = optimizer_arguments(name)
    values = dict(arguments)
    if optimizer_name(workload.optimizer) == name:
        _layer("optimizer", name, arguments, values, workload.optimizer_defaults, f"workload {workload.name} optimizer_defaults")
    if study.optimizer is not None and optimizer_name(study.optimizer) == name:
        _layer("optimizer", name, arguments, values, study.optimizer_kwargs, "the study's optimizer.kwargs")
    values.update({k: params[k] for k in arguments if k in params})
    member = _member_hparams(name)
    for key in OPTIMIZERS[name].pair_hparams:
        pair = list(_pair(key, values[key]))
        if key == "betas":  # Optuna suggests floats, not tuples: beta1/beta2 set the elements
            for i, element in enumerate(("beta1", "beta2")):
                if element in params:
                    pair[i] = _number(element, params[element])
        values[key] = tuple(pair)
    for key in OPTIMIZERS[name].member_hparams:
        values[key] = _number(key, values[key])
    _check_optimizer(name, values)
    hparams = {k: v for k, v in values.items() if k in member}
    options = {k: v for k, v in values.items() if k not in member}

    scheduler = params["lr_scheduler"] if "lr_scheduler" in params else study.lr_scheduler or workload.lr_scheduler
    scheduler_kwargs: dict[str, Any] | None = None
    recipe = Recipe(name, hparams, options)
    if scheduler is not None:
        scheduler = lr_scheduler_name(scheduler)
        sched_arguments = lr_scheduler_arguments(scheduler)
        scheduler_kwargs = {k: d for k, d in sched_arguments.items() if d is not _REQUIRED}
        if workload.lr_scheduler is not None and lr_scheduler_name(workload.lr_scheduler) == scheduler:
            _layer("lr_scheduler", scheduler, sched_arguments, scheduler_kwargs, workload.lr_scheduler_defaults,
                   f"workload {workload.name} lr_scheduler_defaults")
        if study.lr_scheduler is not None and lr_scheduler_name(study.lr_scheduler) == scheduler:
            _layer("lr_scheduler", scheduler, sched_arguments, scheduler_kwargs, study.lr_scheduler_kwargs,
                   "the study's lr_scheduler.kwargs")
        scheduler_kwargs.update(
            {k: params[k] for k in sched_arguments if k in params and k not in arguments and k not in TRAINING_PARAMS}
        )
        missing = [k for k, d in sched_arguments.items() if d is _REQUIRED and k not in scheduler_kwargs]
        if missing:
            raise OptionError(
                missing[0],
                f"lr_scheduler {scheduler} needs {missing[0]!r}: set it in the study's lr_scheduler.kwargs or as a trial param",
            )
        _check_lr_scheduler(scheduler, scheduler_kwargs, recipe)

    warmup = params["warmup_epochs"] if "warmup_epochs" in params else (
        study.warmup_epochs if study.warmup_epochs is not None else workload.warmup_epochs
    )
    if isinstance(warmup, float) and warmup.is_integer():
        warmup = int(warmup)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise OptionError("warmup_epochs", f"warmup_epochs must be a whole number of epochs >= 0, got {warmup!r}")

    max_norm = params["max_norm"] if "max_norm" in params else (
        study.max_norm if study.max_norm is not None else workload.max_norm
    )
    if max_norm is not None:
        max_norm = _number("max_norm", max_norm)
        if not max_norm > 0:
            raise OptionError("max_norm", f"max_norm must be > 0 (or unset: no clipping), got {max_norm!r}")

    amp = bool(study.amp if study.amp is not None else workload.amp)
    return Recipe(name, hparams, options, scheduler, scheduler_kwargs, warmup, max_norm, amp)


def optimizer_kwargs(
    workload: Workload, params: Sequence[Mapping[str, Any]], study: TrainingSpec | None = None
) -> dict[str, list[Any]]:
    """The per-member hyper-parameters of B trials, one list of B values per name (the fused
    optimizers' form): each trial's value, else its study's, else its workload's, else torch's."""
    recipes = [resolve(workload, study, p) for p in params]
    return _per_member([r.hparams for r in recipes])


def _per_member(dicts: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    return {key: [d[key] for d in dicts] for key in dicts[0]} if dicts else {}


class ArrayOptimizer:
    """The optimizer side of one fused array: its members' fused optimizer, LR schedules,
    warm-up, gradient clipping and AMP, following the array's membership.

    Schedules step once per epoch, after validation (``ReduceLROnPlateau`` gets each member's
    first objective). Warm-up is a fused ``LinearLR(start_factor=1 / (W + 1),
    total_iters=W)`` stepped before the scheduler, as torch's ``ChainedScheduler`` does; it
    exists once a member with ``W > 0`` is in the array (members without warm-up get
    ``W = 0``: a factor of one). AMP runs only on CUDA devices: elsewhere the array trains
    in float32 and ``amp`` is ignored.

    Raises:
        OptionError: naming ``optimizer`` when members' array-wide settings differ (they
            are in the shape signature, so the control plane never sends such an array).
    """

    def __init__(self, model: fusion.FusedModel, recipes: Sequence[Recipe], device: torch.device) -> None:
        self._check_shared(recipes[0], recipes)
        first = recipes[0]
        self.settings = first.array_settings()
        self.recipes = list(recipes)
        # Each optimizer class takes its own keyword hyper-parameters, not the base's (params, defaults).
        make: Callable[..., FusedOptimizer] = OPTIMIZERS[first.optimizer]
        self.optimizer = make(model.parameters(), **_per_member([r.hparams for r in recipes]), **first.options)
        self._params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.amp = first.amp and device.type == "cuda"
        self.scaler = fusion.amp.GradScaler(len(recipes)) if self.amp else None
        self.warmup: FusedLRScheduler | None = None
        self.scheduler: FusedLRScheduler | None = None
        if any(r.warmup_epochs for r in recipes):
            self.warmup = self._warmup(recipes)
        if first.lr_scheduler is not None:
            self.scheduler = LR_SCHEDULERS[first.lr_scheduler](
                self.optimizer, **_per_member([r.lr_scheduler_kwargs or {} for r in recipes])
            )

    @staticmethod
    def _check_shared(first: Recipe, recipes: Sequence[Recipe]) -> None:
        for recipe in recipes:
            if recipe.array_settings() != first.array_settings():
                raise OptionError(
                    "optimizer",
                    f"members of one array must share their array-wide training settings: "
                    f"{first.array_settings()} vs {recipe.array_settings()}",
                )

    def _warmup(self, recipes: Sequence[Recipe]) -> FusedLRScheduler:
        return fusion.lr_scheduler.LinearLR(
            self.optimizer,
            start_factor=[1.0 / (r.warmup_epochs + 1) for r in recipes],
            end_factor=1.0,
            total_iters=[r.warmup_epochs for r in recipes],
        )

    @property
    def _limits(self) -> list[float] | None:
        limits = [r.max_norm if r.max_norm is not None else math.inf for r in self.recipes]
        return limits if any(math.isfinite(v) for v in limits) else None

    def autocast(self) -> torch.autocast:
        """The forward pass's mixed-precision context (float16 on CUDA)."""
        return torch.autocast("cuda", dtype=torch.float16)

    def step(self, losses: torch.Tensor) -> None:
        """One optimization step of every member from its loss (``Tensor[B]``)."""
        self.optimizer.zero_grad(set_to_none=True)
        limits = self._limits
        if self.scaler is not None:
            self.scaler.scale(losses).sum().backward()
            if limits is not None:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
                fusion.clip_grad_norm_(self._params, limits)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            return
        losses.sum().backward()
        if limits is not None:
            fusion.clip_grad_norm_(self._params, limits)
        self.optimizer.step()

    def end_epoch(self, objectives: Sequence[float]) -> None:
        """Advance every member's schedule by one epoch; ``objectives``: each member's first objective."""
        if self.warmup is not None:
            self.warmup.step()
        if isinstance(self.scheduler, fusion.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(list(objectives))
        elif self.scheduler is not None:
            self.scheduler.step()

    def remove_members(self, indices: Sequence[int]) -> None:
        """Members ``indices`` leave (call with the fused model's ``remove_members``)."""
        drop = set(indices)
        self.optimizer.remove_members(sorted(drop))  # the schedulers follow through its listener
        if self.scaler is not None:
            self.scaler.remove_members(sorted(drop))
        self.recipes = [r for b, r in enumerate(self.recipes) if b not in drop]

    def add_members(self, recipes: Sequence[Recipe]) -> None:
        """New members with fresh state and schedules (call after the fused model's ``add_members``)."""
        self._check_shared(self.recipes[0], recipes)
        self.optimizer.add_members(len(recipes), **_per_member([r.hparams for r in recipes]))
        if self.scaler is not None:
            self.scaler.add_members(len(recipes))
        self.recipes += recipes
        if self.warmup is not None:
            self.warmup.add_members(
                start_factor=[1.0 / (r.warmup_epochs + 1) for r in recipes],
                end_factor=1.0,
                total_iters=[r.warmup_epochs for r in recipes],
            )
        elif any(r.warmup_epochs for r in recipes):
            # The first member with a warm-up: the others get a factor of one from now on.
            self.warmup = self._warmup(self.recipes)
        if self.scheduler is not None:
            self.scheduler.add_members(**_per_member([r.lr_scheduler_kwargs or {} for r in recipes]))

    def member_state(self, b: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Member ``b``'s optimizer state and its schedules' states, for a checkpoint."""
        schedules = {}
        for key, scheduler in (("warmup", self.warmup), ("lr_scheduler", self.scheduler)):
            if scheduler is not None:
                schedules[key] = scheduler.schedulers[b].state_dict()
        return self.optimizer.member_state_dict(b), schedules

    def load_member_state(self, b: int, optimizer: dict[str, Any], schedules: Mapping[str, Any] | None) -> None:
        """Make member ``b`` continue from :meth:`member_state`'s states."""
        # A schedule's initial_lr is kept only where this array has a schedule.
        groups = self.optimizer.param_groups
        hparams = [{k: v for k, v in h.items() if k in g} for h, g in zip(optimizer["hparams"], groups)]
        self.optimizer.load_member_state_dict(b, {**optimizer, "hparams": hparams})
        for key, scheduler in (("warmup", self.warmup), ("lr_scheduler", self.scheduler)):
            if scheduler is not None and schedules and key in schedules:
                scheduler.schedulers[b].load_state_dict(schedules[key])
