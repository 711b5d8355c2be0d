"""The memory model of an array's class, measured in a worker's process.

With a memory budget (``FUSETUNE_WORKER_MEMORY_BYTES``) the control plane caps each class's
arrays to what fits it. Knowing what fits means building the tenant's model and training a
step of fused arrays of one and two members: a tenant-sized allocation and a tenant-sized
amount of work. That runs here, on a worker (``ArrayWorker.memory_model``), never in the
control plane, which is also the API and the Ray driver: a model too large for the server's
memory would take every tenant's service down with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fusetune.workers.optimization import resolve
from fusetune.workers.spec import TrainingSpec
from fusetune.workers.workloads import Workload

__all__ = ["array_memory_model"]


def array_memory_model(workload: Workload, params: Mapping[str, Any], training: TrainingSpec | None = None) -> tuple[int, int]:
    """Bytes an array of these params' class needs: ``(base, member)``, bytes(B) = base + B * member.

    The fusion engine's memory model (``fusion.sizing.memory_model``): fused arrays of one and
    two members take a training step on the CPU on one of the workload's batches, counting
    parameters, gradients, optimizer state and what autograd saves for backward. The
    optimizer is the one the trial trains with (its params, else ``training``'s, else the
    workload's), counted as Adam when the model has no fused twin of it.
    """
    from fusetune.fusion.sizing import memory_model

    x, y = workload.datasets()[0].tensors
    batch = workload.batch_size_for(params)
    name = resolve(workload, training, params).optimizer.lower()
    return memory_model(
        lambda: workload.build_model(params), x[:batch], y[:batch], loss_fn=workload.loss,
        optimizer=name if name in ("sgd", "adam", "adamw") else "adam",
    )
