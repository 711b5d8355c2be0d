"""FusedModel: B copies of one model trained as a single module.

Mechanism: the member axis of the inputs is folded into the batch axis
(``[B, N, ...] -> [B*N, ...]``, member-major), every parametrised submodule of
a copy of the model is swapped for a fused twin that knows B, or, where there is
none, runs once for all members under ``torch.func.vmap`` (:mod:`fusion._tree`),
and the model's own ``forward`` then runs unchanged -- residual adds,
``torch.flatten``, ``x.view(x.size(0), -1)``, ``torch.cat``, indexing and
functional activations all act per sample and so never mix members. A dry run of
an unfused copy at two batch sizes (once per train/eval mode) tells which axis of
each input and output holds the batch (:mod:`fusion._probe`).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ._errors import FusionError
from ._layout import check_same_layout, module_class
from ._probe import batch_axis, dry_run, place
from ._tree import build_fused_tree, check_same_ties
from .nn import FusedLayer
from .nn._batched import BatchedModule, member_tensors


def _check_members(models: Sequence[nn.Module], reference: nn.Module | None = None) -> None:
    """Validate that ``models`` (and ``reference``, if given) can share one fused model.

    The rule itself is :func:`fusion.layout` (equal layouts, same classes); it is
    enforced here, before anything is built, so that the fused tree never refuses
    members the scheduler's signature (which hashes the same layout) packed together.
    """
    if len(models) < 1:
        raise FusionError("fusion needs at least one model")
    first = reference if reference is not None else models[0]
    for b, m in enumerate(models):
        if not isinstance(m, nn.Module):
            raise FusionError(f"member {b} is a {type(m).__name__}, not an nn.Module")
        if module_class(m) is not module_class(first):
            raise FusionError(
                f"member {b} is a {type(m).__name__} but member 0 is a {type(first).__name__}; "
                "all members must be instances of the same class"
            )
    check_same_layout(models, first)
    # Tied parameters stay tied in the fused tree; members must tie the same ones (layouts
    # do not record ties).
    check_same_ties([first, *[m for m in models if m is not first]])


def _tensor_leaves(tree: Any) -> tuple[list[Any], Any]:
    return pytree.tree_flatten(tree)


class FusedModel(nn.Module):
    """B members of one model architecture, fused into one module.

    Build it with :func:`fusion.fuse`. Call it with per-member inputs
    ``[B, N, ...]`` (member axis first) and get ``[B, N, ...]`` back. Its
    parameters and buffers are the members' ones stacked along a leading axis
    under the original names, so ``fused.module.state_dict()`` keys equal
    the original model's and :meth:`member_state_dict` is a plain slice.
    """

    def __init__(self, models: Sequence[nn.Module], fallback: bool = True,
                 batched: Collection[type[nn.Module]] = ()) -> None:
        super().__init__()
        models = list(models)
        _check_members(models)
        self._fallback = fallback
        self._batched_types = frozenset(batched)
        self.module = build_fused_tree(models, fallback, self._batched_types)
        # An unfused copy of member 0, kept out of the module tree: the dry run uses
        # it to find batch axes, export loads member weights into it, and each fused
        # layer runs its copy of a layer where it runs as plain torch.
        template = copy.deepcopy(models[0])
        object.__setattr__(self, "_template", template)
        for path, layer in self.fused_layers():
            layer.attach_plain(template.get_submodule(path))
        self._num_members = len(models)
        # training flag -> (output batch axes, output tree spec) found by the dry run
        self._out_axes: dict[bool, list[int | None]] = {}

    # ------------------------------------------------------------------ basics
    @property
    def num_members(self) -> int:
        """Number of fused members B."""
        return self._num_members

    def fused_layers(self) -> Iterable[tuple[str, FusedLayer]]:
        """Yield ``(path, layer)`` for every fused layer, twin or batched module (each once)."""
        for path, mod in self.module.named_modules():
            if isinstance(mod, FusedLayer):
                yield path, mod

    def batched_modules(self) -> dict[str, str | None]:
        """The modules on the batched path that run on their own (not inside another one):
        path -> ``None`` where vmap runs them, or why they run once per member instead
        (``"train: ..."``, ``"eval: ..."``: per mode, as found on a first call in it)."""
        found = {p: m for p, m in self.fused_layers() if isinstance(m, BatchedModule)}
        return {p: "; ".join(f"{'train' if mode else 'eval'}: {why}"
                             for mode, why in sorted(m.per_member_reasons.items(), reverse=True)) or None
                for p, m in found.items() if not any(q != p and (q == "" or p.startswith(q + ".")) for q in found)}

    def extra_repr(self) -> str:
        return f"num_members={self._num_members}"

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run every member on its own inputs; tensors are ``[B, N, ...]``."""
        b = self._num_members
        if not kwargs and self.training in self._out_axes and all(isinstance(a, torch.Tensor) for a in args):
            return self._forward_tensors(args)
        leaves, spec = _tensor_leaves((args, kwargs))
        for t in leaves:
            if isinstance(t, torch.Tensor):
                if t.dim() < 2 or t.shape[0] != b:
                    raise FusionError(
                        f"fused inputs must be [B={b}, N, ...] (member axis first); got a tensor "
                        f"of shape {tuple(t.shape)}. Use fusion.broadcast(x, {b}) for an input "
                        "shared by all members"
                    )
        if self.training not in self._out_axes:
            self._probe(leaves, spec)
        folded = [
            t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) if isinstance(t, torch.Tensor) else t
            for t in leaves
        ]
        fargs, fkwargs = pytree.tree_unflatten(folded, spec)
        out = self.module(*fargs, **fkwargs)
        out_leaves, out_spec = _tensor_leaves(out)
        return self._unfold(out_leaves, out_spec)

    def _forward_tensors(self, args: tuple[torch.Tensor, ...]) -> Any:
        """Fast path of :meth:`forward` for positional tensor inputs after the dry run."""
        b = self._num_members
        for t in args:
            if t.dim() < 2 or t.shape[0] != b:
                raise FusionError(
                    f"fused inputs must be [B={b}, N, ...] (member axis first); got a tensor of "
                    f"shape {tuple(t.shape)}. Use fusion.broadcast(x, {b}) for a shared input"
                )
        out = self.module(*(t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]) for t in args))
        axes = self._out_axes[self.training]
        if isinstance(out, torch.Tensor) and len(axes) == 1 and axes[0] is not None:
            axis = axes[0]
            out = out.unflatten(axis, (b, -1))
            return out if axis == 0 else out.movedim(axis, 0)
        out_leaves, out_spec = _tensor_leaves(out)
        return self._unfold(out_leaves, out_spec)

    def _unfold(self, out_leaves: list[Any], out_spec: Any) -> Any:
        b = self._num_members
        axes = self._out_axes[self.training]
        if len(axes) != len(out_leaves):
            raise FusionError(
                "the model returned a different output structure than during its dry run"
            )
        unfolded = []
        for leaf, axis in zip(out_leaves, axes):
            if isinstance(leaf, torch.Tensor) and axis is not None:
                leaf = leaf.unflatten(axis, (b, -1))
                if axis != 0:
                    leaf = leaf.movedim(axis, 0)
            unfolded.append(leaf)
        return pytree.tree_unflatten(unfolded, out_spec)

    def _reference_param(self) -> torch.Tensor | None:
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            if t.is_floating_point():
                return t
        return None

    def _probe(self, leaves: list[Any], spec: Any) -> None:
        """Dry-run the unfused copy at batch sizes 2 and 3 to find batch axes (:mod:`fusion._probe`)."""
        template: nn.Module = self._template  # type: ignore[assignment]
        ref = self._reference_param()
        if ref is not None:
            template.to(device=ref.device, dtype=ref.dtype)
        template.train(self.training)
        records, outs = dry_run(template, leaves, spec, ref.device if ref is not None else None)
        place(self.module, template, records, self._num_members, self._fallback, self.training)
        out_axes: list[int | None] = []
        for i, (o1, o2) in enumerate(zip(outs[0], outs[1])):
            if not isinstance(o1, torch.Tensor):
                out_axes.append(None)
                continue
            axis = batch_axis(o1.shape, o2.shape)
            if axis is None:
                raise FusionError(
                    f"model output {i} (shape {tuple(o1.shape)}) has no batch axis: its shape did "
                    "not change with the batch size. Fused models take batch-first inputs (axis 0 "
                    "of each member's input is its batch) and must return per-sample outputs"
                )
            out_axes.append(axis)
        self._out_axes[self.training] = out_axes

    # ------------------------------------------------------------------ export
    def member_state_dict(self, b: int) -> OrderedDict[str, torch.Tensor]:
        """State dict of member ``b``, loadable with ``strict=True`` into the original class."""
        self._check_index(b)
        return OrderedDict(
            (k, v[b].detach().clone()) for k, v in self.module.state_dict(keep_vars=True).items()
        )

    def member(self, b: int) -> nn.Module:
        """Member ``b`` as a new, ordinary instance of the original model class."""
        model: nn.Module = copy.deepcopy(self.__dict__["_template"])
        model.load_state_dict(self.member_state_dict(b), strict=True)
        model.train(self.training)
        return model

    def _check_index(self, b: int) -> None:
        if not isinstance(b, int) or not 0 <= b < self._num_members:
            raise IndexError(f"member index {b} out of range for {self._num_members} members")

    # ------------------------------------------------------------------ membership
    def remove_members(self, indices: Sequence[int]) -> None:
        """Drop members ``indices`` (finished or pruned); the rest keep their state.

        Parameters stay the same ``nn.Parameter`` objects (their data shrinks),
        so an optimizer keeps working after its own ``remove_members``.
        """
        drop = set(int(i) for i in indices)
        for i in drop:
            self._check_index(i)
        keep = [i for i in range(self._num_members) if i not in drop]
        if not keep:
            raise FusionError("cannot remove every member of a fused model")
        index = torch.tensor(keep, dtype=torch.long)
        done: set[int] = set()  # tied parameters are cut once
        for _, layer in self.fused_layers():
            for owner, name, is_param in member_tensors(layer):
                _keep_rows(owner, name, is_param, index, done)
            layer.select_members(keep)
        self._num_members = len(keep)

    def add_members(self, models: Sequence[nn.Module]) -> None:
        """Append new members (fresh models of the same class and shapes)."""
        models = list(models)
        template: nn.Module = self.__dict__["_template"]
        # Same rule as fuse(): new members must have the existing ones' layout
        # (shapes, strides, eps, slopes, ...; per-member settings may differ).
        _check_members(models, reference=template)
        new_tree = build_fused_tree(models, self._fallback, self._batched_types)
        new_layers = {p: m for p, m in new_tree.named_modules() if isinstance(m, FusedLayer)}
        done: set[int] = set()  # tied parameters are extended once
        for path, target in self.fused_layers():
            new = new_layers.get(path)
            if new is None:
                # A module the dry run put on the batched path (it calls a layer with a
                # shared input): it holds no tensors of its own.
                assert isinstance(target, BatchedModule) and not list(member_tensors(target))
                target.num_members += len(models)
                continue
            for (owner, name, is_param), (new_owner, _, _) in zip(member_tensors(target), member_tensors(new)):
                _append_rows(owner, new_owner, name, is_param, done)
            target.append_members(new)
        self._num_members += len(models)


