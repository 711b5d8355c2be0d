"""How a fused layer runs inside the batched functional path.

A :class:`~fusion.nn._batched.BatchedModule` runs its module's own forward once for all
members under ``torch.func.vmap`` (:func:`torch.func.functional_call` with the members'
stacked tensors), so inside it every tensor is one member's: the inputs, the module's own
parameters, and the parameters of the fused twins below it. A twin called there keeps its
speed (:func:`call_folded`): it takes the members' physical tensors from vmap's batched ones,
folds the member axis into its batch axis, runs its ordinary fused forward once for all
members one level below the vmap (so outside it, exactly the computation it makes outside the
batched path), and hands vmap the outputs with their member axis. Where its inputs cannot be
folded (the dry run found no consistent batch axis for them, or an input depends on the
member but has no batch axis), the twin runs as its plain ``torch.nn`` layer under vmap's own
batching rules.

Stepping below the vmap level uses functorch's own primitives for it (the ones torch's
``autograd.Function.vmap`` support is built from): through ``autograd.Function.apply`` a call
cost about 130 us of Python on the 2-vCPU CPU, directly about 10 us, and a small GPT makes 16
such calls per forward.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch._C._functorch import _add_batch_dim, _unwrap_batched
from torch.utils import _pytree as pytree

from .._errors import FusionError
from ._holding import held, hold, holding, slots
from ._vmap import vmap_interpreter

if TYPE_CHECKING:
    from ._base import FusedLayer

_local = threading.local()


def in_batched_call() -> bool:
    """Whether this thread is inside a batched module's vmapped forward."""
    return getattr(_local, "active", False)


@contextmanager
def batched_call(active: bool) -> Iterator[None]:
    """Mark this thread as inside (``True``) or outside (``False``) a batched module's forward."""
    before = getattr(_local, "active", False)
    _local.active = active
    try:
        yield
    finally:
        _local.active = before


@dataclass(frozen=True)
class FoldPlan:
    """How one fused layer's calls inside a batched module fold the member axis (from the dry run).

    Attributes:
        arg_axes: for every leaf of the call's ``(args, kwargs)``, the axis of the unfused
            call's tensor that holds the batch, ``None`` for a tensor without one (or a
            non-tensor).
        out_axes: the same for every leaf of the output.
        new_axis: no input has a batch axis, so each member's call becomes a batch of one on
            a new leading axis (only for layers that treat an unbatched input as a batch of
            one, :attr:`FusedLayer.folds_unbatched`).
    """

    arg_axes: tuple[int | None, ...]
    out_axes: tuple[int | None, ...]
    new_axis: bool = False
    #: The layer's ``batch_dim`` for a folded call: its main input's batch axis.
    batch_dim: int = field(init=False)

    def __post_init__(self) -> None:
        main = 0 if self.new_axis else next(a for a in self.arg_axes if a is not None)
        object.__setattr__(self, "batch_dim", main)


def make_plan(layer: FusedLayer, arg_axes: list[int | None], out_axes: list[int | None],
              is_tensor: list[bool], out_is_tensor: list[bool]) -> FoldPlan | None:
    """The fold plan of ``layer`` for calls with these axes, or ``None`` where it cannot fold."""
    data = [a for a, t in zip(arg_axes, is_tensor) if t]
    outs = [a for a, t in zip(out_axes, out_is_tensor) if t]
    if not data:
        return None
    if all(a is None for a in data):
        if layer.folds_unbatched and len(data) == 1:
            return FoldPlan(tuple(arg_axes), tuple(0 if t else None for t in out_is_tensor), new_axis=True)
        return None
    if any(a is None for a in outs):
        return None
    return FoldPlan(tuple(arg_axes), tuple(out_axes))


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """pytree's flatten of an output, short-cut for a single tensor."""
    if isinstance(tree, torch.Tensor):
        return [tree], None
    return pytree.tree_flatten(tree)


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """pytree's flatten of a call's ``(args, kwargs)``, short-cut for ``layer(tensor, ...)``."""
    if not kwargs and all(isinstance(t, torch.Tensor) for t in args):
        return list(args), len(args)
    return pytree.tree_flatten((args, kwargs))


def unflatten(leaves: list[Any], spec: Any) -> Any:
    """Undo :func:`flatten` or :func:`flatten_call`."""
    if spec is None:
        return leaves[0]
    if isinstance(spec, int):
        return tuple(leaves), {}
    return pytree.tree_unflatten(leaves, spec)


