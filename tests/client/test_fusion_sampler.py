"""FusionSampler in plain Optuna: trials asked together share their non-fusible values.

The property every test checks (``assert_groups``): the trials of one group share every
non-fusible value they have, a group has at most ``group_size`` members, and a trial joined
its group while an earlier member was still running. Asking patterns: ask-and-tell in
batches (as parallel workers do), ``study.optimize(n_jobs=4)``, several processes on one
storage, enqueued trials, conditional and dynamic spaces, every Optuna sampler.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.storages import InMemoryStorage
from optuna.trial import FrozenTrial, TrialState

from fusetune.client.samplers import ATTR, FusionSampler, fusion_group

ROOT = Path(__file__).resolve().parents[2]
NON_FUSIBLE = ("hidden", "batch_size")

optuna.logging.set_verbosity(optuna.logging.WARNING)


# -- the property -------------------------------------------------------------------------------
def groups_of(trials: list[FrozenTrial]) -> dict[str, list[FrozenTrial]]:
    out: dict[str, list[FrozenTrial]] = defaultdict(list)
    for t in trials:
        group = fusion_group(t)
        assert group is not None, f"trial {t.number} is in no group"
        out[group].append(t)
    return dict(out)


def assert_groups(
    study: optuna.Study,
    non_fusible: tuple[str, ...],
    group_size: int,
    running_at_ask: dict[int, set[int]] | None = None,
) -> dict[str, list[int]]:
    """Check the property; returns each group's trial numbers.

    ``running_at_ask`` maps a trial's number to the numbers of the trials running when it
    was asked; without it, timestamps tell (a member that completed before the joiner
    started was not running when it was asked).
    """
    groups = groups_of(study.get_trials(deepcopy=False))
    for group, members in groups.items():
        members.sort(key=lambda t: t.number)
        assert len(members) <= group_size, (group, [m.number for m in members])
        for name in non_fusible:
            values = {repr(m.params[name]) for m in members if name in m.params}
            assert len(values) <= 1, f"group {group} mixes {name}: {values}"
        for joiner in members[1:]:
            earlier = [m for m in members if m.number < joiner.number]
            if running_at_ask is not None:
                assert any(m.number in running_at_ask[joiner.number] for m in earlier), (group, joiner.number)
            else:
                assert any(
                    m.datetime_complete is None or m.datetime_complete >= joiner.datetime_start for m in earlier
                ), (group, joiner.number)
    return {g: [m.number for m in ms] for g, ms in groups.items()}


def space(trial: optuna.Trial, discrete: bool = False) -> dict[str, Any]:
    """Two non-fusible params (an int width, a categorical batch size) and two fusible ones."""
    params = {
        "hidden": trial.suggest_int("hidden", 16, 64, step=16),
        "batch_size": trial.suggest_categorical("batch_size", [32, 64]),
    }
    if discrete:  # the grid and brute force need finite spaces
        params["lr"] = trial.suggest_float("lr", 0.1, 0.5, step=0.1)
        params["momentum"] = trial.suggest_categorical("momentum", [0.0, 0.9])
    else:
        params["lr"] = trial.suggest_float("lr", 1e-3, 1.0, log=True)
        params["momentum"] = trial.suggest_float("momentum", 0.0, 0.95)
    return params


def loss(params: dict[str, Any]) -> float:
    return (params["hidden"] - 48) ** 2 / 1000 + abs(params["lr"] - 0.1) + params["momentum"] / 10 + params["batch_size"] / 640


def batches(
    study: optuna.Study,
    n_batches: int,
    batch: int,
    objective: Callable[[optuna.Trial], float | tuple[float, float]],
) -> dict[int, set[int]]:
    """Ask ``batch`` trials, run their objective, then tell them all: ``batch`` parallel workers."""
    running_at_ask: dict[int, set[int]] = {}
    for _ in range(n_batches):
        asked = []
        for _ in range(batch):
            running = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
            trial = study.ask()
            running_at_ask[trial.number] = running
            asked.append((trial, objective(trial)))
        for trial, value in asked:
            study.tell(trial, value)
    return running_at_ask


class RecordingRunning(InMemoryStorage):
    """In-memory storage that notes, under its own lock, which trials run as each one is created.

    Threads' timestamps do not order a tell against another thread's ask (``datetime_complete``
    is stamped before the write takes the lock); the storage's lock does.
    """

    def __init__(self) -> None:
        super().__init__()
        self.running_at_create: dict[int, set[int]] = {}

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        with self._lock:
            running = {t.number for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))}
            trial_id = super().create_new_trial(study_id, template_trial)
            self.running_at_create[self.get_trial_number_from_id(trial_id)] = running
            return trial_id


class Recording(optuna.samplers.RandomSampler):
    """A random sampler that also notes what it was asked, to see what FusionSampler delegates."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.calls: list[tuple[str, int, str]] = []  # (method, trial number, param or "")

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.calls.append(("before_trial", trial.number, ""))
        super().before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Any) -> None:
        self.calls.append(("after_trial", trial.number, state.name))
        super().after_trial(study, trial, state, values)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, name: str, distribution: Any) -> Any:
        self.calls.append(("sample_independent", trial.number, name))
        return super().sample_independent(study, trial, name, distribution)

    def reseed_rng(self) -> None:
        self.calls.append(("reseed_rng", -1, ""))
        super().reseed_rng()


