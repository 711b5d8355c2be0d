"""Workloads: the models fusetune tunes, written as ordinary PyTorch.

A workload bundles a model factory, a default search space, datasets, a loss and a
validation metric. Built-ins: ``digits-mlp`` and ``digits-cnn``. Third-party packages add
theirs through the ``fusetune.workloads`` entry-point group, and any
``package.module:attr`` path naming a :class:`Workload` works too.
"""

from ._base import Params, Workload, accuracy
from ._digits import DigitsCNN, digits_datasets
from ._registry import (
    ENTRY_POINT_GROUP,
    UnknownWorkloadError,
    WorkloadImportsDisabled,
    available_workloads,
    get_workload,
    register_workload,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "DigitsCNN",
    "Params",
    "UnknownWorkloadError",
    "Workload",
    "WorkloadImportsDisabled",
    "accuracy",
    "available_workloads",
    "digits_datasets",
    "get_workload",
    "register_workload",
]
