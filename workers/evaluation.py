"""An array's validation pass: each member's metrics of its outputs over the validation set.

The array's fused model runs over the validation batches once for all its members. A
``TensorDataset`` validation set is one batch (the whole set); a set read through a
``DataLoader`` comes in batches, and each metric of the outputs says how it is taken over
them (``Metric.per_batch``): a mean over the batches, weighted by their samples, computed
as the batches pass (a language model's per-token loss and accuracy: its logits are never
held for the whole set), or (the default) over the whole set, its outputs and targets
concatenated along the sample axis first (a classifier's accuracy, an AUC).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fusetune.workers.data import samples_in
from fusetune.workers.workloads import Metric

__all__ = ["Evaluation", "number"]


def member_of(out: Any, b: int) -> Any:
    """Member ``b``'s outputs: ``t[b]`` of every tensor of the fused outputs."""
    return out[b] if isinstance(out, torch.Tensor) else pytree.tree_map_only(torch.Tensor, lambda t: t[b], out)


def _cat(trees: Sequence[Any], dim: int) -> Any:
    """Batches' tensors (tuples or dicts of them) joined along ``dim``, in one structure."""
    if len(trees) == 1:
        return trees[0]
    leaves = [pytree.tree_flatten(t) for t in trees]
    spec = leaves[0][1]
    joined = [torch.cat(parts, dim) if isinstance(parts[0], torch.Tensor) else parts[0] for parts in zip(*(flat for flat, _ in leaves), strict=True)]
    return pytree.tree_unflatten(joined, spec)


class Evaluation:
    """One validation pass of an array of ``count`` members, fed batch by batch (:meth:`add`);
    :meth:`value` is a member's value of a metric of the outputs."""

    def __init__(self, metrics: Sequence[Metric], count: int) -> None:
        outputs = [m for m in metrics if m.of == "outputs"]
        self.count = count
        self.per_batch = [m for m in outputs if m.per_batch]
        # Only a metric over the whole set needs its outputs kept until the pass ends.
        self.keep = any(not m.per_batch for m in outputs)
        self.batches: dict[str, list[list[tuple[Any, int]]]] = {m.name: [[] for _ in range(count)] for m in self.per_batch}
        self.outs: list[Any] = []
        self.targets: list[Any] = []
        self.whole: tuple[Any, Any] | None = None

    def add(self, out: Any, target: Any) -> None:
        """A validation batch's fused outputs (``[B, N, ...]``) and its target (``[N, ...]``)."""
        n = samples_in(target)
        for metric in self.per_batch:
            for b, values in enumerate(self.batches[metric.name]):
                values.append((number(metric, metric.fn(member_of(out, b), target)), n))
        if self.keep:
            self.outs.append(out)
            self.targets.append(target)

    def value(self, metric: Metric, b: int) -> float:
        """Member ``b``'s value of ``metric`` (of the outputs) over the validation set."""
        if metric.per_batch:
            pairs = self.batches[metric.name][b]
            if not pairs:
                raise ValueError("the validation data yields no batch")
            if len(pairs) == 1:  # the whole set in one batch: the metric's own value, unweighted
                return pairs[0][0]
            return sum(v * n for v, n in pairs) / sum(n for _, n in pairs)
        if self.whole is None:
            if not self.outs:
                raise ValueError("the validation data yields no batch")
            # Joined once, for every member and metric; the member axis is the outputs' first.
            self.whole = (_cat(self.outs, 1), _cat(self.targets, 0))
            self.outs, self.targets = [], []
        out, target = self.whole
        return number(metric, metric.fn(member_of(out, b), target))


def number(metric: Metric, value: Any) -> float:
    """What ``metric`` returned, as a float (a 0-d tensor's, a numpy scalar's); anything else
    is a ``TypeError`` naming the metric, not float()'s message about a string."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: a tensor of more than one element
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise TypeError(f"metric {metric.name!r} returned {shown} ({type(value).__name__}), not a number: {exc}") from None
