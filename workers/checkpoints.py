"""Per-member checkpoints: what a trial needs to continue in another array after a crash.

Every ``checkpoint_frequency`` epochs a worker saves each member that trains on: its weights
(a plain state_dict of the workload's model), its optimizer state (``member_state_dict`` of
the fused optimizer), its LR schedules' states (when it has any) and how many epochs it has
done. When its worker dies, the coordinator
re-queues the trials that have one, and whichever array they join next resumes them at that
epoch boundary instead of from scratch: at most the epochs since the last checkpoint are
trained again. A member that ends (complete, pruned, failed) has its checkpoint removed.

Writes happen on a background thread (:class:`CheckpointWriter`), so an epoch's report waits
for its metrics only, never for the disk.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointWriter", "checkpoint_path", "load_checkpoint", "remove_checkpoint", "save_checkpoint"]


def checkpoint_path(artifact_dir: str | os.PathLike[str], study_name: str, trial_number: int) -> Path:
    """Where trial ``trial_number`` of ``study_name`` keeps its checkpoint."""
    return Path(artifact_dir, study_name, "checkpoints", f"trial-{trial_number}.pt")


def save_checkpoint(
    path: Path,
    epochs_done: int,
    model: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    schedules: dict[str, Any] | None = None,
) -> None:
    """Write atomically: a crash mid-write leaves the previous checkpoint, never half of one.

    ``schedules``: the member's LR schedulers' ``state_dict``s by role (``"warmup"``,
    ``"lr_scheduler"``), saved under ``"schedules"`` when given.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    checkpoint: dict[str, Any] = {"epochs_done": epochs_done, "model": model, "optimizer": optimizer}
    if schedules:
        checkpoint["schedules"] = schedules
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (tensors on the CPU), or None if there is none."""
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def remove_checkpoint(path: Path) -> None:
    path.unlink(missing_ok=True)


class CheckpointWriter:
    """Saves and removes checkpoints on one background thread, in the order they were asked.

    :meth:`save` copies the member's tensors before it returns (the training thread goes on
    changing them in place), so what is written is exactly the state at that epoch boundary.
    One thread keeps a save and a later remove of the same path in order.
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusetune-checkpoints")
        self._pending: list[Future[None]] = []

    def save(
        self,
        path: Path,
        epochs_done: int,
        model: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        schedules: dict[str, Any] | None = None,
    ) -> None:
        model, optimizer, schedules = _cpu_copy(model), _cpu_copy(optimizer), _cpu_copy(schedules)
        self._submit(save_checkpoint, path, epochs_done, model, optimizer, schedules)

    def remove(self, path: Path) -> None:
        self._submit(remove_checkpoint, path)

    def flush(self) -> None:
        """Wait for every write asked so far; re-raises the first one that failed."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self.flush()
        self._executor.shutdown(wait=True)

    def _submit(self, fn: Any, *args: Any) -> None:
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append(self._executor.submit(fn, *args))


def _cpu_copy(value: Any) -> Any:
    """A copy on the CPU: ``Tensor.cpu()`` alone would alias a CPU tensor that training mutates."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(v) for v in value)
    return value