def _keep_rows(owner: nn.Module, name: str, is_param: bool, index: torch.Tensor, done: set[int]) -> None:
    """Keep the members ``index`` of one stacked tensor (a parameter stays the same object)."""
    if not is_param:
        buf = owner._buffers[name]
        assert buf is not None
        owner._buffers[name] = buf.index_select(0, index.to(buf.device))
        return
    p = owner._parameters[name]
    assert p is not None
    if id(p) in done:
        return
    done.add(id(p))
    rows = index.to(p.device)
    p.data = p.data.index_select(0, rows)
    if p.grad is not None:
        p.grad = p.grad.index_select(0, rows)


def _append_rows(owner: nn.Module, new_owner: nn.Module, name: str, is_param: bool, done: set[int]) -> None:
    """Append the new members' rows of one stacked tensor to ``owner``'s."""
    if not is_param:
        buf, extra_buf = owner._buffers[name], new_owner._buffers[name]
        assert buf is not None and extra_buf is not None
        owner._buffers[name] = torch.cat([buf, extra_buf.to(buf)])
        return
    p, extra = owner._parameters[name], new_owner._parameters[name]
    assert p is not None and extra is not None
    if id(p) in done:
        return
    done.add(id(p))
    p.data = torch.cat([p.data, extra.data.to(p.data)])
    if p.grad is not None:
        p.grad = torch.cat([p.grad, torch.zeros_like(extra.data).to(p.grad)])


