"""End to end: a sweep submitted over HTTP to a live uvicorn, trained by Ray workers, read back.

Also checks that the service's database is a real Optuna storage: ``optuna.load_study`` sees the
same trials, params, intermediate values and values as the API.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import optuna
import pytest

from fusetune.client import Client
from tests.conftest import _postgres_database, members_at_once, running_service
from tests.faults import wait_until
from tests.sse import events_of, follow_until_done

pytestmark = pytest.mark.slow

SPACE = {
    "lr": optuna.distributions.distribution_to_json(optuna.distributions.FloatDistribution(0.01, 0.3, log=True)),
    "momentum": optuna.distributions.distribution_to_json(optuna.distributions.FloatDistribution(0.0, 0.9)),
    "hidden": optuna.distributions.distribution_to_json(optuna.distributions.CategoricalDistribution([16, 32])),
}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One database per backend for the module's tests, which share one service on it (its
    start is most of a test's time); each test's studies have names of their own."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'fusetune.db'}"
    else:
        yield from _postgres_database()


@pytest.fixture(scope="module")
def service(ray_cluster: str, database_url: str) -> Iterator[Client]:
    with running_service(ray_cluster, database_url, max_array_size=4) as client:
        yield client


def test_sweep_over_http_matches_optuna(service: Client, database_url: str) -> None:
    study = service.create_study(
        "digits-mlp",
        n_trials=7,
        epochs=3,
        name="e2e",
        search_space=SPACE,
        sampler={"name": "RandomSampler", "kwargs": {"seed": 3}},
    )
    study = service.wait(study["id"], timeout=300)
    assert study["trial_counts"]["COMPLETE"] == 7
    # The study completes with its last epoch; each array's record closes with its outcome,
    # which may come just after.
    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.token}"}, timeout=120) as http:
        follow_until_done(http, study["id"])

    trials = service.trials(study["id"])
    arrays = service.arrays(study["id"])
    assert len(trials) == 7
    assert {t["state"] for t in trials} == {"COMPLETE"}
    for t in trials:
        assert sorted(t["intermediate_values"]) == ["0", "1", "2"] or sorted(t["intermediate_values"]) == [0, 1, 2]
        assert t["value"] == pytest.approx(list(t["intermediate_values"].values())[-1])
        assert 0.0 <= t["value"] <= 1.0

    # Arrays: every trial in exactly one, only equal signatures (hence equal widths) together,
    # at most four at once (an array whose members end may go on with their successors).
    assert sum(a["size"] for a in arrays) == 7
    assert all(a["state"] == "COMPLETE" and a["epochs_done"] >= 3 for a in arrays)
    assert all(width <= 4 for width in members_at_once(database_url, study["id"]).values())
    by_id = {t["id"]: t for t in trials}
    for a in arrays:
        members = [by_id[i] for i in a["trial_ids"]]
        assert {m["array_id"] for m in members} == {a["id"]}
        assert {m["signature"] for m in members} == {a["signature"]}
        assert len({m["params"]["hidden"] for m in members}) == 1
        assert a["models_steps_per_s"] > 0
    assert len(arrays) < 7  # trials were actually fused

    # The same study through Optuna's own API.
    loaded = optuna.load_study(study_name="e2e", storage=database_url)
    frozen = {t.number: t for t in loaded.trials}
    assert set(frozen) == {t["number"] for t in trials}
    for t in trials:
        f = frozen[t["number"]]
        assert f.state == optuna.trial.TrialState.COMPLETE
        assert f.params == t["params"]
        assert f.value == t["value"]
        assert {str(k): v for k, v in f.intermediate_values.items()} == {str(k): v for k, v in t["intermediate_values"].items()}
    assert loaded.best_value == max(t["value"] for t in trials)
    assert service.study(study["id"])["best_trial"]["value"] == loaded.best_value


def test_a_seeded_study_run_again_trains_the_same_model(service: Client) -> None:
    """Inits and data order derive from the sampler's seed and the trial's number, not from
    the array's id (which depends on what the database numbered before): the second study's
    array has another id and trains exactly the first one's model."""
    runs = []
    for name in ("seeded-a", "seeded-b"):
        study = service.create_study(
            "digits-mlp", n_trials=1, epochs=2, name=name, search_space=SPACE,
            sampler={"name": "RandomSampler", "kwargs": {"seed": 11}},
        )
        service.wait(study["id"], timeout=300)
        (trial,) = service.trials(study["id"])
        (array,) = service.arrays(study["id"])
        runs.append((trial, array["id"]))
    (first, first_array), (second, second_array) = runs
    assert first_array != second_array
    assert first["params"] == second["params"]
    assert first["intermediate_values"] == second["intermediate_values"] and first["value"] == second["value"]


