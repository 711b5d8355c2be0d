"""A workload whose data cannot be loaded where arrays train (``tests.unbuildable_workload:WORKLOAD``).

Its model and search space are the digits MLP's, so the service accepts and asks its trials;
its ``datasets`` raises, as a workload whose files are missing on the workers does, so every
array of it fails to build. tests/test_faults.py checks that its study fails alone.
"""

import dataclasses

from fusetune.workers.workloads._digits import DIGITS_MLP


def missing_datasets():  # noqa: ANN201
    raise FileNotFoundError("digits.npz: no such file on this worker")


WORKLOAD = dataclasses.replace(DIGITS_MLP, name="unbuildable", datasets=missing_datasets)
