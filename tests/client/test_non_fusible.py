"""non_fusible_params and FusionSampler.for_workload: the service's own signature decides.

A parameter is non-fusible when it changes ``trial_signature``, the digest the service
packs arrays by; the trials of one FusionSampler group must then have one signature.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from torch import nn

from fusetune.client.samplers import FusionSampler, fusion_group, non_fusible_params
from fusetune.workers.samplers._workload import probe_values
from fusetune.workers.signature import trial_signature
from fusetune.workers.workloads import UnknownWorkloadError, get_workload

SPACE = {
    "hidden": CategoricalDistribution([32, 64, 128]),
    "batch_size": CategoricalDistribution([32, 64]),
    "lr": FloatDistribution(1e-3, 0.3, log=True),
    "momentum": FloatDistribution(0.0, 0.95),
    "dropout": FloatDistribution(0.0, 0.5),
}


def test_digits_workloads_default_spaces() -> None:
    assert non_fusible_params("digits-mlp") == {"hidden"}
    assert non_fusible_params(get_workload("digits-cnn")) == {"channels"}


def test_a_study_search_space_is_probed_instead_of_the_workloads() -> None:
    # batch_size is array-wide; dropout's p is kept per member by the fused twin.
    assert non_fusible_params("digits-mlp", distributions=SPACE) == {"hidden", "batch_size"}


def test_a_static_spaces_probes_are_its_params_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """A static space returns a trial's params unchanged, so varying one param is that dict,
    with no Optuna trial run for it: only the contexts are asked (each ask of an in-memory
    study costs more as it fills, which made a wide space's probing quadratic)."""
    from fusetune.workers.samplers import _workload

    asked: list[int] = []
    run = _workload._Prober.run
    monkeypatch.setattr(_workload._Prober, "run", lambda self, fixed=None: asked.append(1) or run(self, fixed))
    wide = {**SPACE, **{f"unused{i}": FloatDistribution(0.0, 1.0) for i in range(200)}}
    assert non_fusible_params("digits-mlp", distributions=wide, contexts=3) == {"hidden", "batch_size"}
    assert len(asked) == 3


def conditional_space(trial: optuna.Trial) -> dict[str, Any]:
    params = {"lr": trial.suggest_float("lr", 1e-3, 0.3, log=True), "layers": trial.suggest_int("layers", 1, 2)}
    if params["layers"] == 2:
        params["width2"] = trial.suggest_categorical("width2", [16, 32])
        params["dropout2"] = trial.suggest_float("dropout2", 0.0, 0.5)
    return params


def conditional_model(params: dict[str, Any]) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(64, 32), nn.ReLU()]
    width = 32
    if params["layers"] == 2:
        layers += [nn.Linear(32, params["width2"]), nn.ReLU(), nn.Dropout(params["dropout2"])]
        width = params["width2"]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def test_a_conditional_param_is_probed_in_the_branch_that_has_it() -> None:
    workload = dataclasses.replace(
        get_workload("digits-mlp"), name="conditional", build_model=conditional_model, search_space=conditional_space
    )
    assert non_fusible_params(workload) == {"layers", "width2"}


def test_the_signature_function_decides() -> None:
    by_lr = non_fusible_params("digits-mlp", signature=lambda params: repr(round(params["lr"], 6)))
    assert by_lr == {"lr"}


def test_a_groups_trials_have_one_service_signature() -> None:
    workload = get_workload("digits-mlp")
    sampler = FusionSampler.for_workload(
        optuna.samplers.TPESampler(seed=0, constant_liar=True), "digits-mlp", group_size=4, distributions=SPACE
    )
    assert sampler.non_fusible == {"hidden", "batch_size"} and sampler.group_size == 4
    study = optuna.create_study(direction="maximize", sampler=sampler)
    signatures: dict[str, set[str]] = {}
    for _ in range(3):
        asked = [study.ask(fixed_distributions=SPACE) for _ in range(8)]
        for trial in asked:
            frozen = study._storage.get_trial(trial._trial_id)
            signatures.setdefault(fusion_group(frozen), set()).add(trial_signature(workload, trial.params))
            study.tell(trial, trial.params["lr"])
    assert len(signatures) == 6  # two groups of four per batch of eight
    assert all(len(s) == 1 for s in signatures.values())


def test_bad_input_names_the_parameter() -> None:
    with pytest.raises(TypeError, match="workload"):
        non_fusible_params(3)  # type: ignore[arg-type]
    with pytest.raises(UnknownWorkloadError):
        non_fusible_params("no-such-workload")
    with pytest.raises(ValueError, match="contexts"):
        non_fusible_params("digits-mlp", contexts=0)


def test_a_space_the_model_always_rejects_is_an_error() -> None:
    space = {"hidden": CategoricalDistribution([-1, -2])}  # negative widths: no model builds
    with pytest.raises(ValueError, match="rejected every one"):
        non_fusible_params("digits-mlp", distributions=space)


def test_probe_values() -> None:
    assert probe_values(CategoricalDistribution(["a", "b"])) == ["a", "b"]
    assert probe_values(IntDistribution(1, 4)) == [1, 2, 3, 4]
    assert probe_values(IntDistribution(16, 512, step=16)) == [16, 144, 272, 384, 512]  # on the step's grid
    assert probe_values(FloatDistribution(0.0, 1.0)) == [0.0, 0.25, 0.5, 0.75, 1.0]
    log = probe_values(FloatDistribution(1e-4, 1.0, log=True))
    assert log[0] == 1e-4 and log[-1] == pytest.approx(1.0) and log[2] == pytest.approx(1e-2)
    assert probe_values(FloatDistribution(0.0, 0.9, step=0.3)) == pytest.approx([0.0, 0.3, 0.6, 0.9])
