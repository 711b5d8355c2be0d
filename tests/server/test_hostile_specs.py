"""A tenant's sampler and pruner specs cannot exhaust or stall the service (issue 29, item 2).

Samplers and pruners come from an allow-list, the kwargs that size their work are capped by
``FUSETUNE_SAMPLER_MAX_*`` settings and checked from the JSON without building anything, the
build runs off the event loop under a deadline, and a study stored before the caps (or under
larger ones) fails alone when the scheduling loop meets it. Building a TPE sampler, on the
client or in the service, passes no argument Optuna deprecated (issue 31, item 5).
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest
import sqlalchemy as sa

from fusetune.client import create_study as client_create_study
from fusetune.server import optuna_specs, service
from fusetune.server.db import Study, StudyState, get_optuna_storage, get_sessionmaker, upgrade
from fusetune.server.optuna_specs import SpecError, SpecLimits, build_within, check_sampler, make_pruner, make_sampler
from fusetune.server.schemas import StudyCreate
from fusetune.server.settings import Settings
from tests.server.conftest import LiveApi

D = optuna.distributions
VALID = {"workload": "digits-mlp", "n_trials": 4, "epochs": 2}
TWO_OBJECTIVES = {"metrics": ["accuracy", "n_params"]}
FLOAT = json.loads(D.distribution_to_json(D.FloatDistribution(0.0, 1.0)))

#: Each bomb: what it is, the request's fields, where the 422 points, what its message names.
BOMBS: list[tuple[str, dict[str, Any], list[str], str]] = [
    ("GridSampler, 2 x 40,000 values (1.6e9 points, 80 KB of JSON)",
     {"sampler": {"name": "GridSampler", "kwargs": {"search_space": {"a": list(range(40_000)), "b": list(range(40_000))}}}},
     ["body", "sampler", "kwargs", "search_space"], "FUSETUNE_SAMPLER_MAX_GRID_POINTS"),
    ("TPESampler, n_ei_candidates 10^8", {"sampler": {"name": "TPESampler", "kwargs": {"n_ei_candidates": 10**8}}},
     ["body", "sampler", "kwargs", "n_ei_candidates"], "FUSETUNE_SAMPLER_MAX_EI_CANDIDATES"),
    ("NSGAIISampler, population_size 10^9", {"sampler": {"name": "NSGAIISampler", "kwargs": {"population_size": 10**9}}},
     ["body", "sampler", "kwargs", "population_size"], "FUSETUNE_SAMPLER_MAX_POPULATION"),
    ("CmaEsSampler, popsize 10^9", {"sampler": {"name": "cmaes", "kwargs": {"popsize": 10**9}}},
     ["body", "sampler", "kwargs", "popsize"], "FUSETUNE_SAMPLER_MAX_POPULATION"),
    ("NSGAIIISampler, dividing_parameter 10^6", {**TWO_OBJECTIVES, "sampler": {"name": "NSGAIIISampler", "kwargs": {"dividing_parameter": 10**6}}},
     ["body", "sampler", "kwargs", "dividing_parameter"], "FUSETUNE_SAMPLER_MAX_REFERENCE_POINTS"),
    ("NSGAIIISampler, 10,001 reference points from dividing_parameter among 2 objectives",
     {**TWO_OBJECTIVES, "sampler": {"name": "NSGAIIISampler", "kwargs": {"dividing_parameter": 10_000}}},
     ["body", "sampler", "kwargs", "dividing_parameter"], "FUSETUNE_SAMPLER_MAX_REFERENCE_POINTS"),
    ("NSGAIIISampler, 20,000 reference points listed",
     {**TWO_OBJECTIVES, "sampler": {"name": "NSGAIIISampler", "kwargs": {"reference_points": [[0.5, 0.5]] * 20_000}}},
     ["body", "sampler", "kwargs", "reference_points"], "FUSETUNE_SAMPLER_MAX_REFERENCE_POINTS"),
    ("BruteForceSampler over 10^9 integers",
     {"search_space": {"hidden": json.loads(D.distribution_to_json(D.IntDistribution(1, 10**9)))}, "sampler": {"name": "BruteForceSampler"}},
     ["body", "search_space"], "FUSETUNE_SAMPLER_MAX_GRID_POINTS"),
    ("CmaEsSampler over 101 parameters",
     {"search_space": {f"p{i}": FLOAT for i in range(101)}, "sampler": {"name": "CmaEsSampler"}},
     ["body", "search_space"], "FUSETUNE_SAMPLER_MAX_CMA_DIMENSIONS"),
    ("GPSampler (not on the allow-list)", {"sampler": {"name": "GPSampler"}}, ["body", "sampler", "name"], "TPESampler"),
    ("PartialFixedSampler (not on the allow-list)", {"sampler": {"name": "PartialFixedSampler", "kwargs": {"fixed_params": {}}}},
     ["body", "sampler", "name"], "TPESampler"),
    ("HyperbandPruner, max_resource 10^40", {"pruner": {"name": "HyperbandPruner", "kwargs": {"max_resource": 10**40}}},
     ["body", "pruner", "kwargs", "max_resource"], str(optuna_specs.MAX_INT)),
]


def _locs(response: httpx.Response) -> list[list[Any]]:
    return [error["loc"] for error in response.json()["detail"]]


def test_each_bomb_is_a_422_naming_its_kwarg_and_limit_while_another_tenant_is_answered(live: LiveApi) -> None:
    """Bombs arrive from one tenant, again and again, until another tenant's reads (its study
    list, /healthz) have been answered while they arrived; answered, not timed (the latency is
    benchmarks/api.py's --hostile-specs). Before the caps, the grid alone froze the API."""
    _, attacker_token = live.create_tenant("attacker")
    _, reader_token = live.create_tenant("reader")
    reader, health = live.client(reader_token), live.client()
    assert reader.post("/api/v1/studies", json={**VALID, "name": "readers-own"}).status_code == 201
    answered_while_bombing = threading.Event()
    bombing = threading.Event()
    answers: dict[str, list[httpx.Response]] = {name: [] for name, *_ in BOMBS}
    reads: list[tuple[str, int, str]] = []  # (path, status, what the reader saw)

    def bomb() -> None:
        attacker = live.client(attacker_token)
        bombing.set()
        try:
            while not answered_while_bombing.is_set() or any(not got for got in answers.values()):
                for name, fields, _, _ in BOMBS:
                    answers[name].append(attacker.post("/api/v1/studies", json={**VALID, **fields}))
        finally:
            bombing.clear()

    def read() -> None:
        bombing.wait(60)
        while bombing.is_set():
            listed = reader.get("/api/v1/studies")
            reads.append(("/api/v1/studies", listed.status_code, ",".join(s["name"] for s in listed.json())))
            healthz = health.get("/healthz")
            reads.append(("/healthz", healthz.status_code, ""))
            if len(reads) >= 20:
                answered_while_bombing.set()

    threads = [threading.Thread(target=bomb), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    assert answered_while_bombing.wait(300), "the other tenant's reads were not answered while the bombs arrived"
    for thread in threads:
        thread.join(300)
    assert {status for _, status, _ in reads} == {200}
    assert {seen for path, _, seen in reads if path == "/api/v1/studies"} == {"readers-own"}  # its own, and only
    for name, _, loc, names in BOMBS:
        for response in answers[name]:
            assert response.status_code == 422, f"{name}: {response.status_code} {response.text[:300]}"
            assert loc in _locs(response), f"{name}: {_locs(response)}"
            assert names in response.text, f"{name}: {response.text[:300]}"
    listed = live.client(live.admin_token).get("/api/v1/studies").json()
    assert [s["name"] for s in listed] == ["readers-own"]  # no bomb was stored


def test_a_kwarg_optuna_rejects_past_the_caps_is_a_422_naming_the_component(api: httpx.Client) -> None:
    """Kwargs that pass each rule but not Optuna's constructor (TPE's group needs multivariate):
    the service's build, off the event loop, refuses them."""
    body = {**VALID, "sampler": {"name": "TPESampler", "kwargs": {"group": True, "multivariate": False}}}
    response = api.post("/api/v1/studies", json=body)
    assert response.status_code == 422, response.text
    assert ["body", "sampler"] in _locs(response) and "multivariate" in response.text


def test_a_search_space_past_its_cap_is_a_422_naming_it(api: httpx.Client) -> None:
    """The scheduling loop probes a new space for the params that change shapes: a space of
    thousands of params held it for minutes for every tenant. The cap refuses it at the door."""
    from fusetune.server.schemas import MAX_SEARCH_SPACE_PARAMS

    def space(n: int) -> dict[str, Any]:
        return {f"p{i}": {"type": "float", "low": 0.0, "high": 1.0} for i in range(n)}

    response = api.post("/api/v1/studies", json={**VALID, "search_space": space(MAX_SEARCH_SPACE_PARAMS + 1)})
    assert response.status_code == 422 and _locs(response) == [["body", "search_space"]], response.text
    assert str(MAX_SEARCH_SPACE_PARAMS) in response.text
    response = api.post("/api/v1/studies", json={**VALID, "search_space": space(MAX_SEARCH_SPACE_PARAMS)})
    assert response.status_code == 201, response.text


def test_user_attrs_past_their_bound_are_a_422_and_nothing_is_stored(api: httpx.Client) -> None:
    """A study's or a trial's user attrs come back in every read of it, and a page holds 1,000
    trials: attrs of a mebibyte each made gigabyte answers. Each object's attrs are bounded."""
    from fusetune.server.schemas import MAX_USER_ATTRS_BYTES

    study = api.post("/api/v1/studies", json={**VALID, "driver": "client"}).json()
    half = "x" * (MAX_USER_ATTRS_BYTES // 2)
    assert api.put(f"/api/v1/studies/{study['id']}/user_attrs/a", json={"value": half}).status_code == 200
    refused = api.put(f"/api/v1/studies/{study['id']}/user_attrs/b", json={"value": half})
    assert refused.status_code == 422 and _locs(refused) == [["body", "value"]], refused.text
    assert str(MAX_USER_ATTRS_BYTES) in refused.text
    assert api.get(f"/api/v1/studies/{study['id']}").json()["user_attrs"] == {"a": half}
    # Replacing a value counts it once.
    assert api.put(f"/api/v1/studies/{study['id']}/user_attrs/a", json={"value": half + "y"}).status_code == 200
    # Writers at once take turns: of 8 quarters past the half stored, one fits.
    from concurrent.futures import ThreadPoolExecutor

    quarter = "q" * (MAX_USER_ATTRS_BYTES // 4)
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(
            lambda i: api.put(f"/api/v1/studies/{study['id']}/user_attrs/k{i}", json={"value": quarter}).status_code, range(8)
        ))
    assert sorted(codes) == [200] + [422] * 7, codes
    # A trial's, given when it is enqueued: refused before the trial is asked.
    big = {"note": "x" * (MAX_USER_ATTRS_BYTES + 1)}
    refused = api.post(f"/api/v1/studies/{study['id']}/trials", json={"params": {}, "user_attrs": big})
    assert refused.status_code == 422 and _locs(refused) == [["body", "user_attrs"]], refused.text


@pytest.mark.parametrize(("params", "loc"), [
    ({"lr": [0.1] * 1000}, ["body", "params", "lr"]),  # a param is a scalar, never a list or an object
    ({"lr": {"deep": {}}}, ["body", "params", "lr"]),
    ({"width": 10**400}, ["body", "params", "width"]),  # past what Optuna's float params hold
    ({"note": "x" * 5000}, ["body", "params", "note"]),
    ({f"p{i}": 1 for i in range(300)}, ["body", "params"]),  # more than a search space may have
])
def test_enqueued_params_are_bounded_scalars(api: httpx.Client, params: dict, loc: list) -> None:
    """Each enqueued trial's params are held in its study's mirror and carried by every read of
    it: 1 MiB of them was a 201, and a thousand such trials gigabytes."""
    response = api.post("/api/v1/studies/1/trials", json={"params": params})
    assert response.status_code == 422, response.text
    assert {tuple(e["loc"][:len(loc)]) for e in response.json()["detail"]} == {tuple(loc)}


def test_a_categorical_choice_past_a_floats_integers_is_a_422(api: httpx.Client) -> None:
    """Refused as the body is read (no double holds it), naming the choice itself."""
    space = {"width": {"type": "categorical", "choices": [32, 10**400]}}
    response = api.post("/api/v1/studies", json={"workload": "digits-mlp", "n_trials": 2, "search_space": space})
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "search_space", "width", "choices", 1] and "must fit a double" in error["msg"], error


def test_samplers_and_pruners_within_the_caps_are_created(api: httpx.Client) -> None:
    specs = [
        {"sampler": {"name": "GridSampler", "kwargs": {"search_space": {"hidden": [32, 64], "lr": [0.01, 0.1]}}}},
        {"sampler": {"name": "TPESampler", "kwargs": {"n_ei_candidates": 256, "multivariate": True, "seed": 3}}},
        {**TWO_OBJECTIVES, "sampler": {"name": "NSGAIIISampler", "kwargs": {"dividing_parameter": 9_999, "population_size": 1_000}}},
        {"search_space": {f"p{i}": FLOAT for i in range(100)}, "sampler": {"name": "CmaEsSampler", "kwargs": {"popsize": 1_000}}},
        {"search_space": {f"p{i}": FLOAT for i in range(101)}, "sampler": {"name": "cmaes", "kwargs": {"use_separable_cma": True}}},
        {"search_space": {"hidden": json.loads(D.distribution_to_json(D.IntDistribution(1, 100_000)))}, "sampler": {"name": "BruteForceSampler"}},
        {"pruner": {"name": "HyperbandPruner", "kwargs": {"max_resource": 2**31 - 1, "reduction_factor": 2}}},
        {"pruner": {"name": "percentile", "kwargs": {"percentile": 25.0, "n_warmup_steps": 1}}},
    ]
    for fields in specs:
        response = api.post("/api/v1/studies", json={**VALID, **fields})
        assert response.status_code == 201, f"{fields}: {response.text[:300]}"


@pytest.mark.parametrize(
    ("kwargs", "kwarg"),
    [
        ({"seed": -1}, "seed"), ({"seed": 2**32}, "seed"), ({"seed": "1"}, "seed"),
        ({"n_startup_trials": True}, "n_startup_trials"), ({"n_ei_candidates": 0}, "n_ei_candidates"),
        ({"multivariate": "yes"}, "multivariate"), ({"consider_prior": False}, "consider_prior"),  # deprecated: not taken
        ({"gamma": 10}, "gamma"),
    ],
)
def test_each_refused_tpe_kwarg_is_named(kwargs: dict[str, Any], kwarg: str) -> None:
    with pytest.raises(SpecError) as refused:
        check_sampler("TPESampler", kwargs, SpecLimits())
    assert refused.value.loc == ("kwargs", kwarg)


def test_grid_values_are_json_scalars() -> None:
    for values in ([[1, 2]], [{"a": 1}], [float("nan")]):
        with pytest.raises(SpecError) as refused:
            check_sampler("GridSampler", {"search_space": {"x": values}}, SpecLimits())
        assert refused.value.loc == ("kwargs", "search_space")
    check_sampler("GridSampler", {"search_space": {"x": []}}, SpecLimits())  # empty: the study fails on its own


def test_the_caps_are_settings_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = SpecLimits.of(Settings(sampler_max_ei_candidates=8))
    check_sampler("TPESampler", {"n_ei_candidates": 8}, limits)
    with pytest.raises(SpecError, match="over its limit of 8 .FUSETUNE_SAMPLER_MAX_EI_CANDIDATES"):
        check_sampler("TPESampler", {"n_ei_candidates": 9}, limits)
    monkeypatch.setenv("FUSETUNE_SAMPLER_MAX_GRID_POINTS", "10")
    limits = SpecLimits.of(Settings())
    check_sampler("GridSampler", {"search_space": {"x": list(range(5)), "y": [0, 1]}}, limits)
    with pytest.raises(SpecError, match="FUSETUNE_SAMPLER_MAX_GRID_POINTS"):
        check_sampler("GridSampler", {"search_space": {"x": list(range(11))}}, limits)


#: A valid value of every kwarg the allow-list takes, class by class (and what a class requires).
SAMPLE_KWARGS: dict[str, dict[str, Any]] = {
    "RandomSampler": {"seed": 1},
    "TPESampler": {"n_startup_trials": 5, "n_ei_candidates": 48, "seed": 1, "multivariate": True, "group": False, "constant_liar": False},
    "GridSampler": {"search_space": {"x": [1, 2.5, "a", True, None]}, "seed": 1},
    "CmaEsSampler": {"n_startup_trials": 2, "warn_independent_sampling": False, "seed": 1, "consider_pruned_trials": True,
                     "popsize": 8, "use_separable_cma": True, "with_margin": True, "lr_adapt": True},
    "NSGAIISampler": {"population_size": 10, "mutation_prob": 0.1, "crossover_prob": 0.8, "swapping_prob": 0.4, "seed": 1},
    "NSGAIIISampler": {"population_size": 10, "mutation_prob": 0.1, "crossover_prob": 0.8, "swapping_prob": 0.4, "seed": 1,
                       "reference_points": [[1.0, 0.0], [0.0, 1.0]], "dividing_parameter": 4},
    "QMCSampler": {"qmc_type": "halton", "scramble": True, "seed": 1, "warn_asynchronous_seeding": False,
                   "warn_independent_sampling": False},
    "BruteForceSampler": {"seed": 1, "avoid_premature_stop": True},
    "NopPruner": {},
    "MedianPruner": {"n_startup_trials": 3, "n_warmup_steps": 2, "interval_steps": 2, "n_min_trials": 2},
    "PercentilePruner": {"percentile": 30.0, "n_startup_trials": 3, "n_warmup_steps": 2, "interval_steps": 2, "n_min_trials": 2},
    "SuccessiveHalvingPruner": {"min_resource": 2, "reduction_factor": 3, "min_early_stopping_rate": 1, "bootstrap_count": 1},
    "HyperbandPruner": {"min_resource": 1, "max_resource": 30, "reduction_factor": 3, "bootstrap_count": 1},
    "ThresholdPruner": {"lower": 0.1, "upper": 10.0, "n_warmup_steps": 1, "interval_steps": 2},
    "WilcoxonPruner": {"p_threshold": 0.05, "n_startup_steps": 3},
}
#: What each class's samples are built beside: its required kwargs, and what one needs with
#: another (bootstrap_count needs a min_resource or max_resource that is not "auto").
BASE = {"GridSampler": {"search_space": {"x": [1]}}, "PercentilePruner": {"percentile": 50.0}, "SuccessiveHalvingPruner": {"min_resource": 2},
        "HyperbandPruner": {"max_resource": 30}, "ThresholdPruner": {"upper": 100.0}}


@pytest.mark.parametrize("kind", ["sampler", "pruner"])
def test_every_allowed_kwarg_is_its_class_s_and_none_is_deprecated(kind: str) -> None:
    """Each kwarg of the allow-list, alone, builds its class without a FutureWarning (Optuna's
    deprecations): a stored spec never carries an argument the next Optuna removes."""
    make = make_sampler if kind == "sampler" else make_pruner
    for name, kwargs in optuna_specs.allowed_kwargs(kind).items():
        assert set(SAMPLE_KWARGS[name]) == set(kwargs), f"{name}: give every kwarg it takes a sample value"
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            make(name, BASE.get(name, {}), SpecLimits())
            for kwarg, value in SAMPLE_KWARGS[name].items():
                built = make(name, {**BASE.get(name, {}), kwarg: value}, SpecLimits())
                assert type(built).__name__ == name


def test_the_build_deadline_refuses_a_build_that_outlasts_it_and_the_builders_recover() -> None:
    """A build past its deadline is a SpecError at once; its thread runs on (threads cannot be
    stopped) and holds one of the two builders, so builds that queue behind two such time out
    too, and builds succeed again once they end."""
    release = threading.Event()
    try:
        for _ in range(2):
            with pytest.raises(SpecError, match="FUSETUNE_SPEC_BUILD_TIMEOUT_S") as late:
                build_within(lambda: release.wait(300), 0.05, "a slow build")
            assert late.value.loc == ("kwargs",)
        with pytest.raises(SpecError, match="took longer"):
            build_within(lambda: "queued behind them", 0.05, "a queued build")
    finally:
        release.set()
    assert build_within(lambda: "built", 60, "a build") == "built"


def test_building_a_tpe_sampler_passes_no_deprecated_argument() -> None:
    """The loop builds TPE once, with the constant liar its batches need (Optuna 5's default,
    so not passed), and no argument that warns."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        sampler = make_sampler("TPESampler", optuna_specs.service_sampler_kwargs("TPESampler", {"seed": 1}), SpecLimits())
        from fusetune.client import component_spec

        spec = component_spec(optuna.samplers.TPESampler(seed=0, n_ei_candidates=32))
    assert sampler._constant_liar is True
    assert set(spec["kwargs"]) == {"seed", "n_ei_candidates"}


def test_a_sampler_built_with_a_deprecated_argument_is_refused_by_the_client() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the user's own build warns; ours must refuse it
        sampler = optuna.samplers.TPESampler(prior_weight=2.0)
    from fusetune.client import component_spec

    with pytest.raises(ValueError, match="prior_weight, which Optuna deprecated"):
        component_spec(sampler)


def test_a_grid_sampler_is_rebuilt_with_every_point_in_the_order_its_spec_seed_gives() -> None:
    """GridSampler shuffles its points with its random state, which keeps no seed: the spec's
    seed (drawn from that state) orders them differently, and that is no difference."""
    from fusetune.client import component_spec

    grid = optuna.samplers.GridSampler({"lr": [0.1, 0.01, 0.001], "momentum": [0.0, 0.9]}, seed=4)
    spec = component_spec(grid)
    rebuilt = optuna.samplers.GridSampler(**spec["kwargs"])
    assert sorted(rebuilt._all_grids) == sorted(grid._all_grids)
    assert component_spec(grid) == spec  # the same seed each time
    with pytest.raises(ValueError, match="GridSampler"):  # other points are a difference
        fewer = optuna.samplers.GridSampler({"lr": [0.1, 0.01], "momentum": [0.0, 0.9]}, seed=4)
        fewer._all_grids.append((0.5, 0.5))  # a point its search space does not give
        component_spec(fewer)


#: Optuna's samplers the service allows (not GPSampler: its cost grows with the cube of the trials).
OPTUNAS_OWN = {
    "RandomSampler": lambda: optuna.samplers.RandomSampler(),
    "TPESampler": lambda: optuna.samplers.TPESampler(),
    "CmaEsSampler": lambda: optuna.samplers.CmaEsSampler(),
    "NSGAIISampler": lambda: optuna.samplers.NSGAIISampler(),
    "NSGAIIISampler": lambda: optuna.samplers.NSGAIIISampler(),
    "NSGAIISampler, seeded": lambda: optuna.samplers.NSGAIISampler(seed=1, population_size=10),
    "QMCSampler": lambda: optuna.samplers.QMCSampler(),
    "QMCSampler, seeded": lambda: optuna.samplers.QMCSampler(seed=3, qmc_type="halton"),
    "BruteForceSampler": lambda: optuna.samplers.BruteForceSampler(),
    "GridSampler": lambda: optuna.samplers.GridSampler({"lr": [0.1, 0.01]}),
}


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
@pytest.mark.parametrize("name", sorted(OPTUNAS_OWN))
def test_each_of_optunas_samplers_as_users_build_it_has_a_spec_the_service_builds(name: str) -> None:
    """An NSGA-II sampler holds a lock and an unseeded QMCSampler a 64-bit seed of its own
    drawing: neither is an argument, and neither stops the spec (they were refused)."""
    from fusetune.client import component_spec

    sampler = OPTUNAS_OWN[name]()
    spec = component_spec(sampler)
    assert spec["name"] == type(sampler).__name__
    rebuilt = make_sampler(spec["name"], spec["kwargs"], SpecLimits())
    assert type(rebuilt) is type(sampler)
    if name == "QMCSampler, seeded":
        assert spec["kwargs"] == {"seed": 3, "qmc_type": "halton"} and rebuilt._seed == 3


def test_a_tpe_study_is_created_without_a_future_warning(live: LiveApi) -> None:
    """Issue 31: every create_study with a TPESampler printed four FutureWarnings. The client's
    rebuild checks and the service's build (this process: the live API) run with them as errors."""
    token = live.token_for("default")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        study = client_create_study(
            workload="digits-mlp", n_trials=2, epochs=1, study_name="tpe-quiet",
            sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=4), url=live.url, token=token,
        )
    assert study.study_name == "tpe-quiet"
    stored = live.client(token).get("/api/v1/studies", params={"name": "tpe-quiet"}).json()[0]["sampler"]
    assert stored["name"] == "TPESampler" and set(stored["kwargs"]) == {"seed", "n_startup_trials"}


@pytest.fixture
def bomb_stored_before_the_caps(ray_cluster: str, tmp_path: Path) -> Iterator[tuple[Settings, int, int]]:
    """A database where one study's stored sampler is a grid bomb, as a version without the caps
    stored it, with a trial waiting (as after a restart); and a neighbour that is fine."""
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    settings = Settings(database_url=url, ray_address=ray_cluster, cpu_workers=1, max_array_size=4,
                        artifact_dir=tmp_path / "artifacts", checkpoint_interval_s=0)
    upgrade(url)
    get_optuna_storage(url)
    space = {"hidden": D.distribution_to_json(D.CategoricalDistribution([32]))}
    with get_sessionmaker(url)() as session:
        bomb = service.create_study(session, url, StudyCreate(
            workload="digits-mlp", n_trials=2, epochs=1, name="stored-bomb", search_space=space,
            sampler={"name": "RandomSampler", "kwargs": {"seed": 1}},
        )).id
        neighbour = service.create_study(session, url, StudyCreate(
            workload="digits-mlp", n_trials=2, epochs=1, name="neighbour", search_space=space,
            sampler={"name": "RandomSampler", "kwargs": {"seed": 2}},
        )).id
    yield settings, bomb, neighbour


@pytest.mark.slow
def test_a_spec_stored_before_the_caps_fails_its_study_alone_at_restart(bomb_stored_before_the_caps: tuple[Settings, int, int]) -> None:
    from fusetune.server.loop import SchedulingLoop
    from fusetune.workers.pool import WorkerPool
    from tests.test_backfill import _state, _step_until_complete

    settings, bomb, neighbour = bomb_stored_before_the_caps
    url = settings.database_url
    pool = WorkerPool(cpu_workers=1, name_prefix="hostile")
    try:
        before = SchedulingLoop(settings, pool)
        before.setup()
        before.asker.enqueue(bomb, {"hidden": 32}, {})  # a trial waits when the service restarts
        grid = {"search_space": {"a": list(range(40_000)), "b": list(range(40_000))}}
        with get_sessionmaker(url).begin() as session:
            session.execute(sa.update(Study).where(Study.id == bomb).values(sampler={"name": "GridSampler", "kwargs": grid}))
        restarted = SchedulingLoop(settings, pool)
        restarted.setup()
        _step_until_complete(restarted, pool, url, neighbour)
    finally:
        pool.shutdown()
    assert _state(url, bomb) == StudyState.FAILED
    with get_sessionmaker(url)() as session:
        failed = service.get_study(session, url, bomb)
    assert "GridSampler" in failed.error and "FUSETUNE_SAMPLER_MAX_GRID_POINTS" in failed.error
