"""The control plane's in-memory Optuna study writes exactly what Optuna's own storage would."""

from __future__ import annotations

import math

import optuna
import pytest
from optuna.trial import TrialState

from fusetune.server.db import get_optuna_storage, get_sessionmaker, upgrade
from fusetune.server.mirror import CreatedStudy, StudyMirror


def space(trial: optuna.Trial) -> dict:
    params = {"lr": trial.suggest_float("lr", 1e-3, 0.3, log=True), "hidden": trial.suggest_categorical("hidden", [32, 64])}
    if params["hidden"] == 64:  # a conditional parameter
        params["dropout"] = trial.suggest_float("dropout", 0.0, 0.5)
    return params


@pytest.fixture
def storage(database_url: str) -> optuna.storages.RDBStorage:
    upgrade(database_url)
    return get_optuna_storage(database_url)


def mirror_of(storage: optuna.storages.RDBStorage, name: str, pruner: optuna.pruners.BasePruner | None = None,
              direction: str = "maximize") -> StudyMirror:
    study = optuna.create_study(study_name=name, storage=storage, direction=direction)
    return StudyMirror(storage, study._study_id, optuna.samplers.TPESampler(seed=0, constant_liar=True),
                       pruner or optuna.pruners.NopPruner())


def test_asked_reported_and_told_trials_read_back_through_optuna(storage: optuna.storages.RDBStorage, database_url: str) -> None:
    mirror = mirror_of(storage, "roundtrip")
    sessions = get_sessionmaker(database_url)
    with sessions.begin() as session:
        asked = mirror.ask(session, 6, space)
    assert [a.number for a in asked] == list(range(6))
    with sessions.begin() as session:
        mirror.report(session, [(a.trial_id, 0, 0.5 + a.number / 100) for a in asked])
        mirror.report(session, [(asked[0].trial_id, 1, float("nan")), (asked[0].trial_id, 0, 0.25)])  # a step again replaces it
        mirror.set_user_attrs(session, asked[0].trial_id, {"state_dict": "/a/b.pt"})
        mirror.tell(session, asked[0].trial_id, TrialState.COMPLETE, 0.9)
        mirror.tell(session, asked[1].trial_id, TrialState.PRUNED)
        mirror.tell(session, asked[2].trial_id, TrialState.COMPLETE, float("inf"))  # not finite: FAIL, as Optuna does
        mirror.tell(session, asked[3].trial_id, TrialState.FAIL)

    loaded = optuna.load_study(study_name="roundtrip", storage=database_url).get_trials(deepcopy=False)
    ours = [mirror.trial(a.trial_id) for a in asked]
    for stored, held, a in zip(loaded, ours, asked, strict=True):
        assert stored.number == held.number == a.number
        assert stored.params == held.params == a.params
        assert stored.distributions == held.distributions
        assert stored.state == held.state
        assert stored.values == held.values
        assert stored.user_attrs == held.user_attrs
        assert stored.system_attrs == held.system_attrs
        assert stored.intermediate_values.keys() == held.intermediate_values.keys()
    assert loaded[0].intermediate_values[0] == 0.25 and math.isnan(loaded[0].intermediate_values[1])
    assert loaded[0].value == 0.9 and loaded[0].user_attrs == {"state_dict": "/a/b.pt"}
    assert loaded[1].state == TrialState.PRUNED and loaded[1].value == pytest.approx(0.51)  # its last value
    assert [t.state for t in loaded[2:]] == [TrialState.FAIL, TrialState.FAIL, TrialState.RUNNING, TrialState.RUNNING]
    assert loaded[0].datetime_complete is not None and loaded[4].datetime_complete is None


