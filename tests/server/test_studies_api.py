"""The studies API over real HTTP: what a valid request creates, and what bad input gets."""

from __future__ import annotations

import json

import httpx
import optuna
import pytest
import sqlalchemy as sa

from fusetune.server.db import get_engine
from tests.server.conftest import LiveApi

VALID = {"workload": "digits-mlp", "n_trials": 4, "epochs": 2}


def row_counts(url: str) -> dict[str, int]:
    """Rows in fusetune's tables and in Optuna's, to show a rejected request wrote nothing."""
    with get_engine(url).connect() as conn:
        return {
            table: conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar_one()
            for table in ("ft_studies", "ft_trials", "ft_arrays", "ft_tenants", "studies", "trials")
        }


def field_of(response: httpx.Response) -> list[list[str]]:
    return [err["loc"] for err in response.json()["detail"]]


def test_create_study_is_an_optuna_study(api: httpx.Client, database_url: str) -> None:
    space = {"lr": optuna.distributions.distribution_to_json(optuna.distributions.FloatDistribution(1e-3, 0.1, log=True))}
    response = api.post("/api/v1/studies", json={**VALID, "name": "mine", "search_space": space})
    assert response.status_code == 201, response.text
    study = response.json()
    assert study["name"] == "mine"
    assert study["tenant"] == "default"  # the token's tenant
    assert study["state"] == "RUNNING"
    assert study["direction"] == "maximize"  # the workload's metric is accuracy
    assert study["sampler"] == {"name": "TPESampler", "kwargs": {}}
    assert study["trial_counts"] == {"WAITING": 0, "RUNNING": 0, "COMPLETE": 0, "PRUNED": 0, "FAIL": 0}

    assert api.get(f"/api/v1/studies/{study['id']}").json()["name"] == "mine"
    assert [s["name"] for s in api.get("/api/v1/studies").json()] == ["mine"]
    assert api.get(f"/api/v1/studies/{study['id']}/trials").json() == []
    assert api.get("/api/v1/arrays", params={"study_id": study["id"]}).json() == []
    loaded = optuna.load_study(study_name="mine", storage=database_url)
    assert loaded.direction == optuna.study.StudyDirection.MAXIMIZE


