"""Fused Adam and AdamW, twins of ``torch.optim.Adam``/``AdamW``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ._base import FusedOptimizer, closure_loss

Num = float | Sequence[float]
Betas = tuple[float, float] | Sequence[tuple[float, float]]


class Adam(FusedOptimizer):
    """``torch.optim.Adam`` for B members at once.

    ``lr``, ``eps``, ``weight_decay`` are scalars or length-B sequences;
    ``betas`` is a pair or a sequence of B pairs. Step counters are per member
    so that bias correction stays exact for members added later.
    """

    member_hparams = ("lr", "eps", "weight_decay")
    nonnegative_hparams = member_hparams
    pair_hparams = ("betas",)
    _decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: Num = 1e-3,
        betas: Betas = (0.9, 0.999),
        eps: Num = 1e-8,
        weight_decay: Num = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        for b1, b2 in group["betas"]:
            if not 0.0 <= b1 < 1.0 or not 0.0 <= b2 < 1.0:
                raise ValueError(f"Invalid beta parameters: {(b1, b2)}")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimisation step for every member."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = self._new_step(p)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"].add_(1)
            if self._can_use_fused_kernel(params):
                self._step_fused_kernel(group, params)
            else:
                for p in params:
                    self._step_tensor_math(group, p)
        return loss

    def _step_fused_kernel(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """One call of torch's fused Adam kernel per member, over that member's slices.

        torch.optim.Adam(fused=True) runs the same kernel; calling it once per
        member with that member's scalars keeps every hyper-parameter per member
        while reading and writing each tensor once.
        """
        kernel = torch._fused_adamw_ if self._decoupled else torch._fused_adam_
        states = [self.state[p] for p in params]
        p_m = self._member_views(params, persistent=True)
        g_m = self._member_views([p.grad for p in params if p.grad is not None])
        a_m = self._member_views([s["exp_avg"] for s in states], persistent=True)
        q_m = self._member_views([s["exp_avg_sq"] for s in states], persistent=True)
        x_m = self._member_views([s["max_exp_avg_sq"] for s in states], persistent=True) if group["amsgrad"] else None
        s_m = self._member_views([s["step"] for s in states], persistent=True)
        for b in range(self.num_members):
            beta1, beta2 = group["betas"][b]
            kernel(
                p_m[b], g_m[b], a_m[b], q_m[b], x_m[b] if x_m is not None else [], s_m[b],
                lr=group["lr"][b], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"][b],
                eps=group["eps"][b], amsgrad=group["amsgrad"], maximize=group["maximize"],
            )

    def _step_tensor_math(self, group: dict[str, Any], p: torch.Tensor) -> None:
        """torch's single-tensor Adam with per-member values broadcast over the member axis."""
        lrs, wds, epss = group["lr"], group["weight_decay"], group["eps"]
        beta1 = [b[0] for b in group["betas"]]
        beta2 = [b[1] for b in group["betas"]]
        state = self.state[p]
        grad = p.grad
        assert grad is not None  # callers pass parameters with gradients only
        grad = -grad if group["maximize"] else grad
        steps = state["step"].tolist()
        if any(w != 0 for w in wds):
            if self._decoupled:
                p.mul_(self._hp([1 - lr * wd for lr, wd in zip(lrs, wds)], p))
            else:
                grad = grad + self._hp(wds, p) * p
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, self._hp([1 - b for b in beta1], p))
        exp_avg_sq.mul_(self._hp(beta2, p)).addcmul_(grad, grad * self._hp([1 - b for b in beta2], p))
        # Bias corrections in float64 on the host, as torch computes them.
        step_size = [lr / (1 - b1**s) for lr, b1, s in zip(lrs, beta1, steps)]
        bc2_sqrt = [math.sqrt(1 - b2**s) for b2, s in zip(beta2, steps)]
        if group["amsgrad"]:
            torch.maximum(state["max_exp_avg_sq"], exp_avg_sq, out=state["max_exp_avg_sq"])
            second = state["max_exp_avg_sq"]
        else:
            second = exp_avg_sq
        denom = (second.sqrt() / self._hp(bc2_sqrt, p, cache=False)).add_(self._hp(epss, p))
        p.add_(exp_avg / denom * self._hp([-s for s in step_size], p, cache=False))


class AdamW(Adam):
    """``torch.optim.AdamW`` (decoupled weight decay) for B members at once."""

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: Num = 1e-3,
        betas: Betas = (0.9, 0.999),
        eps: Num = 1e-8,
        weight_decay: Num = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize,
        )
