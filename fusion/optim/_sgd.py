"""Fused SGD, the twin of ``torch.optim.SGD`` with per-member hyper-parameters."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ._base import FusedOptimizer, closure_loss, grads_of

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

    @classmethod
    def state_tensors(cls, settings: Mapping[str, Any]) -> int:
        return 1 if settings.get("momentum", 0) else 0  # the momentum buffer

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
            if self._can_batch(params):
                self._step_batched(group, params)
            else:
                for p in params:
                    self._step_tensor_math(group, p)
        return loss

    def _step_batched(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """torch's SGD over all of the group's parameters at once.

        Each operation is one ``torch._foreach_*`` call for the group, per-member values
        broadcast along the member axis (or plain scalars where all members agree); with
        every value shared (one member, say) it is torch's fused kernel, one call.
        """
        lrs, wds, momenta, damps = group["lr"], group["weight_decay"], group["momentum"], group["dampening"]
        use_momentum = any(m != 0 for m in momenta)
        grads = grads_of(params)
        states = [self.state[p] for p in params] if use_momentum else []
        # Per parameter: no momentum state yet (every member on its first step), or
        # state whose rows of some members are on their first step (members added or
        # loaded since): ``fresh`` holds those rows.
        new = [("momentum_buffer" not in s or "member_steps" not in s) for s in states]
        fresh: list[tuple[int, torch.Tensor]] = []
        settled = self._settled()
        calm: list[int] = []  # parameters with every member past its first step
        for i, (p, state) in enumerate(zip(params, states)):
            if new[i]:
                continue
            counter = state["member_steps"]
            entry = settled.get(id(p))
            if entry is None or entry[0] is not counter or entry[1] != counter._version:
                zero = counter == 0
                if bool(zero.any()):
                    fresh.append((i, zero.nonzero().flatten().to(p.device)))
                    continue
            calm.append(i)
        uniform = all(v.count(v[0]) == len(v) for v in (lrs, wds, momenta, damps))
        if (
            uniform and not fresh and (all(new) or not any(new))
            and self._can_use_fused_kernel(params)
        ):
            bufs: list[torch.Tensor] = []
            if use_momentum:
                for p, state, is_new in zip(params, states, new):
                    if is_new:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["member_steps"] = torch.zeros(self.num_members)
                bufs = [s["momentum_buffer"] for s in states]
            torch._fused_sgd_(
                params, grads, bufs, weight_decay=wds[0], momentum=momenta[0], lr=lrs[0],
                dampening=damps[0], nesterov=group["nesterov"], maximize=group["maximize"],
                is_first_step=bool(new) and new[0],
            )
        else:
            self._step_foreach(group, params, grads, states, new, fresh)
        if use_momentum:
            counters = [s["member_steps"] for s in states]
            torch._foreach_add_(counters, 1)
            for i in calm:
                settled[id(params[i])] = (counters[i], counters[i]._version)

    def _step_foreach(
        self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
        states: list[dict[str, Any]], new: list[bool], fresh: list[tuple[int, torch.Tensor]],
    ) -> None:
        """torch's ``g' = ±g + wd*p``, ``buf = m*buf + (1-d)*g'`` and ``p -= lr*buf`` (``lr*(g' +
        m*buf)`` with Nesterov, ``lr*g'`` without momentum), in torch's order of operations.

        Members without momentum keep ``buf = g'`` (their rows are zeroed first and their
        dampening does not apply), which is their plain update; rows of members on their
        first step get ``buf = g'``, as in torch.
        """
        lrs, wds, momenta = group["lr"], group["weight_decay"], group["momentum"]
        pm = self._per_member
        owned = False  # whether ``grads`` are this step's temporaries (else the .grad tensors)
        if group["maximize"]:
            grads = list(torch._foreach_neg(grads))
            owned = True
        if any(w != 0 for w in wds):
            grads = _plus_scaled(grads, params, pm(group, "weight_decay", wds, params), in_place=owned)
            owned = True
        neg_lr = pm(group, "-lr", [-lr for lr in lrs], params)
        if not states:  # no member has momentum
            _add_scaled(params, grads, neg_lr)
            return
        keep = [1.0 if m == 0 else 1.0 - d for m, d in zip(momenta, group["dampening"])]
        m = pm(group, "momentum", momenta, params)
        old = [i for i, is_new in enumerate(new) if not is_new]
        if old:
            everything = len(old) == len(params)
            bufs = [states[i]["momentum_buffer"] for i in old]
            if any(v == 0 for v in momenta):  # buf = 0*buf + g' must not keep a NaN or inf of buf
                rows = self._zero_momentum_rows(group, bufs[0].device)
                for buf in bufs:
                    buf.index_fill_(0, rows, 0)
            m_old = m if everything else _subset(m, old)
            if keep.count(1.0) == len(keep):
                # buf = g' + m*buf: one pass per tensor (torch: buf.mul_(m).add_(g')).
                if isinstance(m_old, float):
                    for i, buf in zip(old, bufs):
                        torch.add(grads[i], buf, alpha=m_old, out=buf)
                else:
                    for i, buf, mv in zip(old, bufs, m_old):
                        torch.addcmul(grads[i], buf, mv, out=buf)
            else:
                damped = pm(group, "1-dampening", keep, params)
                torch._foreach_mul_(bufs, m_old)
                if everything:
                    _add_scaled(bufs, grads, damped)
                else:
                    _add_scaled(bufs, [grads[i] for i in old], _subset(damped, old))
        for i, rows in fresh:  # members on their first step: buf = g'
            states[i]["momentum_buffer"].index_copy_(0, rows, grads[i].index_select(0, rows))
        for i, is_new in enumerate(new):
            if is_new:  # every member on its first step: buf = g'
                states[i]["momentum_buffer"] = grads[i].detach().clone()
                states[i]["member_steps"] = torch.zeros(self.num_members)
        bufs = [s["momentum_buffer"] for s in states]
        if group["nesterov"]:  # p -= lr*(g' + m*buf)
            _add_scaled(params, _plus_scaled(grads, bufs, m, in_place=owned), neg_lr)
        else:
            _add_scaled(params, bufs, neg_lr)

    def _zero_momentum_rows(self, group: dict[str, Any], device: torch.device) -> torch.Tensor:
        """Indices of the members without momentum (cached while ``group["momentum"]`` is unchanged)."""
        key = (id(group), "momentum==0")
        momenta = tuple(group["momentum"])
        entry = self._hp_cache.get(key)
        if entry is None or entry[0] != momenta or entry[1].device != device:
            rows = torch.tensor([b for b, m in enumerate(momenta) if m == 0], dtype=torch.long, device=device)
            entry = self._hp_cache[key] = (momenta, rows)
        return entry[1]

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


def _add_scaled(out: list[torch.Tensor], tensors: list[torch.Tensor], scale: float | list[torch.Tensor]) -> None:
    """``out[i] += tensors[i] * scale[i]``: one foreach call; ``scale`` a shared float or per-member views."""
    if isinstance(scale, float):
        torch._foreach_add_(out, tensors, alpha=scale)
    else:
        torch._foreach_addcmul_(out, tensors, scale)


def _plus_scaled(
    tensors: list[torch.Tensor], others: list[torch.Tensor], scale: float | list[torch.Tensor], in_place: bool
) -> list[torch.Tensor]:
    """``tensors[i] + others[i] * scale[i]``: in place when ``tensors`` are this step's own
    temporaries, else new tensors (the ``.grad`` tensors are not the optimizer's to change)."""
    if in_place:
        _add_scaled(tensors, others, scale)
        return tensors
    if isinstance(scale, float):
        return list(torch._foreach_add(tensors, others, alpha=scale))
    return list(torch._foreach_addcmul(tensors, others, scale))


def _subset(value: float | list[torch.Tensor], index: list[int]) -> float | list[torch.Tensor]:
    """The entries ``index`` of a per-tensor operand (a shared float stays as it is)."""
    return value if isinstance(value, float) else [value[i] for i in index]
