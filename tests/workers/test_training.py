"""How a worker maps trial params to per-member optimizer hyper-parameters."""

from __future__ import annotations

from fusetune.workers.training import optimizer_kwargs
from fusetune.workers.workloads import get_workload


def test_sgd_takes_per_member_values_with_workload_and_torch_defaults() -> None:
    kwargs = optimizer_kwargs(
        get_workload("digits-mlp"),
        [{"lr": 0.1, "momentum": 0.9, "hidden": 32}, {"weight_decay": 1e-4}],
    )
    assert kwargs == {
        "lr": [0.1, 0.05],  # the second member falls back to the workload's default lr
        "momentum": [0.9, 0.0],
        "dampening": [0.0, 0.0],
        "weight_decay": [0.0, 1e-4],
    }


def test_adam_collects_betas_per_member() -> None:
    kwargs = optimizer_kwargs(get_workload("digits-cnn"), [{"beta1": 0.8}, {"lr": 0.01, "beta2": 0.99}])
    assert kwargs["betas"] == [(0.8, 0.999), (0.9, 0.99)]
    assert kwargs["lr"] == [1e-3, 0.01]
    assert kwargs["eps"] == [1e-8, 1e-8]
