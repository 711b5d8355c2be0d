"""A workload whose setup takes longer than the epoch deadline tests/workers/test_epoch_deadline.py
sets (``tests.slow_setup_workload:WORKLOAD``): loading its data sleeps ``SETUP_S``, as a large
dataset read from a remote store does, while its epochs take milliseconds (the paced workload's
tiny MLP, at a width that does not sleep: ``hidden`` 8).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from tests.paced_workload import WIDTHS, data

#: How long loading the data takes: twice the deadline the test gives an epoch.
SETUP_S = 10.0


def slow_datasets() -> tuple[Any, Any]:
    time.sleep(SETUP_S)
    return data()


WORKLOAD = dataclasses.replace(WIDTHS, name="slow-setup", datasets=slow_datasets)
