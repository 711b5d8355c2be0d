"""Two tenants share a local Ray's CPU workers in proportion to their weights.

The live scheduling loop (``server.coordinator.Coordinator``) is stepped by hand here, so the
first round sees both tenants' trials at once; it calls the same ``scheduler.Scheduler`` that
the trace-driven simulator runs.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from sqlalchemy import select

from server import service
from server.coordinator import Coordinator
from server.db import Array, Study, get_optuna_storage, get_sessionmaker, upgrade
from server.schemas import StudyCreate, TenantUpdate
from server.settings import Settings
from workers.pool import WorkerPool

pytestmark = pytest.mark.slow

ONE_SHAPE = {"lr": optuna.distributions.distribution_to_json(optuna.distributions.FloatDistribution(0.05, 0.3))}


def test_devices_are_shared_by_weight(ray_cluster: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    settings = Settings(database_url=url, ray_address=ray_cluster, cpu_workers=4, max_array_size=4, artifact_dir=tmp_path)
    upgrade(url)
    get_optuna_storage(url)
    sessions = get_sessionmaker(url)
    with sessions() as session:
        service.put_tenant(session, "big", TenantUpdate(weight=3))
        service.put_tenant(session, "small", TenantUpdate(weight=1))
        for tenant in ("big", "small"):
            service.create_study(
                session, url,
                StudyCreate(workload="digits-mlp", n_trials=16, epochs=2, tenant=tenant, name=tenant, search_space=ONE_SHAPE),
            )

    pool = WorkerPool(cpu_workers=4, name_prefix="tenants")
    try:
        assert len(pool.workers) == 4
        coordinator = Coordinator(settings, pool)
        coordinator.setup()
        coordinator.step()  # both tenants have 16 waiting trials: 4 arrays of 4 each could run

        with sessions() as session:
            tenants = {a.id: s.tenant for a, s in session.execute(select(Array, Study).join(Study, Array.study_id == Study.id))}
        assert Counter(tenants.values()) == {"big": 3, "small": 1}

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            coordinator.step()
            with sessions() as session:
                if all(s.state.value == "COMPLETE" for s in session.scalars(select(Study))):
                    break
            time.sleep(0.2)
        with sessions() as session:
            for study in session.scalars(select(Study)):
                assert study.state.value == "COMPLETE"
                assert {t.state.value for t in study.trials} == {"COMPLETE"}
            classes = {f"{a.signature}@{a.study_id}" for a in session.scalars(select(Array))}

        # What the workers measured replaced the prior (1 step/s) for each class on the CPU.
        for cls in classes:
            curve = coordinator.scheduler.throughput.curve(cls, "cpu")
            assert curve.solo_steps_per_s > 10
            assert curve.member_bytes > 0
    finally:
        pool.shutdown()
