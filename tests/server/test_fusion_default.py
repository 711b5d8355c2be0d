"""The service asks a study's trials through FusionSampler unless the study opts out.

``loop.mirrors.study_sampler`` is what the scheduling loop builds each study's mirror with;
the trials it asks, written to the database through the mirror, come out in groups whose
members share the workload's non-fusible params.
"""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from sqlalchemy import select

from fusetune.client.samplers import FusionSampler, fusion_group
from fusetune.server import service
from fusetune.server.db import Study, get_optuna_storage, get_sessionmaker, upgrade
from fusetune.server.loop.mirrors import study_sampler
from fusetune.server.mirror import StudyMirror
from fusetune.server.schemas import StudyCreate
from fusetune.server.settings import Settings
from fusetune.workers.workloads import get_workload

D = optuna.distributions
SPACE = {
    "hidden": D.distribution_to_json(D.CategoricalDistribution([16, 32])),
    "batch_size": D.distribution_to_json(D.CategoricalDistribution([32, 64])),
    "lr": D.distribution_to_json(D.FloatDistribution(1e-3, 0.3, log=True)),
}


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    upgrade(url)
    get_optuna_storage(url)
    return url


def create(url: str, **request: object) -> Study:
    with get_sessionmaker(url)() as session:
        out = service.create_study(session, url, StudyCreate(**{"workload": "digits-mlp", "n_trials": 8, **request}))
        study = session.scalar(select(Study).where(Study.id == out.id))
        session.expunge(study)
    return study


def test_service_studies_sample_with_fusion_sampler_unless_they_opt_out(url: str) -> None:
    settings = Settings(database_url=url, max_array_size=16)
    sized = study_sampler(create(url, name="sized", max_array_size=4), settings)
    assert isinstance(sized, FusionSampler)
    assert sized.group_size == 4 and sized.non_fusible == {"hidden"}  # digits-mlp's default space
    assert isinstance(sized.base_sampler, optuna.samplers.TPESampler)
    assert sized.base_sampler._constant_liar  # the service's TPE default, inside the wrapper

    own_space = study_sampler(create(url, name="own-space", search_space=SPACE), settings)
    assert isinstance(own_space, FusionSampler)
    # 8 trials fit one device's array of 16: one group of 8.
    assert own_space.group_size == 8 and own_space.non_fusible == {"hidden", "batch_size"}
    # A group fills one device: 64 trials asked at once over 2 devices are 2 groups of 32,
    # so the sweep explores two shapes, not one shape in one group of the array size.
    wide = create(url, name="wide", n_trials=64)
    assert study_sampler(wide, Settings(database_url=url, max_array_size=64), devices=2).group_size == 32
    assert study_sampler(wide, Settings(database_url=url, max_array_size=16), devices=2).group_size == 16

    plain = study_sampler(create(url, name="plain", fusion_sampler=False), settings)
    assert isinstance(plain, optuna.samplers.TPESampler)


def test_the_flag_is_stored_with_the_study_s_configuration_and_shown(url: str) -> None:
    """The opt-out is a column of the study's configuration (it rode in the sampler spec
    before migration 0015); the sampler spec is the sampler's alone."""
    with get_sessionmaker(url)() as session:
        on = service.create_study(session, url, StudyCreate(workload="digits-mlp", n_trials=2, name="on"))
        off = service.create_study(session, url, StudyCreate(workload="digits-mlp", n_trials=2, name="off", fusion_sampler=False))
        assert (on.fusion_sampler, off.fusion_sampler) == (True, False)
        assert on.sampler == off.sampler == {"name": "TPESampler", "kwargs": {}}
        rows = {s.name: (s.sampler, s.config.fusion_sampler) for s in session.scalars(select(Study))}
        assert rows == {"on": ({"name": "TPESampler", "kwargs": {}}, True), "off": ({"name": "TPESampler", "kwargs": {}}, False)}
        assert service.get_study(session, url, off.id).fusion_sampler is False


def test_trials_the_service_asks_share_their_shapes_in_groups_of_the_array_size(url: str) -> None:
    row = create(url, name="asked", max_array_size=4, search_space=SPACE, sampler={"name": "RandomSampler", "kwargs": {"seed": 0}})
    storage = get_optuna_storage(url)
    mirror = StudyMirror(storage, row.optuna_study_id, study_sampler(row, Settings(database_url=url)), optuna.pruners.NopPruner())
    workload = get_workload("digits-mlp")
    with get_sessionmaker(url)() as session:
        mirror.ask(session, 8, workload.search_space, {k: D.json_to_distribution(v) for k, v in SPACE.items()})
        session.commit()
    # Read back from the database, as optuna.load_study and a restarted service do.
    trials = optuna.load_study(study_name="asked", storage=url).trials
    groups: dict[str | None, list[optuna.trial.FrozenTrial]] = {}
    for t in trials:
        groups.setdefault(fusion_group(t), []).append(t)
    assert sorted([t.number for t in g] for g in groups.values()) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for members in groups.values():
        assert len({(t.params["hidden"], t.params["batch_size"]) for t in members}) == 1
        assert len({t.params["lr"] for t in members}) == 4  # fusible: one draw per trial


def test_a_space_no_model_builds_from_keeps_its_plain_sampler(url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Its trials then fail one by one with the model's error, as without FusionSampler."""
    broken = {"hidden": D.distribution_to_json(D.CategoricalDistribution([-1, -2]))}
    sampler = study_sampler(create(url, name="broken", search_space=broken), Settings(database_url=url))
    assert isinstance(sampler, optuna.samplers.TPESampler)
    assert "samples without FusionSampler" in caplog.text
