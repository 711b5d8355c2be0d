"""Per-member learning-rate schedulers, twins of ``torch.optim.lr_scheduler``.

Each fused scheduler drives B real torch schedulers, one per member, each on a
small stand-in optimizer holding that member's hyper-parameters. The fused
optimizer's per-member lists are copied to the stand-ins before a step and
back after it, so every member follows torch's own schedule code exactly
(including chainable forms, OneCycleLR's momentum cycling and
ReduceLROnPlateau's per-member patience), with no re-implementation to drift.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer
from torch.optim import lr_scheduler as _torch_sched

from .._errors import FusionError
from ..optim._base import FusedOptimizer


class _MemberOptimizer(Optimizer):
    """Stand-in for member b's own optimizer: holds only its hyper-parameters.

    torch schedulers read and write ``param_groups`` and ``defaults``; the
    stand-in has one empty tensor per group so torch accepts it. Its ``step``
    does nothing -- the fused optimizer does the real work.
    """

    def __init__(self, fused: FusedOptimizer, b: int) -> None:
        groups = []
        for group in fused.param_groups:
            groups.append({"params": [torch.zeros(0)], **_member_values(fused, group, b)})
        defaults = {k: v for k, v in fused.defaults.items()}
        for key in fused.member_hparams + fused.pair_hparams:
            defaults[key] = groups[0][key]
        super().__init__(groups, defaults)

    def step(self, closure: Any = None) -> Any:  # noqa: D102 - nothing to optimise
        return None


def _member_keys(fused: FusedOptimizer, group: dict[str, Any]) -> list[str]:
    keys = list(fused.member_hparams) + list(fused.pair_hparams)
    if "initial_lr" in group:
        keys.append("initial_lr")
    return keys


def _member_values(fused: FusedOptimizer, group: dict[str, Any], b: int) -> dict[str, Any]:
    return {k: group[k][b] for k in _member_keys(fused, group)}


def _member_views(fused: FusedOptimizer) -> list[_MemberOptimizer]:
    views: list[_MemberOptimizer] = fused.__dict__.setdefault("_scheduler_views", [])
    while len(views) < fused.num_members:
        views.append(_MemberOptimizer(fused, len(views)))
    return views


def _push(fused: FusedOptimizer, views: Sequence[Optimizer]) -> None:
    """Fused per-member lists -> stand-ins (the user may have edited them)."""
    for b, view in enumerate(views):
        for group, vgroup in zip(fused.param_groups, view.param_groups):
            for key in _member_keys(fused, group):
                vgroup[key] = group[key][b]


def _pull(fused: FusedOptimizer, views: Sequence[Optimizer]) -> None:
    """Stand-ins -> fused per-member lists, after a scheduler changed them."""
    for b, view in enumerate(views):
        for group, vgroup in zip(fused.param_groups, view.param_groups):
            for key in list(fused.member_hparams) + list(fused.pair_hparams) + ["initial_lr"]:
                if key not in vgroup:
                    continue
                if key not in group:
                    group[key] = [vgroup[key]] * fused.num_members
                value = vgroup[key]
                group[key][b] = tuple(value) if key in fused.pair_hparams else value
    # Nothing to invalidate: the optimizer's hyper-parameter tensors are checked
    # against the group's current values at every step.


class FusedLRScheduler:
    """B torch schedulers of one type, one per member of a fused optimizer.

    Constructor arguments are those of the torch twin; each may be a single
    value (shared) or a sequence of length B (one per member). Arguments that
    are lists in torch (``milestones``) are per member when given as a list
    of B lists.
    """

    torch_cls: ClassVar[type[_torch_sched.LRScheduler]]
    #: Arguments whose torch value is already a sequence.
    sequence_args: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, optimizer: FusedOptimizer, *args: Any, **kwargs: Any) -> None:
        if not isinstance(optimizer, FusedOptimizer):
            raise FusionError(
                f"{type(self).__name__} needs a fusion.optim optimizer, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        b = optimizer.num_members
        views = _member_views(optimizer)
        _push(optimizer, views)
        arguments = self._bind(args, kwargs)
        per_member = [self._split(arguments, b, i) for i in range(b)]
        self._member_args = per_member
        self.schedulers = [self._make(views[i], per_member[i]) for i in range(b)]
        _pull(optimizer, views)
        optimizer.add_membership_listener(self._select_members)

    # ------------------------------------------------------------------ helpers
    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Torch constructor arguments after the optimizer, by name."""
        bound = inspect.signature(self.torch_cls.__init__).bind(None, None, *args, **kwargs)
        arguments = dict(bound.arguments)
        arguments.pop("self", None)
        arguments.pop("optimizer", None)
        return arguments

    def _split(self, arguments: dict[str, Any], b: int, i: int) -> dict[str, Any]:
        out = {}
        for name, value in arguments.items():
            out[name] = self._member_arg(name, value, b, i)
        return out

    def _member_arg(self, name: str, value: Any, b: int, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            value = value.tolist()
        if not isinstance(value, (list, tuple)) or isinstance(value, str):
            return value
        if name in self.sequence_args:
            if value and all(isinstance(v, (list, tuple)) for v in value):
                if len(value) != b:
                    raise ValueError(f"{name}: expected {b} per-member sequences, got {len(value)}")
                return list(value[i])
            return list(value)
        if len(value) != b:
            raise ValueError(
                f"{name}: expected a single value or a sequence of length {b} (one per member), "
                f"got length {len(value)}"
            )
        return value[i]

    def _make(self, view: Optimizer, arguments: dict[str, Any]) -> Any:
        return self.torch_cls(view, **arguments)

    def _views(self) -> list[_MemberOptimizer]:
        views = _member_views(self.optimizer)
        if len(self.schedulers) != self.optimizer.num_members:
            raise FusionError(
                f"{type(self).__name__} has {len(self.schedulers)} members but the optimizer has "
                f"{self.optimizer.num_members}; call add_members on the scheduler too"
            )
        return views

    def _select_members(self, keep: list[int]) -> None:
        self.schedulers = [self.schedulers[i] for i in keep]
        self._member_args = [self._member_args[i] for i in keep]

    # ------------------------------------------------------------------ public
    def step(self) -> None:
        """Advance every member's schedule by one step (epoch)."""
        views = self._views()
        _push(self.optimizer, views)
        for view, sched in zip(views, self.schedulers):
            view.step()  # marks "optimizer stepped" for torch's ordering check
            sched.step()
        _pull(self.optimizer, views)

    def add_members(self, *args: Any, **kwargs: Any) -> None:
        """Start schedules for members added to the optimizer since construction.

        Arguments are the constructor's (without the optimizer), shared or
        one per new member.
        """
        views = _member_views(self.optimizer)
        start = len(self.schedulers)
        count = self.optimizer.num_members - start
        if count < 1:
            raise FusionError("the optimizer has no new members; call optimizer.add_members first")
        _push(self.optimizer, views)
        arguments = self._bind(args, kwargs)
        for i in range(count):
            member_args = self._split(arguments, count, i)
            self._member_args.append(member_args)
            self.schedulers.append(self._make(views[start + i], member_args))
        _pull(self.optimizer, views)

    def get_last_lr(self) -> list[list[float]]:
        """Last learning rates: one list of B values per param group."""
        per_member = [s.get_last_lr() for s in self.schedulers]
        return [[float(m[g]) for m in per_member] for g in range(len(self.optimizer.param_groups))]

    @property
    def last_epoch(self) -> list[int]:
        """Epoch counter of each member."""
        return [s.last_epoch for s in self.schedulers]

    def state_dict(self) -> dict[str, Any]:
        """State of every member's scheduler."""
        return {"members": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore member schedulers saved by :meth:`state_dict`."""
        states = state_dict["members"]
        if len(states) != len(self.schedulers):
            raise FusionError(f"state has {len(states)} members, scheduler has {len(self.schedulers)}")
        for s, st in zip(self.schedulers, states):
            s.load_state_dict(st)


def _twin(torch_cls: type[_torch_sched.LRScheduler], sequence_args: frozenset[str] = frozenset()) -> type[FusedLRScheduler]:
    doc = (
        f"Per-member ``torch.optim.lr_scheduler.{torch_cls.__name__}``: same arguments, each a "
        "single value or a sequence of length B."
    )
    return type(
        torch_cls.__name__,
        (FusedLRScheduler,),
        {"torch_cls": torch_cls, "sequence_args": sequence_args, "__doc__": doc, "__module__": __name__},
    )


StepLR = _twin(_torch_sched.StepLR)
MultiStepLR = _twin(_torch_sched.MultiStepLR, frozenset({"milestones"}))
ConstantLR = _twin(_torch_sched.ConstantLR)
LinearLR = _twin(_torch_sched.LinearLR)
ExponentialLR = _twin(_torch_sched.ExponentialLR)
PolynomialLR = _twin(_torch_sched.PolynomialLR)
CosineAnnealingLR = _twin(_torch_sched.CosineAnnealingLR)
CosineAnnealingWarmRestarts = _twin(_torch_sched.CosineAnnealingWarmRestarts)
CyclicLR = _twin(_torch_sched.CyclicLR)
OneCycleLR = _twin(_torch_sched.OneCycleLR)
LambdaLR = _twin(_torch_sched.LambdaLR)
MultiplicativeLR = _twin(_torch_sched.MultiplicativeLR)


class ReduceLROnPlateau(_twin(_torch_sched.ReduceLROnPlateau)):  # type: ignore[misc]
    """Per-member ``ReduceLROnPlateau``: ``step`` takes one metric per member."""

    def step(self, metrics: Sequence[float] | torch.Tensor) -> None:
        """Feed each member its own metric (a sequence or ``Tensor[B]``)."""
        values = metrics.tolist() if isinstance(metrics, torch.Tensor) else list(metrics)
        views = self._views()
        if len(values) != len(self.schedulers):
            raise ValueError(f"metrics: expected {len(self.schedulers)} values, got {len(values)}")
        _push(self.optimizer, views)
        for view, sched, value in zip(views, self.schedulers, values):
            view.step()
            sched.step(value)
        _pull(self.optimizer, views)


class _Composite(FusedLRScheduler):
    """Schedulers built from other fused schedulers (SequentialLR, ChainedScheduler)."""

    sequence_args = frozenset({"milestones"})

    def _member_arg(self, name: str, value: Any, b: int, i: int) -> Any:
        if name == "schedulers":
            for s in value:
                if not isinstance(s, FusedLRScheduler):
                    raise FusionError(f"{type(self).__name__} chains fusion.lr_scheduler schedulers only")
                if s.optimizer is not self.optimizer:
                    raise FusionError(f"{type(self).__name__}: all schedulers must share the optimizer")
            return [s.schedulers[i] for s in value]
        return super()._member_arg(name, value, b, i)

    def add_members(self, *args: Any, **kwargs: Any) -> None:
        raise FusionError(
            f"{type(self).__name__} cannot add members; rebuild it from schedulers that have them"
        )


class SequentialLR(_Composite):
    """Per-member ``torch.optim.lr_scheduler.SequentialLR`` over fused schedulers."""

    torch_cls = _torch_sched.SequentialLR


class ChainedScheduler(_Composite):
    """Per-member ``torch.optim.lr_scheduler.ChainedScheduler`` over fused schedulers."""

    torch_cls = _torch_sched.ChainedScheduler

    def __init__(
        self, schedulers: Sequence[FusedLRScheduler], optimizer: FusedOptimizer | None = None
    ) -> None:
        super().__init__(optimizer if optimizer is not None else schedulers[0].optimizer, list(schedulers))

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        # torch's signature is (schedulers, optimizer=None), unlike every other scheduler.
        return {"schedulers": args[0]}

    def _make(self, view: Optimizer, arguments: dict[str, Any]) -> Any:
        return self.torch_cls(arguments["schedulers"], optimizer=view)


__all__ = [
    "ChainedScheduler",
    "ConstantLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "CyclicLR",
    "ExponentialLR",
    "FusedLRScheduler",
    "LambdaLR",
    "LinearLR",
    "MultiStepLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "PolynomialLR",
    "ReduceLROnPlateau",
    "SequentialLR",
    "StepLR",
]
