"""End to end through the live service: trials that choose their own optimizer, and a
multi-objective study whose Pareto front Optuna reads back."""

from __future__ import annotations

from collections.abc import Iterator

import optuna
import pytest

from fusetune.client import Client
from tests.conftest import running_service

pytestmark = pytest.mark.slow
D = optuna.distributions


def space(**distributions: D.BaseDistribution) -> dict[str, str]:
    return {name: D.distribution_to_json(d) for name, d in distributions.items()}


@pytest.fixture(scope="module")
def service(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, str]]:
    root = tmp_path_factory.mktemp("service")
    url = f"sqlite:///{root / 'fusetune.db'}"
    with running_service(ray_cluster, url, max_array_size=8, artifact_dir=root / "artifacts") as client:
        yield client, url


def test_trials_choosing_their_optimizer_train_in_arrays_of_one_optimizer(service: tuple[Client, str]) -> None:
    client, url = service
    study = client.create_study(
        "digits-mlp", n_trials=9, epochs=2, name="optimizers",
        search_space=space(
            optimizer=D.CategoricalDistribution(["SGD", "Adam", "RMSprop"]),
            lr=D.FloatDistribution(1e-3, 1e-2, log=True),
            hidden=D.CategoricalDistribution([16]),
        ),
        sampler={"name": "RandomSampler", "kwargs": {"seed": 2}},
        lr_scheduler={"name": "StepLR", "kwargs": {"step_size": 1, "gamma": 0.5}},
        warmup_epochs=1,
        max_norm=5.0,
    )
    assert client.wait(study["id"], timeout=300)["trial_counts"]["COMPLETE"] == 9
    trials = {t["id"]: t for t in client.trials(study["id"])}
    optimizers = {t["params"]["optimizer"] for t in trials.values()}
    assert len(optimizers) >= 2  # the seed draws more than one
    for array in client.arrays(study["id"]):
        members = [trials[i] for i in array["trial_ids"]]
        assert len({m["params"]["optimizer"] for m in members}) == 1, members  # never two in one array
    # Equal signatures exactly where the optimizer is equal (the widths are).
    by_optimizer: dict[str, set[str]] = {}
    for t in trials.values():
        by_optimizer.setdefault(t["params"]["optimizer"], set()).add(t["signature"])
    assert all(len(s) == 1 for s in by_optimizer.values())
    assert len({s for sigs in by_optimizer.values() for s in sigs}) == len(by_optimizer)
    assert all(0.0 <= t["value"] <= 1.0 for t in trials.values())


def test_a_multi_objective_study_reports_every_metric_and_optuna_reads_its_pareto_front(service: tuple[Client, str]) -> None:
    client, url = service
    study = client.create_study(
        "digits-mlp", n_trials=8, epochs=2, name="pareto",
        metrics=["accuracy", "n_params"],
        search_space=space(
            lr=D.FloatDistribution(0.01, 0.3, log=True),
            momentum=D.FloatDistribution(0.0, 0.9),
            hidden=D.CategoricalDistribution([8, 16, 32]),
        ),
    )
    assert study["sampler"]["name"] == "NSGAIISampler"
    done = client.wait(study["id"], timeout=300)
    assert done["trial_counts"]["COMPLETE"] == 8

    loaded = optuna.load_study(study_name="pareto", storage=url)
    assert loaded.metric_names == ["accuracy", "n_params"]
    complete = [t for t in loaded.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 8
    for t in complete:
        hidden = t.params["hidden"]
        accuracy, size = t.values
        assert size == (64 * hidden + hidden) + (hidden * hidden + hidden) + (hidden * 10 + 10)
        assert accuracy == t.intermediate_values[1]  # intermediate values are the first metric

    def dominates(a: optuna.trial.FrozenTrial, b: optuna.trial.FrozenTrial) -> bool:
        at_least = a.values[0] >= b.values[0] and a.values[1] <= b.values[1]
        return at_least and (a.values[0] > b.values[0] or a.values[1] < b.values[1])

    front = {t.number for t in complete if not any(dominates(u, t) for u in complete)}
    assert {t.number for t in loaded.best_trials} == front
    assert {b["number"] for b in done["best_trials"]} == front
    assert done["best_trial"] is None
    by_number = {t.number: t for t in complete}
    assert all(b["values"] == by_number[b["number"]].values for b in done["best_trials"])
    # fusetune's own value of a trial is its first objective.
    assert all(t["value"] == by_number[t["number"]].values[0] for t in client.trials(study["id"]))


def test_a_multi_objective_study_naming_a_pruner_is_refused(service: tuple[Client, str]) -> None:
    client, _ = service
    from fusetune.client import FusetuneError

    with pytest.raises(FusetuneError) as error:
        client.create_study("digits-mlp", n_trials=2, metrics=["accuracy", "n_params"], pruner={"name": "MedianPruner"})
    assert error.value.status_code == 422
    assert ["body", "pruner"] in [e["loc"] for e in error.value.detail]
