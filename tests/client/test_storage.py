"""fusetune.client.Storage and create_study: a service's study read with plain Optuna, over HTTP.

The study that ``optuna.load_study`` reads through the REST storage is the one Optuna reads
from the service's own database: same trials, params, distributions, states, values and
intermediate values.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from datetime import datetime, timedelta

import optuna
import pytest

from fusetune import client as ft
from fusetune.client import Client
from tests.conftest import running_service
from tests.server.conftest import LiveApi, live_api

pytestmark = pytest.mark.slow

SPACE = {
    "lr": optuna.distributions.FloatDistribution(0.01, 0.3, log=True),
    "momentum": optuna.distributions.FloatDistribution(0.0, 0.9),
    "hidden": optuna.distributions.CategoricalDistribution([16, 32]),
}


@pytest.fixture(scope="module")
def service(ray_cluster: str, module_database_url: str) -> Iterator[Client]:
    """One live service for the module's tests, on SQLite and on PostgreSQL."""
    with running_service(ray_cluster, module_database_url, max_array_size=4) as client:
        yield client


def _comparable(trials: list[optuna.trial.FrozenTrial]) -> list[tuple]:
    return [
        (t.number, t.state, t.params, t.distributions, t.values, t.intermediate_values)
        for t in sorted(trials, key=lambda t: t.number)
    ]


def test_a_study_created_from_optuna_objects_reads_back_as_the_database_holds_it(
    service: Client, module_database_url: str
) -> None:
    study = ft.create_study(
        workload="digits-mlp",
        n_trials=6,
        epochs=2,
        study_name="remote",
        direction="maximize",
        sampler=optuna.samplers.RandomSampler(seed=3),
        pruner=optuna.pruners.MedianPruner(n_warmup_steps=1),
        search_space=SPACE,
        url=service.url,
        token=service.token,
    )
    assert isinstance(study._storage, ft.Storage)
    record = service.studies(name="remote")[0]
    assert record["sampler"]["name"] == "RandomSampler" and "seed" in record["sampler"]["kwargs"]
    assert record["pruner"] == {"name": "MedianPruner", "kwargs": {"n_warmup_steps": 1}}
    service.wait(record["id"], timeout=300, poll=0.2)

    remote = optuna.load_study(study_name="remote", storage=ft.Storage(service.url, token=service.token))
    local = optuna.load_study(study_name="remote", storage=module_database_url)
    assert len(remote.trials) == 6
    assert _comparable(remote.trials) == _comparable(local.trials)
    assert remote.direction == optuna.study.StudyDirection.MAXIMIZE
    assert remote.best_trial.number == local.best_trial.number
    assert len(remote.trials_dataframe()) == 6
    for trial in remote.trials:  # naive local times, as Optuna's storages give (datetime.now())
        assert trial.datetime_start is not None and trial.datetime_start.tzinfo is None
        assert timedelta(0) <= datetime.now() - trial.datetime_start < timedelta(hours=1)
    figure = optuna.visualization.plot_optimization_history(remote)
    assert len(figure.data[0].x) == len(remote.get_trials(states=(optuna.trial.TrialState.COMPLETE,)))
    figure = optuna.visualization.plot_optimization_history(remote)
    assert len(figure.data[0].x) == len(remote.get_trials(states=(optuna.trial.TrialState.COMPLETE,)))
    assert [t.number for t in remote.get_trials(states=(optuna.trial.TrialState.COMPLETE,))] == [
        t.number for t in local.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    ]

    # A study's user attrs are the user's notes; the service's trials are its own.
    remote.set_user_attr("note", {"by": "laptop"})
    assert optuna.load_study(study_name="remote", storage=module_database_url).user_attrs == {"note": {"by": "laptop"}}
    with pytest.raises(ft.ReadOnlyStorageError, match="optimize"):
        remote.ask()

    # load_if_exists, as in optuna.create_study.
    again = ft.create_study(
        workload="digits-mlp", n_trials=6, study_name="remote", load_if_exists=True, url=service.url, token=service.token
    )
    assert again._study_id == remote._study_id
    with pytest.raises(optuna.exceptions.DuplicatedStudyError):
        ft.create_study(workload="digits-mlp", n_trials=6, study_name="remote", url=service.url, token=service.token)


