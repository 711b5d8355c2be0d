"""Torch functions that vmap runs slowly per member, folded for all members instead.

Inside a batched module's forward, every torch function runs under vmap's batching rules.
A few have none in torch (2.13, CPU): ``F.scaled_dot_product_attention`` (GPT's attention)
and ``torch._weight_norm`` (the ``weight_norm`` parametrization). vmap's fallback for those
runs the function once per member and stacks the results (it warns "There is a performance
drop"), in the backward too. ``F.cross_entropy`` has a rule, but under vmap a mean-reduced
cross-entropy of a language model's logits (``per_member_loss`` of a loss function that
reshapes them first) cost four times the folded computation. :class:`FoldOps`, a torch
function mode active during batched calls and ``per_member_loss``'s vmap, runs them once
for all members: it takes the members' physical tensors from vmap (:mod:`fusion.nn._batched_call`
does the same for fused twins), puts the member axis into an axis the function already
treats per element, calls it one vmap level down, and hands the result back with its member
axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch._C._functorch import _add_batch_dim, _unwrap_batched
from torch.overrides import TorchFunctionMode

from ._vmap import vmap_interpreter


def _members_first(t: torch.Tensor, level: int, b: int) -> torch.Tensor:
    """``t``'s physical tensor with the member axis first (a shared tensor expanded to B)."""
    phys, axis = _unwrap_batched(t, level)
    if axis is None:
        return phys.unsqueeze(0).expand(b, *phys.shape)
    return phys.movedim(axis, 0)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
          *args: Any, **kwargs: Any) -> torch.Tensor:
    """Attention is per element of its leading batch axes: the member axis joins the first."""
    interpreter = vmap_interpreter()
    level, b = interpreter.level(), interpreter.batch_size()
    q, k, v = (_members_first(t, level, b) for t in (query, key, value))
    mask = attn_mask
    if attn_mask is not None:
        phys, axis = _unwrap_batched(attn_mask, level)
        mask = phys
        if axis is not None:
            # One mask per member, broadcast over the member's batch like its own mask.
            phys = phys.movedim(axis, 0)
            mask = phys.reshape(b, *([1] * (query.dim() - attn_mask.dim())), *phys.shape[1:])
    fold = query.dim() >= 3  # [B, N, ..., L, E] -> [B*N, ..., L, E]: the kernels' own rank
    if fold:
        n = q.shape[1]
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        if mask is not None and mask.dim() == q.dim() + 1:
            mask = mask.expand(b, n, *mask.shape[2:]).flatten(0, 1)
    with interpreter.lower():
        out = F.scaled_dot_product_attention(q, k, v, mask, *args, **kwargs)
    if fold:
        out = out.unflatten(0, (b, n))
    return _add_batch_dim(out, 0, level)


def _weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``v * g / ||v||`` with the norm over every axis but ``dim``: the member axis joins ``dim``."""
    interpreter = vmap_interpreter()
    level, b = interpreter.level(), interpreter.batch_size()
    pv, pg = _members_first(v, level, b), _members_first(g, level, b)
    if dim == -1:
        # torch's "no dim": one norm over each member's whole tensor, i.e. per row of [B, -1].
        with interpreter.lower():
            out = torch._weight_norm(pv.reshape(b, -1), pg.reshape(b, 1), 0)
        return _add_batch_dim(out.view(pv.shape), 0, level)
    dim = dim % v.dim()
    # [B, ..., D, ...] -> [B*D, ...]: norms per (member, dim index), torch's own kernel.
    pv, pg = pv.movedim(dim + 1, 1), pg.movedim(dim + 1, 1)
    shape = pv.shape
    with interpreter.lower():
        out = torch._weight_norm(pv.flatten(0, 1), pg.flatten(0, 1), 0)
    return _add_batch_dim(out.unflatten(0, shape[:2]).movedim(1, dim + 1), 0, level)


def _cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                   size_average: Any = None, ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean over each member's non-ignored targets of one cross-entropy over all members' rows."""
    if (weight is not None or size_average is not None or reduce is not None or reduction != "mean"
            or target.is_floating_point() or input.dim() < 2):
        return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    interpreter = vmap_interpreter()
    level, b = interpreter.level(), interpreter.batch_size()
    logits, labels = _members_first(input, level, b), _members_first(target, level, b)
    with interpreter.lower():
        per_row = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), reduction="none",
                                  ignore_index=ignore_index, label_smoothing=label_smoothing)
        valid = (labels.reshape(b, -1) != ignore_index).sum(1)
        loss = per_row.reshape(b, -1).sum(1) / valid  # the counts promote to the loss dtype, exactly
    return _add_batch_dim(loss, 0, level)


_RULES: dict[Callable[..., Any], Callable[..., Any]] = {
    F.scaled_dot_product_attention: _sdpa,
    torch._weight_norm: _weight_norm,
    F.cross_entropy: _cross_entropy,
}


class FoldOps(TorchFunctionMode):
    """Entered inside a vmapped function: the functions in ``_RULES`` called at that vmap level
    run folded; everywhere else (a twin's folded call one level down) everything runs as is."""

    def __enter__(self) -> Self:
        top = torch._C._functorch.peek_interpreter_stack()
        self._level = None if top is None else top.level()
        super().__enter__()
        return self

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        rule = _RULES.get(func)
        if rule is not None and self._level is not None:
            top = torch._C._functorch.peek_interpreter_stack()
            if top is not None and top.level() == self._level:
                return rule(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
