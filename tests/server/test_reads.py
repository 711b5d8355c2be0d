"""Reads that scale: cursor pages, filters and sorts, updated_since polls, counts and best
trials in SQL, downsampled learning curves, and the 4xx of bad paging input.

The API alone serves real databases (SQLite and PostgreSQL); trials are written as the
control plane writes them: fusetune's rows through the ORM, Optuna's through its storage,
and reported values through the study's mirror in the same transaction as the trials' touch.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterator
from typing import Any

import httpx
import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optuna.trial import TrialState as OptunaState
from sqlalchemy import select

from fusetune import client as ft
from fusetune.server.curves import downsample
from fusetune.server.db import Array, ArrayMember, Study, Trial, TrialState, get_optuna_storage, get_sessionmaker
from fusetune.server.db.revisions import touch_trials
from fusetune.server.mirror import StudyMirror
from tests.server.conftest import LiveApi

STUDY = {"workload": "digits-mlp", "n_trials": 100, "epochs": 5}
LR = optuna.distributions.FloatDistribution(0.001, 1.0)


def make_study(api: httpx.Client, name: str, **fields: Any) -> dict[str, Any]:
    response = api.post("/api/v1/studies", json={**STUDY, "name": name, **fields})
    assert response.status_code == 201, response.text
    return response.json()


def seed(url: str, study_id: int, trials: list[tuple[TrialState, Any, dict[int, float]]]) -> list[int]:
    """Trials of a study as the control plane leaves them: (state, value or values, curve).
    Optuna's rows first (its storage commits each write), then fusetune's in one transaction."""
    storage = get_optuna_storage(url)
    sessions = get_sessionmaker(url)
    with sessions() as session:
        optuna_study_id = session.get(Study, study_id).optuna_study_id
    first = len(storage.get_all_trials(optuna_study_id))
    rows = []
    for k, (state, value, curve) in enumerate(trials):
        number = first + k
        optuna_id = storage.create_new_trial(optuna_study_id)
        lr = 0.001 + number / 1000
        storage.set_trial_param(optuna_id, "lr", lr, LR)
        for step, v in curve.items():
            storage.set_trial_intermediate_value(optuna_id, step, v)
        values = value if isinstance(value, list) else None if value is None else [value]
        if state == TrialState.COMPLETE:
            storage.set_trial_state_values(optuna_id, OptunaState.COMPLETE, values)
        elif state in (TrialState.PRUNED, TrialState.FAIL):
            storage.set_trial_state_values(optuna_id, OptunaState[state.value])
        rows.append(
            Trial(
                study_id=study_id, optuna_trial_id=optuna_id, number=number, params={"lr": lr}, signature="s" * 64,
                state=state, value=values[0] if values else None,
            )
        )
    with sessions() as session:
        session.add_all(rows)
        session.commit()
        return [row.id for row in rows]


def mixed_trials(n: int, seed_: int = 0) -> list[tuple[TrialState, Any, dict[int, float]]]:
    """Trials of every state; values with ties (accuracies of a small validation set) and without."""
    rng = random.Random(seed_)
    out = []
    for _ in range(n):
        state = rng.choice(list(TrialState))
        curve = {step: round(rng.random(), 2) for step in range(rng.randint(0, 6))}
        value = rng.choice([0.5, 0.75, 0.9, round(rng.random(), 3)]) if state in (TrialState.COMPLETE, TrialState.PRUNED) else None
        out.append((state, value, curve))
    return out


def follow(client: httpx.Client, path: str, **params: Any) -> Iterator[httpx.Response]:
    """Every page of a listing, by its Link headers."""
    url: str | None = path
    query: dict[str, Any] | None = params
    while url is not None:
        response = client.get(url, params=query)
        assert response.status_code == 200, response.text
        yield response
        url, query = response.links.get("next", {}).get("url"), None


def every_row(client: httpx.Client, path: str, **params: Any) -> list[dict[str, Any]]:
    return [row for page in follow(client, path, **params) for row in page.json()]


def expected_order(trials: list[dict[str, Any]], sort: str) -> list[int]:
    """The order of ``sort``, computed from the whole listing: ties by id, trials without a value last."""
    if sort in ("number", "-number"):
        key = sorted(trials, key=lambda t: (t["number"], t["id"]), reverse=sort.startswith("-"))
    elif sort == "revision":
        key = sorted(trials, key=lambda t: (t["revision"], t["id"]))
    else:
        valued = [t for t in trials if t["value"] is not None]
        key = sorted(valued, key=lambda t: (t["value"], t["id"]), reverse=sort == "-value")
        key += sorted((t for t in trials if t["value"] is None), key=lambda t: t["id"])
    return [t["id"] for t in key]


def test_pages_visit_every_trial_exactly_once_in_each_sort(api: httpx.Client, database_url: str) -> None:
    study = make_study(api, "paged")
    ids = seed(database_url, study["id"], mixed_trials(57))
    path = f"/api/v1/studies/{study['id']}/trials"
    whole = every_row(api, path, limit=1000)
    assert sorted(t["id"] for t in whole) == sorted(ids)
    for sort in ("number", "-number", "value", "-value", "revision"):
        for limit in (1, 7, 57, 100):
            pages = list(follow(api, path, sort=sort, limit=limit))
            seen = [t["id"] for page in pages for t in page.json()]
            assert seen == expected_order(whole, sort), (sort, limit)
            assert len(pages) == max(1, math.ceil(57 / limit)), (sort, limit)
            assert all(len(page.json()) == limit for page in pages[:-1])
            assert "link" not in pages[-1].headers
    # The default: by number, 100 a page.
    first = api.get(path)
    assert [t["number"] for t in first.json()] == list(range(57)) and "link" not in first.headers


def test_a_page_shows_what_the_trial_route_shows(api: httpx.Client, database_url: str) -> None:
    study = make_study(api, "same")
    seed(database_url, study["id"], mixed_trials(12, seed_=3))
    for row in api.get(f"/api/v1/studies/{study['id']}/trials", params={"limit": 5}).json():
        assert api.get(f"/api/v1/trials/{row['id']}").json() == row
    loaded = {t.number: t for t in optuna.load_study(study_name="same", storage=database_url).trials}
    for row in every_row(api, f"/api/v1/studies/{study['id']}/trials", limit=5):
        frozen = loaded[row["number"]]
        assert {int(k): v for k, v in row["intermediate_values"].items()} == frozen.intermediate_values
        assert row["values"] == frozen.values
        assert row["distributions"] == {"lr": {"name": "FloatDistribution", "attributes": {"step": None, "low": 0.001, "high": 1.0, "log": False}}}


def test_filters_by_state_and_pages_within_them(api: httpx.Client, database_url: str) -> None:
    study = make_study(api, "filtered")
    seed(database_url, study["id"], mixed_trials(40, seed_=1))
    path = f"/api/v1/studies/{study['id']}/trials"
    whole = every_row(api, path)
    for states in (["COMPLETE"], ["COMPLETE", "PRUNED"], ["WAITING", "RUNNING", "FAIL"]):
        want = [t for t in whole if t["state"] in states]
        got = every_row(api, path, state=states, sort="-value", limit=3)
        assert [t["id"] for t in got] == expected_order(want, "-value"), states
    assert api.get(path, params={"state": "SLEEPING"}).status_code == 422


def poll(api: httpx.Client, study_id: int, since: int, **params: Any) -> tuple[list[dict[str, Any]], int]:
    rows = every_row(api, f"/api/v1/studies/{study_id}/trials", updated_since=since, **params)
    return rows, max([since, *(r["revision"] for r in rows)])


def report(url: str, study_id: int, values: list[tuple[int, int, float]]) -> None:
    """Intermediate values (fusetune trial id, step, value) recorded as the control plane's
    array-epoch transaction records them: the study's mirror, and the members touched."""
    storage = get_optuna_storage(url)
    with get_sessionmaker(url)() as session:
        study = session.get(Study, study_id)
        optuna_id = dict(session.execute(select(Trial.id, Trial.optuna_trial_id).where(Trial.study_id == study_id)).all())
        mirror = StudyMirror(storage, study.optuna_study_id, optuna.samplers.RandomSampler(), optuna.pruners.NopPruner())
        mirror.report(session, [(optuna_id[t], step, v) for t, step, v in values])
        touch_trials(session, [t for t, _, _ in values])
        session.commit()


