"""The fault matrix, in-process part: a worker killed, a worker that hangs, a study that breaks.

Each test injects its fault mid-sweep, waits for the event it expects (a checkpoint reported,
a resume reported, a row written), never for a guessed time, and then checks on the
database, through ``optuna.load_study``, that every trial ended with its curve intact: no
metric point lost, none stored twice. Each writes its row of docs/reliability.md's matrix
(tests/faults.py).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa

from fusetune.client import Client
from fusetune.workers.checkpoints import saved_epochs
from fusetune.workers.store import ArtifactStore
from tests.faults import GUARD_S, audit, faults_service, record, resumed, wait_until

pytestmark = pytest.mark.slow
D = optuna.distributions
ONE_SHAPE = {
    "hidden": D.distribution_to_json(D.CategoricalDistribution([32])),
    "lr": D.distribution_to_json(D.FloatDistribution(0.01, 0.1)),
}



@pytest.fixture(scope="module")
def service(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, str, Path]]:
    """One worker, heartbeats every 0.5 s and a hung worker after 5 s; its epochs have the
    default deadline (an hour: tests/test_faults_epoch.py shortens it), so however slowly a
    loaded machine trains them, none overruns."""
    with faults_service(ray_cluster, tmp_path_factory.mktemp("faults")) as found:
        yield found


def checkpoint_epochs(url: str, study_id: int) -> dict[int, int | None]:
    """Each trial's checkpoint epoch as the control plane holds it (from its workers' reports)."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT number, checkpoint_epoch FROM ft_trials WHERE study_id = :s"), {"s": study_id})
            return dict(rows.all())
    finally:
        engine.dispose()


def worker_pid(url: str, name: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            node = conn.execute(sa.text("SELECT node FROM ft_workers WHERE name = :n"), {"n": name}).scalar_one()
    finally:
        engine.dispose()
    return int(node.rsplit(":", 1)[1])


def crash_mid_array(client: Client, url: str, name: str, fault: str, sig: signal.Signals, epochs: int = 60) -> dict:
    """Start a one-array study, hit its worker's process with ``sig`` once every member has a
    checkpoint reported, and measure what it cost; returns the audit."""
    study = client.create_study(
        "digits-mlp", n_trials=4, epochs=epochs, name=name, search_space=ONE_SHAPE,
        sampler={"name": "RandomSampler", "kwargs": {"seed": 1}},
    )
    sid = study["id"]
    durable = wait_until(
        lambda: (c := checkpoint_epochs(url, sid)) and len(c) == 4 and all((e or 0) >= 2 for e in c.values()) and c,
        "every member's second checkpoint",
    )
    (array,) = [a for a in client.arrays(sid) if a["state"] == "RUNNING"]
    pid = worker_pid(url, array["worker"])
    os.kill(pid, sig)
    hit = time.monotonic()
    wait_until(lambda: resumed(client, sid, set(durable)), "every member to resume")
    recovered = time.monotonic() - hit
    done = client.wait(sid, timeout=GUARD_S)
    assert done["trial_counts"].get("COMPLETE") == 4, done["trial_counts"]
    result = audit(url, name, epochs)
    assert result["unfinished"] == [] and result["states"] == ["COMPLETE"]
    assert result["points_lost"] == 0 and result["points_duplicated"] == 0
    for number, at in result["resumed_at_epochs"].items():
        # A checkpoint the worker reported is never lost: the trial resumes from it or later.
        assert len(at) == 1 and durable[number] <= at[0] < epochs
    arrays = client.arrays(sid)
    assert arrays[0]["state"] == "FAIL" and arrays[0]["error"]
    record(
        fault, points_lost=result["points_lost"], points_duplicated=result["points_duplicated"],
        trials_failed=result["trials_failed"], epochs_retrained=result["epochs_retrained"], trials=4, epochs=epochs, recover_s=round(recovered, 2),
        resumed_at_epochs=result["resumed_at_epochs"], how="measured by tests/test_faults.py",
    )
    return {**result, "arrays": arrays}


def test_a_worker_actor_killed_mid_array(service: tuple[Client, str, Path]) -> None:
    client, url, _ = service
    result = crash_mid_array(client, url, "fault-kill-worker", "worker actor killed (SIGKILL)", signal.SIGKILL)
    assert "failed" in result["arrays"][0]["error"]


def test_a_worker_that_hangs_is_replaced_and_its_members_resume(service: tuple[Client, str, Path]) -> None:
    """SIGSTOP freezes the worker's process: it answers no heartbeat, is killed and replaced."""
    client, url, _ = service
    result = crash_mid_array(client, url, "fault-hang", "worker hangs (SIGSTOP, no heartbeat in 5 s)", signal.SIGSTOP)
    assert "no heartbeat" in result["arrays"][0]["error"]


def test_a_study_whose_sampler_raises_or_whose_workload_cannot_build_fails_alone(service: tuple[Client, str, Path]) -> None:
    client, url, _ = service
    # GridSampler over an empty grid raises in Study.ask, for every trial.
    broken = client.create_study(
        "digits-mlp", n_trials=4, epochs=2, name="fault-sampler",
        sampler={"name": "GridSampler", "kwargs": {"search_space": {"lr": []}}},
    )
    unbuildable = client.create_study("tests.unbuildable_workload:WORKLOAD", n_trials=2, epochs=2, name="fault-build")
    fine = client.create_study(
        "digits-mlp", n_trials=4, epochs=3, name="fault-neighbour", search_space=ONE_SHAPE,
        sampler={"name": "RandomSampler", "kwargs": {"seed": 5}},
    )
    done = client.wait(fine["id"], timeout=GUARD_S)
    assert done["state"] == "COMPLETE" and done["trial_counts"].get("COMPLETE") == 4
    failed = client.wait(broken["id"], timeout=GUARD_S)
    assert failed["state"] == "FAILED" and "cannot be empty" in failed["error"]
    assert client.trials(broken["id"]) == []  # nothing was asked: the sampler raised first
    built = client.wait(unbuildable["id"], timeout=GUARD_S)
    assert built["state"] == "FAILED" and {k: n for k, n in built["trial_counts"].items() if n} == {"FAIL": 2}
    assert all("digits.npz" in t["error"] for t in client.trials(unbuildable["id"]))
    result = audit(url, "fault-neighbour", 3)
    assert result["states"] == ["COMPLETE"] and result["points_lost"] == 0 and result["points_duplicated"] == 0
    record(
        "a study's sampler raises / its workload cannot build", points_lost=0, points_duplicated=0,
        trials_failed=result["trials_failed"], epochs_retrained=0,
        trials=4, epochs=3, recover_s=None, how="measured by tests/test_faults.py (the neighbouring study's curves)",
    )


def _flip_a_byte(path: Path) -> None:
    """Flip a byte in the middle of ``path``: in a checkpoint, one of its tensors' (the file
    still loads with ``torch.load`` alone; its checksum no longer matches)."""
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))