def test_a_form_encoded_body_is_refused_even_when_it_holds_json(api: httpx.Client, database_url: str) -> None:
    """`curl -d @sweep.json` without `-H 'Content-Type: application/json'`, or a cross-site
    HTML form, labels the body form data: 415, and nothing is written."""
    before = row_counts(database_url)
    response = api.post(
        "/api/v1/studies",
        content=json.dumps(VALID),
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert response.status_code == 415, response.text
    assert "application/json" in response.json()["detail"]
    assert row_counts(database_url) == before


def test_search_space_accepts_distribution_objects(api: httpx.Client) -> None:
    encoded = json.loads(optuna.distributions.distribution_to_json(optuna.distributions.CategoricalDistribution([32, 64])))
    response = api.post("/api/v1/studies", json={**VALID, "search_space": {"hidden": encoded}})
    assert response.status_code == 201, response.text


@pytest.mark.parametrize(
    ("change", "loc"),
    [
        ({"workload": "no-such-workload"}, ["body", "workload"]),
        ({"n_trials": 0}, ["body", "n_trials"]),
        ({"n_trials": -3}, ["body", "n_trials"]),
        ({"epochs": 0}, ["body", "epochs"]),
        ({"max_concurrent_trials": 0}, ["body", "max_concurrent_trials"]),
        ({"max_concurrent_trials": "four"}, ["body", "max_concurrent_trials"]),
        ({"driver": "client", "max_concurrent_trials": 4}, ["body"]),  # its client asks the trials
        ({"direction": "sideways"}, ["body", "direction"]),
        ({"search_space": {"lr": "{not json"}}, ["body", "search_space", "lr"]),
        ({"search_space": {"lr": '{"name": "NoSuchDistribution", "attributes": {}}'}}, ["body", "search_space", "lr"]),
        ({"search_space": {"lr": {"name": "FloatDistribution", "attributes": {"low": 1.0, "high": 0.0}}}}, ["body", "search_space", "lr"]),
        ({"search_space": {"lr": {"type": "float", "low": True, "high": 1.0}}}, ["body", "search_space", "lr"]),
        ({"search_space": {"lr": {"type": "int", "low": 1.5, "high": 3}}}, ["body", "search_space", "lr"]),
        ({"search_space": {"lr": {"type": "int", "low": 1, "high": 2**60}}}, ["body", "search_space", "lr"]),
        ({"search_space": {"lr": '{"type": "float", "low": NaN, "high": 1}'}}, ["body", "search_space", "lr"]),
        ({"search_space": {"lr": {"type": "categorical", "choices": [{"nested": 1}]}}}, ["body", "search_space", "lr"]),
        ({"search_space": {"lr": {"type": "float", "low": 0.0, "high": 1.0, "log": True}}}, ["body", "search_space", "lr"]),
        # Optuna's Decimal arithmetic cannot fit a step that small into a range that wide (it raised, a 500).
        ({"search_space": {"lr": {"type": "float", "low": 1e-38, "high": 8e128, "step": 7e15}}}, ["body", "search_space", "lr"]),
        ({"sampler": {"name": "NoSuchSampler"}}, ["body", "sampler", "name"]),
        ({"sampler": {"name": "TPESampler", "kwargs": {"n_startup": 3}}}, ["body", "sampler", "kwargs", "n_startup"]),
        ({"pruner": {"name": "NoSuchPruner"}}, ["body", "pruner", "name"]),
        ({"pruner": {"name": "MedianPruner", "kwargs": {"n_warmup_steps": -1}}}, ["body", "pruner", "kwargs", "n_warmup_steps"]),
        ({"unexpected": 1}, ["body", "unexpected"]),
        ({"name": "../outside"}, ["body", "name"]),  # names a folder under the artifact directory
        ({"name": "a/b"}, ["body", "name"]),
    ],
)
def test_bad_input_is_422_naming_the_field_and_writes_nothing(
    api: httpx.Client, database_url: str, change: dict, loc: list[str]
) -> None:
    before = row_counts(database_url)
    response = api.post("/api/v1/studies", json={**VALID, **change})
    assert response.status_code == 422, response.text
    assert loc in field_of(response)
    assert any(change_key in json.dumps(response.json()) for change_key in change)
    assert row_counts(database_url) == before


def test_duplicate_name_is_409_naming_the_field(api: httpx.Client, database_url: str) -> None:
    assert api.post("/api/v1/studies", json={**VALID, "name": "twice"}).status_code == 201
    before = row_counts(database_url)
    response = api.post("/api/v1/studies", json={**VALID, "name": "twice"})
    assert response.status_code == 409
    assert field_of(response) == [["body", "name"]]
    assert row_counts(database_url) == before


def test_a_name_an_optuna_study_holds_is_409_naming_the_field(api: httpx.Client, database_url: str) -> None:
    """The Optuna study is written in the service's own transaction: a name a plain Optuna
    study already has is refused, and nothing of the refused study is left in either's tables."""
    optuna.create_study(study_name="theirs", storage=database_url)
    before = row_counts(database_url)
    response = api.post("/api/v1/studies", json={**VALID, "name": "theirs"})
    assert response.status_code == 409
    assert field_of(response) == [["body", "name"]]
    assert "Optuna study" in response.text
    assert row_counts(database_url) == before


def test_unknown_study_is_404(api: httpx.Client) -> None:
    for path in ("/api/v1/studies/999", "/api/v1/studies/999/trials"):
        response = api.get(path)
        assert response.status_code == 404
        assert "study 999 does not exist" in response.json()["detail"]
    assert api.get("/api/v1/arrays", params={"study_id": 999}).status_code == 404
    assert api.get("/api/v1/studies/abc").status_code == 422


def test_healthz_names_the_database(live: LiveApi, database_url: str) -> None:
    body = live.client().get("/healthz").json()  # the one route that needs no token
    assert body == {"status": "ok", "database": database_url.split("+")[0].split(":")[0], "workers": 0}


def test_tenants_are_created_with_one_share_and_reweighted(live: LiveApi, admin: httpx.Client) -> None:
    created = admin.post("/api/v1/tenants", json={"name": "acme"})
    assert created.status_code == 201, created.text
    acme = {"name": "acme", "weight": 1.0, "max_running_studies": None, "max_trials_per_study": None, "code_upload": False}
    assert created.json()["tenant"] == acme
    assert admin.post("/api/v1/studies", json={**VALID, "tenant": "acme"}).json()["tenant"] == "acme"
    default = {**acme, "name": "default"}
    assert admin.get("/api/v1/tenants").json() == [acme, default]
    response = admin.patch("/api/v1/tenants/acme", json={"weight": 3})
    assert response.status_code == 200 and response.json() == {**acme, "weight": 3.0}
    response = admin.patch("/api/v1/tenants/acme", json={"max_running_studies": 4, "max_trials_per_study": 10})
    assert response.json() == {**acme, "weight": 3.0, "max_running_studies": 4, "max_trials_per_study": 10}
    response = admin.patch("/api/v1/tenants/acme", json={"max_running_studies": None})  # null: no limit
    assert response.json() == {**acme, "weight": 3.0, "max_trials_per_study": 10}
    assert admin.patch("/api/v1/tenants/beta", json={"weight": 0.5}).status_code == 404  # only POST creates
    assert [t["name"] for t in admin.get("/api/v1/tenants").json()] == ["acme", "default"]
    # acme's own token sees acme only.
    acme_client = live.client(created.json()["token"]["token"])
    assert acme_client.get("/api/v1/tenants").json() == [{**acme, "weight": 3.0, "max_trials_per_study": 10}]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"weight": 0}, "weight"),
        ({"weight": -1}, "weight"),
        ({"weight": None}, "weight"),
        ({"weight": "heavy"}, "weight"),
        ({"weight": 1, "x": 1}, "x"),
        ({"max_running_studies": -1}, "max_running_studies"),
        ({"max_trials_per_study": 0}, "max_trials_per_study"),
    ],
)
def test_bad_tenant_update_is_422_naming_the_field(admin: httpx.Client, database_url: str, body: dict, field: str) -> None:
    before = row_counts(database_url)
    response = admin.patch("/api/v1/tenants/default", json=body)
    assert response.status_code == 422
    assert ["body", field] in [loc[:2] for loc in field_of(response)]
    assert row_counts(database_url) == before
    assert admin.get("/api/v1/tenants").json()[0]["weight"] == 1.0


def test_an_empty_tenant_update_is_422_naming_the_fields(admin: httpx.Client) -> None:
    response = admin.patch("/api/v1/tenants/default", json={})
    assert response.status_code == 422
    assert "weight" in response.text and "max_running_studies" in response.text
