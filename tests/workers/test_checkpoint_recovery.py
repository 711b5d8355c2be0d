"""Checkpoints that must survive a crash and checkpoints that did not: a local write is synced
before and after its rename, a damaged checkpoint is found out when read, and a member whose
checkpoint cannot be used resumes from an older one or from scratch, alone, through the
worker's real training loop (the other members of its array resume where they were)."""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fusetune.workers.actor import ArrayWorker
from fusetune.workers.checkpoints import (
    MAGIC,
    CheckpointWriter,
    UnreadableCheckpoint,
    checkpoint_dir,
    checkpoint_key,
    decode_checkpoint,
    encode_checkpoint,
    save_checkpoint,
    saved_epochs,
)
from fusetune.workers.spec import ArrayOutcome, ArraySpec, EpochReply, EpochReport, MemberSpec
from fusetune.workers.store import ArtifactStore
from fusetune.workers.training import train_array
from fusetune.workers.workloads import get_workload

PARAMS = {"hidden": 16, "lr": 0.05}


@pytest.fixture
def inbox() -> Iterator[ArrayWorker]:
    """A CPU worker's own inbox (offers and releases), without Ray; it sets torch's thread count."""
    threads = torch.get_num_threads()
    try:
        yield ArrayWorker("test-worker", "cpu", num_threads=threads)
    finally:
        torch.set_num_threads(threads)