def test_a_restarted_mirror_holds_the_database_and_numbers_on(storage: optuna.storages.RDBStorage, database_url: str) -> None:
    sessions = get_sessionmaker(database_url)
    first = mirror_of(storage, "reload")
    with sessions.begin() as session:
        asked = first.ask(session, 3, space)
        first.report(session, [(asked[0].trial_id, 0, 0.7)])
        first.tell(session, asked[1].trial_id, TrialState.COMPLETE, 0.8)
    study_id = storage.get_study_id_from_name("reload")
    again = StudyMirror(storage, study_id, optuna.samplers.RandomSampler(seed=1), optuna.pruners.NopPruner())
    assert again.trial(asked[0].trial_id).intermediate_values == {0: 0.7}
    assert again.study.best_trial.number == 1
    with sessions.begin() as session:
        more = again.ask(session, 2, space)
    assert [m.number for m in more] == [3, 4]
    assert [t.number for t in storage.get_all_trials(study_id)] == [0, 1, 2, 3, 4]


def test_a_search_space_that_raises_fails_its_trial(storage: optuna.storages.RDBStorage, database_url: str) -> None:
    def broken(trial: optuna.Trial) -> dict:
        trial.suggest_float("lr", 0.1, 0.2)
        raise ValueError("lr too high for this model")

    mirror = mirror_of(storage, "broken")
    with get_sessionmaker(database_url).begin() as session:
        (asked,) = mirror.ask(session, 1, broken)
    assert asked.error == "ValueError: lr too high for this model"
    assert storage.get_trial(asked.trial_id).state == TrialState.FAIL


def test_pruner_state_in_system_attrs_is_written_with_the_report(storage: optuna.storages.RDBStorage, database_url: str) -> None:
    # Successive halving keeps each rung's value in the trial's system attrs.
    mirror = mirror_of(storage, "asha", optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))
    sessions = get_sessionmaker(database_url)
    with sessions.begin() as session:
        asked = mirror.ask(session, 4, space)
    decisions = []
    with sessions.begin() as session:
        for k, a in enumerate(asked):
            mirror.report(session, [(a.trial_id, 1, 1 - k / 10)])  # each worse than the first
            decisions.append(mirror.should_prune(session, a.trial_id))
    assert any(decisions) and not all(decisions)
    for a in asked:
        stored = storage.get_trial(a.trial_id).system_attrs
        assert stored == mirror.trial(a.trial_id).system_attrs
        assert any(key.startswith("completed_rung_") for key in stored)


def test_a_mirror_of_a_study_just_created_holds_what_reading_it_back_would_and_reads_nothing(
    storage: optuna.storages.RDBStorage, database_url: str
) -> None:
    from sqlalchemy import event

    from fusetune.server import service
    from fusetune.server.schemas import StudyCreate

    handed: list[tuple[int, CreatedStudy]] = []
    with get_sessionmaker(database_url)() as session:
        request = StudyCreate(workload="digits-mlp", n_trials=4, epochs=2, name="handed", metrics=["accuracy", "n_params"],
                              directions=["maximize", "minimize"], optimizer={"name": "Adam", "kwargs": {"betas": [0.8, 0.9]}})
        out = service.create_study(session, database_url, request, created=lambda *args: handed.append(args))
    [(study_id, created)] = handed
    assert study_id == out.id
    statements: list[str] = []

    def count(conn, cursor, statement, *rest) -> None:  # type: ignore[no-untyped-def]
        statements.append(statement)

    event.listen(storage.engine, "before_cursor_execute", count)
    try:
        new = StudyMirror(storage, created.study_id, optuna.samplers.RandomSampler(seed=0), optuna.pruners.NopPruner(), created=created)
    finally:
        event.remove(storage.engine, "before_cursor_execute", count)
    assert statements == []
    read = StudyMirror(storage, created.study_id, optuna.samplers.RandomSampler(seed=0), optuna.pruners.NopPruner())
    for mirror in (new, read):
        assert mirror.study.study_name == "handed"
    assert new.study.directions == read.study.directions == [optuna.study.StudyDirection.MAXIMIZE, optuna.study.StudyDirection.MINIMIZE]
    assert new.system_attrs == read.system_attrs and new.system_attrs  # the metric names and the training spec
    assert new.study.metric_names == ["accuracy", "n_params"]
    assert new.study.user_attrs == read.study.user_attrs == {}
    with get_sessionmaker(database_url).begin() as session:
        asked = new.ask(session, 2, space)
    assert [t.number for t in optuna.load_study(study_name="handed", storage=database_url).trials] == [a.number for a in asked]
