"""A study whose workload the service cannot load when it asks its trials ends FAILED.

Its own module: it starts a service on a database prepared beforehand, which must not share
the local Ray's CPUs with tests/test_lifecycle.py's module-wide services.
"""

from __future__ import annotations

import dataclasses

import pytest

from fusetune.server import service
from fusetune.server.db import get_optuna_storage, get_sessionmaker, upgrade
from fusetune.server.schemas import StudyCreate
from fusetune.workers.workloads import register_workload
from fusetune.workers.workloads._digits import DIGITS_MLP
from fusetune.workers.workloads._registry import _registered
from tests.conftest import running_service

pytestmark = pytest.mark.slow


def test_a_study_whose_workload_cannot_be_loaded_fails(ray_cluster: str, database_url: str) -> None:
    """The workload was registered when the study was created, and is gone when the loop asks."""
    upgrade(database_url)
    get_optuna_storage(database_url)
    register_workload(dataclasses.replace(DIGITS_MLP, name="vanishing"))
    try:
        with get_sessionmaker(database_url)() as session:
            created = service.create_study(session, database_url, StudyCreate(workload="vanishing", n_trials=2, epochs=1))
    finally:
        _registered.pop("vanishing")
    with running_service(ray_cluster, database_url, cpu_workers=1) as client:
        done = client.wait(created.id, timeout=300)
        assert done["state"] == "FAILED" and "'vanishing' cannot be loaded" in done["error"]
        assert done["completed_at"] is not None and client.trials(created.id) == []
        assert client.delete_study(created.id) is None  # a failed study can be removed
        assert client.studies() == []
