"""Input broadcasting, per-member losses and per-member gradient clipping."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, overload

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from ._errors import FusionError
from .nn._batched_ops import FoldOps

LossFn = Callable[..., torch.Tensor]
_Batch = TypeVar("_Batch")


@overload
def broadcast(x: torch.Tensor, num_members: int) -> torch.Tensor: ...


@overload
def broadcast(x: _Batch, num_members: int) -> _Batch: ...


def broadcast(x: Any, num_members: int) -> Any:
    """Share one input ``[N, ...]`` with all members: returns ``[B, N, ...]`` (a view).

    ``x`` may also be a tuple, list or dict of tensors (a batch as a ``DataLoader`` collates
    it): every tensor in it is broadcast, anything else is kept as it is.
    """
    if num_members < 1:
        raise FusionError(f"num_members must be >= 1, got {num_members}")
    if isinstance(x, torch.Tensor):
        return x.unsqueeze(0).expand(num_members, *x.shape)
    if type(x) is tuple and all(isinstance(t, torch.Tensor) for t in x):  # (x, y): 3x faster than the tree map
        return tuple(t.unsqueeze(0).expand(num_members, *t.shape) for t in x)
    return pytree.tree_map_only(torch.Tensor, lambda t: t.unsqueeze(0).expand(num_members, *t.shape), x)


def _mean_reduced_cross_entropy(loss_fn: Any) -> dict[str, Any] | None:
    """Keyword arguments of ``F.cross_entropy`` if ``loss_fn`` is a plain one."""
    if loss_fn is F.cross_entropy:
        return {}
    if type(loss_fn) is nn.CrossEntropyLoss and loss_fn.reduction == "mean" and loss_fn.weight is None:
        return {"ignore_index": loss_fn.ignore_index, "label_smoothing": loss_fn.label_smoothing}
    return None


def _members_of(tree: Any, name: str) -> int:
    """How many members the tensors of ``tree`` hold (their first axis, which they share)."""
    sizes = {t.shape[0] for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)}
    if len(sizes) != 1:
        raise FusionError(f"the tensors of {name} must share one member axis, got sizes {sorted(sizes)}")
    return sizes.pop()


def _member(tree: Any, b: int) -> Any:
    """Member ``b``'s part of ``tree``: ``t[b]`` of every tensor in it."""
    return tree[b] if isinstance(tree, torch.Tensor) else pytree.tree_map_only(torch.Tensor, lambda t: t[b], tree)


def per_member_loss(loss_fn: LossFn | Sequence[LossFn], out: Any, target: Any) -> torch.Tensor:
    """Loss of each member: ``Tensor[B]`` with ``losses[b] == loss_fn(out[b], target[b])``.

    ``loss_fn`` is an ordinary mean-reduced torch loss (module or function),
    or a sequence of B of them for per-member settings such as label
    smoothing. Summing the result and calling ``backward`` gives every member
    exactly the gradients of separate training (members share no parameters,
    so the sum's gradient splits per member).

    ``out`` and ``target`` are ``[B, ...]`` tensors, or tuples, lists or dicts of them (a
    model's several outputs; a loss that reads more of the batch than its labels, such as a
    padding mask, or the whole batch broadcast): member b's are every tensor's ``[b]``, in
    the same structure.
    """
    tensors = isinstance(out, torch.Tensor) and isinstance(target, torch.Tensor)
    b, members = (out.shape[0], target.shape[0]) if tensors else (_members_of(out, "out"), _members_of(target, "target"))
    if members != b:
        raise FusionError(f"out has {b} members but target has {members}")
    if isinstance(loss_fn, Sequence):
        if len(loss_fn) != b:
            raise ValueError(f"loss_fn: expected {b} loss functions, got {len(loss_fn)}")
        return torch.stack([fn(_member(out, i), _member(target, i)) for i, fn in enumerate(loss_fn)])
    if b == 1:
        # One member: its loss exactly as computed separately (squeeze, not [0]: a view whose
        # backward is a view too).
        one = pytree.tree_map_only(torch.Tensor, lambda t: t.squeeze(0), (out, target))
        return loss_fn(*one).unsqueeze(0)
    if not tensors:
        return _vmapped(loss_fn, out, target, b)
    ce = _mean_reduced_cross_entropy(loss_fn)
    if ce is not None and not target.is_floating_point() and out.dim() == target.dim() + 1 >= 3:
        # Fast path for class-index targets ([B, N, C, *d] vs [B, N, *d]): one
        # kernel for all members, then torch's "mean over non-ignored targets"
        # per member.
        n = out.shape[1]
        flat_target = target.reshape(b * n, *target.shape[2:])  # a copy when broadcast: made once
        per_elem = F.cross_entropy(
            out.reshape(b * n, *out.shape[2:]), flat_target, reduction="none", **ce,
        ).view(b, -1)
        valid = (flat_target.reshape(b, -1) != ce.get("ignore_index", -100)).sum(1)
        return per_elem.sum(1) / valid  # the counts promote to the loss dtype, exactly
    return _vmapped(loss_fn, out, target, b)


def _vmapped(loss_fn: LossFn, out: Any, target: Any, b: int) -> torch.Tensor:
    """Every member's loss in one call under vmap, else (a loss vmap cannot run) one call each."""
    try:
        return torch.func.vmap(_with_folded_ops(loss_fn))(out, target)
    except Exception:
        return torch.stack([loss_fn(_member(out, i), _member(target, i)) for i in range(b)])


def _with_folded_ops(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` with the functions vmap runs slowly folded for all members (cross-entropy)."""

    def folded(out: Any, target: Any) -> torch.Tensor:
        with FoldOps():
            return loss_fn(out, target)

    return folded


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float | Sequence[float],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Per-member ``torch.nn.utils.clip_grad_norm_`` for fused parameters.

    Each member's gradients (slice ``[b]`` of every parameter) are clipped to
    that member's ``max_norm`` (scalar or length-B sequence). Returns the
    members' total norms before clipping, ``Tensor[B]``.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(0)
    b = grads[0].shape[0]
    limits = _per_member("max_norm", max_norm, b)
    norm_type = float(norm_type)
    per_param = torch.stack(
        [torch.linalg.vector_norm(g.reshape(b, -1), norm_type, dim=1) for g in grads]
    )
    total = torch.linalg.vector_norm(per_param, norm_type, dim=0)
    if error_if_nonfinite and not torch.isfinite(total).all():
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients of members "
            f"{torch.nonzero(~torch.isfinite(total)).flatten().tolist()} is non-finite"
        )
    limit_t = torch.tensor(limits, dtype=total.dtype, device=total.device)
    coef = torch.clamp(limit_t / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.view(b, *([1] * (g.dim() - 1))).to(g.dtype))
    return total


def _per_member(name: str, value: Any, b: int) -> list[Any]:
    """Expand a scalar to B values or check a sequence has length B."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        if len(value) != b:
            raise ValueError(f"{name}: expected a scalar or a sequence of length {b}, got length {len(value)}")
        return list(value)
    return [value] * b
