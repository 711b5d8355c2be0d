"""How trials end besides COMPLETE: FAIL with the error visible in the API, and PRUNED."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa
import torch

from fusetune.client import Client
from fusetune.server.db import get_engine
from tests.conftest import running_service
from fusetune.workers.workloads import get_workload

pytestmark = pytest.mark.slow
D = optuna.distributions


def space(**distributions: D.BaseDistribution) -> dict[str, str]:
    return {name: D.distribution_to_json(d) for name, d in distributions.items()}


@pytest.fixture(scope="module")
def service(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, str, Path]]:
    root = tmp_path_factory.mktemp("service")
    url = f"sqlite:///{root / 'fusetune.db'}"
    # min_member_efficiency near 0: whether a waiting trial may join an array must not hang on
    # how fast this machine measured a fused step against a solo one.
    with running_service(
        ray_cluster, url, cpu_workers=1, max_array_size=4, artifact_dir=root / "artifacts", checkpoint_interval_s=0,
        min_member_efficiency=1e-6,
    ) as client:
        yield client, url, root / "artifacts"


def test_params_the_model_rejects_fail_with_the_error(service: tuple[Client, str, Path]) -> None:
    client, url, _ = service
    study = client.create_study(
        "digits-mlp", n_trials=4, epochs=1, name="bad-width",
        search_space=space(hidden=D.CategoricalDistribution([-1, 16])),
        sampler={"name": "RandomSampler", "kwargs": {"seed": 7}},  # draws each choice twice
    )
    client.wait(study["id"], timeout=120)
    trials = client.trials(study["id"])
    failed = [t for t in trials if t["params"]["hidden"] == -1]
    assert len(failed) == 2 and all(t["state"] == "FAIL" for t in failed)
    assert all("negative dimension" in t["error"] and t["array_id"] is None for t in failed)
    assert all(t["state"] == "COMPLETE" for t in trials if t["params"]["hidden"] == 16)
    states = {t.number: t.state for t in optuna.load_study(study_name="bad-width", storage=url).trials}
    assert {states[t["number"]] for t in failed} == {optuna.trial.TrialState.FAIL}


def test_diverged_members_fail_and_the_rest_of_the_array_completes(service: tuple[Client, str, Path]) -> None:
    client, url, _ = service
    study = client.create_study(
        "digits-mlp", n_trials=4, epochs=3, name="diverge",
        search_space=space(lr=D.CategoricalDistribution([0.3, 1e12])),
        sampler={"name": "RandomSampler", "kwargs": {"seed": 7}},  # draws each choice twice
    )
    client.wait(study["id"], timeout=120)
    trials = client.trials(study["id"])
    assert len({t["array_id"] for t in trials}) == 1  # all four trained as one array
    for t in trials:
        if t["params"]["lr"] == 1e12:
            assert t["state"] == "FAIL" and "non-finite loss" in t["error"]
        else:
            assert t["state"] == "COMPLETE" and t["value"] > 0.5


def test_pruned_members_stop_reporting(service: tuple[Client, str, Path]) -> None:
    client, url, _ = service
    study = client.create_study(
        "digits-mlp", n_trials=4, epochs=3, name="prune",
        search_space=space(lr=D.CategoricalDistribution([1e-5, 0.2]), momentum=D.CategoricalDistribution([0.9])),
        sampler={"name": "RandomSampler", "kwargs": {"seed": 7}},  # draws each choice twice
        pruner={"name": "ThresholdPruner", "kwargs": {"lower": 0.3}},
    )
    client.wait(study["id"], timeout=120)
    for t in client.trials(study["id"]):
        if t["params"]["lr"] == 1e-5:  # learns nothing in an epoch: below the threshold at once
            assert t["state"] == "PRUNED"
            assert list(t["intermediate_values"]) in (["0"], [0])
            assert t["value"] == list(t["intermediate_values"].values())[0]
        else:
            assert t["state"] == "COMPLETE" and len(t["intermediate_values"]) == 3
    pruned = [t for t in optuna.load_study(study_name="prune", storage=url).trials if t.state.name == "PRUNED"]
    assert len(pruned) == 2


def test_finished_members_are_saved_as_plain_state_dicts(service: tuple[Client, str, Path]) -> None:
    client, url, artifacts = service
    study = client.create_study(
        "digits-cnn", n_trials=2, epochs=1, name="export",
        search_space=space(channels=D.CategoricalDistribution([8]), lr=D.FloatDistribution(1e-3, 1e-2)),
        sampler={"name": "RandomSampler", "kwargs": {"seed": 0}},
    )
    client.wait(study["id"], timeout=120)
    workload = get_workload("digits-cnn")
    x, y = workload.datasets()[1].tensors
    for trial in optuna.load_study(study_name="export", storage=url).trials:
        path = Path(trial.user_attrs["state_dict"])
        assert path.parent == artifacts / "export"
        model = workload.build_model(trial.params)
        model.load_state_dict(torch.load(path), strict=True)
        model.eval()
        with torch.no_grad():
            assert workload.metric(model(x), y) == pytest.approx(trial.value, abs=1e-6)


def test_pruned_members_free_slots_that_waiting_trials_take(service: tuple[Client, str, Path]) -> None:
    """Backfill: a pruned member's slot goes to a waiting trial of the same class at an epoch boundary."""
    client, url, _ = service
    study = client.create_study(
        "digits-mlp", n_trials=8, epochs=20, name="backfill",
        search_space=space(lr=D.CategoricalDistribution([1e-5, 0.2]), momentum=D.CategoricalDistribution([0.9])),
        sampler={"name": "RandomSampler", "kwargs": {"seed": 7}},  # trials 2, 3 and 6 learn nothing
        pruner={"name": "ThresholdPruner", "kwargs": {"lower": 0.3}},
    )
    client.wait(study["id"], timeout=180)
    trials = client.trials(study["id"])
    arrays = client.arrays(study["id"])
    for t in trials:
        steps = sorted(int(k) for k in t["intermediate_values"])
        if t["params"]["lr"] == 1e-5:
            assert t["state"] == "PRUNED" and steps == [0]
        else:  # late joiners count their own epochs from 0, like everyone else
            assert t["state"] == "COMPLETE" and steps == list(range(20))
    # Eight trials, at most four at a time (max_array_size=4): the first array took the slots
    # of its pruned members, so it held more than four over its life. (Whether the last
    # waiting trials still join it or start a new array depends on timing.)
    assert sum(a["size"] for a in arrays) == 8
    assert arrays[0]["size"] > 4


