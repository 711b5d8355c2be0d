"""The workload registry and the two built-in digits workloads."""

from __future__ import annotations

import optuna
import pytest
import torch

from fusetune.workers.workloads import UnknownWorkloadError, Workload, available_workloads, digits_datasets, get_workload


def test_builtins_are_listed() -> None:
    assert {"digits-mlp", "digits-cnn"} <= set(available_workloads())


def test_lookup_by_import_path() -> None:
    assert get_workload("fusetune.workers.workloads._digits:DIGITS_CNN") is get_workload("digits-cnn")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", "unknown workload 'nope'; known workloads: digits-cnn, digits-mlp"),
        ("no.such.module:thing", "cannot import workload 'no.such.module:thing'"),
        ("fusetune.workers.workloads:get_workload", "is a function, not a fusetune Workload"),
    ],
)
def test_unknown_workloads_say_why(name: str, message: str) -> None:
    with pytest.raises(UnknownWorkloadError, match=message.replace("(", r"\(")):
        get_workload(name)


def test_digits_split_is_fixed_and_disjoint() -> None:
    train, val = digits_datasets()
    assert len(train) == 1437 and len(val) == 360
    assert train.tensors[0].shape[1:] == (1, 8, 8)
    assert 0.0 <= float(train.tensors[0].min()) and float(train.tensors[0].max()) <= 1.0
    assert sorted(torch.unique(val.tensors[1]).tolist()) == list(range(10))


@pytest.mark.parametrize("name", ["digits-mlp", "digits-cnn"])
def test_default_space_builds_a_model_that_classifies_digits(name: str) -> None:
    workload: Workload = get_workload(name)
    trial = optuna.create_study().ask()
    params = workload.search_space(trial)
    assert params == trial.params
    model = workload.build_model(params)
    x, y = digits_datasets()[1].tensors
    out = model(x[:5])
    assert out.shape == (5, 10)
    assert workload.loss(out, y[:5]).ndim == 0
    assert 0.0 <= workload.metric(out, y[:5]) <= 1.0
