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


def test_a_copy_made_with_dataclasses_replace_optimises_its_own_metric() -> None:
    """``dataclasses.replace`` is how a user derives a variant of a frozen workload: the copy's
    ``metric`` (with its name and direction) is its objective, not the original's."""
    import dataclasses

    from fusetune import Metric

    base = get_workload("digits-mlp")

    def error_rate(output: torch.Tensor, target: torch.Tensor) -> float:
        return 1.0 - float((output.argmax(dim=-1) == target).float().mean())

    def size(model: torch.nn.Module) -> float:
        return 1.0

    # The digits workloads declare their accuracy among their metrics: which would count?
    with pytest.raises(ValueError, match="its metrics declare 'accuracy' as accuracy: give metric a metric_name of its own"):
        dataclasses.replace(base, metric=error_rate)
    undeclared = dataclasses.replace(base, metrics=())
    assert [m.name for m in undeclared.metrics] == ["accuracy"]
    same_name = dataclasses.replace(undeclared, metric=error_rate, direction="minimize")
    assert [m.name for m in same_name.metrics] == ["accuracy"]
    assert same_name.metric_named("accuracy").fn is error_rate and same_name.metrics[0].direction == "minimize"
    renamed = dataclasses.replace(undeclared, metric=error_rate, metric_name="error")
    assert [m.name for m in renamed.metrics] == ["error"] and renamed.metrics[0].fn is error_rate
    # Beside declared ones, a new name adds the new metric first.
    assert [m.name for m in dataclasses.replace(base, metric=error_rate, metric_name="error").metrics] == ["error", "accuracy", "n_params"]
    # Metrics the workload declares stay, through any number of copies.
    declared = dataclasses.replace(base, metrics=(Metric("size", size, "minimize", of="model"),))
    again = dataclasses.replace(dataclasses.replace(declared, metric=error_rate), metric_name="error")
    assert [(m.name, m.fn) for m in again.metrics] == [("error", error_rate), ("size", size)]


def test_a_loader_option_that_dataloader_does_not_take_is_refused_where_the_workload_is_defined() -> None:
    import dataclasses

    base = get_workload("digits-mlp")
    assert dataclasses.replace(base, loader={"num_workers": 2, "persistent_workers": True, "shuffle": False}).loader["num_workers"] == 2
    with pytest.raises(ValueError, match=r"loader options \['shufle'\] are not arguments of torch.utils.data.DataLoader, which takes: .*shuffle"):
        dataclasses.replace(base, loader={"shufle": False})
    with pytest.raises(ValueError, match=r"loader options \['batch_size', 'sampler'\] are the array's own"):
        dataclasses.replace(base, loader={"sampler": None, "batch_size": 7})