def fuse(models: Sequence[nn.Module], *, fallback: bool = True,
         batched: Collection[type[nn.Module]] = ()) -> FusedModel:
    """Fuse ``models`` (same class, identical shapes) into one :class:`FusedModel`.

    Parameters and buffers are copied; the originals are not modified. Layers
    with a fused twin run as the twin; modules without one run once for all
    members under ``torch.func.vmap`` (the batched path). Raises
    :class:`fusion.FusionError` for members that cannot share one fused model
    (the parameter whose shape differs, the submodule and attribute whose
    configuration differs, ties that differ). Where vmap cannot run a module
    (found on its first call), it runs once per member -- exact, not faster --
    and a :class:`fusion.FusionWarning` names it; with ``fallback=False`` that
    call raises :class:`fusion.FusionError` instead. Layers of the classes in
    ``batched`` run on the batched path even where they have a twin (where that
    measured faster on the device: :func:`fusion.paths.choose_paths`).
    """
    return FusedModel(models, fallback=fallback, batched=batched)


def fuse_from_state_dicts(
    model: nn.Module | Callable[[], nn.Module], state_dicts: Sequence[dict[str, torch.Tensor]],
    *, fallback: bool = True, batched: Collection[type[nn.Module]] = (),
) -> FusedModel:
    """Build a fused model from saved member state dicts, for resuming.

    ``model`` is an instance of the model class (its weights are ignored) or a
    zero-argument factory; each state dict is loaded with ``strict=True``.
    """
    if not state_dicts:
        raise FusionError("fuse_from_state_dicts needs at least one state dict")
    members = []
    for sd in state_dicts:
        m = model() if not isinstance(model, nn.Module) else copy.deepcopy(model)
        m.load_state_dict(sd, strict=True)
        members.append(m)
    return FusedModel(members, fallback=fallback, batched=batched)


def fuse_seeded(
    factory: Callable[[], nn.Module], seeds: Sequence[int], *, fallback: bool = True,
    batched: Collection[type[nn.Module]] = (),
) -> FusedModel:
    """Fuse ``len(seeds)`` fresh models, member b initialised under ``torch.manual_seed(seeds[b])``.

    Each member's initial weights are exactly those ``factory()`` gives after
    ``torch.manual_seed(seed)`` in a separate run; the global RNG state is
    restored afterwards, so seeding members does not perturb the caller's stream.
    """
    if not seeds:
        raise FusionError("fuse_seeded needs at least one seed")
    models = []
    with torch.random.fork_rng(devices=[]):
        for seed in seeds:
            torch.manual_seed(int(seed))
            models.append(factory())
    return FusedModel(models, fallback=fallback, batched=batched)
