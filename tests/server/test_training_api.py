"""A study's optimizer, LR schedule, clipping, AMP and objectives over real HTTP: what a valid
request stores, and the 422 that bad input gets (naming the field, writing nothing)."""

from __future__ import annotations

import json

import httpx
import optuna
import pytest

from tests.server.test_studies_api import field_of, row_counts

VALID = {"workload": "digits-mlp", "n_trials": 4, "epochs": 2}
CATEGORICAL = optuna.distributions.CategoricalDistribution


def test_training_settings_and_objectives_are_stored_with_the_optuna_study(api: httpx.Client, database_url: str) -> None:
    request = {
        **VALID,
        "name": "pareto",
        "optimizer": {"name": "adamw", "kwargs": {"weight_decay": 0.05, "betas": [0.8, 0.99]}},
        "lr_scheduler": {"name": "StepLR", "kwargs": {"step_size": 1, "gamma": 0.5}},
        "warmup_epochs": 1,
        "max_norm": 2.0,
        "amp": True,
        "metrics": ["accuracy", "n_params"],
    }
    response = api.post("/api/v1/studies", json=request)
    assert response.status_code == 201, response.text
    study = response.json()
    assert study["optimizer"] == {"name": "AdamW", "kwargs": {"weight_decay": 0.05, "betas": [0.8, 0.99]}}  # torch's name
    assert study["lr_scheduler"] == {"name": "StepLR", "kwargs": {"step_size": 1, "gamma": 0.5}}
    assert (study["warmup_epochs"], study["max_norm"], study["amp"]) == (1, 2.0, True)
    assert study["metrics"] == ["accuracy", "n_params"]
    assert study["sampler"]["name"] == "NSGAIISampler"  # multi-objective: NSGA-II unless the request names one
    assert study["best_trial"] is None and study["best_trials"] == []

    loaded = optuna.load_study(study_name="pareto", storage=database_url)
    assert loaded.directions == [optuna.study.StudyDirection.MAXIMIZE, optuna.study.StudyDirection.MINIMIZE]
    assert loaded.metric_names == ["accuracy", "n_params"]


def test_a_study_that_sets_nothing_keeps_the_workloads_training(api: httpx.Client, database_url: str) -> None:
    study = api.post("/api/v1/studies", json={**VALID, "name": "plain"}).json()
    assert study["sampler"] == {"name": "TPESampler", "kwargs": {}}
    assert study["metrics"] == ["accuracy"]
    assert study["optimizer"] is None and study["lr_scheduler"] is None
    loaded = optuna.load_study(study_name="plain", storage=database_url)
    assert loaded.directions == [optuna.study.StudyDirection.MAXIMIZE]
    assert loaded.metric_names is None  # nothing stored beyond what a plain study had


def test_directions_override_the_metrics_own_and_a_named_sampler_stays(api: httpx.Client, database_url: str) -> None:
    request = {
        **VALID, "name": "mine", "metrics": ["n_params", "accuracy"], "directions": ["maximize", "maximize"],
        "sampler": {"name": "RandomSampler", "kwargs": {"seed": 1}},
    }
    study = api.post("/api/v1/studies", json=request).json()
    assert study["sampler"] == {"name": "RandomSampler", "kwargs": {"seed": 1}}
    loaded = optuna.load_study(study_name="mine", storage=database_url)
    assert loaded.directions == [optuna.study.StudyDirection.MAXIMIZE] * 2


def _space(**distributions: optuna.distributions.BaseDistribution) -> dict[str, str]:
    return {k: optuna.distributions.distribution_to_json(d) for k, d in distributions.items()}