def test_an_updated_since_poll_returns_exactly_the_trials_changed_since(api: httpx.Client, database_url: str) -> None:
    study = make_study(api, "polled")
    # Trial 0 is slow: it runs while every later one has finished.
    trials = [(TrialState.RUNNING, None, {0: 0.1})] + [(TrialState.COMPLETE, 0.5 + k / 100, {0: 0.2, 1: 0.3}) for k in range(30)]
    ids = seed(database_url, study["id"], trials)
    everything, since = poll(api, study["id"], 0, limit=7)
    assert sorted(t["id"] for t in everything) == sorted(ids)
    assert poll(api, study["id"], since) == ([], since)  # nothing changed

    # The slow trial reports its next epoch: only it comes back, not every later trial.
    report(database_url, study["id"], [(ids[0], 1, 0.4)])
    changed, since2 = poll(api, study["id"], since)
    assert [t["id"] for t in changed] == [ids[0]]
    assert changed[0]["intermediate_values"] == {"0": 0.1, "1": 0.4}
    assert since2 > since

    # A change of fusetune's row (the ORM flushes it) and one of its array (an UPDATE statement).
    sessions = get_sessionmaker(database_url)
    with sessions() as session:
        trial = session.get(Trial, ids[0])
        trial.state, trial.value = TrialState.COMPLETE, 0.4
        session.commit()
    with sessions() as session:
        array = Array(study_id=study["id"], signature="s" * 64, members=[ArrayMember(slot=0, trial_id=ids[5])])
        session.add(array)
        session.flush()
        from sqlalchemy import update

        session.execute(update(Trial).where(Trial.id.in_([ids[5], ids[6]])).values(array_id=array.id))
        session.commit()
    changed, since3 = poll(api, study["id"], since2, limit=1)
    assert sorted(t["id"] for t in changed) == sorted([ids[0], ids[5], ids[6]])
    assert [t["revision"] for t in changed] == sorted(t["revision"] for t in changed)  # in commit order
    assert {t["id"]: t["state"] for t in changed}[ids[0]] == "COMPLETE"
    assert poll(api, study["id"], since3) == ([], since3)
    # Another study's changes are not this study's.
    other = make_study(api, "elsewhere")
    seed(database_url, other["id"], [(TrialState.WAITING, None, {})])
    assert poll(api, study["id"], since3) == ([], since3)


