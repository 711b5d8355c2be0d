"""Per-member checkpoints: what a trial needs to continue in another array after a crash.

At every epoch boundary a worker saves each member that trains on: its weights (a plain
state_dict of the workload's model), its optimizer state (``member_state_dict`` of the
fused optimizer) and how many epochs it has done. When its worker dies, the coordinator
re-queues the trials that have one, and whichever array they join next resumes them at
that epoch boundary instead of from scratch. A member that ends (complete, pruned,
failed) has its checkpoint removed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["checkpoint_path", "load_checkpoint", "remove_checkpoint", "save_checkpoint"]


def checkpoint_path(artifact_dir: str | os.PathLike[str], study_name: str, trial_number: int) -> Path:
    """Where trial ``trial_number`` of ``study_name`` keeps its checkpoint."""
    return Path(artifact_dir, study_name, "checkpoints", f"trial-{trial_number}.pt")


def save_checkpoint(path: Path, epochs_done: int, model: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None:
    """Write atomically: a crash mid-write leaves the previous checkpoint, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"epochs_done": epochs_done, "model": _cpu(model), "optimizer": _cpu(optimizer)}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (tensors on the CPU), or None if there is none."""
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def remove_checkpoint(path: Path) -> None:
    path.unlink(missing_ok=True)


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value
