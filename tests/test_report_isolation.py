"""One bad array-epoch report costs only itself: the reports recorded with it are written, and
no study's mirror is reloaded whole.

The scheduling loop writes the reports that arrive together in one transaction. A report
that cannot be written (here, one from a worker that names a trial of another study, as a
hostile or broken worker node might) rolls that transaction back: the others are then
written, and only the trials the failed transaction touched are read again into their
studies' mirrors (about 1 GB each at 100,000 trials x 100 epochs), not the mirrors whole.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import optuna
import pytest
from sqlalchemy import select

from fusetune.server import service
from fusetune.server.db import Trial, get_optuna_storage, get_sessionmaker, upgrade
from fusetune.server.loop import SchedulingLoop
from fusetune.server.schemas import StudyCreate
from fusetune.server.settings import Settings
from fusetune.workers.pool import WorkerPool
from fusetune.workers.spec import EpochReport, MemberReport

pytestmark = pytest.mark.slow
D = optuna.distributions
ONE_SHAPE = {"hidden": D.distribution_to_json(D.CategoricalDistribution([32]))}


def _study(url: str, name: str) -> int:
    with get_sessionmaker(url)() as session:
        return service.create_study(session, url, StudyCreate(
            workload="digits-mlp", n_trials=2, epochs=4, name=name, search_space=ONE_SHAPE,
            # A pruner that never prunes: each array waits for each report's reply, so both
            # workers' first reports are waiting in the pool together.
            pruner={"name": "ThresholdPruner", "kwargs": {"lower": -1.0}},
        )).id


def _reported(url: str, name: str) -> dict[int, dict[int, float]]:
    study = optuna.load_study(study_name=name, storage=url)
    return {t.number: dict(t.intermediate_values) for t in study.get_trials(deepcopy=False)}


def test_a_report_that_cannot_be_written_costs_only_itself(ray_cluster: str, database_url: str, tmp_path: Path) -> None:
    url = database_url
    settings = Settings(database_url=url, ray_address=ray_cluster, cpu_workers=2, max_array_size=2,
                        artifact_dir=tmp_path / "artifacts", checkpoint_interval_s=0, prune_reply_timeout_s=600)
    upgrade(url)
    get_optuna_storage(url)
    good, bad = _study(url, "isolation-good"), _study(url, "isolation-bad")
    pool = WorkerPool(cpu_workers=2, name_prefix="isolation")
    try:
        coordinator = SchedulingLoop(settings, pool)
        coordinator.setup()
        coordinator.step()  # each study's two trials start as one array, one per worker
        assert not pool.idle(), "the arrays did not start"
        events: list = []
        deadline = time.monotonic() + 180
        while len(events) < 2:  # both arrays' first reports, each waiting for its reply
            assert time.monotonic() < deadline, "the workers did not report"
            events += pool.wait(1.0)
        assert all(isinstance(item, EpochReport) for _, _, item in events)
        mirrors = {study_id: coordinator.mirrors.loaded(study_id) for study_id in (good, bad)}
        with get_sessionmaker(url)() as session:
            foreign = session.scalar(select(Trial.id).where(Trial.study_id == good).limit(1))
        poisoned = []
        for worker, spec, report in events:
            if coordinator.state.live[report.array_id].study_id == bad:
                # The bad study's worker also reports a trial of the good study's array.
                report = dataclasses.replace(report, members=(*report.members, MemberReport(foreign, 0, 0.5)))
            poisoned.append((worker, spec, report))

        coordinator.handle(poisoned)  # what the loop does with reports that came together

        stored = _reported(url, "isolation-good")
        assert all(0 in values for values in stored.values()), stored  # the good report was written...
        assert all(values == {} for values in _reported(url, "isolation-bad").values())  # ...the bad one not at all
        # Neither study's mirror was dropped to be read again whole...
        assert all(coordinator.mirrors.loaded(study_id) is mirror for study_id, mirror in mirrors.items())
        # ...and the bad study's mirror holds what the database holds: its trials were read again.
        bad_mirror = coordinator.mirrors.fresh(bad)  # its stale trials are read as it is next used
        for trial in optuna.load_study(study_name="isolation-bad", storage=url).get_trials(deepcopy=False):
            held = bad_mirror.trial(trial._trial_id)
            assert (held.state, held.intermediate_values) == (trial.state, trial.intermediate_values)
        good_mirror = coordinator.mirrors.fresh(good)
        for trial in optuna.load_study(study_name="isolation-good", storage=url).get_trials(deepcopy=False):
            assert good_mirror.trial(trial._trial_id).intermediate_values == trial.intermediate_values
    finally:
        pool.shutdown()
