"""Workloads: the models fusetune tunes, written as ordinary PyTorch.

A workload bundles a model factory, a default search space, datasets, a loss and the
validation metrics a study may choose as objectives. Built-ins: ``digits-mlp`` and
``digits-cnn``. Third-party packages add theirs through the ``fusetune.workloads``
entry-point group, and any ``package.module:attr`` path naming a :class:`Workload` works too.
"""

from ._base import Metric, Params, Workload, accuracy, n_params
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
    "Metric",
    "Params",
    "UnknownWorkloadError",
    "Workload",
    "WorkloadImportsDisabled",
    "accuracy",
    "available_workloads",
    "digits_datasets",
    "get_workload",
    "n_params",
    "register_workload",
]
