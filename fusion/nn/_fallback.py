"""Per-member fallback for modules that have no fused twin.

With ``fusion.fuse(models, fallback=True)``, a module that owns parameters or
buffers but has no fused twin (``nn.RNN``, a user block with its own
``nn.Parameter``, ...) is not refused: its copy keeps its own class and
forward, its parameters and buffers are stacked per member under their
original names, and each call runs the original forward once per member on
that member's rows with that member's slices (``torch.func.functional_call``).
That is separate execution, so it is exact, but it gains nothing from fusion;
a :class:`fusion.FusionWarning` says so.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .._errors import FusionError
from ._base import FusedLayer, stack_buffer, stack_param

_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


class PerMemberFallback(FusedLayer):
    """Mixin placed in front of the original class of a fallback module.

    ``arg_axes``/``out_axes`` (the folded batch axis of every tensor leaf of
    the call's inputs and outputs, ``None`` for leaves shared by all members)
    come from the dry run of :class:`fusion.FusedModel`.
    """

    needs_batch_probe = True
    arg_axes: list[int | None] | None = None
    out_axes: list[int | None] | None = None
    _member_call: bool = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._member_call:
            # Inside functional_call: the module's own forward, on one member.
            return super(PerMemberFallback, self).forward(*args, **kwargs)  # type: ignore[misc]
        b = self.num_members
        leaves, spec = pytree.tree_flatten((args, kwargs))
        axes = self.arg_axes
        if axes is None or len(axes) != len(leaves):
            axes = [0 if isinstance(t, torch.Tensor) else None for t in leaves]
        chunks = []
        for t, axis in zip(leaves, axes):
            if isinstance(t, torch.Tensor) and axis is not None:
                if t.shape[axis] % b:
                    raise FusionError(
                        f"fallback {type(self).__name__}: input axis {axis} of size {t.shape[axis]} "
                        f"does not split into {b} members"
                    )
                chunks.append(t.chunk(b, dim=axis))
            else:
                chunks.append([t] * b)
        tensors = dict(self.named_parameters())
        tensors.update(dict(self.named_buffers()))
        outs = []
        self._member_call = True
        try:
            for m in range(b):
                state = {name: t[m] for name, t in tensors.items()}
                a, k = pytree.tree_unflatten([c[m] for c in chunks], spec)
                outs.append(torch.func.functional_call(self, state, a, k, strict=True))
        finally:
            self._member_call = False
        flat = [pytree.tree_flatten(o) for o in outs]
        out_spec = flat[0][1]
        out_axes = self.out_axes
        merged = []
        for i, leaf in enumerate(flat[0][0]):
            if not isinstance(leaf, torch.Tensor):
                merged.append(leaf)
                continue
            axis = out_axes[i] if out_axes is not None and i < len(out_axes) else 0
            if axis is None:
                raise FusionError(
                    f"fallback {type(self).__name__}: output {i} has no batch axis, so members' "
                    "outputs cannot be told apart"
                )
            merged.append(torch.cat([f[0][i] for f in flat], dim=axis))
        return pytree.tree_unflatten(merged, out_spec)


def make_fallback(members: Sequence[nn.Module], path: str) -> nn.Module:
    """A copy of ``members[0]`` with stacked state that runs once per member."""
    first = members[0]
    module = copy.deepcopy(first)
    for sub_name, sub in module.named_modules():
        prefix = f"{sub_name}." if sub_name else ""
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = stack_param([m.get_parameter(prefix + name) for m in members])
        for name, buf in list(sub._buffers.items()):
            if buf is not None:
                sub._buffers[name] = stack_buffer([m.get_buffer(prefix + name) for m in members])
    cls = type(first)
    fallback_cls = _CLASSES.get(cls)
    if fallback_cls is None:
        fallback_cls = type(f"PerMember{cls.__name__}", (PerMemberFallback, cls), {"__module__": __name__})
        _CLASSES[cls] = fallback_cls
    module.__class__ = fallback_cls
    module.num_members = len(members)
    return module


def member_tensors(module: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """``(owner, name, is_parameter)`` for every stacked tensor a fused layer owns.

    Ordinary twins own their tensors directly; a fallback module's tensors
    also live in its (unfused) children.
    """
    owners = module.modules() if isinstance(module, PerMemberFallback) else [module]
    out = []
    for owner in owners:
        out += [(owner, n, True) for n, p in owner._parameters.items() if p is not None]
        out += [(owner, n, False) for n, t in owner._buffers.items() if t is not None]
    return out
