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
from tests.test_backfill import run_by_hand
from tests.test_training_choices import space

pytestmark = pytest.mark.slow


def test_the_idle_device_takes_half_of_the_costlier_array_and_they_resume_there(ray_cluster: str, tmp_path: Path) -> None:
    """A sweep of two widths on two CPU workers: FusionSampler gives each device one group of
    8, one of hidden width 16 and one of 512, whose epochs take many times longer (on a CPU a
    wide member costs about what a model alone does). When the narrow array is done, four of
    the wide array's members leave it at an epoch boundary with their checkpoints and train
    their other epochs on the free device, from where they left off.

    The study has a pruner that never prunes, so each array waits for its reports' replies:
    the hand-stepped loop sees every epoch, and whether the members move does not depend on
    this machine's speed (``move_latency_s`` is 0: what a move costs is the movers' measured
    build, next to the measured epochs of the same model). Until the wide class's speed-up is
    measured, or where a noisy measurement cannot be fitted, a member is taken to cost what a
    model alone does (``prior_marginal_cost``), as it about does here.
    """
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    settings = Settings(database_url=url, ray_address=ray_cluster, cpu_workers=2, max_array_size=8,
                        artifact_dir=tmp_path / "artifacts", move_latency_s=0.0,
                        prior_marginal_cost=1.0, min_member_efficiency=1e-6)
    upgrade(url)
    get_optuna_storage(url)
    epochs = 20
    with get_sessionmaker(url)() as session:
        study_id = service.create_study(session, url, StudyCreate(
            workload="digits-mlp", n_trials=16, epochs=epochs, name="widths",
            search_space=space(hidden=D.CategoricalDistribution([16, 512]), lr=D.FloatDistribution(0.01, 0.1)),
            sampler={"name": "RandomSampler", "kwargs": {"seed": 0}},  # its groups: 512 wide, then 16
            pruner={"name": "ThresholdPruner", "kwargs": {"lower": -1.0}},
        )).id
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
    first, second = arrays[0], arrays[1]
    assert {width[t] for t in members[first.id]} != {width[t] for t in members[second.id]}  # one group of each width
    wide = first if width[min(members[first.id])] == 512 else second
    narrow = second if wide is first else first
    moves = arrays[2:]
    assert moves, "the wide array was not split"
    # Half of the wide array's members went to the narrow array's device once it was free
    # (and, as devices freed again, half of what was left may have moved on).
    assert moves[0].worker_id == narrow.worker_id != wide.worker_id and len(members[moves[0].id]) == 4
    assert all(a.signature == wide.signature and members[a.id] <= members[wide.id] for a in moves)
    moved = set().union(*(members[a.id] for a in moves))
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