def test_one_transaction_stamps_its_trials_with_one_revision(api: httpx.Client, database_url: str) -> None:
    study = make_study(api, "epoch")
    ids = seed(database_url, study["id"], [(TrialState.RUNNING, None, {}) for _ in range(8)])
    _, since = poll(api, study["id"], 0)
    report(database_url, study["id"], [(i, 0, 0.5) for i in ids])  # one array-epoch of eight members
    changed, _ = poll(api, study["id"], since)
    assert sorted(t["id"] for t in changed) == sorted(ids)
    assert len({t["revision"] for t in changed}) == 1


def test_counts_and_best_trials_in_sql_match_a_brute_force_count(api: httpx.Client, database_url: str) -> None:
    made = {
        "max": make_study(api, "max"),  # digits: accuracy, maximized
        "min": make_study(api, "min", direction="minimize"),
        "none": make_study(api, "none"),
        "empty": make_study(api, "empty"),
        "multi": make_study(api, "multi", metrics=["accuracy", "n_params"]),
    }
    rng = random.Random(5)
    for name in ("max", "min"):
        seed(database_url, made[name]["id"], mixed_trials(45, seed_=rng.randint(0, 99)))
    seed(database_url, made["none"]["id"], [(TrialState.RUNNING, None, {0: 0.3}), (TrialState.FAIL, None, {})])
    seed(
        database_url, made["multi"]["id"],
        [(TrialState.COMPLETE, [rng.choice([0.8, 0.9, 0.95]), float(rng.choice([100, 200, 300]))], {}) for _ in range(20)]
        + [(TrialState.RUNNING, None, {})],
    )
    studies = every_row(api, "/api/v1/studies", limit=2)
    assert [s["id"] for s in studies] == sorted(s["id"] for s in made.values())
    for s in studies:
        trials = every_row(api, f"/api/v1/studies/{s['id']}/trials")
        assert s["trial_counts"] == {state.value: sum(t["state"] == state.value for t in trials) for state in TrialState}
        complete = [t for t in trials if t["state"] == "COMPLETE" and t["value"] is not None]
        if s["name"] == "multi":
            assert s["best_trial"] is None
            front = optuna.load_study(study_name="multi", storage=database_url).best_trials
            assert [b["number"] for b in s["best_trials"]] == [t.number for t in front]
            assert [b["values"] for b in s["best_trials"]] == [t.values for t in front]
            assert [b["params"] for b in s["best_trials"]] == [t.params for t in front]
        elif not complete:
            assert s["best_trial"] is None and s["best_trials"] == []
        else:
            pick = max if s["direction"] == "maximize" else min
            best_value = pick(t["value"] for t in complete)
            best = min((t for t in complete if t["value"] == best_value), key=lambda t: t["number"])
            assert s["best_trial"] == {"number": best["number"], "value": best["value"], "params": best["params"], "values": [best["value"]]}
        assert api.get(f"/api/v1/studies/{s['id']}").json() == s
    # A new Pareto-optimal trial changes the front at once.
    seed(database_url, made["multi"]["id"], [(TrialState.COMPLETE, [0.99, 1.0], {})])
    front = api.get(f"/api/v1/studies/{made['multi']['id']}").json()["best_trials"]
    assert [b["values"] for b in front] == [[0.99, 1.0]]


