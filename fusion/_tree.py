"""The fused tree: a copy of member 0 in which every parametrised module runs for all members.

Each submodule that owns parameters or buffers becomes one of two things:

* its **fused twin** (:mod:`fusion.nn`), where ``torch.nn`` has one and the twin supports its
  configuration: the member axis folded into the batch, one kernel for all members;
* otherwise a **batched module** (:mod:`fusion.nn._batched`): the module's own class and
  forward, its tensors and those of the plain modules below it stacked per member, run once
  for all members under ``torch.func.vmap``. Twins below it stay twins.

Parameter-free containers in between run unchanged. Tied parameters (one ``nn.Parameter`` at
several paths, e.g. GPT's token embedding and output layer) stay tied: all paths get the same
stacked parameter.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Sequence

from torch import nn

from ._errors import FusionError, UnsupportedByTwin
from ._layout import module_label
from .nn import TWINS, FusedLayer, pin_composable_paths
from .nn._batched import make_batched, stack_own_tensors


def tie_groups(model: nn.Module) -> list[list[str]]:
    """The parameter names that share one ``nn.Parameter`` in ``model`` (groups of two or more)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    # A module used at several paths shares its parameters there too; that is not a tie
    # of two modules, but it is kept the same way.
    return [names for names in groups.values() if len(names) > 1]


def check_same_ties(models: Sequence[nn.Module]) -> None:
    """Raise :class:`FusionError` unless every member ties the same parameters as member 0."""
    first = sorted(map(sorted, tie_groups(models[0])))
    for b, m in enumerate(models[1:], start=1):
        other = sorted(map(sorted, tie_groups(m)))
        if other != first:
            extra = [g for g in other if g not in first] or [g for g in first if g not in other]
            raise FusionError(
                f"parameters {extra[0]} are tied in {'member ' + str(b) if extra[0] in other else 'member 0'} "
                f"but not in {'member 0' if extra[0] in other else 'member ' + str(b)}; members must tie "
                "the same parameters"
            )


def own_state(module: nn.Module) -> list[str]:
    """Names of the parameters and (non-``None``) buffers ``module`` owns itself."""
    own = [n for n, p in module._parameters.items() if p is not None]
    return own + [n for n, t in module._buffers.items() if t is not None]


def build_fused_tree(models: Sequence[nn.Module], allow_loop: bool,
                     batched: Collection[type[nn.Module]] = ()) -> nn.Module:
    """Copy member 0 and make every parametrised submodule run for all members.

    Layers of the classes in ``batched`` run on the batched path even where they have a
    twin (where that measured faster, :func:`fusion.paths.choose_paths`). Callers have
    checked ``models`` (same layout, same ties), so the tree is built from members that
    agree on every class, shape and shared attribute.
    """
    root = copy.deepcopy(models[0])
    if type(root) in TWINS:
        # A bare layer: wrap it so the swap has a parent to live in.
        raise FusionError(
            f"fuse a model that contains the layer, not a bare {type(root).__name__}; wrap it in nn.Sequential"
        )
    builder = _Builder(models, allow_loop, frozenset(batched))
    inside = bool(own_state(root))
    if inside:
        stack_own_tensors(root, models)
        make_batched(root, "", len(models), allow_loop)
    builder.fuse_below(root, "", inside)
    pin_composable_paths(root)
    _retie(root, models[0])
    return root


class _Builder:
    """One walk of the tree; modules shared by several paths are fused once (``memo``)."""

    def __init__(self, models: Sequence[nn.Module], allow_loop: bool, batched: frozenset[type[nn.Module]]) -> None:
        self.models = models
        self.allow_loop = allow_loop
        self.batched = batched
        self.memo: dict[int, nn.Module] = {}

    def fuse_below(self, module: nn.Module, path: str, inside: bool) -> None:
        """Fuse the children of ``module``; ``inside``: it is (in) a batched module."""
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            cpath = f"{path}.{name}" if path else name
            members = [m.get_submodule(cpath) for m in self.models]
            key = id(members[0])
            if key not in self.memo:
                self.memo[key] = self._fuse(child, cpath, members, inside)
            module._modules[name] = self.memo[key]

    def _prefers_batched(self, members: list[nn.Module]) -> bool:
        """Whether the caller asked for the batched path for these layers, and it is exact:
        plain torch runs member 0's settings, so members must agree on the settings their
        twin would hold per member (dropout ``p``, BatchNorm ``momentum``)."""
        first = members[0]
        twin_type = TWINS.get(type(first))
        if type(first) not in self.batched or twin_type is None:
            return False
        return all(getattr(m, attr) == getattr(first, attr) for m in members for attr in twin_type.per_member_attrs)

    def _fuse(self, child: nn.Module, path: str, members: list[nn.Module], inside: bool) -> nn.Module:
        twin = None if self._prefers_batched(members) else _twin(members, path)
        if twin is not None:
            return twin
        if own_state(child):
            stack_own_tensors(child, members)
            if not inside:
                make_batched(child, path, len(members), self.allow_loop)
            self.fuse_below(child, path, True)
        else:
            self.fuse_below(child, path, inside)
        pin_composable_paths(child)
        return child


def _twin(members: list[nn.Module], path: str) -> FusedLayer | None:
    """The fused twin of ``members``, or ``None`` where there is none for this configuration."""
    twin_type = TWINS.get(type(members[0]))
    if twin_type is None:
        return None
    try:
        return twin_type.from_members(members, path)
    except UnsupportedByTwin:
        # A configuration the twin does not support (InstanceNorm with running statistics,
        # an LSTM projection): the batched path runs the layer as torch does.
        return None


def _retie(root: nn.Module, reference: nn.Module) -> None:
    """Give every tied name in ``root`` the same stacked parameter, as in ``reference``."""
    for names in tie_groups(reference):
        first = root.get_parameter(names[0])
        for name in names[1:]:
            owner_path, _, pname = name.rpartition(".")
            owner = root.get_submodule(owner_path)
            if owner._parameters[pname] is first:
                continue
            if owner._parameters[pname].shape != first.shape:  # type: ignore[union-attr]
                raise FusionError(
                    f"parameter '{name}' is tied to '{names[0]}', but {module_label(owner_path, owner)} "
                    "holds it in another layout when fused; tie it to a layer of the same kind"
                )
            owner._parameters[pname] = first
