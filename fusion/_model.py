"""FusedModel: B copies of one model trained as a single module.

Mechanism: the member axis of the inputs is folded into the batch axis
(``[B, N, ...] -> [B*N, ...]``, member-major), every parametrised submodule of
a copy of the model is swapped for a fused twin that knows B, and the model's
own ``forward`` then runs unchanged -- residual adds, ``torch.flatten``,
``x.view(x.size(0), -1)``, ``torch.cat``, indexing and functional activations
all act per sample and so never mix members. A dry run of an unfused copy at
two batch sizes (once per train/eval mode) tells which axis of each
feature-last layer's input and of each output holds the batch.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ._errors import FusionError, FusionWarning
from ._layout import check_same_layout, module_label as _module_label
from .nn import TWINS, FusedLayer, pin_composable_paths
from .nn._fallback import PerMemberFallback, make_fallback, member_tensors


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
        if type(m) is not type(first):
            raise FusionError(
                f"member {b} is a {type(m).__name__} but member 0 is a {type(first).__name__}; "
                "all members must be instances of the same class"
            )
    check_same_layout(models, first)
    # A parameter owned by two different modules (weight tying) cannot be
    # stacked once per twin without breaking the tie. Every member is checked:
    # layouts do not record ties, and a tie only in member b would be broken too.
    for m in models:
        owner: dict[int, str] = {}
        for path, mod in m.named_modules(remove_duplicate=True):
            for pname, p in mod.named_parameters(recurse=False):
                full = f"{path}.{pname}" if path else pname
                if id(p) in owner:
                    raise FusionError(
                        f"parameter '{full}' is tied to '{owner[id(p)]}'; tied parameters are not "
                        "supported by fusion"
                    )
                owner[id(p)] = full


def _build_fused_tree(
    models: Sequence[nn.Module], fallback: bool = False, notes: list[str] | None = None
) -> nn.Module:
    """Copy member 0 and replace each parametrised submodule by its fused twin.

    A module that owns parameters or buffers but has no twin is refused, or
    with ``fallback`` runs once per member (see :mod:`fusion.nn._fallback`);
    those are listed in ``notes`` for the caller to warn about. Callers have
    checked ``models`` with :func:`_check_members`, so the tree is built from
    members that agree on every class and shared attribute.
    """
    root = copy.deepcopy(models[0])
    memo: dict[int, nn.Module] = {}

    def own_state(mod: nn.Module) -> list[str]:
        own = [n for n, _ in mod.named_parameters(recurse=False)]
        return own + [n for n, t in mod.named_buffers(recurse=False) if t is not None]

    def unsupported(path: str, mod: nn.Module) -> FusionError:
        return FusionError(
            f"{_module_label(path, mod)} cannot be fused: fusion has no fused twin for "
            f"{type(mod).__module__}.{type(mod).__name__} and it owns parameters/buffers "
            f"{own_state(mod)}. Supported parametrised layers: "
            + ", ".join(sorted({t.__name__ for t in TWINS}))
            + ". fusion.fuse(models, fallback=True) runs such modules once per member instead"
        )

    def per_member(path: str, members: list[nn.Module]) -> nn.Module:
        if notes is not None:
            notes.append(_module_label(path, members[0]))
        return make_fallback(members, path)

    def visit(path: str, module: nn.Module) -> None:
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            cpath = f"{path}.{name}" if path else name
            members = [m.get_submodule(cpath) for m in models]
            key = id(members[0])
            if key in memo:
                module._modules[name] = memo[key]
                continue
            twin_type = TWINS.get(type(child))
            if twin_type is not None:
                memo[key] = twin_type.from_members(members, cpath)
            elif own_state(child):
                if not fallback:
                    raise unsupported(cpath, child)
                memo[key] = per_member(cpath, members)
            else:
                visit(cpath, child)
                pin_composable_paths(child)
                continue
            module._modules[name] = memo[key]

    if type(root) in TWINS:
        # A bare layer: wrap it so the swap has a parent to live in.
        raise FusionError(
            f"fuse a model that contains the layer, not a bare {type(root).__name__}; "
            "wrap it in nn.Sequential"
        )
    if own_state(root):
        if not fallback:
            raise unsupported("", root)
        return per_member("", list(models))
    try:
        visit("", root)
    finally:
        # visit calls itself through its closure cell: function and cell form a cycle that
        # holds memo, and with it every fused layer's parameters, until the cyclic collector
        # runs. On a GPU that memory would outlive the array (an array that ran out of memory
        # left its halves none to run in), so the cycle is broken here.
        del visit
    pin_composable_paths(root)
    return root


def _warn_fallbacks(notes: list[str], stacklevel: int) -> None:
    if notes:
        warnings.warn(
            "no fused twin for " + ", ".join(notes) + "; these run once per member "
            "(exact, but without the speed-up of fusion)",
            FusionWarning,
            stacklevel=stacklevel + 1,
        )


def _tensor_leaves(tree: Any) -> tuple[list[Any], Any]:
    return pytree.tree_flatten(tree)


def _batch_axis(s1: torch.Size, s2: torch.Size) -> int | None:
    """First axis whose size changed between the two probe batch sizes."""
    if len(s1) != len(s2):
        return None
    for d, (a, b) in enumerate(zip(s1, s2)):
        if a != b:
            return d
    return None


class FusedModel(nn.Module):
    """B members of one model architecture, fused into one module.

    Build it with :func:`fusion.fuse`. Call it with per-member inputs
    ``[B, N, ...]`` (member axis first) and get ``[B, N, ...]`` back. Its
    parameters and buffers are the members' ones stacked along a leading axis
    under the original names, so ``fused.module.state_dict()`` keys equal
    the original model's and :meth:`member_state_dict` is a plain slice.
    """

    def __init__(self, models: Sequence[nn.Module], fallback: bool = False) -> None:
        super().__init__()
        models = list(models)
        _check_members(models)
        self._fallback = fallback
        notes: list[str] = []
        self.module = _build_fused_tree(models, fallback, notes)
        _warn_fallbacks(notes, stacklevel=3)
        # An unfused copy of member 0, kept out of the module tree: the dry run
        # uses it to find batch axes, and export loads member weights into it.
        template = copy.deepcopy(models[0])
        object.__setattr__(self, "_template", template)
        self._num_members = len(models)
        # training flag -> (output batch axes, output tree spec) found by the dry run
        self._out_axes: dict[bool, list[int | None]] = {}

    # ------------------------------------------------------------------ basics
    @property
    def num_members(self) -> int:
        """Number of fused members B."""
        return self._num_members

    def fused_layers(self) -> Iterable[tuple[str, FusedLayer]]:
        """Yield ``(path, twin)`` for every fused layer (each once)."""
        for path, mod in self.module.named_modules():
            if isinstance(mod, FusedLayer):
                yield path, mod

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
        """Dry-run the unfused copy at batch sizes 2 and 3 to find batch axes."""
        template: nn.Module = self._template  # type: ignore[assignment]
        ref = self._reference_param()
        if ref is not None:
            template.to(device=ref.device, dtype=ref.dtype)
        template.train(self.training)
        twins = {path: m for path, m in self.fused_layers() if m.needs_batch_probe}
        records: dict[str, list[list[torch.Size]]] = {p: [[], []] for p in twins}
        run = [0]
        handles = []
        for path in twins:
            sub = template.get_submodule(path)

            def hook(_mod: nn.Module, inputs: tuple[Any, ...], path: str = path) -> None:
                if inputs and isinstance(inputs[0], torch.Tensor):
                    records[path][run[0]].append(inputs[0].shape)

            handles.append(sub.register_forward_pre_hook(hook))
        # Fallback modules split every input and merge every output: record all axes.
        full: dict[str, list[list[tuple[list[Any], list[Any]]]]] = {
            p: [[], []] for p, m in twins.items() if isinstance(m, PerMemberFallback)
        }
        for path in full:

            def full_hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any,
                          path: str = path) -> None:
                shapes_in = [t.shape if isinstance(t, torch.Tensor) else None
                             for t in _tensor_leaves((args, kwargs))[0]]
                shapes_out = [t.shape if isinstance(t, torch.Tensor) else None for t in _tensor_leaves(output)[0]]
                full[path][run[0]].append((shapes_in, shapes_out))

            handles.append(template.get_submodule(path).register_forward_hook(full_hook, with_kwargs=True))
        outs = []
        try:
            devices = [ref.device] if ref is not None and ref.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                for i, n in enumerate((2, 3)):
                    run[0] = i
                    sample = []
                    for t in leaves:
                        if isinstance(t, torch.Tensor):
                            idx = torch.arange(n, device=t.device) % t.shape[1]
                            t = t[0].index_select(0, idx)
                        sample.append(t)
                    a, k = pytree.tree_unflatten(sample, spec)
                    outs.append(_tensor_leaves(template(*a, **k))[0])
        except FusionError:
            raise
        except Exception as exc:
            raise FusionError(
                f"dry run of the unfused model at batch sizes 2 and 3 failed: {exc!r}"
            ) from exc
        finally:
            for h in handles:
                h.remove()
        for path, twin in twins.items():
            first, second = records[path]
            if not first:
                continue
            axes = {_batch_axis(s1, s2) for s1, s2 in zip(first, second)}
            if None in axes or len(axes) != 1:
                raise FusionError(
                    f"{_module_label(path, twin)}: cannot tell which input axis is the batch "
                    f"(input shapes {list(first)} at batch 2, {list(second)} at batch 3)"
                )
            twin.batch_dim = axes.pop()
        for path, (calls1, calls2) in full.items():
            if not calls1:
                continue
            (in1, out1), (in2, out2) = calls1[0], calls2[0]
            fb = twins[path]
            assert isinstance(fb, PerMemberFallback)
            fb.arg_axes = [None if a is None or b is None else _batch_axis(a, b) for a, b in zip(in1, in2)]
            fb.out_axes = [None if a is None or b is None else _batch_axis(a, b) for a, b in zip(out1, out2)]
            if all(a is None for a in fb.arg_axes):
                raise FusionError(f"{_module_label(path, fb)}: no input has a batch axis to split per member")
        out_axes: list[int | None] = []
        for i, (o1, o2) in enumerate(zip(outs[0], outs[1])):
            if not isinstance(o1, torch.Tensor):
                out_axes.append(None)
                continue
            axis = _batch_axis(o1.shape, o2.shape)
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
        for _, twin in self.fused_layers():
            for owner, name, is_param in member_tensors(twin):
                if is_param:
                    p = owner._parameters[name]
                    assert p is not None
                    rows = index.to(p.device)
                    p.data = p.data.index_select(0, rows)
                    if p.grad is not None:
                        p.grad = p.grad.index_select(0, rows)
                else:
                    buf = owner._buffers[name]
                    assert buf is not None
                    owner._buffers[name] = buf.index_select(0, index.to(buf.device))
            twin.select_members(keep)
        self._num_members = len(keep)

    def add_members(self, models: Sequence[nn.Module]) -> None:
        """Append new members (fresh models of the same class and shapes)."""
        models = list(models)
        template: nn.Module = self.__dict__["_template"]
        # Same rule as fuse(): new members must have the existing ones' layout
        # (shapes, strides, eps, slopes, ...; per-member settings may differ).
        _check_members(models, reference=template)
        notes: list[str] = []
        new_tree = _build_fused_tree(models, self._fallback, notes)
        _warn_fallbacks(notes, stacklevel=2)
        mine = dict(self.fused_layers())
        for path, twin in new_tree.named_modules():
            if not isinstance(twin, FusedLayer):
                continue
            target = mine[path]
            for (owner, name, is_param), (new_owner, _, _) in zip(member_tensors(target), member_tensors(twin)):
                if is_param:
                    p = owner._parameters[name]
                    extra = new_owner._parameters[name]
                    assert p is not None and extra is not None
                    p.data = torch.cat([p.data, extra.data.to(p.data)])
                    if p.grad is not None:
                        p.grad = torch.cat([p.grad, torch.zeros_like(extra.data).to(p.grad)])
                else:
                    buf = owner._buffers[name]
                    extra_buf = new_owner._buffers[name]
                    assert buf is not None and extra_buf is not None
                    owner._buffers[name] = torch.cat([buf, extra_buf.to(buf)])
            target.append_members(twin)
        self._num_members += len(models)


def fuse(models: Sequence[nn.Module], *, fallback: bool = False) -> FusedModel:
    """Fuse ``models`` (same class, identical shapes) into one :class:`FusedModel`.

    Parameters and buffers are copied; the originals are not modified. Raises
    :class:`fusion.FusionError` naming the submodule path and type of a layer
    that cannot be fused, or the parameter whose shape differs between members.
    With ``fallback=True`` such a layer instead runs once per member (exact,
    not faster) and a :class:`fusion.FusionWarning` names it.
    """
    return FusedModel(models, fallback=fallback)


def fuse_from_state_dicts(
    model: nn.Module | Callable[[], nn.Module], state_dicts: Sequence[dict[str, torch.Tensor]],
    *, fallback: bool = False,
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
    return FusedModel(members, fallback=fallback)


def fuse_seeded(
    factory: Callable[[], nn.Module], seeds: Sequence[int], *, fallback: bool = False
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
    return FusedModel(models, fallback=fallback)