def test_a_corrupt_checkpoint_restarts_that_member_from_an_older_one_and_the_others_resume(
    service: tuple[Client, str, Path],
) -> None:
    """Checkpoints are corrupted while the study is paused: one member's newest (it restarts
    from its older one) and every one of another member (it restarts from epoch 0). The other
    two resume where they left, and the array trains all four to the end, every curve whole."""
    client, url, artifacts = service
    name, epochs = "fault-corrupt-checkpoint", 30
    sid = client.create_study(
        "digits-mlp", n_trials=4, epochs=epochs, name=name, search_space=ONE_SHAPE,
        sampler={"name": "RandomSampler", "kwargs": {"seed": 3}},
    )["id"]
    wait_until(
        lambda: (c := checkpoint_epochs(url, sid)) and len(c) == 4 and all((e or 0) >= 2 for e in c.values()),
        "every member's second checkpoint recorded",
    )
    assert client.pause_study(sid)["state"] == "PAUSED"
    # Paused: every member left its array checkpointed, and the array (its checkpoint writer) has ended.
    wait_until(
        lambda: all(t["state"] == "WAITING" for t in client.trials(sid))
        and all(a["state"] != "RUNNING" for a in client.arrays(sid)),
        "the paused array to end",
    )
    left_at = checkpoint_epochs(url, sid)
    older, scratch = min(left_at), max(left_at)
    store = ArtifactStore(artifacts)
    kept = {n: saved_epochs(store, f"{name}/checkpoints/trial-{n}") for n in (older, scratch)}
    assert all(len(epochs_) >= 2 and epochs_[-1] == left_at[n] for n, epochs_ in kept.items()), kept
    _flip_a_byte(artifacts / name / "checkpoints" / f"trial-{older}" / f"{left_at[older]}.pt")
    for epoch in kept[scratch]:
        _flip_a_byte(artifacts / name / "checkpoints" / f"trial-{scratch}" / f"{epoch}.pt")

    hit = time.monotonic()
    assert client.resume_study(sid)["state"] == "RUNNING"
    wait_until(lambda: resumed(client, sid, set(left_at)), "every member to resume")
    recovered = time.monotonic() - hit
    done = client.wait(sid, timeout=GUARD_S)
    assert done["trial_counts"].get("COMPLETE") == 4, done["trial_counts"]
    result = audit(url, name, epochs)
    assert result["unfinished"] == [] and result["states"] == ["COMPLETE"]
    assert result["points_lost"] == 0 and result["points_duplicated"] == 0
    # One restarted from its newest older checkpoint, one from scratch; the others where they left.
    fallback = kept[older][-2]
    assert result["resumed_at_epochs"] == {**{n: [at] for n, at in left_at.items()}, older: [fallback], scratch: [0]}
    assert result["epochs_retrained"] == left_at[older] - fallback + left_at[scratch]
    record(
        "checkpoints corrupt: one member's newest, another's all (study paused, resumed)",
        points_lost=result["points_lost"], points_duplicated=result["points_duplicated"],
        trials_failed=result["trials_failed"], epochs_retrained=result["epochs_retrained"], trials=4, epochs=epochs, recover_s=round(recovered, 2),
        resumed_at_epochs=result["resumed_at_epochs"], how="measured by tests/test_faults.py",
    )
