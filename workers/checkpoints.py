"""Per-member checkpoints: what a trial needs to continue in another array after a crash.

Every ``checkpoint_frequency`` epochs a worker saves each member that trains on: its weights
(a plain state_dict of the workload's model), its optimizer state (``member_state_dict`` of
the fused optimizer), its LR schedules' states (when it has any) and how many epochs it has
done, in the artifact store (``workers.store``: a local directory, a shared filesystem or an
object store, seen by every node). Each epoch report tells the control plane the epoch of
each member's newest checkpoint that is completely written (``MemberReport.checkpoint_epoch``);
the control plane keeps it in ``ft_trials.checkpoint_epoch``. When its worker dies, or the
whole service restarts, the coordinator re-queues the trials that have one, and whichever
array they join next, on whichever node, resumes them at that epoch boundary instead of from
scratch: at most the epochs since the last checkpoint are trained again. A member that ends
(complete, pruned, failed) has its checkpoint removed.

Writes happen on a background thread (:class:`CheckpointWriter`), so an epoch's report waits
for its metrics only, never for the store.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from fusetune.workers.store import ArtifactStore, get_store

__all__ = [
    "CheckpointWriter",
    "checkpoint_key",
    "checkpoint_path",
    "load_checkpoint",
    "remove_checkpoint",
    "save_checkpoint",
]


def checkpoint_key(study_name: str, trial_number: int) -> str:
    """The store key of trial ``trial_number``'s checkpoint in ``study_name``."""
    return f"{study_name}/checkpoints/trial-{trial_number}.pt"


def checkpoint_path(store: str, study_name: str, trial_number: int) -> str:
    """Where trial ``trial_number`` of ``study_name`` keeps its checkpoint in the store ``store``
    (a local path for a local store, a URI otherwise)."""
    return get_store(store).location(checkpoint_key(study_name, trial_number))


def save_checkpoint(
    store: ArtifactStore,
    key: str,
    epochs_done: int,
    model: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    schedules: dict[str, Any] | None = None,
) -> None:
    """Write as a whole (``ArtifactStore.write``): a crash mid-write leaves the previous checkpoint.

    ``schedules``: the member's LR schedulers' ``state_dict``s by role (``"warmup"``,
    ``"lr_scheduler"``), saved under ``"schedules"`` when given.
    """
    checkpoint: dict[str, Any] = {"epochs_done": epochs_done, "model": model, "optimizer": optimizer}
    if schedules:
        checkpoint["schedules"] = schedules
    store.save_torch(key, checkpoint)


def load_checkpoint(store: ArtifactStore, key: str) -> dict[str, Any] | None:
    """The checkpoint at ``key`` (tensors on the CPU), or None if there is none."""
    return store.load_torch(key)


def remove_checkpoint(store: ArtifactStore, key: str) -> None:
    store.delete(key)


class CheckpointWriter:
    """Saves and removes checkpoints on one background thread, in the order they were asked.

    :meth:`save` copies the member's tensors before it returns (the training thread goes on
    changing them in place), so what is written is exactly the state at that epoch boundary.
    One thread keeps a save and a later remove of the same key in order. :meth:`durable`
    tells the epochs done of the newest checkpoint of a key whose write has completed: what
    a report may promise the control plane.
    """

    def __init__(self, store: ArtifactStore | None) -> None:
        self.store = store
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusetune-checkpoints")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self._durable: dict[str, int] = {}

    def save(
        self,
        key: str,
        epochs_done: int,
        model: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        schedules: dict[str, Any] | None = None,
    ) -> None:
        model, optimizer, schedules = _cpu_copy(model), _cpu_copy(optimizer), _cpu_copy(schedules)
        self._submit(self._save, key, epochs_done, model, optimizer, schedules)

    def remove(self, key: str) -> None:
        self._submit(self._remove, key)

    def assume(self, key: str, epochs_done: int) -> None:
        """``key`` holds a complete checkpoint at ``epochs_done`` already (a member resumed from it)."""
        with self._lock:
            self._durable[key] = epochs_done

    def durable(self, key: str) -> int | None:
        """Epochs done of ``key``'s newest checkpoint written completely, if any."""
        with self._lock:
            return self._durable.get(key)

    def _save(self, key: str, epochs_done: int, *state: Any) -> None:
        save_checkpoint(self.store, key, epochs_done, *state)
        with self._lock:
            self._durable[key] = epochs_done

    def _remove(self, key: str) -> None:
        with self._lock:
            self._durable.pop(key, None)
        remove_checkpoint(self.store, key)

    def flush(self) -> None:
        """Wait for every write asked so far; re-raises the first one that failed."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        try:
            self.flush()
        finally:
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