def kill_worker(url: str) -> str:
    """SIGKILL the CPU worker's process; returns the node it ran on."""
    with get_engine(url).connect() as conn:
        node = conn.execute(sa.text("SELECT node FROM ft_workers WHERE name = 'fusetune-cpu-0'")).scalar_one()
    os.kill(int(node.rsplit(":", 1)[1]), signal.SIGKILL)
    return node


def test_a_worker_killed_before_any_checkpoint_fails_its_trials_and_is_replaced(
    service: tuple[Client, str, Path],
) -> None:
    client, url, _ = service
    # Batch size 1 makes one epoch take seconds (after seconds of sizing dry runs): the kill
    # lands before the first epoch boundary, so no member has a checkpoint to resume from.
    study = client.create_study(
        "digits-mlp", n_trials=2, epochs=2000, name="crash",
        search_space=space(lr=D.FloatDistribution(0.01, 0.1), batch_size=D.IntDistribution(1, 1)),
    )
    deadline = time.monotonic() + 60
    while not any(t["state"] == "RUNNING" for t in client.trials(study["id"])):
        assert time.monotonic() < deadline, "the array never started"
        time.sleep(0.1)
    node = kill_worker(url)

    client.wait(study["id"], timeout=60)
    for t in client.trials(study["id"]):
        assert t["state"] == "FAIL"
        assert "worker fusetune-cpu-0 failed" in t["error"]
    assert [a["state"] for a in client.arrays(study["id"])] == ["FAIL"]
    states = {t.state for t in optuna.load_study(study_name="crash", storage=url).trials}
    assert states == {optuna.trial.TrialState.FAIL}

    # The pool replaced the dead worker: the next study trains as usual.
    again = client.create_study("digits-mlp", n_trials=1, epochs=1, name="after-crash")
    assert client.wait(again["id"], timeout=120)["trial_counts"]["COMPLETE"] == 1
    with get_engine(url).connect() as conn:
        assert conn.execute(sa.text("SELECT node FROM ft_workers WHERE name = 'fusetune-cpu-0'")).scalar_one() != node


def test_a_worker_killed_mid_array_resumes_its_trials_from_their_checkpoints(
    service: tuple[Client, str, Path],
) -> None:
    client, url, artifacts = service
    epochs = 100
    study = client.create_study(
        "digits-mlp", n_trials=2, epochs=epochs, name="resume",
        search_space=space(lr=D.FloatDistribution(0.01, 0.1)),
    )
    deadline = time.monotonic() + 120
    while not any(len(t["intermediate_values"]) >= 3 for t in client.trials(study["id"])):
        assert time.monotonic() < deadline, "no trial reached its third epoch"
        time.sleep(0.05)
    assert list((artifacts / "resume" / "checkpoints").glob("trial-*/*.pt")), "no checkpoint at the epoch boundary"
    kill_worker(url)

    done = client.wait(study["id"], timeout=180)
    assert done["trial_counts"]["COMPLETE"] == 2
    for t in client.trials(study["id"]):
        assert sorted(map(int, t["intermediate_values"])) == list(range(epochs))
    for t in optuna.load_study(study_name="resume", storage=url).trials:
        assert len(t.user_attrs["resumed_at_epochs"]) == 1 and 2 <= t.user_attrs["resumed_at_epochs"][0] < epochs
    arrays = client.arrays(study["id"])
    assert arrays[0]["state"] == "FAIL" and "fusetune-cpu-0 failed" in arrays[0]["error"]
    assert arrays[0]["epochs_done"] >= 2
    # Resumed, not restarted: the arrays together ran each epoch once, plus exactly the epochs
    # the first array reported after the checkpoint the trials resumed from (checkpoints are
    # written in the background at every boundary here: the one being written when the kill
    # came, and on a loaded machine the one queued behind it, at most).
    resumed_at = {t.user_attrs["resumed_at_epochs"][0] for t in optuna.load_study(study_name="resume", storage=url).trials}
    assert len(resumed_at) == 1  # both members of the array, from the same boundary
    lost = arrays[0]["epochs_done"] - resumed_at.pop()
    assert 0 <= lost <= 2
    assert sum(a["epochs_done"] for a in arrays) == epochs + lost
    assert {t.state for t in optuna.load_study(study_name="resume", storage=url).trials} == {
        optuna.trial.TrialState.COMPLETE
    }
    # Finished members leave no checkpoint behind.
    assert not list((artifacts / "resume" / "checkpoints").glob("trial-*/*.pt"))
