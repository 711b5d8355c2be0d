"""Fused RMSprop, Adagrad and Adadelta, twins of their ``torch.optim`` namesakes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ._base import FusedOptimizer, closure_loss

Num = float | Sequence[float]


class RMSprop(FusedOptimizer):
    """``torch.optim.RMSprop`` for B members; every numeric setting per member."""

    member_hparams = ("lr", "alpha", "eps", "weight_decay", "momentum")
    nonnegative_hparams = ("lr", "eps", "momentum", "weight_decay", "alpha")

    @classmethod
    def state_tensors(cls, settings: Mapping[str, Any]) -> int:
        # square_avg, the momentum buffer and the centered variant's grad_avg
        return 1 + bool(settings.get("momentum", 0)) + bool(settings.get("centered", False))

    def __init__(
        self,
        params: Iterable[Any],
        lr: Num = 1e-2,
        alpha: Num = 0.99,
        eps: Num = 1e-8,
        weight_decay: Num = 0.0,
        momentum: Num = 0.0,
        centered: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
            centered=centered, maximize=maximize,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimisation step for every member."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            use_momentum = any(m > 0 for m in group["momentum"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = self._new_step(p)
                    state["square_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if use_momentum:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["centered"]:
                        state["grad_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                grad = -p.grad if group["maximize"] else p.grad
                state["step"].add_(1)
                if any(w != 0 for w in group["weight_decay"]):
                    grad = grad + self._hp(group["weight_decay"], p) * p
                alpha = group["alpha"]
                one_minus = self._hp([1 - a for a in alpha], p)
                square_avg = state["square_avg"]
                square_avg.mul_(self._hp(alpha, p)).addcmul_(grad, grad * one_minus)
                if group["centered"]:
                    grad_avg = state["grad_avg"]
                    grad_avg.lerp_(grad, one_minus)
                    avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
                else:
                    avg = square_avg.sqrt()
                avg = avg.add_(self._hp(group["eps"], p))
                neg_lr = self._hp([-lr for lr in group["lr"]], p)
                if "momentum_buffer" in state:
                    # A member with momentum 0 gets buf = grad/avg: the plain update.
                    buf = state["momentum_buffer"]
                    buf.mul_(self._hp(group["momentum"], p)).add_(grad / avg)
                    p.add_(buf * neg_lr)
                else:
                    p.add_(grad / avg * neg_lr)
        return loss


class Adagrad(FusedOptimizer):
    """``torch.optim.Adagrad`` for B members; every numeric setting per member."""

    member_hparams = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")
    nonnegative_hparams = member_hparams

    @classmethod
    def state_tensors(cls, settings: Mapping[str, Any]) -> int:
        return 1  # sum

    def __init__(
        self,
        params: Iterable[Any],
        lr: Num = 1e-2,
        lr_decay: Num = 0.0,
        weight_decay: Num = 0.0,
        initial_accumulator_value: Num = 0.0,
        eps: Num = 1e-10,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value, eps=eps, maximize=maximize,
        )
        super().__init__(params, defaults)
        # torch creates the accumulator at construction, filled per member here.
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["step"] = self._new_step(p)
                init = self._hp(group["initial_accumulator_value"], p)
                state["sum"] = (torch.zeros_like(p, memory_format=torch.preserve_format) + init)

    def _fresh_state(self, key: str, value: torch.Tensor, count: int, new: dict[str, list[Any]]) -> torch.Tensor:
        fresh = super()._fresh_state(key, value, count, new)
        if key == "sum":
            fresh += torch.tensor(new["initial_accumulator_value"], dtype=value.dtype, device=value.device).view(
                -1, *([1] * (value.dim() - 1))
            )
        return fresh

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimisation step for every member."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"].add_(1)
                steps = state["step"].tolist()
                grad = -p.grad if group["maximize"] else p.grad
                if any(w != 0 for w in group["weight_decay"]):
                    grad = grad + self._hp(group["weight_decay"], p) * p
                clr = [lr / (1 + (s - 1) * d) for lr, d, s in zip(group["lr"], group["lr_decay"], steps)]
                state["sum"].addcmul_(grad, grad, value=1)
                std = state["sum"].sqrt().add_(self._hp(group["eps"], p))
                p.add_(grad / std * self._hp([-c for c in clr], p))
        return loss


class Adadelta(FusedOptimizer):
    """``torch.optim.Adadelta`` for B members; every numeric setting per member."""

    member_hparams = ("lr", "rho", "eps", "weight_decay")
    nonnegative_hparams = ("lr", "eps", "weight_decay")

    @classmethod
    def state_tensors(cls, settings: Mapping[str, Any]) -> int:
        return 2  # square_avg, acc_delta

    def __init__(
        self,
        params: Iterable[Any],
        lr: Num = 1.0,
        rho: Num = 0.9,
        eps: Num = 1e-6,
        weight_decay: Num = 0.0,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        for v in group["rho"]:
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"Invalid rho value: {v}")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimisation step for every member."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = self._new_step(p)
                    state["square_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["acc_delta"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"].add_(1)
                grad = -p.grad if group["maximize"] else p.grad
                if any(w != 0 for w in group["weight_decay"]):
                    grad = grad + self._hp(group["weight_decay"], p) * p
                rho = self._hp(group["rho"], p)
                one_minus = self._hp([1 - r for r in group["rho"]], p)
                eps = self._hp(group["eps"], p)
                square_avg, acc_delta = state["square_avg"], state["acc_delta"]
                square_avg.mul_(rho).addcmul_(grad, grad * one_minus)
                std = square_avg.add(eps).sqrt_()
                delta = acc_delta.add(eps).sqrt_().div_(std).mul_(grad)
                acc_delta.mul_(rho).addcmul_(delta, delta * one_minus)
                p.add_(delta * self._hp([-lr for lr in group["lr"]], p))
        return loss