def _run_folded(layer: FusedLayer, plan: FoldPlan, b: int, spec: Any, leaves: list[Any],
                phys: dict[int, tuple[torch.Tensor, int | None]], state: list[torch.Tensor]) -> tuple[list[Any], Any]:
    """Below the vmap level: fold the members' inputs, call the fused layer, unfold its outputs.

    ``state`` holds the layer's stacked tensors (its slots' order). Returns the output leaves
    (tensors as ``(physical, member axis)`` pairs) and the output's spec.
    """
    folded = list(leaves)
    for i, (t, d) in phys.items():
        folded[i] = _fold(t, d, plan.arg_axes[i], b, plan.new_axis)
    args, kwargs = unflatten(folded, spec)
    layer.batch_dim = plan.batch_dim
    places = slots(layer)
    batched = [held(place) for place in places]
    try:
        for place, t in zip(places, state):
            hold(place, t)
        with batched_call(False):
            out = layer(*args, **kwargs)
    finally:
        for place, t in zip(places, batched):
            hold(place, t)
    out_leaves, out_spec = flatten(out)
    if len(out_leaves) != len(plan.out_axes):
        raise FusionError(f"{type(layer).__name__}: called with other outputs than in the dry run")
    for i, leaf in enumerate(out_leaves):
        if isinstance(leaf, torch.Tensor):
            axis = plan.out_axes[i]
            if axis is None:
                raise FusionError(f"{type(layer).__name__}: an output has no batch axis, unlike in the dry run")
            out_leaves[i] = (leaf if plan.new_axis else leaf.unflatten(axis, (b, -1)), axis)
    return out_leaves, out_spec


def _foldable(plan: FoldPlan, phys: dict[int, tuple[torch.Tensor, int | None]]) -> bool:
    """Whether every input can be folded: none depends on the member without a batch axis."""
    return plan.new_axis or all(plan.arg_axes[i] is not None or d is None for i, (_, d) in phys.items())


def _fold(t: torch.Tensor, in_dim: int | None, axis: int | None, b: int, new_axis: bool) -> torch.Tensor:
    """One input of a folded call: the members' physical tensor as the fused layer takes it."""
    if new_axis:
        # Each member's unbatched input becomes that member's batch of one.
        return t.movedim(in_dim, 0) if in_dim is not None else t.unsqueeze(0).expand(b, *t.shape)
    if axis is None:
        return t  # shared by all members and without a batch axis (a mask, a table): as is
    if in_dim is None:
        # The same samples for every member: repeat them once per member.
        return t.unsqueeze(axis).expand(*t.shape[:axis], b, *t.shape[axis:]).flatten(axis, axis + 1)
    return t.movedim(in_dim, axis).flatten(axis, axis + 1)


def call_folded(layer: FusedLayer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``layer`` inside a batched call, for all members at once (see the module docstring)."""
    plan = layer.fold_plans.get(layer.training)
    leaves, spec = flatten_call(args, kwargs)
    interpreter = vmap_interpreter()
    level = interpreter.level()
    phys = {i: _unwrap_batched(t, level) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
    places = slots(layer)
    if plan is None or len(leaves) != len(plan.arg_axes) or not _foldable(plan, phys):
        _check_plain(layer)
        with holding(layer.plain, {place[3]: held(place) for place in places}):
            return layer.plain(*args, **kwargs)
    # A stacked tensor is [B, ...]: the batched call swapped it for the members' view on
    # axis 0 (a tensor it did not swap is that stacked tensor itself).
    stacked = [_unwrap_batched(held(place), level)[0] for place in places]
    rest = [None if isinstance(t, torch.Tensor) else t for t in leaves]
    with interpreter.lower():
        out_leaves, out_spec = _run_folded(layer, plan, interpreter.batch_size(), spec, rest, phys, stacked)
    wrapped = [_add_batch_dim(leaf[0], leaf[1], level) if isinstance(leaf, tuple) else leaf for leaf in out_leaves]
    return unflatten(wrapped, out_spec)


def _check_plain(layer: FusedLayer) -> None:
    """Raise unless the plain layer (member 0's copy) computes every member's result.

    A layer whose per-member settings (dropout ``p``, BatchNorm ``momentum``) differ cannot
    run as member 0's plain layer; the batched module around it then runs once per member.
    """
    for attr in type(layer).per_member_attrs:
        values = getattr(layer, attr)
        if any(v != values[0] for v in values):
            raise FusionError(
                f"{type(layer).__name__}: its inputs cannot be folded and '{attr}' differs between members"
            )


def per_member_flags(check: Any, *tensors: torch.Tensor) -> torch.Tensor:
    """Inside a batched call: ``check`` (Python code on tensors, returning a bool: what vmap
    cannot run) of each member's tensors, as one member's bool tensor under vmap."""
    interpreter = vmap_interpreter()
    level, b = interpreter.level(), interpreter.batch_size()
    members = []
    for t in tensors:
        phys, axis = _unwrap_batched(t, level)
        members.append(phys.movedim(axis, 0) if axis is not None else phys.unsqueeze(0).expand(b, *phys.shape))
    with interpreter.lower():
        flags = torch.tensor([bool(check(*(t[m] for t in members))) for m in range(b)], device=members[0].device)
    return _add_batch_dim(flags, 0, level)