def test_a_storage_kept_open_never_shows_a_deleted_studys_trials_in_the_next_study(service: Client, module_database_url: str) -> None:
    """SQLite gives a deleted study's id, and its trials' ids, to the next ones created (what a
    dashboard on one long-lived Storage would see); PostgreSQL never does, and must read the same."""
    storage = ft.Storage(service.url, token=service.token)
    old = service.create_study("digits-mlp", n_trials=3, epochs=1, name="reused-old", search_space=_json(SPACE))
    service.wait(old["id"], timeout=300, poll=0.2)
    assert len(storage.get_all_trials(old["id"])) == 3
    assert service.delete_study(old["id"]) is None  # gone at once: nothing of it trains
    new = service.create_study("digits-mlp", n_trials=2, epochs=1, name="reused-new", search_space=_json(SPACE))
    if module_database_url.startswith("sqlite"):
        assert new["id"] == old["id"]  # the case this test is about
    service.wait(new["id"], timeout=300, poll=0.2)
    trials = storage.get_all_trials(new["id"])
    assert [t._trial_id for t in trials] == [t["id"] for t in sorted(service.trials(new["id"]), key=lambda t: t["number"])]
    assert [t.number for t in trials] == [0, 1]
    for trial in trials:
        assert storage.get_trial(trial._trial_id).params == trial.params


def _json(space: dict) -> dict:
    return {k: optuna.distributions.distribution_to_json(d) for k, d in space.items()}


def test_an_unknown_study_is_a_key_error_as_in_optuna(service: Client) -> None:
    storage = ft.Storage(service.url, token=service.token)
    with pytest.raises(KeyError):
        optuna.load_study(study_name="nowhere", storage=storage)
    for name in ["my study", "é", "-leading-dash", "x" * 300]:  # names no study can have: no such study
        with pytest.raises(KeyError):
            optuna.load_study(study_name=name, storage=storage)
        with pytest.raises(KeyError):
            ft.load_study(study_name=name, url=service.url, token=service.token)
    with pytest.raises(KeyError):
        storage.get_trial(10**6)
    for outside in (0, -1, 2**31):  # ids the service's paths refuse (a 422 naming the path): none such
        with pytest.raises(KeyError):
            storage.get_trial(outside)
        with pytest.raises(KeyError):
            storage.get_all_trials(outside)
        with pytest.raises(KeyError):
            storage.get_study_name_from_id(outside)


def test_a_sampler_that_cannot_be_rebuilt_is_refused_by_name(service: Client) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(constraints_func=lambda trial: [0.0])
    before = {s["id"] for s in service.studies()}
    with pytest.raises(ValueError, match="TPESampler"):
        ft.create_study(workload="digits-mlp", n_trials=2, sampler=sampler, url=service.url, token=service.token)
    assert {s["id"] for s in service.studies()} == before  # nothing was created


@pytest.fixture
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    yield from live_api(f"sqlite:///{tmp_path_factory.mktemp('db') / 'fusetune.db'}")


def test_the_storage_sees_only_its_tenants_studies_and_refuses_a_bad_token(api: LiveApi) -> None:
    _, mine = api.create_tenant("mine")
    _, theirs = api.create_tenant("theirs")
    ft.create_study(workload="digits-mlp", n_trials=2, study_name="private", url=api.url, token=mine)

    assert [s.study_name for s in ft.Storage(api.url, token=mine).get_all_studies()] == ["private"]
    other = ft.Storage(api.url, token=theirs)
    assert other.get_all_studies() == []
    with pytest.raises(KeyError):
        optuna.load_study(study_name="private", storage=other)
    study_id = ft.Storage(api.url, token=mine).get_study_id_from_name("private")
    with pytest.raises(KeyError):  # another tenant's study is not there at all, not forbidden
        other.get_all_trials(study_id)
    for bad in ("not-a-token", "x" * 43):
        with pytest.raises(ft.FusetuneError) as refused:
            ft.Storage(api.url, token=bad).get_all_studies()
        assert refused.value.status_code == 401
