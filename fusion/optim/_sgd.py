"""Fused SGD, the twin of ``torch.optim.SGD`` with per-member hyper-parameters."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ._base import FusedOptimizer

Num = float | Sequence[float]


class SGD(FusedOptimizer):
    """``torch.optim.SGD`` for B members at once.

    ``lr``, ``momentum``, ``dampening`` and ``weight_decay`` are scalars or
    length-B sequences. Member ``b`` follows exactly the update of a separate
    ``torch.optim.SGD`` (its momentum buffer starts as its first gradient,
    also for members added later; members with momentum 0 use the raw gradient).
    """

    member_hparams = ("lr", "momentum", "dampening", "weight_decay")

    def __init__(
        self,
        params: Iterable[Any],
        lr: Num = 1e-3,
        momentum: Num = 0.0,
        dampening: Num = 0.0,
        weight_decay: Num = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        for key in ("lr", "momentum", "weight_decay"):
            for v in group[key]:
                if v < 0.0:
                    raise ValueError(f"Invalid {key} value: {v}")
        if group["nesterov"]:
            for m, d in zip(group["momentum"], group["dampening"]):
                if m <= 0 or d != 0:
                    raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimisation step for every member."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            momenta = group["momentum"]
            use_momentum = any(m != 0 for m in momenta)
            mixed_momentum = use_momentum and any(m == 0 for m in momenta)
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                if any(w != 0 for w in group["weight_decay"]):
                    grad = grad + self._hp(group["weight_decay"], p) * p
                if use_momentum:
                    state = self.state[p]
                    m_t = self._hp(momenta, p)
                    buf = state.get("momentum_buffer")
                    steps = state.get("member_steps")
                    if buf is None or steps is None:
                        buf = grad.detach().clone()
                        state["momentum_buffer"] = buf
                        state["member_steps"] = torch.ones(self.num_members)
                    else:
                        updated = buf * m_t + grad * self._hp([1 - d for d in group["dampening"]], p)
                        fresh = steps == 0
                        if bool(fresh.any()):
                            # Members added after the first step start like torch: buf = grad.
                            mask = fresh.to(p.device).view(-1, *([1] * (p.dim() - 1)))
                            updated = torch.where(mask, grad, updated)
                        buf.copy_(updated)
                        steps.add_(1)
                    direction = grad + m_t * buf if group["nesterov"] else buf
                    if mixed_momentum:
                        mask = (m_t == 0)
                        direction = torch.where(mask, grad, direction)
                else:
                    direction = grad
                p.add_(direction * self._hp([-lr for lr in group["lr"]], p))
        return loss
