"""fusetune.client.optimize: a user's own Optuna study, in its own SQLite file, trained on the service.

Afterwards the user's study holds what the service recorded: the same trials, params,
intermediate values, values and states, with pruning decided by the user's own pruner object
(one the service could never rebuild), in the user's process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest

from fusetune import client as ft
from fusetune.client import Client
from tests.conftest import free_port, running_service

pytestmark = pytest.mark.slow


class EvenTrialsStopAfterSecondEpoch(optuna.pruners.BasePruner):
    """The user's own pruner: prunes even-numbered trials once they reported step 1."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        self.asked.append((trial.number, trial.last_step))
        return trial.number % 2 == 0 and trial.last_step == 1


@pytest.fixture(scope="module")
def service(ray_cluster: str, module_database_url: str) -> Iterator[Client]:
    """One live service for the module's tests, on SQLite and on PostgreSQL."""
    with running_service(ray_cluster, module_database_url, max_array_size=4) as client:
        yield client


def test_a_users_own_study_gets_the_services_records_and_its_own_pruning(
    service: Client, module_database_url: str, tmp_path: Path
) -> None:
    pruner = EvenTrialsStopAfterSecondEpoch()
    user_storage = f"sqlite:///{tmp_path / 'mine.db'}"
    study = optuna.create_study(
        study_name="mine", storage=user_storage, direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=4), pruner=pruner,
    )
    ft.optimize(study, "digits-mlp", n_trials=6, epochs=3, max_array_size=4, url=service.url, token=service.token)

    (record,) = [s for s in service.studies() if s["name"].startswith("mine-")]
    assert record["state"] == "COMPLETE" and record["driver"] == "client"
    theirs = sorted(optuna.load_study(study_name=record["name"], storage=module_database_url).trials, key=lambda t: t.number)
    mine = sorted(optuna.load_study(study_name="mine", storage=user_storage).trials, key=lambda t: t.number)
    assert len(mine) == len(theirs) == 6

    def facts(t: optuna.trial.FrozenTrial) -> tuple:
        return (t.params, t.distributions, t.state, t.values, t.intermediate_values)

    by_number = {t.user_attrs["client_trial_number"]: t for t in theirs}
    for trial in mine:
        assert facts(trial) == facts(by_number[trial.number])
    # The user's pruner decided: even trials stopped after two epochs, odd ones ran all three.
    for trial in mine:
        if trial.number % 2 == 0:
            assert trial.state == optuna.trial.TrialState.PRUNED and sorted(trial.intermediate_values) == [0, 1]
        else:
            assert trial.state == optuna.trial.TrialState.COMPLETE and sorted(trial.intermediate_values) == [0, 1, 2]
    assert {number for number, _ in pruner.asked} == set(range(6))


def test_a_decision_for_a_trial_not_between_epochs_is_refused_naming_step(service: Client) -> None:
    created = service.create_study("digits-mlp", n_trials=1, epochs=1, driver="client")
    trial = service.enqueue_trial(created["id"], {"lr": 0.05, "momentum": 0.5, "weight_decay": 1e-4, "hidden": 32})
    assert trial["params"]["hidden"] == 32
    with pytest.raises(ft.FusetuneError) as refused:
        service.decide_pruning(trial["id"], 5, True)
    assert refused.value.status_code == 409 and refused.value.detail[0]["loc"][-1] == "step"
    # Its budget is n_trials: a second enqueue is refused, naming it.
    with pytest.raises(ft.FusetuneError) as full:
        service.enqueue_trial(created["id"], {"lr": 0.05, "momentum": 0.5, "weight_decay": 1e-4, "hidden": 32})
    assert full.value.status_code == 409 and full.value.detail[0]["loc"][-1] == "n_trials"


def test_a_client_driven_study_names_no_sampler(service: Client) -> None:
    with pytest.raises(ft.FusetuneError) as refused:
        service.create_study("digits-mlp", n_trials=1, driver="client", sampler={"name": "RandomSampler"})
    assert refused.value.status_code == 422 and "sampler" in str(refused.value.detail)


