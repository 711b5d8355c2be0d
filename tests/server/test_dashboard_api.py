"""The routes the dashboard reads besides the API's own: importances (Optuna's evaluators, cached
until a trial completes), a study's arrays timeline, and the cluster; and the page at /."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import optuna
import pytest

from fusetune.server import importance
from fusetune.server.db import Array, ArrayMember, Study, Trial, TrialState, Worker, get_optuna_storage, get_sessionmaker
from tests.server.conftest import LiveApi

SPACE = {
    "lr": optuna.distributions.FloatDistribution(1e-3, 1.0, log=True),
    "noise": optuna.distributions.FloatDistribution(0.0, 1.0),
    "hidden": optuna.distributions.CategoricalDistribution([32, 64]),
}


def complete_trials(live: LiveApi, study_id: int, n: int, start: int = 0) -> list[int]:
    """n COMPLETE trials written as the coordinator writes them: the value depends on lr only."""
    sessions = get_sessionmaker(live.database_url)
    storage = get_optuna_storage(live.database_url)
    with sessions() as session:
        optuna_study_id = session.get(Study, study_id).optuna_study_id
    rows = []
    for number in range(start, start + n):  # Optuna's rows first: SQLite has one writer at a time
        params = {"lr": 10 ** (-3 + 3 * ((number * 7) % n) / n), "noise": ((number * 13) % 17) / 17, "hidden": [32, 64][number % 2]}
        oid = storage.create_new_trial(optuna_study_id)
        for name, value in params.items():
            storage.set_trial_param(oid, name, SPACE[name].to_internal_repr(value), SPACE[name])
        value = -abs(params["lr"] - 0.1)
        storage.set_trial_state_values(oid, optuna.trial.TrialState.COMPLETE, [value])
        rows.append((number, oid, params, value))
    ids = []
    with sessions() as session:
        for number, oid, params, value in rows:
            trial = Trial(
                study_id=study_id, optuna_trial_id=oid, number=number, params=params, signature="s" * 64,
                state=TrialState.COMPLETE, value=value, completed_at=datetime.now(UTC) + timedelta(seconds=number),
            )
            session.add(trial)
            session.flush()
            ids.append(trial.id)
        session.commit()
    return ids


@pytest.fixture
def study_id(api: httpx.Client) -> int:
    importance.clear_cache()
    response = api.post("/api/v1/studies", json={"workload": "digits-mlp", "n_trials": 100, "epochs": 1, "direction": "maximize"})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_importances_come_from_optuna_and_are_cached_until_a_trial_completes(live: LiveApi, api: httpx.Client, study_id: int) -> None:
    empty = api.get(f"/api/v1/studies/{study_id}/importances").json()
    assert (empty["importances"], empty["n_complete"], empty["n_used"]) == ({}, 0, 0)

    complete_trials(live, study_id, 30)
    first = api.get(f"/api/v1/studies/{study_id}/importances").json()
    assert first["cached"] is False and first["n_complete"] == first["n_used"] == 30
    assert set(first["importances"]) == {"lr", "noise", "hidden"}
    assert max(first["importances"], key=first["importances"].get) == "lr"  # the value depends on lr alone
    assert sum(first["importances"].values()) == pytest.approx(1.0)
    # Optuna's own answer on the same trials.
    study = optuna.load_study(study_name=api.get(f"/api/v1/studies/{study_id}").json()["name"], storage=live.database_url)
    expected = optuna.importance.get_param_importances(study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0))
    assert first["importances"] == pytest.approx(expected)

    again = api.get(f"/api/v1/studies/{study_id}/importances").json()
    assert again["cached"] is True and again["importances"] == first["importances"]
    assert again["computed_at"] == first["computed_at"]

    complete_trials(live, study_id, 1, start=30)
    fresh = api.get(f"/api/v1/studies/{study_id}/importances").json()
    assert fresh["cached"] is False and fresh["n_complete"] == 31

    other = api.get(f"/api/v1/studies/{study_id}/importances", params={"evaluator": "mdi"}).json()
    assert other["evaluator"] == "mdi" and other["cached"] is False and set(other["importances"]) == {"lr", "noise", "hidden"}
    assert api.get(f"/api/v1/studies/{study_id}/importances", params={"evaluator": "nope"}).status_code == 422
    bad = api.get(f"/api/v1/studies/{study_id}/importances", params={"objective": 1})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "objective"]


def test_a_large_study_is_evaluated_on_a_seeded_sample(live: LiveApi, api: httpx.Client, study_id: int) -> None:
    complete_trials(live, study_id, 40)
    with get_sessionmaker(live.database_url)() as session:
        out = importance.param_importances(session, live.database_url, study_id, max_trials=25)
        again = importance.param_importances(session, live.database_url, study_id, max_trials=25)
    assert (out.n_complete, out.n_used) == (40, 25)
    assert again.cached and again.importances == out.importances


def test_timeline_and_cluster(live: LiveApi, api: httpx.Client, study_id: int) -> None:
    first, second, late = complete_trials(live, study_id, 3)
    now = datetime.now(UTC)
    with get_sessionmaker(live.database_url)() as session:
        worker = Worker(name="gpu-0", device_type="cuda:H100", node="node-a")
        idle = Worker(name="gpu-1", device_type="cuda:H100", node="node-b")
        session.add_all([worker, idle])
        session.flush()
        array = Array(
            study_id=study_id, signature="s" * 64, worker_id=worker.id, created_at=now - timedelta(seconds=60),
            members=[ArrayMember(slot=0, trial_id=first), ArrayMember(slot=1, trial_id=second), ArrayMember(slot=2, trial_id=late)],
            models_steps_per_s=300.0,
        )
        session.add(array)
        session.flush()
        for trial_id, started in ((first, now - timedelta(seconds=60)), (second, now - timedelta(seconds=60)), (late, now - timedelta(seconds=20))):
            trial = session.get(Trial, trial_id)
            trial.array_id, trial.started_at = array.id, started
        session.get(Trial, second).state = TrialState.RUNNING
        session.get(Trial, second).completed_at = None
        from fusetune.server.db import Throughput

        session.add(Throughput(signature="s" * 64, device_type="cuda:H100", members=1, models_steps_per_s=100.0))
        session.commit()
        array_id = array.id

    timeline = api.get(f"/api/v1/studies/{study_id}/timeline").json()
    assert timeline["devices"] == ["gpu-0"]
    (span,) = timeline["arrays"]
    assert (span["id"], span["worker"], span["node"], span["speedup"]) == (array_id, "gpu-0", "node-a", pytest.approx(3.0))
    members = {m["trial_id"]: m for m in span["members"]}
    assert [members[t]["end"] for t in (first, second, late)] == ["COMPLETE", "RUNNING", "COMPLETE"]
    assert [members[t]["backfill"] for t in (first, second, late)] == [False, False, True]
    assert members[second]["left_at"] is None and members[first]["left_at"] is not None

    cluster = api.get("/api/v1/cluster").json()
    assert cluster["device_types"] == {"cuda:H100": 2} and cluster["nodes"] == {"node-a": 1, "node-b": 1}
    busy = {d["name"]: d for d in cluster["devices"]}
    assert busy["gpu-0"]["busy"] and busy["gpu-0"]["array_id"] == array_id and busy["gpu-0"]["members"] == 1
    assert not busy["gpu-1"]["busy"] and busy["gpu-1"]["utilisation"] == 0
    assert busy["gpu-0"]["utilisation"] == pytest.approx(60 / 300, abs=0.02)
    (mine,) = cluster["tenants"]
    assert (mine["name"], mine["running_trials"], mine["devices"], mine["share"], mine["fair_share"]) == ("default", 1, 1, 1.0, 1.0)

    # Another tenant sees the device busy, not whose array it trains.
    _, rival = live.create_tenant("rival")
    seen = {d["name"]: d for d in live.client(rival).get("/api/v1/cluster").json()["devices"]}
    assert seen["gpu-0"]["busy"] and seen["gpu-0"]["array_id"] is None and seen["gpu-0"]["study_name"] is None
    assert live.client(rival).get(f"/api/v1/studies/{study_id}/timeline").status_code == 404


def test_the_page_and_its_assets_need_no_token(live: LiveApi) -> None:
    anonymous = live.client()
    page = anonymous.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-cache"
    for asset in ("dashboard/app.js", "dashboard/style.css", "dashboard/views/study.js", "dashboard/vendor/uplot-1.6.32/uPlot.esm.js"):
        if asset in ("dashboard/app.js", "dashboard/style.css"):
            assert f'"{asset}"' in page.text  # relative, so the page works behind a path prefix too
        assert anonymous.get(f"/{asset}").status_code == 200, asset
    assert anonymous.get("/api/v1/studies").status_code == 401
    assert "/" not in anonymous.get("/openapi.json").json()["paths"]
