"""Torch functions that vmap would run once per member, folded for all members instead.

Inside a batched module's forward, every torch function runs under vmap's batching rules.
A few have none in torch (2.13, CPU): ``F.scaled_dot_product_attention`` (GPT's attention)
and ``torch._weight_norm`` (the ``weight_norm`` parametrization). vmap's fallback for those
runs the function once per member and stacks the results (it warns "There is a performance
drop"), in the backward too. :class:`FoldOps`, a torch function mode active during batched
calls, runs them once for all members: it takes the members' physical tensors from vmap
(:mod:`fusion.nn._batched_call` does the same for fused twins), puts the member axis into
an axis the function already treats per element, calls it one vmap level down, and hands
the result back with its member axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch._C._functorch import _add_batch_dim, _unwrap_batched
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
from torch.overrides import TorchFunctionMode

from ._batched_call import in_batched_call


def _members_first(t: torch.Tensor, level: int, b: int) -> torch.Tensor:
    """``t``'s physical tensor with the member axis first (a shared tensor expanded to B)."""
    phys, axis = _unwrap_batched(t, level)
    if axis is None:
        return phys.unsqueeze(0).expand(b, *phys.shape)
    return phys.movedim(axis, 0)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
          *args: Any, **kwargs: Any) -> torch.Tensor:
    """Attention is per element of its leading batch axes: the member axis joins the first."""
    interpreter = retrieve_current_functorch_interpreter()
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
    interpreter = retrieve_current_functorch_interpreter()
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


_RULES: dict[Callable[..., Any], Callable[..., Any]] = {
    F.scaled_dot_product_attention: _sdpa,
    torch._weight_norm: _weight_norm,
}


class FoldOps(TorchFunctionMode):
    """Active during a batched module's forward: the functions in ``_RULES`` run folded."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        rule = _RULES.get(func)
        # Inside a twin's folded call (below the vmap level) everything runs as is.
        if rule is None or not in_batched_call():
            return func(*args, **(kwargs or {}))
        return rule(*args, **(kwargs or {}))
