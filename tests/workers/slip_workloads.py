"""The digits MLP with one of a newcomer's slips each (``tests.workers.slip_workloads:...``;
tests/workers/test_user_errors.py): a metric that returns text, a ``datasets()`` that returns
one dataset."""

import dataclasses
from typing import Any

from fusetune.workers.workloads._digits import DIGITS_MLP


def verdict(output: Any, target: Any) -> str:
    return "good"


TEXT_METRIC = dataclasses.replace(DIGITS_MLP, name="text-metric", metric=verdict, metric_name="verdict", metrics=())
ONE_DATASET = dataclasses.replace(DIGITS_MLP, name="one-dataset", datasets=lambda: DIGITS_MLP.datasets()[0])