def test_study_filters_and_sorts(api: httpx.Client) -> None:
    ids = [make_study(api, f"s{k}")["id"] for k in range(5)]
    assert [s["id"] for s in every_row(api, "/api/v1/studies", sort="-id", limit=2)] == ids[::-1]
    assert [s["id"] for s in every_row(api, "/api/v1/studies", state="RUNNING", limit=3)] == ids
    assert every_row(api, "/api/v1/studies", state="COMPLETE") == []
    assert [s["name"] for s in every_row(api, "/api/v1/studies", name="s3")] == ["s3"]


def test_arrays_tenants_and_tokens_page_too(live: LiveApi, admin: httpx.Client, database_url: str) -> None:
    for k in range(5):
        live.create_tenant(f"t{k}")
    tenant, token = live.create_tenant("owner")
    owner = live.client(token)
    for _ in range(4):
        live.token_for("owner")
    study = make_study(owner, "arrays")
    ids = seed(database_url, study["id"], [(TrialState.RUNNING, None, {}) for _ in range(6)])
    with get_sessionmaker(database_url)() as session:
        for trial_id in ids:
            session.add(Array(study_id=study["id"], signature="s" * 64, members=[ArrayMember(slot=0, trial_id=trial_id)]))
        session.commit()
    arrays = every_row(owner, "/api/v1/arrays", limit=4)
    assert [a["trial_ids"] for a in arrays] == [[i] for i in ids]
    assert [a["id"] for a in every_row(owner, "/api/v1/arrays", study_id=study["id"], sort="-id", limit=5)] == [a["id"] for a in arrays][::-1]
    assert [a["id"] for a in every_row(admin, "/api/v1/arrays", tenant="owner", state="RUNNING", limit=1)] == [a["id"] for a in arrays]
    assert every_row(admin, "/api/v1/arrays", tenant="t0") == []
    assert every_row(owner, "/api/v1/arrays", tenant="t0") == []  # a tenant sees only its own anyway
    names = [t["name"] for t in every_row(admin, "/api/v1/tenants", limit=2)]
    assert names == sorted(["default", "owner", *(f"t{k}" for k in range(5))])
    assert [t["name"] for t in every_row(owner, "/api/v1/tenants", limit=1)] == ["owner"]
    tokens = every_row(owner, "/api/v1/tenants/owner/tokens", limit=2)
    assert len(tokens) == 5 and [t["id"] for t in tokens] == sorted(t["id"] for t in tokens)
    assert len({t["id"] for t in tokens}) == 5


def field_of(response: httpx.Response) -> list[list[Any]]:
    return [err["loc"] for err in response.json()["detail"]]


