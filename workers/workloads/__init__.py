"""Workloads: the models fusetune tunes, written as ordinary PyTorch.

A workload bundles a model factory, a default search space, datasets, a loss and the
validation metrics a study may choose as objectives. Built-ins: ``digits-mlp`` and
``digits-cnn``. Third-party packages add theirs through the ``fusetune.workloads``
entry-point group, and any ``package.module:attr`` path naming a :class:`Workload` works too.
"""

from ._base import LOADER_OWNED, Batch, Metric, Params, Workload, accuracy, feed_model, labels_of, n_params
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
    "LOADER_OWNED",
    "Batch",
    "DigitsCNN",
    "Metric",
    "Params",
    "UnknownWorkloadError",
    "Workload",
    "WorkloadImportsDisabled",
    "accuracy",
    "available_workloads",
    "digits_datasets",
    "feed_model",
    "get_workload",
    "labels_of",
    "n_params",
    "register_workload",
]
