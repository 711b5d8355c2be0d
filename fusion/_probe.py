"""The dry run that tells a fused model where the batch is, and what follows from it.

On its first call in each of train/eval mode, :class:`fusion.FusedModel` runs an unfused copy
of member 0 (the template) at batch sizes 2 and 3, with hooks on every submodule that record
the shapes of each call's inputs and outputs and which module made the call. The axis whose
size changed is a tensor's batch axis; a tensor whose shape did not change has none (an
``arange`` of positions, a causal mask, a table). From that record:

* a fused twin applied to feature-last tensors learns its input's batch axis;
* a batched module learns the batch axis of every input and output (vmap's ``in_dims`` and
  ``out_dims``; ``None`` for a shared input);
* a fused layer whose call cannot be folded -- a twin fed a tensor without a batch axis
  (``nn.Embedding(L, d)(torch.arange(L))``), a batched module returning a member-dependent
  tensor without one (a module returning its ``nn.Parameter``), calls with differing axes --
  makes the module that calls it a batched module, so that the call happens inside vmap,
  where such tensors are simply one member's;
* a twin called inside a batched module learns how to fold its calls there
  (:class:`fusion.nn._batched_call.FoldPlan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ._errors import FusionError
from ._layout import module_label
from .nn import FusedLayer
from .nn._batched import BatchedModule, make_batched
from .nn._batched_call import make_plan


@dataclass
class Call:
    """One call of a module in a dry run: the modules running when it was called, its tensors' shapes."""

    stack: tuple[str, ...]  # paths of the modules whose forward was running, outermost first
    ins: list[torch.Size | None]
    outs: list[torch.Size | None] = field(default_factory=list)

    @property
    def caller(self) -> str | None:
        """Path of the module that made the call (``""``: the root); ``None``: the fused model."""
        return self.stack[-1] if self.stack else None


#: path -> [calls at batch size 2, calls at batch size 3]
Records = dict[str, tuple[list[Call], list[Call]]]


def _shapes(tree: Any) -> list[torch.Size | None]:
    return [t.shape if isinstance(t, torch.Tensor) else None for t in pytree.tree_flatten(tree)[0]]


def batch_axis(s1: torch.Size | None, s2: torch.Size | None) -> int | None:
    """First axis whose size changed between the two probe batch sizes."""
    if s1 is None or s2 is None or len(s1) != len(s2):
        return None
    for d, (a, b) in enumerate(zip(s1, s2)):
        if a != b:
            return d
    return None


def dry_run(template: nn.Module, leaves: list[Any], spec: Any, device: torch.device | None) -> tuple[Records, list[list[Any]]]:
    """Run ``template`` on member 0's inputs cut to 2 and 3 samples; record every module's calls.

    Returns the records and the model's output leaves of both runs. The RNG state is forked,
    so the dry run does not perturb the training's random stream.
    """
    records: Records = {}
    stack: list[str] = []
    pending: list[Call] = []
    run = [0]
    handles = []
    for path, module in template.named_modules():
        records[path] = ([], [])

        def pre(_m: nn.Module, args: Any, kwargs: Any, path: str = path) -> None:
            call = Call(tuple(stack), _shapes((args, kwargs)))
            records[path][run[0]].append(call)
            stack.append(path)
            pending.append(call)

        def post(_m: nn.Module, _args: Any, _kwargs: Any, output: Any) -> None:
            stack.pop()
            pending.pop().outs = _shapes(output)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    outs = []
    try:
        devices = [device] if device is not None and device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            for i, n in enumerate((2, 3)):
                run[0] = i
                stack.clear()
                pending.clear()
                sample = [_cut(t, n) for t in leaves]
                a, k = pytree.tree_unflatten(sample, spec)
                outs.append(pytree.tree_flatten(template(*a, **k))[0])
    except FusionError:
        raise
    except Exception as exc:
        raise FusionError(f"dry run of the unfused model at batch sizes 2 and 3 failed: {exc!r}") from exc
    finally:
        for h in handles:
            h.remove()
    return records, outs


def _cut(t: Any, n: int) -> Any:
    """Member 0's input ``[B, N, ...]`` as ``n`` samples (repeating them if ``N < n``)."""
    if not isinstance(t, torch.Tensor):
        return t
    idx = torch.arange(n, device=t.device) % t.shape[1]
    return t[0].index_select(0, idx)


