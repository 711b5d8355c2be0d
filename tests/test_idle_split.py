"""A device left idle with nothing waiting takes half of a running array's members."""

from __future__ import annotations

from pathlib import Path

import optuna
import optuna.distributions as D
import pytest
import sqlalchemy as sa

from fusetune.server import service
from fusetune.server.db import Array, Event, Trial, get_optuna_storage, get_sessionmaker, upgrade
from fusetune.server.schemas import StudyCreate
from fusetune.server.settings import Settings
from tests.paced_workload import WIDE
from tests.test_backfill import run_by_hand
from tests.test_training_choices import space

pytestmark = pytest.mark.slow


def test_the_idle_device_takes_half_of_the_costlier_array_and_they_resume_there(ray_cluster: str, tmp_path: Path) -> None:
    """A sweep of two widths on two CPU workers: FusionSampler gives each device one group of
    8, one of each width. The wide members are paced (tests/paced_workload.py): each sleeps
    a set time per training step, B times as long in an array of B, so the wide array's epochs
    take many times the narrow one's and a wide member costs what a model alone does, on any
    CPU. When the narrow array is done, half of the wide array's members leave it at an epoch
    boundary with their checkpoints and train their other epochs on the free device, from
    where they left off. (How the first round shares the two widths between the devices may
    vary: the scheduler may spread one width over both while the other's trials join later.)

    The study has a pruner that never prunes, so each array waits for its reports' replies:
    the hand-stepped loop sees every epoch. Whether the members move does not depend on this
    machine's speed: the speeds the loop measures, and fits the class's curve to, are the
    pace's (``move_latency_s`` is 0: what a move costs is the movers' measured build, next to
    the measured epochs). Without the pace, a wide MLP on a CPU with large caches fuses well
    enough (or measures noisily enough under other load) that splitting it does not pay.
    """
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    settings = Settings(database_url=url, ray_address=ray_cluster, cpu_workers=2, max_array_size=8,
                        artifact_dir=tmp_path / "artifacts", move_latency_s=0.0, allow_workload_imports=True,
                        prior_marginal_cost=1.0, min_member_efficiency=1e-6)
    upgrade(url)
    get_optuna_storage(url)
    epochs = 40  # long enough that the split pays even when other work slows the narrow array
    with get_sessionmaker(url)() as session:
        study_id = service.create_study(session, url, StudyCreate(
            workload="tests.paced_workload:WIDTHS", n_trials=16, epochs=epochs, name="widths",
            search_space=space(hidden=D.CategoricalDistribution([8, WIDE]), lr=D.FloatDistribution(0.01, 0.1)),
            sampler={"name": "RandomSampler", "kwargs": {"seed": 0}},
            pruner={"name": "ThresholdPruner", "kwargs": {"lower": -1.0}},
        ), allow_workload_imports=True).id
    run_by_hand(settings, study_id, "split")

    with get_sessionmaker(url)() as session:
        arrays = session.execute(
            sa.select(Array.id, Array.worker_id, Array.signature).where(Array.study_id == study_id).order_by(Array.id)
        ).all()
        started = session.execute(
            sa.select(Event.array_id, Event.trial_id).where(Event.study_id == study_id, Event.kind == "trial.started")
        ).all()
        width = dict(session.execute(sa.select(Trial.id, Trial.params["hidden"].as_integer()).where(Trial.study_id == study_id)).all())
    members = {a.id: {t for array, t in started if array == a.id} for a in arrays}
    worker = {a.id: a.worker_id for a in arrays}
    wide = {a.signature for a in arrays if width[min(members[a.id])] == WIDE}
    assert len(wide) == 1 and all(len({width[t] for t in members[a.id]}) == 1 for a in arrays)  # arrays of one width
    # A member that trained in two arrays moved: where it came from, the array before.
    came_from: dict[int, int] = {}
    moves: dict[int, int] = {}  # array a move started -> the array its members left
    for a in arrays:
        for t in sorted(members[a.id]):
            if t in came_from:
                assert moves.setdefault(a.id, came_from[t]) == came_from[t]  # a move's members left one array
            came_from[t] = a.id
    assert moves, "the wide array was not split"
    # Members of the wide class moved to another device once the narrow class's was free:
    # half of those going on, at most (and, as devices freed again, half of what was left).
    for to, left in moves.items():
        source = next(a for a in arrays if a.id == left)
        assert source.signature in wide and worker[to] != worker[left]
        assert 1 <= len(members[to]) <= len(members[left]) // 2
    moved = {t for a in moves for t in members[a]}
    optuna_number = dict(_numbers(url, study_id))
    study = optuna.load_study(study_name="widths", storage=url)
    for trial in study.trials:  # every epoch of every trial reported once, in one array or another
        assert trial.state.name == "COMPLETE" and sorted(trial.intermediate_values) == list(range(epochs))
    resumed = {t.number: t.user_attrs.get("resumed_at_epochs", []) for t in study.trials}
    for trial_id, number in optuna_number.items():  # the moved resumed where they left off, not from scratch
        assert bool(resumed[number]) == (trial_id in moved)
        assert all(0 < epoch < epochs for epoch in resumed[number])


def _numbers(url: str, study_id: int) -> list[tuple[int, int]]:
    """(fusetune trial id, Optuna trial number) of the study's trials."""
    with get_sessionmaker(url)() as session:
        return [tuple(r) for r in session.execute(sa.select(Trial.id, Trial.number).where(Trial.study_id == study_id))]
