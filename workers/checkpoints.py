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
(complete, pruned, failed) has its checkpoints removed, once the control plane has recorded
its end (``workers.training``: a worker whose scheduler died removes nothing a standby may
resume from).

A checkpoint is durable once reported: the store's write returns only when the bytes survive
a crash (``workers.store``: fsync and rename on a local disk, one upload on an object store),
and only then may a report name it. It is also self-checking: the file begins with a magic
line and the SHA-256 of the rest, so a checkpoint that was truncated or corrupted at rest
(a bit flipped in its tensors, which ``torch.load`` alone does not notice) is found out when
it is read, as :class:`UnreadableCheckpoint`. A member keeps its newest recorded checkpoint
and the one recorded before it: when the newest cannot be read (or is missing), the member
resumes from the older one, else from epoch 0, and only that member
(``workers.training.resume_members``); the others of its array resume as usual.

Writes happen on a background thread (:class:`CheckpointWriter`), so an epoch's report waits
for its metrics only, never for the store.
"""

from __future__ import annotations

import hashlib
import io
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from fusetune.workers.store import ArtifactStore, get_store

__all__ = [
    "KEEP",
    "MAGIC",
    "CheckpointWriter",
    "UnreadableCheckpoint",
    "checkpoint_dir",
    "checkpoint_key",
    "checkpoint_path",
    "decode_checkpoint",
    "encode_checkpoint",
    "load_checkpoint",
    "remove_checkpoints",
    "save_checkpoint",
    "saved_epochs",
]

log = logging.getLogger(__name__)

#: What a checkpoint file begins with; the SHA-256 of the rest (torch.save's bytes) follows.
MAGIC = b"fusetune-checkpoint-1\n"
_DIGEST = hashlib.sha256().digest_size
#: Recorded checkpoints a member keeps: the newest, and the one before it to fall back to
#: when the newest cannot be read. (Unrecorded newer ones stay too, until recorded or resumed past.)
KEEP = 2


class UnreadableCheckpoint(ValueError):
    """A checkpoint that is there but cannot be used: truncated, corrupt, or not a checkpoint."""


def checkpoint_dir(study_name: str, trial_number: int) -> str:
    """The store folder of trial ``trial_number``'s checkpoints in ``study_name``: one per epoch kept."""
    return f"{study_name}/checkpoints/trial-{trial_number}"


def checkpoint_key(study_name: str, trial_number: int, epochs_done: int) -> str:
    """The store key of the trial's checkpoint after ``epochs_done`` epochs."""
    return f"{checkpoint_dir(study_name, trial_number)}/{epochs_done}.pt"


def checkpoint_path(store: str, study_name: str, trial_number: int, epochs_done: int | None = None) -> str:
    """Where the trial's checkpoints are (its folder, or the one after ``epochs_done`` epochs) in
    the store ``store``: a local path for a local store, a URI otherwise."""
    key = checkpoint_dir(study_name, trial_number) if epochs_done is None else checkpoint_key(study_name, trial_number, epochs_done)
    return get_store(store).location(key)


def save_checkpoint(
    store: ArtifactStore,
    key: str,
    epochs_done: int,
    model: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    schedules: dict[str, Any] | None = None,
) -> None:
    """Write as a whole and durably (``ArtifactStore.write``), with its checksum: a crash
    mid-write leaves no half checkpoint, and one damaged later is found out when it is read.

    ``schedules``: the member's LR schedulers' ``state_dict``s by role (``"warmup"``,
    ``"lr_scheduler"``), saved under ``"schedules"`` when given.
    """
    checkpoint: dict[str, Any] = {"epochs_done": epochs_done, "model": model, "optimizer": optimizer}
    if schedules:
        checkpoint["schedules"] = schedules
    store.write(key, encode_checkpoint(checkpoint))


def encode_checkpoint(checkpoint: dict[str, Any]) -> bytes:
    """A checkpoint's bytes in the store: :data:`MAGIC`, the SHA-256 of the payload, the
    payload (``torch.save``'s)."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    payload = buffer.getbuffer()
    return b"".join((MAGIC, hashlib.sha256(payload).digest(), payload))


def decode_checkpoint(data: bytes) -> dict[str, Any]:
    """The checkpoint in ``data`` (tensors on the CPU).

    Raises:
        UnreadableCheckpoint: the checksum does not match (truncated, or changed at rest),
            ``torch.load`` refuses it, or it lacks a checkpoint's fields.
    """
    view = memoryview(data)
    if data.startswith(MAGIC):
        digest, payload = view[len(MAGIC) : len(MAGIC) + _DIGEST], view[len(MAGIC) + _DIGEST :]
        if len(digest) < _DIGEST or hashlib.sha256(payload).digest() != digest:
            raise UnreadableCheckpoint("its checksum does not match its bytes: truncated or corrupt")
    else:  # written before checkpoints carried a checksum: torch.save's bytes alone
        payload = view
    try:
        checkpoint = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises RuntimeError, EOFError, UnpicklingError, ValueError...
        raise UnreadableCheckpoint(f"torch.load failed: {type(exc).__name__}: {exc}") from exc
    if not (
        isinstance(checkpoint, dict)
        and isinstance(checkpoint.get("epochs_done"), int)
        and isinstance(checkpoint.get("model"), dict)
        and isinstance(checkpoint.get("optimizer"), dict)
    ):
        raise UnreadableCheckpoint("it is not a checkpoint (epochs_done, model and optimizer are missing)")
    return checkpoint


def load_checkpoint(store: ArtifactStore, key: str) -> dict[str, Any] | None:
    """The checkpoint at ``key`` (tensors on the CPU), or None if there is none.

    Raises:
        UnreadableCheckpoint: there is one, but it cannot be used (:func:`decode_checkpoint`).
    """
    data = store.read(key)
    return None if data is None else decode_checkpoint(data)


def saved_epochs(store: ArtifactStore, folder: str) -> list[int]:
    """The epochs of the checkpoints in a trial's ``folder``, oldest first."""
    return sorted(int(name[:-3]) for name in store.list(folder) if name.endswith(".pt") and name[:-3].isdigit())