@dataclass
class Axes:
    """The batch axes of one kind of call of a module: every leaf of its inputs and outputs."""

    ins: list[int | None]
    outs: list[int | None]
    in_is_tensor: list[bool]
    out_is_tensor: list[bool]


def _call_axes(pairs: list[tuple[Call, Call]]) -> Axes | None:
    """The axes the calls (paired across the two runs) share; ``None`` if any two differ."""
    found: Axes | None = None
    for c1, c2 in pairs:
        if len(c1.ins) != len(c2.ins) or len(c1.outs) != len(c2.outs):
            return None
        axes = Axes([batch_axis(a, b) for a, b in zip(c1.ins, c2.ins)],
                    [batch_axis(a, b) for a, b in zip(c1.outs, c2.outs)],
                    [s is not None for s in c1.ins], [s is not None for s in c1.outs])
        if found is not None and axes != found:
            return None
        found = axes
    return found


def _split(calls: tuple[list[Call], list[Call]], batched: set[str]) -> tuple[list[tuple[Call, Call]], list[tuple[Call, Call]]]:
    """The calls paired across the two runs: those made outside any batched module, and inside."""
    outer: list[tuple[Call, Call]] = []
    inner: list[tuple[Call, Call]] = []
    for c1, c2 in zip(*calls):
        (inner if any(p in batched for p in c1.stack) else outer).append((c1, c2))
    return outer, inner


def place(root: nn.Module, template: nn.Module, records: Records, num_members: int, allow_loop: bool,
          training: bool) -> None:
    """Apply a dry run's records to the fused tree ``root`` (see the module docstring)."""
    layers = {p: m for p, m in root.named_modules() if isinstance(m, FusedLayer)}
    while True:
        batched = {p for p, m in layers.items() if isinstance(m, BatchedModule)}
        callers = _callers_to_batch(layers, records, batched)
        if not callers:
            break
        for path in sorted(callers):
            module = root.get_submodule(path)
            if isinstance(module, FusedLayer):
                raise FusionError(
                    f"{module_label(path, module)} calls a fused layer with inputs whose batch axis "
                    "cannot be told (see the fused model's dry run); fusion cannot run it"
                )
            made = make_batched(module, path, num_members, allow_loop)
            made.attach_plain(template.get_submodule(path))
            layers[path] = made
    batched = {p for p, m in layers.items() if isinstance(m, BatchedModule)}
    for path, layer in layers.items():
        outer, inner = _split(records.get(path, ([], [])), batched)
        if isinstance(layer, BatchedModule):
            axes = _call_axes(outer) if outer else None
            if axes is not None:
                layer.arg_axes[training] = axes.ins
                layer.out_axes[training] = axes.outs
            continue
        if outer and layer.needs_batch_probe:
            axes = _call_axes(outer)
            assert axes is not None and axes.ins and axes.ins[0] is not None
            layer.batch_dim = axes.ins[0]
        if inner:
            axes = _call_axes(inner)
            plan = None if axes is None else make_plan(layer, axes.ins, axes.outs, axes.in_is_tensor,
                                                       axes.out_is_tensor)
            layer.fold_plans = {**layer.fold_plans, training: plan}


def _callers_to_batch(layers: dict[str, FusedLayer], records: Records, batched: set[str]) -> set[str]:
    """The modules that make calls of fused layers which cannot be folded, outside vmap."""
    callers: set[str] = set()
    for path, layer in layers.items():
        outer, _ = _split(records.get(path, ([], [])), batched)
        if not outer or _foldable(layer, outer):
            continue
        # A call by the fused model itself is the root's; the fused model checks its outputs.
        callers.update(c1.caller for c1, _ in outer if c1.caller is not None)
    return callers


def _foldable(layer: FusedLayer, pairs: list[tuple[Call, Call]]) -> bool:
    """Whether the folded world can run these calls: every batch axis known, and the same each call."""
    axes = _call_axes(pairs)
    if axes is None:
        return False
    if isinstance(layer, BatchedModule):
        # vmap splits shared inputs off as in_dims=None, but a member-dependent output
        # needs a batch axis to go back into the folded batch.
        return all(a is not None for a, t in zip(axes.outs, axes.out_is_tensor) if t)
    if layer.needs_batch_probe:
        return bool(axes.ins) and axes.ins[0] is not None
    return True