def test_a_local_write_is_fsynced_before_its_rename_and_its_folder_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order that makes a reported checkpoint survive a power loss: the file's bytes are
    on disk before its name points at them, and the rename (and each new folder) is synced."""
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        calls.append(("replace", dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    root = tmp_path / "store"
    store = ArtifactStore(root)
    store.write("s/checkpoints/trial-1/3.pt", b"three")
    target = str(root / "s" / "checkpoints" / "trial-1" / "3.pt")
    folder = os.path.dirname(target)
    assert ("replace", target) in calls
    at = calls.index(("replace", target))
    synced_file = [path for kind, path in calls[:at] if kind == "fsync" and path.startswith(target + ".tmp-")]
    assert synced_file, calls  # the temporary file's bytes, before the rename
    assert ("fsync", folder) in calls[at + 1 :]  # the rename, after it
    # Each folder the write created is an entry of its parent, synced too.
    for parent in (tmp_path, root, root / "s", root / "s" / "checkpoints"):
        assert ("fsync", str(parent)) in calls[:at], (parent, calls)
    assert store.read("s/checkpoints/trial-1/3.pt") == b"three" and store.list("s/checkpoints/trial-1") == ["3.pt"]
    calls.clear()
    store.write("s/checkpoints/trial-1/3.pt", b"again")  # the folders exist: only the file and its folder
    assert [kind for kind, _ in calls] == ["fsync", "replace", "fsync"] and calls[-1] == ("fsync", folder)


def checkpoint(hidden: int = 16, epochs_done: int = 2) -> dict:
    model = get_workload("digits-mlp").build_model({"hidden": hidden})
    return {"epochs_done": epochs_done, "model": model.state_dict(), "optimizer": {"state": {}}}


def _flipped(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0x01  # one bit of a tensor: torch.load alone would not notice
    return bytes(damaged)


@pytest.mark.parametrize(
    "damage",
    [_flipped, lambda d: d[: len(d) - 100], lambda d: d[: len(MAGIC) + 5], lambda d: b"", lambda d: b"hello, world"],
    ids=["a bit flipped", "truncated", "cut in its checksum", "empty", "not torch's"],
)
def test_a_damaged_checkpoint_is_found_out_when_read(damage) -> None:  # type: ignore[no-untyped-def]
    data = encode_checkpoint(checkpoint())
    assert data.startswith(MAGIC) and decode_checkpoint(data)["epochs_done"] == 2
    with pytest.raises(UnreadableCheckpoint):
        decode_checkpoint(damage(data))


def test_a_checkpoint_is_torchs_bytes_with_a_checksum_and_old_ones_still_read() -> None:
    buffer = io.BytesIO()
    torch.save({"weights": torch.ones(2)}, buffer)  # torch's, but no checkpoint
    with pytest.raises(UnreadableCheckpoint, match="not a checkpoint"):
        decode_checkpoint(buffer.getvalue())
    # One written before checkpoints carried a checksum (torch.save alone) still reads.
    buffer = io.BytesIO()
    torch.save(checkpoint(epochs_done=7), buffer)
    assert decode_checkpoint(buffer.getvalue())["epochs_done"] == 7


def test_a_member_keeps_its_two_newest_recorded_checkpoints(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    writer = CheckpointWriter(store)
    folder = checkpoint_dir("study", 1)
    state = {"w": torch.zeros(1)}
    for epoch in (1, 2, 3, 4, 5):
        writer.save(folder, epoch, state, {"state": {}})
    for recorded, left in [(1, [1, 2, 3, 4, 5]), (3, [1, 3, 4, 5]), (4, [3, 4, 5]), (5, [4, 5])]:
        writer.confirm(folder, recorded)
        writer.flush()
        assert saved_epochs(store, folder) == left, recorded
    # A member resumed from 4 (5 was unreadable): 5 goes, 4 and the newest older one stay.
    for epoch in (2, 3):
        save_checkpoint(store, checkpoint_key("study", 1, epoch), epoch, state, {"state": {}})
    writer.confirm(folder, 4, newer=True)
    writer.flush()
    assert saved_epochs(store, folder) == [3, 4]
    writer.close()


def member(number: int, resume_epoch: int | None = 0) -> MemberSpec:
    return MemberSpec(trial_id=100 + number, optuna_trial_id=1000 + number, number=number, params=dict(PARAMS), resume_epoch=resume_epoch)


def spec(tmp_path: Path, array_id: int, resume_epoch: int, epochs: int = 4) -> ArraySpec:
    return ArraySpec(
        array_id=array_id, signature="s", study_name="study", workload="digits-mlp", epochs=epochs,
        members=tuple(member(n, resume_epoch) for n in range(4)), seed=5, artifact_dir=str(tmp_path),
        checkpoint_interval_s=0.0,
    )


def run(spec: ArraySpec, inbox: ArrayWorker | None = None) -> tuple[list[EpochReport], ArrayOutcome]:
    """Drive ``train_array`` as the control plane does for a study without a pruner, every
    report recorded; with an ``inbox``, every member is preempted at the first boundary."""
    if inbox is not None:
        inbox.release(spec.array_id, [m.trial_id for m in spec.members])
    training = train_array(spec, torch.device("cpu"), inbox)
    reports: list[EpochReport] = []
    try:
        reports.append(next(training))
        while True:
            reports.append(training.send(EpochReply()))
    except StopIteration as stop:
        return reports, stop.value


def test_a_member_whose_checkpoint_cannot_be_used_restarts_older_alone(tmp_path: Path, inbox: ArrayWorker) -> None:
    """Four members with checkpoints at epochs 1 and 2: the newest of one is corrupt (it
    resumes at 1), both of another are (it restarts at 0), a third has none left (0); the
    fourth resumes at 2, and the array trains all four to the end."""
    store = ArtifactStore(tmp_path)
    _, first = run(spec(tmp_path, 1, 0), inbox)  # preempted after an epoch: 1.pt each
    assert sorted(first.released) == [100, 101, 102, 103] and first.error is None
    _, second = run(spec(tmp_path, 2, 1), inbox)  # resumed at 1, preempted at 2
    assert sorted(second.released) == [100, 101, 102, 103] and second.error is None
    folders = [checkpoint_dir("study", n) for n in range(4)]
    assert [saved_epochs(store, f) for f in folders] == [[1, 2]] * 4

    newest = tmp_path / folders[0] / "2.pt"
    damaged = bytearray(newest.read_bytes())
    damaged[len(damaged) // 2] ^= 0x10
    newest.write_bytes(bytes(damaged))
    # Member 1: a whole checkpoint, but of another model (other shapes), and a truncated older one.
    save_checkpoint(store, f"{folders[1]}/2.pt", 2, checkpoint(hidden=32)["model"], {"state": {}})
    older = tmp_path / folders[1] / "1.pt"
    older.write_bytes(older.read_bytes()[:-64])
    store.delete_dir(folders[2])  # member 2: nothing left in the store

    reports, outcome = run(spec(tmp_path, 3, 2))
    assert outcome.error is None and outcome.failed == {}
    assert sorted(outcome.completed) == [100, 101, 102, 103]
    assert {j.trial_id: j.resumed_at_epoch for j in reports[0].joined} == {100: 1, 101: 0, 102: 0, 103: 2}
    steps: dict[int, list[int]] = {}
    for report in reports:
        for m in report.members:
            steps.setdefault(m.trial_id, []).append(m.step)
    # Each member reports every epoch from where it really resumed, once.
    assert steps == {100: [1, 2, 3], 101: [0, 1, 2, 3], 102: [0, 1, 2, 3], 103: [2, 3]}
    assert all(saved_epochs(store, f) == [] for f in folders)  # every member completed: nothing to resume


def _members_checkpointed(tmp_path: Path, array: ArraySpec) -> list[int]:
    store = ArtifactStore(tmp_path)
    return [m.number for m in array.members if saved_epochs(store, checkpoint_dir(array.study_name, m.number))]


def test_a_completed_members_checkpoints_stay_until_the_control_plane_has_recorded_its_end(tmp_path: Path) -> None:
    """A worker whose scheduler died trains on until Ray stops it, and may see its members
    complete: their checkpoints must stay for the standby that resumes them from what the
    dead scheduler recorded. So the worker's own run (``ArrayWorker.run``, driven here as the
    control plane drives it, without Ray) removes them only once the report saying they
    ended is acknowledged; a control plane that never answers leaves them all."""
    first = dataclasses.replace(spec(tmp_path, 7, resume_epoch=0, epochs=3), reply_timeout_s=0.2)
    silent = ArrayWorker("silent", "cpu", num_threads=torch.get_num_threads())
    items = list(silent.run(first))  # no report is ever acknowledged: its scheduler is gone
    assert isinstance(items[-1], ArrayOutcome) and sorted(items[-1].completed) == [m.trial_id for m in first.members]
    assert _members_checkpointed(tmp_path, first) == [0, 1, 2, 3]

    # Answered, the array ends as soon as its last report is acknowledged: never waiting out
    # the reply timeout (an hour here; the thread's join is a guard against hanging). A study
    # without a pruner, whose reports the scheduling loop acknowledges in batches.
    answered = dataclasses.replace(first, array_id=8, study_name="answered", reply_timeout_s=3600.0, prunes=False)
    worker = ArrayWorker("answered", "cpu", num_threads=torch.get_num_threads())
    items: list[EpochReport | ArrayOutcome] = []

    def drive() -> None:
        unacked = 0
        for item in worker.run(answered):
            # Each report recorded; as the scheduling loop does, one reply acknowledges those
            # not acknowledged yet, sent when members end (or name a new checkpoint, or are pruned).
            if isinstance(item, EpochReport):
                unacked += 1
                if any(m.state for m in item.members):
                    worker.reply(answered.array_id, EpochReply(acked=unacked))
                    unacked = 0
            items.append(item)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    driver.join(timeout=300)
    assert not driver.is_alive(), "the array waited for acknowledgements it had been given"
    outcome = items[-1]
    assert isinstance(outcome, ArrayOutcome) and sorted(outcome.completed) == [m.trial_id for m in answered.members]
    assert _members_checkpointed(tmp_path, answered) == []
