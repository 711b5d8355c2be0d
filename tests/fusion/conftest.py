"""Fixtures for the fusion tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Run fusion tests on one intra-op thread, restoring the setting afterwards.

    The tests use tiny tensors, where a second OpenMP thread buys nothing, and
    on a CI machine shared with other jobs two spinning threads per process
    make the suite many times slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
