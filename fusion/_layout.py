"""The one rule that decides which models can be fused into one array.

A fused model is built from member 0: every member runs member 0's module
classes and forwards, and reads member 0's copy of every plain attribute
(strides, eps, ``inplace``, a user's ``self.scale``), except the few that a
fused twin holds per member (Dropout ``p``, BatchNorm ``momentum``). Only
parameters and buffers are really per member, and they are stacked, so their
shapes must agree. Members can therefore be fused iff, at every submodule
path, they have the same module class, the same parameter and buffer shapes
and the same shared configuration: iff their :func:`layout` is equal.

:func:`fusion.fuse` refuses members whose layouts differ
(:func:`check_same_layout` names the first difference), and the scheduler's
shape signature hashes the layout, so the two cannot disagree. The layout is
pure (it reads types, shapes and attributes, never tensor data), so it works
on ``meta`` models.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ._errors import FusionError
from .nn import TWINS
from .nn._base import plain_config

__all__ = ["ModuleLayout", "layout", "check_same_layout"]


@dataclass(frozen=True)
class ModuleLayout:
    """What all members must share at one submodule path (one entry of :func:`layout`).

    Attributes:
        path: dotted submodule path, ``""`` for the root.
        type_name: ``module.qualname`` of the submodule's class.
        tensors: ``(name, shape)`` of its own parameters, then its own buffers
            (``None`` ones skipped; non-persistent buffers included, since they
            are stacked per member too).
        config: sorted ``(attribute, canonical JSON)`` pairs: every public plain
            attribute (``None``, bool, int, float, str, tuple, list) of the
            module, except those its fused twin holds per member.
    """

    path: str
    type_name: str
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    config: tuple[tuple[str, str], ...]


def layout(model: nn.Module) -> tuple[ModuleLayout, ...]:
    """The fusibility layout of ``model``: one :class:`ModuleLayout` per submodule, in module order.

    Two models that can each be fused on their own can be fused together iff
    their layouts are equal and their classes are the same objects (a layout
    names classes, so it cannot tell apart two classes with the same module and
    qualified name, e.g. classes defined inside a factory function).
    """
    return tuple(entry for _, _, entry in _walk(model))


def check_same_layout(models: Sequence[nn.Module], reference: nn.Module) -> None:
    """Raise :class:`fusion.FusionError` unless every model has ``reference``'s layout.

    The error names the first difference in model order: a parameter or buffer
    shape first, then per submodule path its class, then its configuration.
    ``reference`` is called member 0 in messages, ``models[b]`` member ``b``.
    """
    ref = _walk(reference)
    ref_shapes = _shapes(ref)
    ref_paths = {path for path, _, _ in ref}
    for b, model in enumerate(models):
        if model is reference:
            continue
        walked = _walk(model)
        shapes = _shapes(walked)
        # Shapes first (in model order), so that a different width is reported as the
        # weight it resizes rather than as the in_features attribute that says so.
        for name in list(ref_shapes) + [k for k in shapes if k not in ref_shapes]:
            if ref_shapes.get(name) != shapes.get(name):
                raise FusionError(
                    f"parameter or buffer '{name}' has shape {ref_shapes.get(name)} in member 0 "
                    f"but {shapes.get(name)} in member {b}; members must have identical shapes"
                )
        by_path = {path: (module, entry) for path, module, entry in walked}
        for path, mod, entry in ref:
            if path not in by_path:
                raise FusionError(f"{module_label(path, mod)} exists in member 0 but not in member {b}")
            other, other_entry = by_path[path]
            if module_class(other) is not module_class(mod):
                raise FusionError(f"{module_label(path, mod)} is a {type(other).__name__} in member {b}")
            if other_entry.config != entry.config:
                _raise_config_difference(path, mod, entry, other, other_entry, b)
        for path, (other, _) in by_path.items():
            if path not in ref_paths:
                raise FusionError(f"member {b} has {module_label(path, other)}, which member 0 lacks")


def module_class(module: nn.Module) -> type[nn.Module]:
    """The class that decides what ``module`` computes, for comparing members.

    ``torch.nn.utils.parametrize`` gives every parametrized module a class of its own
    (``ParametrizedLinear``, made per instance) over the original class; two members
    parametrized alike differ only in that class object, and their parametrizations are
    submodules that the layout compares like any other.
    """
    cls = type(module)
    if parametrize.is_parametrized(module) and len(cls.__bases__) == 1:
        return cls.__bases__[0]
    return cls


def module_label(path: str, module: nn.Module) -> str:
    """How fusion's errors name a submodule: ``submodule 'path' (Type)``."""
    return f"submodule '{path or '<root>'}' ({type(module).__name__})"


