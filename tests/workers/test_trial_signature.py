"""Trial signatures are memoised by the params the model factory read, and stay exact."""

from __future__ import annotations

import pytest
from torch import nn

from fusetune.workers.signature import array_settings, trial_model, trial_signature
from fusetune.workers.workloads import get_workload
from fusetune.workers.workloads._base import Workload

MLP = get_workload("digits-mlp")


def counting(workload: Workload) -> tuple[Workload, list[int]]:
    """The workload with a factory that records every call (a new factory: its own memo)."""
    calls: list[int] = []

    def build(params):
        calls.append(1)  # reading the params here would count as the factory reading them
        return workload.build_model(params)

    return Workload(**{**workload.__dict__, "build_model": build}), calls


def test_params_the_factory_does_not_read_reuse_the_signature():
    workload, calls = counting(MLP)
    base = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "hidden": 32}
    first = trial_signature(workload, base)
    again = [trial_signature(workload, {**base, "lr": lr, "momentum": 0.1}) for lr in (0.01, 0.02, 0.3)]
    assert again == [first] * 3
    assert len(calls) == 1


def test_a_param_the_factory_reads_builds_again_and_changes_the_signature():
    workload, calls = counting(MLP)
    base = {"lr": 0.1, "hidden": 32}
    narrow = trial_signature(workload, base)
    wide = trial_signature(workload, {**base, "hidden": 64})
    assert wide != narrow and len(calls) == 2
    # A value of another type is another read (int(32.0) is 32, yet a factory may tell them apart).
    assert trial_signature(workload, {**base, "hidden": 32.0}) == narrow and len(calls) == 3
    # Back to a width seen before: no build.
    assert trial_signature(workload, {**base, "hidden": 64, "lr": 0.5}) == wide and len(calls) == 3


def test_array_settings_are_part_of_the_key():
    workload, calls = counting(MLP)
    params = {"lr": 0.1, "hidden": 32}
    assert trial_signature(workload, params) != trial_signature(workload, {**params, "optimizer": "Adam"})
    assert len(calls) == 2


def test_the_study_s_epochs_are_not_in_the_signature():
    # An array holds one study's trials whatever the signature says; what else a signature
    # keys (the measured speed of its arrays, persisted) holds for any number of epochs.
    assert "epochs" not in array_settings(MLP, {"lr": 0.1, "hidden": 32})


def test_a_factory_that_needs_a_dict_is_built_unmemoised():
    def build(params):
        params = params.copy()  # a dict method the read-recording view does not have
        return nn.Linear(4, int(params.get("width", 2)))

    workload = Workload(**{**MLP.__dict__, "build_model": build})
    assert trial_signature(workload, {"width": 3}) != trial_signature(workload, {"width": 5})


def test_a_factory_error_is_the_factorys_own():
    def build(params):
        raise ValueError(f"width must be positive, got {params['width']}")

    workload = Workload(**{**MLP.__dict__, "build_model": build})
    with pytest.raises(ValueError, match="width must be positive, got -1"):
        trial_signature(workload, {"width": -1})


def test_a_trials_memory_floor_follows_its_own_optimizer_settings_from_the_memoised_model():
    workload, calls = counting(MLP)
    base = {"lr": 0.1, "weight_decay": 1e-4, "hidden": 1000}
    weights = (64 * 1000 + 1000 + 1000 * 1000 + 1000 + 1000 * 10 + 10) * 4  # float32, no buffers
    plain = trial_model(workload, {**base, "momentum": 0.0})
    heavy = trial_model(workload, {**base, "momentum": 0.9})
    assert plain.signature == heavy.signature == trial_signature(workload, base)
    assert plain.least_bytes == 2 * weights  # the weights and their gradients
    assert heavy.least_bytes == 3 * weights  # and SGD's momentum buffer
    assert len(calls) == 1  # one model built, on the meta device
    wide = trial_model(workload, {**base, "hidden": 100_000, "momentum": 0.9})  # 40 GB of weights
    assert wide.least_bytes > 3 * 4 * 100_000**2
