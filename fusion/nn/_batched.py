"""The batched functional path: a module without a fused twin runs once for all members.

A module that owns parameters or buffers but has no fused twin (a user block with its own
``nn.Parameter``, a root model owning a position embedding, ``nn.RMSNorm``, a parametrized
layer, ...) keeps its own class and forward. Its tensors, and those of the plain modules below
it, are stacked per member under their original names (so export, import and membership
changes work as on twins), and each call runs its forward once for all members under
``torch.func.vmap`` over ``torch.func.functional_call`` with the stacked tensors: the member
axis is split off the folded batch of every input that has one, inputs without one are shared
(``in_dims=None``), dropout draws differ per member (``randomness="different"``), and in-place
updates of buffers (BatchNorm running statistics) land in the member's rows of the stacked
buffer. Fused twins below it still run fused (:mod:`fusion.nn._batched_call`).

Where vmap's batching rules do not cover the module (data-dependent Python control flow, an
in-place write of member data into a shared tensor, ...), the first call finds out, puts back
any buffer it changed, and the module runs once per member from then on, on its plain copy
with each member's slices: exact, but without fusion's speed; a :class:`fusion.FusionWarning`
says so. With ``fuse(..., fallback=False)`` it raises :class:`fusion.FusionError` instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from .._errors import FusionError, FusionWarning
from ._base import FusedLayer, stack_buffer, stack_param
from ._batched_call import batched_call, flatten, flatten_call, in_batched_call, unflatten
from ._batched_ops import FoldOps
from ._holding import holding, state_of

_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


class BatchedModule(FusedLayer):
    """Mixin placed in front of the original class of a module on the batched path.

    ``arg_axes`` / ``out_axes`` (per training flag: the folded batch axis of every leaf of the
    call's inputs and outputs, ``None`` for a leaf without one) come from the dry run of
    :class:`fusion.FusedModel`. Inside another batched module's call, this one is just its
    own forward: the outer call already hands it one member's tensors.
    """

    folds_in_batched_call: ClassVar[bool] = False
    fusion_path: str = ""
    allow_loop: bool = True
    #: training flag -> why vmap could not run the module in that mode (it then runs once
    #: per member in that mode).
    per_member_reasons: dict[bool, str]
    #: training flag -> batch axis of every leaf of the call's inputs / outputs (dry run).
    arg_axes: dict[bool, list[int | None]]
    out_axes: dict[bool, list[int | None]]

    @property
    def label(self) -> str:
        """How messages name this module: ``submodule 'path' (OriginalClass)``."""
        return f"submodule '{self.fusion_path or '<root>'}' ({type(self).__bases__[1].__name__})"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if in_batched_call():
            return super().forward(*args, **kwargs)
        if self.num_members == 1:
            return self._single(args, kwargs)
        if self.training in self.per_member_reasons:
            return self._per_member(args, kwargs)
        if self.training in self.__dict__.get("_vmapped_ok", ()):
            return self._vmapped(args, kwargs)
        return self._first_call(args, kwargs)

    # ------------------------------------------------------------------ batched
    def _axes(self, kind: str, count: int | None = None) -> list[int | None]:
        axes = self.__dict__.get(kind, {}).get(self.training)
        if axes is None or (count is not None and len(axes) != count):
            raise FusionError(
                f"{self.label}: called with other inputs or outputs than in the fused model's dry run"
            )
        return axes

    def _vmapped(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        b = self.num_members
        leaves, spec = flatten_call(args, kwargs)
        axes = self._axes("arg_axes", len(leaves))
        inputs = [t.unflatten(a, (b, -1)) if isinstance(t, torch.Tensor) and a is not None else t
                  for t, a in zip(leaves, axes)]
        in_dims = [a if isinstance(t, torch.Tensor) else None for t, a in zip(leaves, axes)]
        state = state_of(self)
        found: dict[str, Any] = {}

        def member(state: dict[str, torch.Tensor], inputs: list[Any]) -> tuple[Any, ...]:
            a, k = unflatten(inputs, spec)
            with holding(self, state), batched_call(True), FoldOps():
                out = self(*a, **k)
            out_leaves, found["spec"] = flatten(out)
            found["leaves"] = out_leaves
            return tuple(t for t in out_leaves if isinstance(t, torch.Tensor))

        # The outputs' axes are known from the dry run (which made sure that every tensor
        # output has one); vmap puts the member axis there.
        out_dims = tuple(a for a in self._axes("out_axes") if a is not None)
        outs = torch.func.vmap(member, in_dims=(0, in_dims), out_dims=out_dims, randomness="different")(
            state, inputs
        )
        folded = iter(t.flatten(a, a + 1) for t, a in zip(outs, out_dims))
        merged = [next(folded) if isinstance(t, torch.Tensor) else t for t in found["leaves"]]
        return unflatten(merged, found["spec"])

    def _first_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Try vmap; where it cannot run the module, undo what it changed and loop over members."""
        buffers = [(t, t.clone()) for t in self.buffers()]
        try:
            out = self._vmapped(args, kwargs)
        except Exception as exc:
            with torch.no_grad():
                for t, saved in buffers:
                    t.copy_(saved)
            label = self.label
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if not self.allow_loop:
                raise FusionError(f"{label} cannot run batched under torch.func.vmap ({reason})") from exc
            out = self._per_member(args, kwargs)  # a module that cannot run at all raises here
            self.per_member_reasons[self.training] = reason
            warnings.warn(
                f"{label} runs once per member in {'training' if self.training else 'eval'} mode (exact, but "
                f"without the speed-up of fusion): torch.func.vmap cannot run it ({reason})",
                FusionWarning,
                stacklevel=2,
            )
            return out
        self.__dict__["_vmapped_ok"] = self.__dict__.get("_vmapped_ok", frozenset()) | {self.training}
        return out

    # ------------------------------------------------------------------ per member
    def _per_member(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the plain copy once per member on its rows and tensors; merge the outputs."""
        b = self.num_members
        leaves, spec = flatten_call(args, kwargs)
        axes = self._axes("arg_axes", len(leaves))
        chunks = [t.chunk(b, dim=a) if isinstance(t, torch.Tensor) and a is not None else [t] * b
                  for t, a in zip(leaves, axes)]
        # unbind: one view per member whose backward stacks the gradients (indexing each
        # member would scatter each one into zeros of the whole stacked shape).
        members = {name: t.unbind(0) for name, t in state_of(self).items()}
        outs = []
        for m in range(b):
            a, k = unflatten([c[m] for c in chunks], spec)
            with self._member_settings(m), holding(self.plain, {name: t[m] for name, t in members.items()}):
                outs.append(flatten(self.plain(*a, **k)))
        return self._merge(outs)

    def _single(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One member is an ordinary model: the plain copy with its tensors, no vmap, no loop."""
        # squeeze, not [0]: a view whose backward is a view too.
        with self._member_settings(0), holding(self.plain, {n: t.squeeze(0) for n, t in state_of(self).items()}):
            return self.plain(*args, **kwargs)

    @contextmanager
    def _member_settings(self, m: int) -> Iterator[None]:
        """The plain copy holds one member's per-member settings (dropout ``p``, BatchNorm
        ``momentum``): member ``m``'s while the block runs, its own again afterwards."""
        found = self.__dict__.get("_member_settings_layers")
        if found is None:
            found = [layer for layer in self.modules()
                     if isinstance(layer, FusedLayer) and layer is not self and layer.per_member_attrs]
            self.__dict__["_member_settings_layers"] = found
        saved = [(layer.plain, {attr: getattr(layer.plain, attr) for attr in layer.per_member_attrs})
                 for layer in found]
        try:
            for layer in found:
                for attr, value in layer.member_config(m).items():
                    setattr(layer.plain, attr, value)
            yield
        finally:
            for plain, values in saved:
                for attr, value in values.items():
                    setattr(plain, attr, value)

    def _merge(self, outs: list[tuple[list[Any], Any]]) -> Any:
        """The members' outputs, each tensor joined along its batch axis."""
        out_axes = self._axes("out_axes", len(outs[0][0]))
        merged = []
        for i, leaf in enumerate(outs[0][0]):
            if not isinstance(leaf, torch.Tensor):
                merged.append(leaf)
                continue
            axis = out_axes[i]
            if axis is None:
                raise FusionError(f"{self.label}: output {i} has no batch axis")
            merged.append(leaf if len(outs) == 1 else torch.cat([o[0][i] for o in outs], dim=axis))
        return unflatten(merged, outs[0][1])


def batched_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The class ``BatchedModule`` + ``cls`` (made once per class)."""
    made = _CLASSES.get(cls)
    if made is None:
        made = type(f"Batched{cls.__name__}", (BatchedModule, cls), {"__module__": __name__})
        _CLASSES[cls] = made
    return made


def make_batched(module: nn.Module, path: str, num_members: int, allow_loop: bool) -> BatchedModule:
    """Turn ``module`` (a copy inside the fused tree) into a batched module, in place."""
    module.__class__ = batched_class(type(module))
    assert isinstance(module, BatchedModule)
    module.num_members = num_members
    module.fusion_path = path
    module.allow_loop = allow_loop
    module.arg_axes = {}
    module.out_axes = {}
    module.per_member_reasons = {}
    return module


def stack_own_tensors(module: nn.Module, members: Sequence[nn.Module]) -> None:
    """Replace ``module``'s own parameters and buffers by the members' ones stacked."""
    for name, p in list(module._parameters.items()):
        if p is not None:
            module._parameters[name] = stack_param([m._parameters[name] for m in members])
    for name, buf in list(module._buffers.items()):
        if buf is not None:
            module._buffers[name] = stack_buffer([m._buffers[name] for m in members])


def member_tensors(layer: nn.Module) -> Iterator[tuple[nn.Module, str, bool]]:
    """``(owner, name, is_parameter)`` for every stacked tensor a fused layer holds itself.

    A twin owns its tensors; a batched module also holds those of the plain modules below
    it, but not those of the fused layers below it (they are fused layers of their own).
    """
    stack = [layer]
    while stack:
        owner = stack.pop()
        yield from ((owner, n, True) for n, p in owner._parameters.items() if p is not None)
        yield from ((owner, n, False) for n, t in owner._buffers.items() if t is not None)
        if isinstance(layer, BatchedModule):
            stack.extend(c for c in reversed(list(owner._modules.values()))
                         if c is not None and not isinstance(c, FusedLayer))
