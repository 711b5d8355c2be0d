"""How trials end besides COMPLETE: FAIL with the error visible in the API, and PRUNED."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import torch

from fusetune.client import Client
from fusetune.workers.workloads import get_workload
from tests.conftest import running_service

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


BACKFILL_SPACE = space(lr=D.CategoricalDistribution([1e-5, 0.2]), momentum=D.CategoricalDistribution([0.9]))


def test_pruned_members_free_slots_that_waiting_trials_take(service: tuple[Client, str, Path]) -> None:
    """Through the whole service: pruned trials stop, the others complete, every trial trains once."""
    client, url, _ = service
    study = client.create_study(
        "digits-mlp", n_trials=8, epochs=20, name="backfill", search_space=BACKFILL_SPACE,
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
    # Eight trials, at most four at a time (max_array_size=4). Whether waiting trials join the
    # first array or start a new one depends on how far it got meanwhile: tests/test_backfill.py
    # pins it down.
    assert sum(a["size"] for a in arrays) == 8