@pytest.mark.parametrize(
    ("params", "loc"),
    [
        ({"limit": 0}, ["query", "limit"]),
        ({"limit": 1001}, ["query", "limit"]),
        ({"limit": "ten"}, ["query", "limit"]),
        ({"after": "not-a-cursor!"}, ["query", "after"]),
        ({"after": "W10"}, ["query", "after"]),  # the base64 cursors of old
        ({"after": "x" * 2000}, ["query", "after"]),
        ({"after": f"{10**30}_1_1_n"}, ["query", "after"]),  # past what the database compares
        ({"after": "1_2_3"}, ["query", "after"]),
        ({"after": "1_2_3_4_5"}, ["query", "after"]),
        ({"after": "1_2_3_nan", "sort": "value"}, ["query", "after"]),
        ({"after": "1_2_3_inf", "sort": "value"}, ["query", "after"]),
        ({"after": "1_2_3_1e+5", "sort": "value"}, ["query", "after"]),
        ({"after": "1_2_3_0.5\n"}, ["query", "after"]),
        ({"after": "-1_2_3_n"}, ["query", "after"]),
        ({"sort": "params"}, ["query", "sort"]),
        ({"updated_since": -1}, ["query", "updated_since"]),
        ({"updated_since": 3, "sort": "number"}, ["query", "sort"]),
        ({"max_points": 3}, ["query", "max_points"]),
        ({"max_points": 10**6}, ["query", "max_points"]),
    ],
)
def test_bad_paging_input_is_a_422_naming_the_parameter(api: httpx.Client, params: dict[str, Any], loc: list[str]) -> None:
    study = make_study(api, "bad")
    response = api.get(f"/api/v1/studies/{study['id']}/trials", params=params)
    assert response.status_code == 422, response.text
    assert loc in [list(error[:2]) for error in field_of(response)], response.text


def test_a_cursor_is_a_position_in_every_order_of_its_listing(api: httpx.Client, database_url: str) -> None:
    """A cursor holds its row's key in each sort, so any sort reads on from that row; each
    listing's `after` pattern, in the OpenAPI document, is exactly what it accepts."""
    study = make_study(api, "cursors")
    seed(database_url, study["id"], mixed_trials(12, seed_=3))
    path = f"/api/v1/studies/{study['id']}/trials"
    by_number = every_row(api, path)
    cursor = httpx.URL(api.get(path, params={"limit": 5}).links["next"]["url"]).params["after"]
    fifth = by_number[4]
    for sort in ("number", "-number", "value", "-value", "revision"):
        whole = every_row(api, path, sort=sort)
        position = [t["id"] for t in whole].index(fifth["id"])
        after = api.get(path, params={"after": cursor, "sort": sort, "limit": 1000})
        assert after.status_code == 200, (sort, after.text)
        assert [t["id"] for t in after.json()] == [t["id"] for t in whole[position + 1:]], sort
    doc = api.get("/openapi.json").json()
    for listing in ("/api/v1/studies", "/api/v1/arrays", "/api/v1/tenants", "/api/v1/tenants/{name}/tokens", path):
        template = "/api/v1/studies/{study_id}/trials" if listing == path else listing
        (after,) = [p for p in doc["paths"][template]["get"]["parameters"] if p["name"] == "after"]
        pattern = after["schema"]["anyOf"][0]["pattern"] if "anyOf" in after["schema"] else after["schema"]["pattern"]
        fits = re.fullmatch(pattern, cursor) is not None
        url = listing.replace("{name}", "default")
        response = api.get(url, params={"after": cursor})
        assert (response.status_code == 200) == fits, (listing, pattern, response.text)
        if not fits:
            assert field_of(response) == [["query", "after"]], response.text


