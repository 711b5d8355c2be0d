"""Of the arrays one scheduling round starts, the slowest starts first: a sweep ends with it."""

from __future__ import annotations

from pathlib import Path

import optuna.distributions as D
import pytest
import sqlalchemy as sa

from fusetune.server import service
from fusetune.server.db import Array, Throughput, Trial, get_optuna_storage, get_sessionmaker, upgrade
from fusetune.server.schemas import StudyCreate
from fusetune.server.settings import Settings
from fusetune.workers.signature import trial_signature
from fusetune.workers.workloads import get_workload
from tests.test_backfill import run_by_hand
from tests.test_training_choices import space

pytestmark = pytest.mark.slow


# The sampler's first group is wide with seed 0, narrow with seed 6 (and each seed gives one group per width).
@pytest.mark.parametrize("seed", [0, 6])
def test_the_slowest_class_starts_first_whatever_size_the_scheduler_chose(ray_cluster: str, tmp_path: Path, seed: int) -> None:
    """Two widths on two idle CPU workers: FusionSampler asks one group of eight per width,
    and both arrays start in one round. The measured speeds (ft_throughput, as an earlier
    study left them: no dry run, nothing timed here) make the wide class's array of eight
    take four times the narrow one's, so the wide array starts first, whichever width the
    sampler asked first. Its time is estimated at the size it starts with (its share of its
    class's trials), not at the size the scheduler's placement named.
    """
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    settings = Settings(database_url=url, ray_address=ray_cluster, cpu_workers=2, max_array_size=8,
                        artifact_dir=tmp_path / "artifacts")
    upgrade(url)
    get_optuna_storage(url)
    workload = get_workload("digits-mlp")
    wide, narrow = (trial_signature(workload, {"hidden": h}) for h in (64, 16))
    with get_sessionmaker(url)() as session:
        # models·steps/s at B = 1, 4 and 8: the wide class gains nothing from fusion, so the
        # scheduler may size it small, yet an array of eight takes four times the narrow one's.
        for signature, rates in ((wide, (100.0, 100.0, 100.0)), (narrow, (100.0, 250.0, 400.0))):
            session.add_all(Throughput(signature=signature, device_type="cpu", members=b, models_steps_per_s=rate)
                            for b, rate in zip((1, 4, 8), rates, strict=True))
        study_id = service.create_study(session, url, StudyCreate(
            workload="digits-mlp", n_trials=16, epochs=1, name="start-order",
            search_space=space(hidden=D.CategoricalDistribution([16, 64]), lr=D.FloatDistribution(0.01, 0.1)),
            sampler={"name": "RandomSampler", "kwargs": {"seed": seed}},
        )).id
        session.commit()
    run_by_hand(settings, study_id, "order")

    with get_sessionmaker(url)() as session:
        arrays = session.execute(
            sa.select(Array.id, Array.signature).where(Array.study_id == study_id).order_by(Array.id)
        ).all()
        first_asked = session.scalar(sa.select(Trial.signature).where(Trial.study_id == study_id, Trial.number == 0))
    assert first_asked == (narrow if seed == 6 else wide)
    assert [a.signature for a in arrays] == [wide, narrow]