def test_a_refused_study_leaves_the_users_sampler_as_it_was(service: Client) -> None:
    sampler = optuna.samplers.RandomSampler(seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    with pytest.raises(ValueError, match="the service refused the study"):
        ft.optimize(study, "digits-mlp", n_trials=2, metrics=["no-such-metric"], url=service.url, token=service.token)
    assert study.sampler is sampler and study.trials == []


def test_an_unreachable_service_leaves_the_users_sampler_as_it_was() -> None:
    sampler = optuna.samplers.RandomSampler(seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    with pytest.raises(httpx.ConnectError):
        ft.optimize(study, "digits-mlp", n_trials=2, url=f"http://127.0.0.1:{free_port()}", token="unused")
    assert study.sampler is sampler


def test_callbacks_see_each_trial_as_it_ends_and_may_stop_the_asking(service: Client) -> None:
    """As ``study.optimize``: each callback gets the study and the trial as it ended, and Optuna's
    ``MaxTrialsCallback`` (which calls ``study.stop()``) ends the asking."""
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    seen: list[tuple[int, optuna.trial.TrialState, float | None]] = []

    def record(s: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        assert s is study and s.trials[trial.number].state == trial.state  # told before the call
        seen.append((trial.number, trial.state, trial.value))

    stop = optuna.study.MaxTrialsCallback(3, states=(optuna.trial.TrialState.COMPLETE,))
    ft.optimize(study, "digits-mlp", n_trials=8, epochs=1, n_concurrent=1, callbacks=[record, stop],
                url=service.url, token=service.token)
    assert [number for number, _, _ in seen] == [0, 1, 2] and len(study.trials) == 3
    assert all(state == optuna.trial.TrialState.COMPLETE and value is not None for _, state, value in seen)
    with pytest.raises(RuntimeError, match="Study.stop"):
        study.stop()  # outside optimize again, as Optuna has it
    # The service study asked 3 of its 8: it ends at 3 rather than wait for trials that never come.
    record_ = service_study_of(service, study)
    assert record_["n_trials"] == 3 and service.wait(record_["id"], timeout=300)["state"] == "COMPLETE"


def service_study_of(service: Client, study: optuna.Study) -> dict:
    (found,) = [s for s in service.studies() if s["name"].startswith(f"{study.study_name}-")]
    return found


def test_an_open_ended_run_asks_until_a_callback_stops_it(service: Client) -> None:
    """n_trials=None, as study.optimize takes it: the service study is given trials as they are
    asked (two at a time here), and ends at what was asked."""
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    ft.optimize(study, "digits-mlp", n_trials=None, epochs=1, n_concurrent=1,
                callbacks=[optuna.study.MaxTrialsCallback(5)], url=service.url, token=service.token)
    assert len(study.trials) == 5 and all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    record_ = service_study_of(service, study)
    assert record_["n_trials"] == 5 and service.wait(record_["id"], timeout=300)["state"] == "COMPLETE"


@pytest.mark.parametrize(("argument", "value"), [("n_trials", 0), ("n_trials", -1), ("n_concurrent", 0), ("n_concurrent", -1),
                                                 ("epochs", 0), ("n_concurrent", True)])
def test_a_count_that_is_not_positive_is_refused_naming_it(argument: str, value: int) -> None:
    study = optuna.create_study()
    arguments = {"n_trials": 2, argument: value}
    with pytest.raises(ValueError, match=f"^{argument} must be a positive int"):
        ft.optimize(study, "digits-mlp", url="http://127.0.0.1:9", token="unused", **arguments)
    assert study.trials == []


def test_a_callback_that_raises_ends_optimize_with_its_error_and_cancels_the_rest(service: Client) -> None:
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))

    def broken(s: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        raise KeyError("the user's callback is broken")

    with pytest.raises(KeyError, match="broken"):
        ft.optimize(study, "digits-mlp", n_trials=4, epochs=1, n_concurrent=2, callbacks=[broken],
                    url=service.url, token=service.token)
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) >= 1 and optuna.trial.TrialState.RUNNING not in states
    with pytest.raises(ValueError, match="callbacks"):
        ft.optimize(study, "digits-mlp", n_trials=1, callbacks=["not callable"], url=service.url, token=service.token)  # type: ignore[list-item]


def test_calls_on_one_study_from_two_threads_give_the_users_sampler_back_after_the_last(service: Client) -> None:
    """The first call wraps the sampler and the last one restores it: the second call must not
    take the first call's FusionSampler for the user's own. The calls overlap, the first
    ending first, as the events below order them."""
    sampler = optuna.samplers.RandomSampler(seed=0)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    first_inside, second_inside, first_returned = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold(inside: threading.Event, until: threading.Event) -> Any:
        def callback(s: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            inside.set()
            assert until.wait(300)
        return callback

    def call(callback: Any, then: threading.Event | None = None) -> None:
        try:
            ft.optimize(study, "digits-mlp", n_trials=1, epochs=1, callbacks=[callback], url=service.url, token=service.token)
        except BaseException as exc:
            errors.append(exc)
        finally:
            if then is not None:
                then.set()

    first = threading.Thread(target=call, args=(hold(first_inside, second_inside), first_returned))
    first.start()
    assert first_inside.wait(300)
    second = threading.Thread(target=call, args=(hold(second_inside, first_returned),))
    second.start()
    first.join(600)
    second.join(600)
    assert not errors and len(study.trials) == 2
    assert study.sampler is sampler
