"""Fused SGD, the twin of ``torch.optim.SGD`` with per-member hyper-parameters."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ._base import FusedOptimizer, closure_loss

Num = float | Sequence[float]


class SGD(FusedOptimizer):
    """``torch.optim.SGD`` for B members at once.

    ``lr``, ``momentum``, ``dampening`` and ``weight_decay`` are scalars or
    length-B sequences. Member ``b`` follows exactly the update of a separate
    ``torch.optim.SGD`` (its momentum buffer starts as its first gradient,
    also for members added later; members with momentum 0 use the raw gradient).
    """

    member_hparams = ("lr", "momentum", "dampening", "weight_decay")
    nonnegative_hparams = ("lr", "momentum", "weight_decay")

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
        super()._validate_group(group)
        if group["nesterov"]:
            for m, d in zip(group["momentum"], group["dampening"]):
                if m <= 0 or d != 0:
                    raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimisation step for every member."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if self._can_use_fused_kernel(params):
                self._step_fused_kernel(group, params)
            else:
                for p in params:
                    self._step_tensor_math(group, p)
        return loss

    def _step_fused_kernel(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """torch's fused SGD kernel (as in SGD(fused=True)), once per member."""
        momenta = group["momentum"]
        use_momentum = any(m != 0 for m in momenta)
        first: list[bool] = [False] * self.num_members
        bufs: list[list[torch.Tensor]] | None = None
        if use_momentum:
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if "momentum_buffer" not in state or "member_steps" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["member_steps"] = torch.zeros(self.num_members)
            # Members share the step counter of every parameter they own; a
            # member is on its first step when its count is zero.
            first = [s == 0 for s in states[0]["member_steps"].tolist()]
            bufs = self._member_views([s["momentum_buffer"] for s in states], persistent=True)
        p_m = self._member_views(params, persistent=True)
        g_m = self._member_views([p.grad for p in params if p.grad is not None])
        for b in range(self.num_members):
            has_momentum = momenta[b] != 0
            torch._fused_sgd_(
                p_m[b], g_m[b], bufs[b] if (bufs is not None and has_momentum) else [],
                weight_decay=group["weight_decay"][b], momentum=momenta[b], lr=group["lr"][b],
                dampening=group["dampening"][b], nesterov=group["nesterov"], maximize=group["maximize"],
                is_first_step=first[b],
            )
        if use_momentum:
            for p in params:
                self.state[p]["member_steps"].add_(1)

    def _step_tensor_math(self, group: dict[str, Any], p: torch.Tensor) -> None:
        """torch's single-tensor SGD with per-member values broadcast over the member axis."""
        momenta = group["momentum"]
        use_momentum = any(m != 0 for m in momenta)
        mixed_momentum = use_momentum and any(m == 0 for m in momenta)
        grad = p.grad
        assert grad is not None  # callers pass parameters with gradients only
        grad = -grad if group["maximize"] else grad
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
                direction = torch.where(m_t == 0, grad, direction)
        else:
            direction = grad
        p.add_(direction * self._hp([-lr for lr in group["lr"]], p))