# -- construction -----------------------------------------------------------------------------
def test_import_needs_only_optuna() -> None:
    probe = "import sys, fusetune.client.samplers; print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_client_package_re_exports_it() -> None:
    from fusetune import client

    assert client.FusionSampler is FusionSampler


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"base_sampler": "tpe"}, TypeError, "base_sampler"),
        ({"non_fusible": "hidden"}, TypeError, "non_fusible"),
        ({"non_fusible": ["hidden", 3]}, TypeError, "non_fusible"),
        ({"group_size": 0}, ValueError, "group_size"),
        ({"group_size": 2.0}, TypeError, "group_size"),
        ({"group_size": True}, TypeError, "group_size"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs: dict[str, Any], error: type[Exception], names: str) -> None:
    args: dict[str, Any] = {"base_sampler": optuna.samplers.RandomSampler(), "non_fusible": ["hidden"], "group_size": 4}
    args.update(kwargs)
    base = args.pop("base_sampler")
    with pytest.raises(error, match=names):
        FusionSampler(base, **args)


# -- how groups form ----------------------------------------------------------------------------
def test_trials_asked_together_share_non_fusible_values_in_groups_of_group_size() -> None:
    base = Recording(seed=1)
    study = optuna.create_study(sampler=FusionSampler(base, non_fusible=NON_FUSIBLE, group_size=4))
    running = batches(study, n_batches=3, batch=6, objective=lambda t: loss(space(t)))
    groups = assert_groups(study, NON_FUSIBLE, 4, running)
    # Six asked at a time, four to a group; a batch's groups close when the batch is told.
    assert sorted(groups.values()) == [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11], [12, 13, 14, 15], [16, 17]]
    # The base sampler chose each group's non-fusible values once, through its founder, and
    # every trial's fusible values.
    for name in NON_FUSIBLE:
        assert sorted(n for m, n, p in base.calls if m == "sample_independent" and p == name) == [0, 4, 6, 10, 12, 16]
    for name in ("lr", "momentum"):
        assert sorted(n for m, n, p in base.calls if m == "sample_independent" and p == name) == list(range(18))
    lrs = [t.params["lr"] for t in study.trials]
    assert len(set(lrs)) == len(lrs)