@pytest.mark.parametrize(
    ("change", "loc", "named"),
    [
        ({"optimizer": {"name": "Adamm"}}, ["body", "optimizer", "name"], "Adamm"),
        ({"optimizer": {"name": "SGD", "kwargs": {"weight_dcay": 0.1}}}, ["body", "optimizer", "kwargs", "weight_dcay"], "weight_dcay"),
        ({"optimizer": {"name": "SGD", "kwargs": {"betas": [0.9, 0.99]}}}, ["body", "optimizer", "kwargs", "betas"], "betas"),
        ({"optimizer": {"name": "Adam", "kwargs": {"betas": [0.9]}}}, ["body", "optimizer", "kwargs", "betas"], "betas"),
        ({"optimizer": {"name": "Adam", "kwargs": {"betas": [0.9, 0.99, 0.5]}}}, ["body", "optimizer", "kwargs", "betas"], "betas"),
        ({"optimizer": {"name": "Adam", "kwargs": {"betas": [1.5, 0.99]}}}, ["body", "optimizer", "kwargs", "betas"], "betas"),
        ({"optimizer": {"name": "SGD", "kwargs": {"lr": -1}}}, ["body", "optimizer", "kwargs", "lr"], "lr"),
        ({"optimizer": {"name": "SGD", "kwargs": {"nesterov": True}}}, ["body", "optimizer", "kwargs", "nesterov"], "nesterov"),
        ({"lr_scheduler": {"name": "NoSuchLR"}}, ["body", "lr_scheduler", "name"], "NoSuchLR"),
        ({"lr_scheduler": {"name": "LambdaLR"}}, ["body", "lr_scheduler", "name"], "LambdaLR"),  # takes a function
        ({"lr_scheduler": {"name": "StepLR", "kwargs": {"step_sise": 2}}}, ["body", "lr_scheduler", "kwargs", "step_sise"], "step_sise"),
        ({"lr_scheduler": {"name": "LinearLR", "kwargs": {"start_factor": 2.0}}}, ["body", "lr_scheduler", "kwargs", "start_factor"], "start_factor"),
        # Accepted by StepLR's constructor, a division by zero at its second step.
        ({"lr_scheduler": {"name": "StepLR", "kwargs": {"step_size": 0}}}, ["body", "lr_scheduler", "kwargs", "step_size"], "step_size"),
        ({"warmup_epochs": -1}, ["body", "warmup_epochs"], "warmup_epochs"),
        ({"max_norm": 0}, ["body", "max_norm"], "max_norm"),
        ({"metrics": ["accuracy", "recall"]}, ["body", "metrics", 1], "recall"),
        ({"metrics": ["accuracy", "accuracy"]}, ["body", "metrics"], "accuracy"),
        ({"metrics": ["accuracy", "n_params"], "directions": ["maximize"]}, ["body", "directions"], "directions"),
        ({"directions": ["maximize", "minimize"]}, ["body", "directions"], "directions"),
        ({"metrics": ["accuracy", "n_params"], "pruner": {"name": "MedianPruner"}}, ["body", "pruner"], "pruner"),
        ({"metrics": ["accuracy", "n_params"], "direction": "maximize"}, ["body", "direction"], "direction"),
        ({"search_space": _space(optimizer=CATEGORICAL(["SGD", "Adamax"]))}, ["body", "search_space", "optimizer"], "Adamax"),
        ({"search_space": _space(lr_scheduler=CATEGORICAL(["StepLR", "Stepp"]))}, ["body", "search_space", "lr_scheduler"], "Stepp"),
    ],
)
def test_bad_training_settings_are_422_naming_the_field_and_write_nothing(
    api: httpx.Client, database_url: str, change: dict, loc: list, named: str
) -> None:
    before = row_counts(database_url)
    response = api.post("/api/v1/studies", json={**VALID, **change})
    assert response.status_code == 422, response.text
    assert loc in field_of(response), response.text
    assert named in json.dumps(response.json()["detail"])
    assert row_counts(database_url) == before


def test_a_studys_dataloader_options_are_stored_and_bounded(api: httpx.Client, database_url: str) -> None:
    """DataLoader options over the workload's (for data that is not a TensorDataset): torch's
    names, a cap on the worker processes an array may fork, and nothing the array sets itself."""
    loader = {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 4, "pin_memory": False}
    response = api.post("/api/v1/studies", json={**VALID, "name": "loaded", "loader": loader})
    assert response.status_code == 201, response.text
    assert response.json()["loader"] == loader
    assert api.get(f"/api/v1/studies/{response.json()['id']}").json()["loader"] == loader
    before = row_counts(database_url)
    for bad, field in (({"num_workers": 1000}, "num_workers"), ({"batch_size": 8}, "batch_size"), ({"sampler": "x"}, "sampler"),
                       ({"num_workers": "2"}, "num_workers")):
        refused = api.post("/api/v1/studies", json={**VALID, "loader": bad})
        assert refused.status_code == 422, (bad, refused.text)
        assert field_of(refused)[0][:3] == ["body", "loader", field], (bad, refused.json())
    assert row_counts(database_url) == before
