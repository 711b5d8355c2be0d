"""An array's epoch deadline (``FUSETUNE_EPOCH_TIMEOUT_S``) times its epochs, not its setup.

Loading an array's data, building and resuming its models is not an epoch: a workload whose
data takes longer to load than an epoch may run still trains, its first epoch timed from the
worker's word that its setup is done (its heartbeat). The setup has a bound of its own, the
setup grace (``FUSETUNE_PACKAGE_LOAD_TIMEOUT_S``): one that takes longer overruns. The
deadlines are shortened through the pool's settings; the workload's setup sleeps twice the
epoch deadline (``tests/slow_setup_workload.py``), its epochs take milliseconds.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fusetune.workers.pool import EpochOverran, WorkerPool
from fusetune.workers.spec import ArrayOutcome, ArraySpec, EpochReply, EpochReport, MemberSpec
from tests.slow_setup_workload import SETUP_S

pytestmark = pytest.mark.slow
EPOCH_TIMEOUT_S = SETUP_S / 2
EPOCHS = 3


def slow_setup_array(tmp_path: Path) -> ArraySpec:
    members = tuple(
        MemberSpec(trial_id=1 + n, optuna_trial_id=100 + n, number=n, params={"hidden": 8, "lr": 0.05}) for n in range(2)
    )
    return ArraySpec(
        array_id=1, signature="s", study_name="slow-setup", workload="tests.slow_setup_workload:WORKLOAD",
        epochs=EPOCHS, members=members, seed=0, artifact_dir=str(tmp_path), checkpoint_interval_s=0.0,
    )


def train(pool: WorkerPool, spec: ArraySpec) -> tuple[list[EpochReport], ArrayOutcome | BaseException]:
    """Submit ``spec`` to the pool's one worker and answer its reports, pinging it as the
    scheduling loop does, until its outcome (or the error that ended it)."""
    pool.refresh()
    (worker,) = pool.idle()
    pool.submit(worker, spec)
    reports: list[EpochReport] = []
    deadline = time.monotonic() + 300  # a guard against hanging, not a guess at how long anything takes
    while time.monotonic() < deadline:
        pool.heartbeat()
        for busy, _, item in pool.wait(0.1):
            if not isinstance(item, EpochReport):
                return reports, item
            reports.append(item)
            pool.reply(busy, EpochReply())
    raise AssertionError(f"the array did not end; it reported {len(reports)} epochs")


def train_slow_setup(tmp_path: Path, setup_grace_s: float) -> tuple[list[EpochReport], ArrayOutcome | BaseException]:
    """The slow-setup array on a pool of one worker whose epochs may run ``EPOCH_TIMEOUT_S``
    and whose arrays' setup ``setup_grace_s`` more."""
    pool = WorkerPool(
        cpu_workers=1, name_prefix=f"setup-{setup_grace_s:g}", heartbeat_interval_s=0.1, epoch_timeout_s=EPOCH_TIMEOUT_S,
        setup_grace_s=setup_grace_s,
    )
    try:
        return train(pool, slow_setup_array(tmp_path))
    finally:
        pool.shutdown()


def test_an_array_whose_setup_outlasts_the_epoch_deadline_trains_to_the_end(ray_cluster: str, tmp_path: Path) -> None:
    reports, outcome = train_slow_setup(tmp_path, setup_grace_s=600)
    assert isinstance(outcome, ArrayOutcome), outcome
    assert outcome.error is None and sorted(outcome.completed) == [1, 2] and len(reports) == EPOCHS


def test_a_setup_past_its_grace_overruns_and_the_array_fails(ray_cluster: str, tmp_path: Path) -> None:
    reports, outcome = train_slow_setup(tmp_path, setup_grace_s=0.1)
    assert isinstance(outcome, EpochOverran) and reports == [], outcome