def test_a_trial_asked_when_no_member_runs_opens_a_new_group() -> None:
    study = optuna.create_study(sampler=FusionSampler(optuna.samplers.RandomSampler(seed=0), non_fusible=NON_FUSIBLE))
    running = batches(study, n_batches=5, batch=1, objective=lambda t: loss(space(t)))  # ask, tell, ask, ...
    groups = assert_groups(study, NON_FUSIBLE, 8, running)
    assert sorted(groups.values()) == [[0], [1], [2], [3], [4]]


def test_a_trial_joins_the_oldest_open_group_that_agrees() -> None:
    study = optuna.create_study(sampler=FusionSampler(optuna.samplers.RandomSampler(seed=0), non_fusible=NON_FUSIBLE, group_size=3))
    for hidden in (16, 32, None, 32, None, None):  # None: not enqueued
        if hidden is not None:
            study.enqueue_trial({"hidden": hidden})
        space(study.ask())
    groups = assert_groups(study, NON_FUSIBLE, 3)
    # 0 opens "0", 1 (width 32) cannot join it and opens "1"; 2 joins the older "0", 3 (32)
    # joins "1"; 4 fills "0", so 5 goes to "1".
    assert groups == {"0": [0, 2, 4], "1": [1, 3, 5]}
    assert [t.params["hidden"] for t in study.trials] == [16, 32, 16, 32, 16, 32]


def test_finished_members_still_count_and_still_decide() -> None:
    """A group stays open while any member runs; its finished members count and hold its values."""
    sampler = FusionSampler(optuna.samplers.RandomSampler(seed=0), non_fusible=NON_FUSIBLE, group_size=3)
    study = optuna.create_study(sampler=sampler)
    other = optuna.create_study(sampler=sampler)  # the same sampler on a second study meanwhile
    first, second = study.ask(), study.ask()
    values = space(first)
    space(second)
    study.tell(first, 1.0)
    space(other.ask())
    third = study.ask()  # joins "0": trial 1 still runs
    assert (space(third)["hidden"], third.params["batch_size"]) == (values["hidden"], values["batch_size"])
    space(study.ask())  # "0" has three members, one finished: full
    assert assert_groups(study, NON_FUSIBLE, 3) == {"0": [0, 1, 2], "3": [3]}
    assert assert_groups(other, NON_FUSIBLE, 3) == {"0": [0]}


def test_optimize_with_four_threads() -> None:
    group_size = 4
    # Each trial waits in its objective until four are running: trial 0 cannot end before
    # trials 1-3 were asked, so the first group is exactly those four.
    barrier = threading.Barrier(4, timeout=120)

    def objective(trial: optuna.Trial) -> float:
        value = loss(space(trial))
        barrier.wait()
        return value

    storage = RecordingRunning()
    study = optuna.create_study(
        storage=storage,
        sampler=FusionSampler(optuna.samplers.TPESampler(seed=0, constant_liar=True), non_fusible=NON_FUSIBLE, group_size=group_size),
    )
    study.optimize(objective, n_trials=32, n_jobs=4)
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 32
    groups = assert_groups(study, NON_FUSIBLE, group_size, storage.running_at_create)
    assert [0, 1, 2, 3] in groups.values()
    assert sum(len(g) for g in groups.values()) == 32
    assert len(groups) <= 16  # trials in flight together shared groups


