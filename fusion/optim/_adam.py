"""Fused Adam and AdamW, twins of ``torch.optim.Adam``/``AdamW``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ._base import FusedOptimizer, closure_loss, grads_of

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

    @classmethod
    def state_tensors(cls, settings: Mapping[str, Any]) -> int:
        return 3 if settings.get("amsgrad", False) else 2  # the moments, and AMSGrad's maximum

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
            states = []
            for p in params:
                state = self.state[p]
                if not state:
                    self._host_steps().pop(id(p), None)
                    state["step"] = self._new_step(p)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                states.append(state)
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            counts = self._count_steps(params, steps)
            if self._can_batch(params):
                self._step_batched(group, params, states, counts)
            else:
                for p in params:
                    self._step_tensor_math(group, p)
        return loss

    def _step_batched(
        self, group: dict[str, Any], params: list[torch.Tensor], states: list[dict[str, Any]],
        counts: list[tuple[float, ...]],
    ) -> None:
        """torch's Adam over all of the group's parameters at once.

        Each operation is one ``torch._foreach_*`` call for the group, per-member values
        (bias corrections included) broadcast along the member axis, or plain scalars where
        all members agree; with every value and step count shared (one member, say) it is
        torch's fused kernel (as in ``Adam(fused=True)``), one call.
        """
        grads = grads_of(params)
        # Step counts are per member and usually the same tuple for all the group's
        # parameters; parameters whose counts differ (gradients missing at some steps)
        # are updated separately.
        by_steps: dict[int, list[int]] = {}
        for i, c in enumerate(counts):
            by_steps.setdefault(id(c), []).append(i)
        for index in by_steps.values():
            if len(index) < len(params):
                self._update(group, [params[i] for i in index], [grads[i] for i in index],
                             [states[i] for i in index], counts[index[0]])
            else:
                self._update(group, params, grads, states, counts[0])

    def _update(
        self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
        states: list[dict[str, Any]], counts: tuple[float, ...],
    ) -> None:
        lrs, wds, epss = group["lr"], group["weight_decay"], group["eps"]
        betas = group["betas"]
        amsgrad, maximize = group["amsgrad"], group["maximize"]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        maxs = [s["max_exp_avg_sq"] for s in states] if amsgrad else []
        uniform = counts.count(counts[0]) == len(counts) and all(
            v.count(v[0]) == len(v) for v in (lrs, wds, epss, betas)
        )
        if uniform and self._can_use_fused_kernel(params):
            kernel = torch._fused_adamw_ if self._decoupled else torch._fused_adam_
            beta1, beta2 = betas[0]
            # The kernel reads one step count per tensor: every member's is the same.
            kernel(
                params, grads, exp_avgs, exp_avg_sqs, maxs, [s["step"][0] for s in states],
                lr=lrs[0], beta1=beta1, beta2=beta2, weight_decay=wds[0], eps=epss[0],
                amsgrad=amsgrad, maximize=maximize,
            )
            return
        if maximize:
            grads = list(torch._foreach_neg(grads))
        if any(w != 0 for w in wds):
            if self._decoupled:
                decay = [1 - lr * wd for lr, wd in zip(lrs, wds)]
                torch._foreach_mul_(params, self._per_member(group, "1-lr*wd", decay, params))
            else:
                wd = self._per_member(group, "weight_decay", wds, params)
                if isinstance(wd, float):
                    grads = list(torch._foreach_add(grads, params, alpha=wd))
                else:
                    grads = list(torch._foreach_addcmul(grads, params, wd))
        beta1 = [b[0] for b in betas]
        beta2 = [b[1] for b in betas]
        torch._foreach_lerp_(exp_avgs, grads, self._per_member(group, "1-beta1", [1 - b for b in beta1], params))
        torch._foreach_mul_(exp_avg_sqs, self._per_member(group, "beta2", beta2, params))
        keep2 = self._per_member(group, "1-beta2", [1 - b for b in beta2], params)
        if isinstance(keep2, float):
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=keep2)
        else:
            torch._foreach_addcmul_(exp_avg_sqs, grads, torch._foreach_mul(grads, keep2))
        if amsgrad:
            torch._foreach_maximum_(maxs, exp_avg_sqs)
            second = maxs
        else:
            second = exp_avg_sqs
        # Bias corrections in float64 on the host, as torch computes them.
        neg_step_size = [-lr / (1 - b1**s) for lr, b1, s in zip(lrs, beta1, counts)]
        bc2_sqrt = [(1 - b2**s) ** 0.5 for b2, s in zip(beta2, counts)]
        denom = torch._foreach_sqrt(second)
        torch._foreach_div_(denom, self._per_member(group, "bc2_sqrt", bc2_sqrt, params, cache=False))
        torch._foreach_add_(denom, self._per_member(group, "eps", epss, params))
        step = self._per_member(group, "-step_size", neg_step_size, params, cache=False)
        if isinstance(step, float):
            torch._foreach_addcdiv_(params, exp_avgs, denom, value=step)
        else:
            # p += exp_avg / denom * (-step_size), the step size folded into denom.
            torch._foreach_div_(denom, step)
            torch._foreach_addcdiv_(params, exp_avgs, denom)

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