_ABSENT = object()


def _raise_config_difference(
    path: str, mod: nn.Module, entry: ModuleLayout, other: nn.Module, other_entry: ModuleLayout, b: int
) -> None:
    first, second = dict(entry.config), dict(other_entry.config)
    for key in sorted(set(first) | set(second)):
        if first.get(key) != second.get(key):
            # Show the attributes' own values; the canonical JSON is an implementation detail.
            v0 = vars(mod).get(key, _ABSENT)
            v1 = vars(other).get(key, _ABSENT)
            shown0 = "absent" if v0 is _ABSENT else repr(v0)
            shown1 = "absent" if v1 is _ABSENT else repr(v1)
            raise FusionError(
                f"{module_label(path, mod)}: attribute '{key}' differs between member 0 ({shown0}) and "
                f"member {b} ({shown1}); only parameters, buffers and per-member settings may differ"
            )


def _walk(model: nn.Module) -> list[tuple[str, nn.Module, ModuleLayout]]:
    """``(path, submodule, its layout)`` for every submodule, in module order."""
    walked: list[tuple[str, nn.Module, ModuleLayout]] = []
    # remove_duplicate=False: a module shared by two paths is stacked at both, and
    # state_dict (what members are exported and resumed with) lists it at both.
    for path, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        tensors = tuple(
            (name, _shape(tensor, f"{path}.{name}" if path else name))
            for name, tensor in list(module.named_parameters(recurse=False))
            + [(n, t) for n, t in module.named_buffers(recurse=False) if t is not None]
        )
        entry = ModuleLayout(
            path=path, type_name=f"{cls.__module__}.{cls.__qualname__}", tensors=tensors, config=_config(module)
        )
        walked.append((path, module, entry))
    return walked


def _shapes(walked: list[tuple[str, nn.Module, ModuleLayout]]) -> dict[str, tuple[int, ...]]:
    return {
        f"{path}.{name}" if path else name: shape
        for path, _, entry in walked
        for name, shape in entry.tensors
    }


def _shape(tensor: torch.Tensor, qualified: str) -> tuple[int, ...]:
    # What nn.parameter.is_lazy checks (the mixin under both is missing from torch's stubs).
    if isinstance(tensor, nn.parameter.UninitializedParameter | nn.parameter.UninitializedBuffer):
        raise FusionError(
            f"tensor {qualified!r} is uninitialized (lazy module); materialise the model "
            "(e.g. run one forward pass on meta tensors) before fusing it or taking its signature"
        )
    return tuple(int(d) for d in tensor.shape)


def _config(module: nn.Module) -> tuple[tuple[str, str], ...]:
    # The twin registry is looked up by exact type, as the fused tree is built: a
    # subclass of nn.Dropout gets no twin, runs unchanged with member 0's p, and so
    # must agree on p.
    twin = TWINS.get(type(module))
    per_member = twin.per_member_attrs if twin is not None else frozenset()
    # plain_config is the engine's own definition of which attributes configure a
    # layer (the twins check it too); the rule only adds a canonical encoding.
    items = plain_config(module, ignore=per_member)
    return tuple(sorted((key, _canonical_json(value)) for key, value in items.items()))


def _canonical_json(value: Any) -> str:
    return json.dumps(_encode(value), sort_keys=True, separators=(",", ":"), allow_nan=False)


def _encode(value: Any) -> Any:
    """Plain JSON for a config value; equal encodings mean fusing them is safe.

    It follows Python equality (``2 == 2.0``, ``-0.0 == 0.0``) except where that
    would refuse identical members or lose a difference: NaN equals NaN (members
    built alike are fused), ``True`` differs from ``1``. Tuples and lists encode
    alike: torch converts such layer arguments to tuples itself.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return {"__float__": repr(float(value))}
        # 2.0 and 2 configure a layer alike; this also maps -0.0 onto 0.
        return int(value) if value.is_integer() else float(value)
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    # An object inside a tuple or list (plain_config keeps the container): only its
    # class can be named reproducibly across processes, so that is what is compared.
    cls = type(value)
    return {"__object__": f"{cls.__module__}.{cls.__qualname__}"}