def test_two_samplers_asking_from_threads_of_one_process_share_the_storages_groups() -> None:
    """Two FusionSamplers on one in-memory storage, each asked from a thread of its own: the
    storage's lock orders their decisions (nothing reads a group back here: only this
    process writes an in-memory storage), so no group mixes values or overfills."""
    storage = InMemoryStorage()
    studies = [
        optuna.create_study(storage=storage, study_name="s", sampler=FusionSampler(optuna.samplers.RandomSampler(seed=0), non_fusible=NON_FUSIBLE, group_size=4)),
    ]
    studies.append(optuna.load_study(study_name="s", storage=storage, sampler=FusionSampler(optuna.samplers.RandomSampler(seed=1), non_fusible=NON_FUSIBLE, group_size=4)))
    start = threading.Barrier(2)

    def ask(study: optuna.Study) -> None:
        start.wait()
        for _ in range(60):
            space(study.ask())

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between almost every bytecode: races happen if they can
    try:
        threads = [threading.Thread(target=ask, args=(study,)) for study in studies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    groups = assert_groups(studies[0], NON_FUSIBLE, 4, {t.number: set(range(120)) for t in studies[0].trials})
    assert sum(len(g) for g in groups.values()) == 120
    assert all(len(g) == 4 for g in groups.values())  # every trial is still running: each group fills up


def test_multi_objective_study() -> None:
    study = optuna.create_study(
        directions=["minimize", "maximize"],
        sampler=FusionSampler(optuna.samplers.TPESampler(seed=0), non_fusible=NON_FUSIBLE, group_size=4),
    )

    def objective(trial: optuna.Trial) -> tuple[float, float]:
        params = space(trial)
        return loss(params), params["hidden"] * params["lr"]

    running = batches(study, n_batches=4, batch=4, objective=objective)
    groups = assert_groups(study, NON_FUSIBLE, 4, running)
    assert sorted(groups.values()) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert len(study.best_trials) >= 1


# -- every sampler ------------------------------------------------------------------------------
GRID = {"hidden": [16, 32, 48, 64], "batch_size": [32, 64], "lr": [0.1, 0.2, 0.3, 0.4, 0.5], "momentum": [0.0, 0.9]}
SAMPLERS: dict[str, tuple[Callable[[int], optuna.samplers.BaseSampler], int, bool]] = {
    # name: (seeded factory, objectives, discrete space)
    "random": (lambda s: optuna.samplers.RandomSampler(seed=s), 1, False),
    "tpe": (lambda s: optuna.samplers.TPESampler(seed=s, n_startup_trials=4), 1, False),
    "tpe-multivariate": (lambda s: optuna.samplers.TPESampler(seed=s, n_startup_trials=4, multivariate=True), 1, False),
    "tpe-multi-objective": (lambda s: optuna.samplers.TPESampler(seed=s, n_startup_trials=4), 2, False),
    "gp": (lambda s: optuna.samplers.GPSampler(seed=s, n_startup_trials=4), 1, False),
    "cma-es": (lambda s: optuna.samplers.CmaEsSampler(seed=s, n_startup_trials=4, warn_independent_sampling=False), 1, False),
    "nsga-ii": (lambda s: optuna.samplers.NSGAIISampler(seed=s, population_size=4), 2, False),
    "nsga-iii": (lambda s: optuna.samplers.NSGAIIISampler(seed=s, population_size=4), 2, False),
    "qmc": (lambda s: optuna.samplers.QMCSampler(seed=s, warn_independent_sampling=False), 1, False),
    "grid": (lambda s: optuna.samplers.GridSampler(GRID, seed=s), 1, True),
    "brute-force": (lambda s: optuna.samplers.BruteForceSampler(seed=s), 1, True),
}


def run_with(name: str, seed: int, n_batches: int = 4, batch: int = 4) -> tuple[optuna.Study, dict[int, set[int]]]:
    factory, objectives, discrete = SAMPLERS[name]
    study = optuna.create_study(
        directions=["minimize"] * objectives,
        sampler=FusionSampler(factory(seed), non_fusible=NON_FUSIBLE, group_size=4),
    )

    def objective(trial: optuna.Trial) -> float | tuple[float, float]:
        params = space(trial, discrete)
        return loss(params) if objectives == 1 else (loss(params), params["lr"] * params["hidden"])

    running = batches(study, n_batches, batch, objective)
    return study, running


#: Samplers that enumerate their space: FusionSampler leaves their choices be (below).
ENUMERATING = ("grid", "brute-force")


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # GP, NSGA-III
@pytest.mark.parametrize("name", sorted(set(SAMPLERS) - set(ENUMERATING)))
def test_every_sampler_gives_fusible_groups_reproducibly(name: str) -> None:
    study, running = run_with(name, seed=3)
    groups = assert_groups(study, NON_FUSIBLE, 4, running)
    assert sorted(groups.values()) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert all(t.state == TrialState.COMPLETE for t in study.trials)

    again, _ = run_with(name, seed=3)
    assert [(fusion_group(t), t.params) for t in again.trials] == [(fusion_group(t), t.params) for t in study.trials]


def enumerated(name: str, points: int) -> optuna.Study:
    """``points`` trials of an enumerating sampler through FusionSampler, four running at a
    time; the last four by ``study.optimize``, where the GridSampler may stop the study as
    its grid runs out (ask-and-tell raises there, in plain Optuna too)."""
    study, _ = run_with(name, seed=3, n_batches=points // 4 - 1, batch=4)
    study.optimize(lambda t: loss(space(t, discrete=True)), n_trials=4)
    return study


@pytest.mark.parametrize("name", ENUMERATING)
def test_a_sampler_that_enumerates_its_space_tries_every_point_once_through_fusion_sampler(name: str) -> None:
    """A group's values put over the point GridSampler picked would try a neighbour twice and
    the point never: FusionSampler leaves an enumerating sampler's choices be, reproducibly."""
    points = 4 * 2 * 5 * 2  # hidden x batch_size x lr x momentum (GRID, and the discrete space)
    study = enumerated(name, points)
    tried = [tuple(sorted(t.params.items())) for t in study.trials]
    assert len(tried) == points and len(set(tried)) == points
    assert all(t.state == TrialState.COMPLETE for t in study.trials)
    assert [t.params for t in enumerated(name, points).trials] == [t.params for t in study.trials]


# -- enqueued trials, conditional and dynamic spaces -------------------------------------------
def test_enqueued_trials_keep_their_values_and_join_only_groups_that_agree() -> None:
    study = optuna.create_study(sampler=FusionSampler(optuna.samplers.RandomSampler(seed=0), non_fusible=NON_FUSIBLE, group_size=8))
    study.enqueue_trial({"hidden": 32})
    study.enqueue_trial({"hidden": 64})  # disagrees with the open group: opens its own
    study.enqueue_trial({"lr": 0.5})  # fixes only a fusible param: joins the oldest open group
    study.enqueue_trial({"hidden": 32, "batch_size": 64})  # agrees with trial 0 (no batch size yet)
    trials = [study.ask() for _ in range(5)]  # the fifth is not enqueued
    for t in trials:
        space(t)
    frozen = study.get_trials(deepcopy=False)
    assert [t.params["hidden"] for t in frozen] == [32, 64, 32, 32, 32]
    assert frozen[2].params["lr"] == 0.5
    # Trial 3 was the first of its group with a batch size (trial 0 had none when 3 was
    # asked): its enqueued 64 became the group's, trial 0's included.
    assert [t.params["batch_size"] for t in frozen if t.number != 1] == [64, 64, 64, 64]
    groups = assert_groups(study, NON_FUSIBLE, 8)
    assert sorted(groups.values()) == [[0, 2, 3, 4], [1]]


def test_an_enqueued_value_that_clashes_with_every_open_group_opens_a_new_one() -> None:
    study = optuna.create_study(sampler=FusionSampler(optuna.samplers.RandomSampler(seed=0), non_fusible=NON_FUSIBLE, group_size=8))
    first = study.ask()
    params = space(first)
    other = 64 if params["batch_size"] == 32 else 32
    study.enqueue_trial({"hidden": params["hidden"], "batch_size": other})
    second = study.ask()
    assert space(second)["batch_size"] == other
    third = study.ask()
    assert space(third)["batch_size"] == params["batch_size"]
    assert sorted(assert_groups(study, NON_FUSIBLE, 8).values()) == [[0, 2], [1]]


def test_an_enqueued_trial_opens_a_group_that_others_join() -> None:
    study = optuna.create_study(sampler=FusionSampler(optuna.samplers.RandomSampler(seed=0), non_fusible=NON_FUSIBLE, group_size=4))
    study.enqueue_trial({"hidden": 16, "batch_size": 32})
    trials = [study.ask() for _ in range(4)]
    for t in trials:
        space(t)
    assert {(t.params["hidden"], t.params["batch_size"]) for t in study.trials} == {(16, 32)}
    assert len(set(assert_groups(study, NON_FUSIBLE, 4))) == 1


def conditional_space(trial: optuna.Trial) -> None:
    # "extra" is fusible (a flag the model reads per member, say); the width of the extra
    # layer is not, and only trials with the flag have it.
    trial.suggest_float("lr", 1e-3, 1.0, log=True)
    if trial.suggest_categorical("extra", [False, True]):
        trial.suggest_categorical("extra_width", [8, 16, 32, 64, 128, 256])


def test_a_conditional_param_first_sampled_by_a_later_member_fixes_it_for_the_group() -> None:
    base = Recording(seed=0)
    study = optuna.create_study(sampler=FusionSampler(base, non_fusible=["extra_width"], group_size=8))
    for extra in (False, True, False, True, True):
        study.enqueue_trial({"extra": extra})
    for t in [study.ask() for _ in range(5)]:
        conditional_space(t)
    trials = study.get_trials(deepcopy=False)
    assert "extra_width" not in trials[0].params
    widths = {t.params["extra_width"] for t in trials if t.params["extra"]}
    assert len(widths) == 1  # trial 1 chose it; trials 3 and 4 took it
    assert [n for m, n, p in base.calls if p == "extra_width"] == [1]
    assert len(set(assert_groups(study, ("extra_width",), 8))) == 1


def test_a_group_value_outside_a_dynamic_space_starts_a_new_group_instead_of_raising() -> None:
    study = optuna.create_study(sampler=FusionSampler(optuna.samplers.RandomSampler(seed=0), non_fusible=["hidden"], group_size=8))
    study.enqueue_trial({"hidden": 64})
    a = study.ask()
    a.suggest_int("hidden", 32, 64)
    b = study.ask()  # joins a's group, but its range stops short of 64
    assert fusion_group(study.trials[1]) == "0"
    assert 16 <= b.suggest_int("hidden", 16, 48) <= 48
    c = study.ask()  # a's group is still open
    assert c.suggest_int("hidden", 32, 64) == 64
    groups = assert_groups(study, ("hidden",), 8)
    assert sorted(groups.values()) == [[0, 2], [1]]
    assert fusion_group(study.trials[1]) == "1.1"  # trial 1's new group of its own


def test_relative_values_of_a_joining_trial_are_the_groups() -> None:
    """Multivariate TPE samples the non-fusible params relatively: the group's values win."""
    sampler = FusionSampler(optuna.samplers.TPESampler(seed=0, multivariate=True, n_startup_trials=2), non_fusible=NON_FUSIBLE, group_size=4)
    study = optuna.create_study(sampler=sampler)
    batches(study, n_batches=1, batch=2, objective=lambda t: loss(space(t)))  # startup: now TPE is relative
    founder = study.ask()
    space(founder)
    joiner = study.ask()
    relative = sampler.infer_relative_search_space(study, study.trials[3])
    assert set(relative) == {"hidden", "batch_size", "lr", "momentum"}  # the base's own space
    proposed = sampler.sample_relative(study, study._storage.get_trial(joiner._trial_id), relative)
    assert proposed["hidden"] == founder.params["hidden"] and proposed["batch_size"] == founder.params["batch_size"]
    assert space(joiner)["hidden"] == founder.params["hidden"]


# -- the rest of the BaseSampler contract -----------------------------------------------------
def test_before_after_trial_and_reseed_are_the_base_samplers() -> None:
    base = Recording(seed=0)
    sampler = FusionSampler(base, non_fusible=NON_FUSIBLE)
    study = optuna.create_study(sampler=sampler)
    study.optimize(lambda t: loss(space(t)), n_trials=2)
    sampler.reseed_rng()
    kinds = [(m, n) for m, n, _ in base.calls if m != "sample_independent"]
    assert kinds == [("before_trial", 0), ("after_trial", 0), ("before_trial", 1), ("after_trial", 1), ("reseed_rng", -1)]
    assert [p for m, n, p in base.calls if m == "after_trial"] == ["COMPLETE", "COMPLETE"]


def test_pickled_copies_keep_the_groups_of_the_storage() -> None:
    storage = InMemoryStorage()
    sampler = FusionSampler(optuna.samplers.RandomSampler(seed=0), non_fusible=NON_FUSIBLE, group_size=4)
    study = optuna.create_study(storage=storage, sampler=sampler, study_name="s")
    first = study.ask()
    space(first)
    blob = pickle.dumps(sampler)
    assert b"InMemoryStorage" not in blob and "_lock" not in sampler.__getstate__()
    copy = pickle.loads(blob)
    assert isinstance(copy, FusionSampler) and copy.non_fusible == frozenset(NON_FUSIBLE) and copy.group_size == 4
    # Another worker, its own copy of the sampler, the same storage: its trial joins the group.
    other = optuna.load_study(study_name="s", storage=storage, sampler=copy)
    second = other.ask()
    params = space(second)
    assert fusion_group(storage.get_trial(second._trial_id)) == "0"
    assert (params["hidden"], params["batch_size"]) == (first.params["hidden"], first.params["batch_size"])
    copy.reseed_rng()


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_a_retried_trial_is_not_a_member_of_the_failed_trials_group() -> None:
    """Optuna's retry callback copies the failed trial's system attrs to its retry."""
    study = optuna.create_study(sampler=FusionSampler(optuna.samplers.RandomSampler(seed=0), non_fusible=NON_FUSIBLE, group_size=2))
    failed = study.ask()
    space(failed)
    study.tell(failed, state=TrialState.FAIL)
    optuna.storages.RetryHeartbeatStaleTrialCallback()(study, study.trials[0])
    assert study.trials[1].system_attrs[ATTR]["number"] == 0  # the copy
    assert fusion_group(study.trials[1]) is None
    retry = study.ask()
    assert retry.number == 1
    space(retry)
    assert fusion_group(study.trials[1]) == "1"
    assert study.trials[1].params == study.trials[0].params


# -- several processes on one storage ---------------------------------------------------------
class Interleaving(InMemoryStorage):
    """An in-memory storage that runs ``hook`` once, just before the next FusionSampler write:
    another process's steps landing between a trial's read and its write."""

    hook: Callable[[], None] | None = None

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        hook, self.hook = self.hook, None
        if key == ATTR and hook is not None:
            hook()
        elif hook is not None:
            self.hook = hook
        super().set_trial_system_attr(trial_id, key, value)


def two_processes(group_size: int) -> tuple[Interleaving, optuna.Study, optuna.Study]:
    """Two studies on one storage, each with its own FusionSampler (its own lock), as two processes have."""
    storage = Interleaving()
    mine = optuna.create_study(
        storage=storage, study_name="s",
        sampler=FusionSampler(optuna.samplers.RandomSampler(seed=0), non_fusible=["hidden"], group_size=group_size),
    )
    theirs = optuna.load_study(
        study_name="s", storage=storage,
        sampler=FusionSampler(optuna.samplers.RandomSampler(seed=1), non_fusible=["hidden"], group_size=group_size),
    )
    return storage, mine, theirs


def test_a_join_raced_by_another_process_never_overfills_the_group() -> None:
    storage, mine, theirs = two_processes(group_size=3)
    mine.ask(), mine.ask()  # group "0": two of three
    storage.hook = theirs.ask  # their trial joins "0" between my read and my write
    mine.ask()
    groups = assert_groups(mine, ("hidden",), 3)
    # Their trial 3 wrote first and stays; my trial 2, whose write made four, leaves.
    assert sorted(groups.values()) == [[0, 1, 3], [2]]
    assert fusion_group(mine.trials[2]) == "2.1"


def test_a_value_raced_by_another_process_splits_the_group_instead_of_mixing() -> None:
    storage, mine, theirs = two_processes(group_size=8)
    founder = mine.ask()
    theirs_trial = theirs.ask()
    my_trial = mine.ask()
    assert {fusion_group(t) for t in mine.trials} == {"0"}
    # Neither has seen the other's width when it chooses its own: theirs lands first.
    storage.hook = lambda: theirs_trial.suggest_int("hidden", 16, 32)
    assert 64 <= my_trial.suggest_int("hidden", 64, 128) <= 128  # so the two widths differ
    assert founder.suggest_int("hidden", 16, 128) == theirs_trial.params["hidden"]
    groups = assert_groups(mine, ("hidden",), 8)
    assert sorted(groups.values()) == [[0, 1], [2]]


WORKER = textwrap.dedent(
    """
    import sys
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage
    from fusetune.client.samplers import FusionSampler

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = JournalStorage(JournalFileBackend(sys.argv[1]))
    sampler = FusionSampler(optuna.samplers.TPESampler(seed=int(sys.argv[2])), non_fusible=["hidden", "batch_size"], group_size=4)
    study = optuna.load_study(study_name="shared", storage=storage, sampler=sampler)
    for _ in range(6):
        trials = [study.ask() for _ in range(3)]
        for t in trials:
            t.suggest_int("hidden", 16, 64, step=16)
            t.suggest_categorical("batch_size", [32, 64])
            t.suggest_float("lr", 1e-3, 1.0, log=True)
        for t in trials:
            study.tell(t, t.params["lr"])
    """
)


def test_several_processes_on_one_storage(tmp_path: Path) -> None:
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    path = str(tmp_path / "journal.log")
    storage = JournalStorage(JournalFileBackend(path))
    optuna.create_study(study_name="shared", storage=storage)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    workers = [subprocess.Popen([sys.executable, str(script), path, str(seed)], cwd=ROOT) for seed in (0, 1, 2)]
    assert [w.wait(timeout=300) for w in workers] == [0, 0, 0]
    study = optuna.load_study(study_name="shared", storage=JournalStorage(JournalFileBackend(path)))
    assert len(study.trials) == 54
    groups = assert_groups(study, NON_FUSIBLE, 4, running_at_ask=running_in_journal(path))
    assert sum(len(g) for g in groups.values()) == 54


def running_in_journal(path: str) -> dict[int, set[int]]:
    """Each trial's number -> the trials still running where the journal records its creation.

    The journal's order is the one order all processes agree on; timestamps are not (a
    process stamps ``datetime_complete`` before it appends the op another process may read
    after it created a trial). A sampler can only have seen a member running if that
    member's finish comes later in the log than the joiner's creation.
    """
    running: set[int] = set()
    at_create: dict[int, set[int]] = {}
    created = 0
    with open(path) as log:
        for line in log:
            op = json.loads(line)
            if op["op_code"] == 4:  # CREATE_TRIAL: ids count up from 0 in a one-study journal
                at_create[created] = set(running)
                running.add(created)
                created += 1
            elif op["op_code"] == 6 and op["state"] != optuna.trial.TrialState.RUNNING.value:
                running.discard(op["trial_id"])
    return at_create


def test_the_example_runs_and_groups_each_round_of_eight() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "client" / "samplers" / "example.py")], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert [line.split(":")[1].split(",")[0].strip() for line in out.splitlines() if line.startswith("group")] == ["8 trials"] * 4
    assert "best value" in out