def test_max_concurrent_trials_caps_the_trials_asked_and_not_finished(service: Client) -> None:
    """Ray Tune's max_concurrent_trials: never more than two trials asked and not yet ended,
    so the sampler asks each later trial after earlier ones finished (and learns from them)."""
    study = service.create_study(
        "digits-mlp", n_trials=5, epochs=1, name="capped", search_space=SPACE, max_concurrent_trials=2,
        sampler={"name": "TPESampler", "kwargs": {"seed": 0, "n_startup_trials": 2}},
    )
    assert study["max_concurrent_trials"] == 2
    assert service.wait(study["id"], timeout=300)["trial_counts"]["COMPLETE"] == 5
    response = service._http.get(f"/api/v1/studies/{study['id']}/events", params={"after": 0, "follow": "false"})
    in_flight, most = 0, 0
    for event in events_of(response.text):  # in the order they were committed
        in_flight += {"trial.asked": 1, "trial.ended": -1}.get(event["event"], 0)
        most = max(most, in_flight)
    assert most == 2 and in_flight == 0


def test_idle_devices_get_one_group_each_asked_together(service: Client) -> None:
    """While devices are idle, a study is asked one FusionSampler group (one array's worth)
    per idle device, all in one batch, and every group starts in that step, one array per
    device: the slowest class's array, which the sweep ends with, waits for no later step."""
    wait_until(lambda: not service.arrays(state="RUNNING"), "the workers of earlier tests to be idle")
    devices = service.health()["workers"]
    study = service.create_study(
        "digits-mlp", n_trials=4 * devices, epochs=1, name="per-group", search_space=SPACE, max_array_size=4,
        sampler={"name": "RandomSampler", "kwargs": {"seed": 5}},
    )
    assert service.wait(study["id"], timeout=300)["trial_counts"]["COMPLETE"] == 4 * devices
    response = service._http.get(f"/api/v1/studies/{study['id']}/events", params={"after": 0, "follow": "false"})
    kinds = [e["event"] for e in events_of(response.text)]  # in the order they were committed
    # The sweep's 4 x devices trials make groups of four, one per device, all asked first...
    assert kinds[: kinds.index("array.started")].count("trial.asked") == 4 * devices
    # ...and an array of each started before any of them reported.
    assert kinds[: kinds.index("trial.reported")].count("array.started") == devices
    assert [a["size"] for a in service.arrays(study["id"])] == [4] * devices


def test_a_param_nothing_reads_is_named_on_its_trials_and_warned_on_the_study(service: Client) -> None:
    """A typo in the search space tunes nothing: neither the model factory nor the training
    recipe reads ``learning_rate`` (the recipe's name is ``lr``), so each trial names it in its
    user attr ``unused_params`` and the study warns once."""
    space = {**SPACE, "learning_rate": SPACE["lr"]}
    study = service.create_study("digits-mlp", n_trials=2, epochs=1, name="typo", search_space=space)
    study = service.wait(study["id"], timeout=300)
    assert study["trial_counts"]["COMPLETE"] == 2
    (warning,) = [w for w in study["warnings"] if "learning_rate" in w]
    assert "['learning_rate']" in warning and "tune nothing" in warning
    for trial in service.trials(study["id"]):
        assert service.trial(trial["id"])["user_attrs"]["unused_params"] == ["learning_rate"]
