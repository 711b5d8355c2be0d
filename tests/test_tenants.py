"""Two tenants share a local Ray's CPU workers in proportion to their weights.

The live scheduling loop (``server.loop.SchedulingLoop``) is stepped by hand here, so the
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

from fusetune.server import service
from fusetune.server.db import Array, Study, Throughput, get_optuna_storage, get_sessionmaker, upgrade
from fusetune.server.loop import SchedulingLoop
from fusetune.server.schemas import StudyCreate, TenantCreate
from fusetune.server.settings import Settings
from fusetune.server.tenants import create_tenant
from fusetune.workers.pool import WorkerPool

pytestmark = pytest.mark.slow

ONE_SHAPE = {"lr": optuna.distributions.distribution_to_json(optuna.distributions.FloatDistribution(0.05, 0.3))}


def test_devices_are_shared_by_weight(ray_cluster: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    settings = Settings(database_url=url, ray_address=ray_cluster, cpu_workers=4, max_array_size=4, artifact_dir=tmp_path)
    upgrade(url)
    get_optuna_storage(url)
    sessions = get_sessionmaker(url)
    with sessions() as session:
        create_tenant(session, TenantCreate(name="big", weight=3))
        create_tenant(session, TenantCreate(name="small", weight=1))
        for tenant in ("big", "small"):
            service.create_study(
                session, url,
                StudyCreate(workload="digits-mlp", n_trials=16, epochs=2, tenant=tenant, name=tenant, search_space=ONE_SHAPE),
            )

    pool = WorkerPool(cpu_workers=4, name_prefix="tenants")
    try:
        assert len(pool.workers) == 4
        coordinator = SchedulingLoop(settings, pool)
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

        # What the workers measured replaced the prior (1 step/s) for each class on the CPU:
        # the arrays' own speed at B = 4 and the unfused probe's at B = 1, both persisted.
        for cls in classes:
            curve = coordinator.scheduler.throughput.curve(cls, "cpu")
            assert curve.solo_steps_per_s > 10
        with sessions() as session:
            assert {(t.members, t.device_type) for t in session.scalars(select(Throughput))} >= {(1, "cpu"), (4, "cpu")}
    finally:
        pool.shutdown()


def test_a_tenant_arriving_later_preempts_at_an_epoch_boundary_and_the_preempted_resume(
    ray_cluster: str, tmp_path: Path
) -> None:
    """One CPU worker, short leases: the early tenant's array gives way to the late tenant at
    an epoch boundary (its members leave checkpointed), and resumes after without losing epochs."""
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    settings = Settings(database_url=url, ray_address=ray_cluster, cpu_workers=1, max_array_size=4,
                        artifact_dir=tmp_path, lease_s=0.5)
    upgrade(url)
    storage = get_optuna_storage(url)
    sessions = get_sessionmaker(url)
    epochs = 150
    with sessions() as session:
        for tenant in ("early", "late"):
            create_tenant(session, TenantCreate(name=tenant))
        service.create_study(session, url, StudyCreate(workload="digits-mlp", n_trials=2, epochs=epochs, tenant="early",
                                                       name="early", search_space=ONE_SHAPE))
    pool = WorkerPool(cpu_workers=1, name_prefix="preempt")
    try:
        coordinator = SchedulingLoop(settings, pool)
        coordinator.setup()

        def reported(name: str) -> list[int]:
            study = optuna.load_study(study_name=name, storage=storage)
            return [len(t.intermediate_values) for t in study.get_trials(deepcopy=False)]

        deadline = time.monotonic() + 120
        while min(reported("early"), default=0) < 2:
            assert time.monotonic() < deadline, "the early tenant's array never reached its second epoch"
            coordinator.step()
            time.sleep(0.05)
        with sessions() as session:
            service.create_study(session, url, StudyCreate(workload="digits-mlp", n_trials=1, epochs=3, tenant="late",
                                                           name="late", search_space=ONE_SHAPE))

        states: dict[str, str] = {}
        while True:
            assert time.monotonic() < deadline + 180, f"studies did not complete: {states}"
            coordinator.step()
            with sessions() as session:
                states = {s.name: s.state.value for s in session.scalars(select(Study))}
            if states["late"] == "COMPLETE":
                break
            time.sleep(0.05)
        assert states["early"] == "RUNNING", "the late tenant waited for the early one to finish"
        while states["early"] != "COMPLETE":
            assert time.monotonic() < deadline + 300, "the preempted study never completed"
            coordinator.step()
            with sessions() as session:
                states = {s.name: s.state.value for s in session.scalars(select(Study))}
            time.sleep(0.05)

        early = optuna.load_study(study_name="early", storage=storage).get_trials(deepcopy=False)
        assert {t.state for t in early} == {optuna.trial.TrialState.COMPLETE}
        with sessions() as session:
            arrays = [a for a, s in session.execute(select(Array, Study).join(Study, Array.study_id == Study.id))
                      if s.name == "early"]
        assert len(arrays) >= 2, "the early tenant's members never left their first array"
        moved = [t for t in early if t.user_attrs.get("resumed_at_epochs")]
        assert moved, "no preempted member resumed from its checkpoint"
        for t in early:
            assert sorted(t.intermediate_values) == list(range(epochs))
            # Resumed where it left, never restarted from epoch 0.
            assert all(0 < e < epochs for e in t.user_attrs.get("resumed_at_epochs", []))
        assert not list((tmp_path / "early" / "checkpoints").glob("*.pt"))
    finally:
        pool.shutdown()