@pytest.mark.parametrize("value", ["1e999", "-1e999", "1e-999", "-0", "0.1", "12345678901234567.123456789012345678901234"])
def test_every_value_a_trial_cursor_can_hold_is_a_position(api: httpx.Client, database_url: str, value: str) -> None:
    """Values past float's range read as infinities, which both databases compare: a page, never a 5xx."""
    study = make_study(api, "far")
    seed(database_url, study["id"], mixed_trials(6, seed_=1))
    path = f"/api/v1/studies/{study['id']}/trials"
    for sort in ("value", "-value", "number", "revision"):
        response = api.get(path, params={"after": f"999999999999999999_0_0_{value}", "sort": sort})
        assert response.status_code == 200, (sort, response.text)
    # Ids past a 32-bit INTEGER column's range are positions after every row, not database errors.
    for listing in ("/api/v1/studies", "/api/v1/arrays", "/api/v1/tenants/default/tokens"):
        response = api.get(listing, params={"after": "999999999999999999"})
        assert response.status_code == 200 and response.json() == [], (listing, response.text)
    response = api.get(path, params={"after": f"{2**40}_{2**40}_{2**40}_n", "sort": "-number"})
    assert response.status_code == 200 and len(response.json()) == 6, response.text
    whole = every_row(api, path, sort="value")
    unvalued = [t["id"] for t in whole if t["value"] is None]
    response = api.get(path, params={"after": "0_0_0_1e999", "sort": "value"})
    assert [t["id"] for t in response.json()] == unvalued  # after every value: the run without one


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=0, max_size=300),
    st.integers(4, 40),
)
def test_downsampling_keeps_first_last_min_and_max(values: list[float], max_points: int) -> None:
    curve = {step * 3: v for step, v in enumerate(values)}  # steps need not be consecutive
    kept = downsample(curve, max_points)
    assert len(kept) <= max_points
    assert all(curve[step] == v for step, v in kept.items())
    assert list(kept) == sorted(kept)
    if len(curve) <= max_points:
        assert kept == curve
    elif curve:
        steps = sorted(curve)
        assert steps[0] in kept and steps[-1] in kept
        assert min(kept.values()) == min(values) and max(kept.values()) == max(values)
        # Every bucket keeps its extremes: a spike anywhere shows.
        assert len(kept) >= min(len(curve), 2 + (max_points - 2) // 2)


def test_downsampled_curves_over_the_api(api: httpx.Client, database_url: str) -> None:
    study = make_study(api, "curves")
    rng = random.Random(2)
    curve = {step: rng.random() for step in range(200)}
    curve[137] = 5.0  # a spike
    (trial_id,) = seed(database_url, study["id"], [(TrialState.RUNNING, None, curve)])
    full = api.get(f"/api/v1/trials/{trial_id}").json()["intermediate_values"]
    assert len(full) == 200
    for response in (
        api.get(f"/api/v1/trials/{trial_id}", params={"max_points": 10}),
        api.get(f"/api/v1/studies/{study['id']}/trials", params={"max_points": 10}),
    ):
        assert response.status_code == 200, response.text
        body = response.json()
        got = (body[0] if isinstance(body, list) else body)["intermediate_values"]
        assert len(got) <= 10
        assert {"0", "199", "137", str(min(curve, key=curve.get))} <= set(got)
        assert got == {str(k): v for k, v in downsample(curve, 10).items()}
    assert api.get(f"/api/v1/trials/{trial_id}", params={"max_points": 1}).status_code == 422


def test_storage_downloads_only_the_changes_after_its_first_read(live: LiveApi, api: httpx.Client, database_url: str) -> None:
    study = make_study(api, "storage")
    # States that fusetune and Optuna name alike (a WAITING trial is RUNNING in Optuna; a
    # PRUNED one has a value in fusetune only).
    others = [(s, v, c) for s, v, c in mixed_trials(60, seed_=4) if s in (TrialState.RUNNING, TrialState.COMPLETE, TrialState.FAIL)]
    ids = seed(database_url, study["id"], [(TrialState.RUNNING, None, {0: 0.1})] + others[:30])
    storage = ft.Storage(live.url, token=api.headers["authorization"].split()[1])
    seen: list[httpx.Response] = []
    storage._client._http.event_hooks["response"].append(lambda r: seen.append(r))

    def rows() -> int:
        count = 0
        for r in seen:
            if "/trials" in r.url.path:
                r.read()
                count += len(r.json())
        seen.clear()
        return count

    def matches_the_database() -> None:
        remote = storage.get_all_trials(study["id"])
        local = optuna.load_study(study_name="storage", storage=database_url).trials
        assert [(t.number, t.state, t.params, t.values, t.intermediate_values, t.user_attrs) for t in remote] == [
            (t.number, t.state, t.params, t.values, t.intermediate_values, t.user_attrs) for t in local
        ]

    matches_the_database()
    assert rows() == 31
    matches_the_database()
    assert rows() == 0  # nothing changed: nothing downloaded
    report(database_url, study["id"], [(ids[0], 1, 0.2)])
    matches_the_database()
    assert rows() == 1
    assert storage.get_all_trials(study["id"])[0].intermediate_values == {0: 0.1, 1: 0.2}
    running = [t.number for t in optuna.load_study(study_name="storage", storage=database_url).trials if t.state == OptunaState.RUNNING]
    assert [t.number for t in storage.get_all_trials(study["id"], states=(OptunaState.RUNNING,))] == running
