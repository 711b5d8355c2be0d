"""The memory model of an array's class, measured in a worker's process.

With a memory budget (``FUSETUNE_WORKER_MEMORY_BYTES``) the control plane caps each class's
arrays to what fits it. Knowing what fits means building the tenant's model and training a
step of fused arrays of one and two members: a tenant-sized allocation and a tenant-sized
amount of work. That runs here, on a worker (``ArrayWorker.memory_model``), never in the
control plane, which is also the API and the Ray driver: a model too large for the server's
memory would take every tenant's service down with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from fusetune.workers.data import sample_batch
from fusetune.workers.optimization import resolve
from fusetune.workers.spec import TrainingSpec
from fusetune.workers.workloads import Batch, Workload, feed_model

__all__ = ["array_memory_model"]


class Fed(nn.Module):
    """A workload's model called as its ``forward`` feeds it a batch: sizing calls a model
    with one argument, and this one takes the whole batch (a dict, a tuple) as it."""

    def __init__(self, model: nn.Module, forward: Callable[[nn.Module, Batch], Any]) -> None:
        super().__init__()
        self.model = model
        self.feed = forward

    def forward(self, batch: Batch) -> Any:
        return self.feed(self.model, batch)


def array_memory_model(workload: Workload, params: Mapping[str, Any], training: TrainingSpec | None = None) -> tuple[int, int]:
    """Bytes an array of these params' class needs: ``(base, member)``, bytes(B) = base + B * member.

    The fusion engine's memory model (``fusion.sizing.memory_model``): fused arrays of one and
    two members take a training step on the CPU on one of the workload's batches (its
    first training batch, read in this process: ``workers.data.sample_batch``), counting
    parameters, gradients, optimizer state and what autograd saves for backward. The
    optimizer is the one the trial trains with (its params, else ``training``'s, else the
    workload's), counted as Adam when the model has no fused twin of it.
    """
    from fusetune.fusion.sizing import memory_model

    batch = sample_batch(workload, params, training)
    name = resolve(workload, training, params).optimizer.lower()
    optimizer = name if name in ("sgd", "adam", "adamw") else "adam"
    target = workload.target_of(batch)
    if workload.forward is feed_model and isinstance(batch, (tuple, list)):  # model(x), as sizing calls it
        return memory_model(lambda: workload.build_model(params), batch[0], target, loss_fn=workload.loss, optimizer=optimizer)
    # Any other batch (a dict, a tensor) or forward: the model takes the batch through a
    # parameter-free wrapper, which adds nothing to the memory counted.
    return memory_model(
        lambda: Fed(workload.build_model(params), workload.forward), batch, target, loss_fn=workload.loss, optimizer=optimizer
    )
