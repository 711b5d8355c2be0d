"""Backfill: a pruned member's slot goes to a waiting trial of the same class at an epoch boundary."""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa

from fusetune.server import service
from fusetune.server.db import Array, Event, Study, StudyState, get_optuna_storage, get_sessionmaker, upgrade
from fusetune.server.loop import SchedulingLoop
from fusetune.server.schemas import StudyCreate
from fusetune.server.settings import Settings
from fusetune.workers.pool import WorkerPool
from tests.test_trial_ends import BACKFILL_SPACE

pytestmark = pytest.mark.slow


def test_a_pruned_members_slot_goes_to_a_waiting_trial_at_the_next_epoch_boundary(ray_cluster: str, tmp_path: Path) -> None:
    """Backfill, event by event: the scheduling loop is stepped by hand.

    A study with a pruner makes its array wait for each report's reply, so a step handles at
    most one report of it: the two steps after the prune offer the freed slots by the reply to
    epoch 2 at the latest, and the newcomers join long before the array's sixth epoch.
    The array never trains more than four at once (the worker's inbox holds later offers
    back: tests/workers/test_optimization.py).
    """
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    settings = Settings(database_url=url, ray_address=ray_cluster, cpu_workers=1, max_array_size=4,
                        artifact_dir=tmp_path / "artifacts", checkpoint_interval_s=0, min_member_efficiency=1e-6)
    upgrade(url)
    get_optuna_storage(url)
    with get_sessionmaker(url)() as session:
        study_id = service.create_study(session, url, StudyCreate(
            workload="digits-mlp", n_trials=8, epochs=6, name="backfill-steps", search_space=BACKFILL_SPACE,
            sampler={"name": "RandomSampler", "kwargs": {"seed": 7}},  # trials 2, 3 and 6 learn nothing
            pruner={"name": "ThresholdPruner", "kwargs": {"lower": 0.3}},
        )).id
    pool = WorkerPool(cpu_workers=1, name_prefix="backfill")

    def next_events() -> list:
        deadline = time.monotonic() + 180
        while not (events := pool.wait(1.0)):
            assert time.monotonic() < deadline, "the worker said nothing"
        return events

    def arrays() -> list[tuple[int, int, set[int]]]:
        with get_sessionmaker(url)() as session:
            return [(a.id, a.size, {m.trial_id for m in a.members})
                    for a in session.scalars(sa.select(Array).where(Array.study_id == study_id).order_by(Array.id))]

    try:
        coordinator = SchedulingLoop(settings, pool)
        coordinator.setup()
        coordinator.step()  # the first four trials start as one array
        [(first, size, founders)] = arrays()
        assert size == 4
        coordinator.handle(next_events())  # epoch 0: two members learned nothing and are pruned
        coordinator.step()  # asks the next trials...
        coordinator.step()  # ...and offers two of them to the running array
        [(_, size, members)] = arrays()
        # Two for the freed slots; the survivors' successors may be offered already too, for
        # the boundary where the survivors leave (when that is within the array's look-ahead).
        assert size >= 6
        newcomers = members - founders
        _step_until_complete(coordinator, pool, url, study_id)
    finally:
        pool.shutdown()
    with get_sessionmaker(url)() as session:
        started = session.scalars(sa.select(Event.trial_id).where(Event.kind == "trial.started", Event.array_id == first)).all()
    assert set(started) >= founders | newcomers  # they trained in the first array (later ones may have too)
    study = optuna.load_study(study_name="backfill-steps", storage=url)
    for trial in study.trials:
        if trial.params["lr"] == 1e-5:
            assert trial.state.name == "PRUNED" and sorted(trial.intermediate_values) == [0]
        else:  # the newcomers count their own epochs from 0
            assert trial.state.name == "COMPLETE" and sorted(trial.intermediate_values) == list(range(6))


def run_by_hand(settings: Settings, study_id: int, name_prefix: str) -> None:
    """Step a new scheduling loop by hand, on ``settings.cpu_workers`` CPU workers of its own,
    until the study is COMPLETE."""
    pool = WorkerPool(cpu_workers=settings.cpu_workers, name_prefix=name_prefix)
    try:
        coordinator = SchedulingLoop(settings, pool)
        coordinator.setup()
        _step_until_complete(coordinator, pool, settings.database_url, study_id)
    finally:
        pool.shutdown()


def _step_until_complete(coordinator: SchedulingLoop, pool: WorkerPool, url: str, study_id: int) -> None:
    deadline = time.monotonic() + 300
    while _state(url, study_id) != StudyState.COMPLETE:
        assert time.monotonic() < deadline, "the study did not complete"
        coordinator.step()
        coordinator.handle(pool.wait(0.5))


def _state(url: str, study_id: int) -> StudyState:
    with get_sessionmaker(url)() as session:
        return session.get(Study, study_id).state


@pytest.mark.parametrize(("policy", "study_cap"), [("fusetune", 1), ("fifo", None)])
def test_an_array_of_one_goes_on_with_the_next_trial_where_its_member_leaves(
    ray_cluster: str, tmp_path: Path, policy: str, study_cap: int | None
) -> None:
    """Unfused (arrays of one: the study's cap, or a policy that does not fuse, whatever the
    service's cap), each trial's successor is offered within the array's look-ahead of the trial's last epoch and
    starts in the same array at the boundary where it ends: the worker trains the study's
    trials one after the other without waiting for a scheduling round between them, and
    never two at once.

    The study's pruner (which never prunes) makes the worker wait for each report's reply,
    so the hand-stepped loop is always ahead of it: the offer always arrives in time.
    """
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    settings = Settings(database_url=url, ray_address=ray_cluster, cpu_workers=1, max_array_size=4,
                        artifact_dir=tmp_path / "artifacts", scheduling_policy=policy)
    upgrade(url)
    get_optuna_storage(url)
    with get_sessionmaker(url)() as session:
        study_id = service.create_study(session, url, StudyCreate(
            workload="digits-mlp", n_trials=3, epochs=4, name="chain", search_space=BACKFILL_SPACE, max_array_size=study_cap,
            sampler={"name": "RandomSampler", "kwargs": {"seed": 0}},
            pruner={"name": "ThresholdPruner", "kwargs": {"lower": -1.0}},
        )).id
    run_by_hand(settings, study_id, f"chain-{policy}")
    with get_sessionmaker(url)() as session:
        (array,) = session.scalars(sa.select(Array).where(Array.study_id == study_id)).all()
        size, epochs = array.size, array.epochs_done
        timeline = session.execute(
            sa.select(Event.kind, Event.trial_id)
            .where(Event.study_id == study_id, Event.kind.in_(["trial.started", "trial.ended"]))
            .order_by(Event.id)
        ).all()
    assert (size, epochs) == (3, 12)  # three trials, one after the other
    # Each trial starts after the one before it has ended.
    assert [kind for kind, _ in timeline] == ["trial.started", "trial.ended"] * 3
    assert len({trial for _, trial in timeline}) == 3
    study = optuna.load_study(study_name="chain", storage=url)
    assert all(t.state.name == "COMPLETE" and sorted(t.intermediate_values) == [0, 1, 2, 3] for t in study.trials)