def remove_checkpoints(store: ArtifactStore, folder: str, keep: int | None = None) -> list[int]:
    """Remove the trial's checkpoints in ``folder``: all of them, or, with ``keep``, those
    newer than ``keep`` and all but the newest of those older. Returns the epochs left."""
    if keep is None:
        store.delete_dir(folder)
        return []
    saved = saved_epochs(store, folder)
    older = [e for e in saved if e < keep]
    kept = [*older[-(KEEP - 1) :], keep] if KEEP > 1 and older else [keep]
    for epoch in saved:
        if epoch not in kept:
            store.delete(f"{folder}/{epoch}.pt")
    return kept


class CheckpointWriter:
    """Saves and removes checkpoints on one background thread, in the order they were asked.

    A member's checkpoints are kept one per epoch in its folder until the control plane has
    recorded a report naming a newer one (:meth:`confirm`, from the acknowledgements of the
    reports): whatever the control plane knows of is in the store, so a trial it resumes
    never resumes past the values it has stored, even if the worker ran ahead of it. Of the
    recorded ones, the newest :data:`KEEP` stay: the older is the member's fallback should
    the newest be unreadable when it resumes.

    :meth:`save` copies the member's tensors before it returns (the training thread goes on
    changing them in place), so what is written is exactly the state at that epoch boundary.
    :meth:`durable` tells the epochs done of the newest checkpoint of a member whose write has
    completed: what a report may promise the control plane.
    """

    def __init__(self, store: ArtifactStore | None) -> None:
        self.store = store
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusetune-checkpoints")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self._durable: dict[str, int] = {}  # folder -> newest complete epoch
        self._written: dict[str, set[int]] = {}  # folder -> epochs in the store (this writer's, and the resumed one)
        self._recorded: dict[str, list[int]] = {}  # folder -> the newest KEEP epochs the control plane recorded

    def save(
        self,
        folder: str,
        epochs_done: int,
        model: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        schedules: dict[str, Any] | None = None,
    ) -> None:
        model, optimizer, schedules = _cpu_copy(model), _cpu_copy(optimizer), _cpu_copy(schedules)
        self._submit(self._save, folder, epochs_done, model, optimizer, schedules)

    def confirm(self, folder: str, epochs_done: int, newer: bool = False) -> None:
        """The control plane has recorded the checkpoint at ``epochs_done``: older ones can go,
        but for the one recorded before it (with ``newer``, a member resumed from it: every
        newer one in the store goes too, and of the older ones the newest stays)."""
        self._submit(self._confirm, folder, epochs_done, newer)

    def remove(self, folder: str) -> None:
        """The member ended: every checkpoint of it goes."""
        self._submit(self._remove, folder)

    def assume(self, folder: str, epochs_done: int) -> None:
        """``folder`` holds a complete checkpoint at ``epochs_done`` already (a member resumed from it)."""
        with self._lock:
            self._durable[folder] = epochs_done
            self._written.setdefault(folder, set()).add(epochs_done)

    def durable(self, folder: str) -> int | None:
        """Epochs done of the member's newest checkpoint written completely, if any."""
        with self._lock:
            return self._durable.get(folder)

    def _store(self) -> ArtifactStore:
        """The store, which an array that saves checkpoints has (a writer without one writes nothing)."""
        if self.store is None:
            raise RuntimeError("this checkpoint writer has no artifact store: its array keeps no checkpoints")
        return self.store

    def _save(self, folder: str, epochs_done: int, *state: Any) -> None:
        save_checkpoint(self._store(), f"{folder}/{epochs_done}.pt", epochs_done, *state)
        with self._lock:
            self._durable[folder] = epochs_done
            self._written.setdefault(folder, set()).add(epochs_done)

    def _confirm(self, folder: str, epochs_done: int, newer: bool = False) -> None:
        if newer:
            kept = remove_checkpoints(self._store(), folder, keep=epochs_done)
            with self._lock:
                self._recorded[folder] = kept
                self._written[folder] = set(kept)
            return
        with self._lock:
            recorded = self._recorded.get(folder, [])
            if epochs_done not in recorded:
                recorded = self._recorded[folder] = sorted({*recorded, epochs_done})[-KEEP:]
            written = self._written.get(folder, set())
            old = sorted(e for e in written if e < epochs_done and e not in recorded)
            self._written[folder] = written - set(old)
        for epoch in old:
            self._store().delete(f"{folder}/{epoch}.pt")

    def _remove(self, folder: str) -> None:
        with self._lock:
            self._durable.pop(folder, None)
            self._written.pop(folder, None)
            self._recorded.pop(folder, None)
        remove_checkpoints(self._store(), folder)

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
