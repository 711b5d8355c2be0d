"""Tenants with real auth, over HTTP: tokens, the admin, quotas, and workload imports."""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
import time

import httpx
import sqlalchemy as sa
import uvicorn

from fusetune.server.db import get_engine
from tests.conftest import free_port
from tests.server.conftest import LiveApi, live_api
from tests.server.test_studies_api import VALID, field_of, row_counts

PATH_WORKLOAD = "tests.server.path_workload:WORKLOAD"


def weights(url: str) -> dict[str, float]:
    with get_engine(url).connect() as conn:
        return dict(conn.execute(sa.text("SELECT name, weight FROM ft_tenants")).all())


def test_nobody_but_the_admin_sets_a_weight(live: LiveApi, admin: httpx.Client, database_url: str) -> None:
    _, acme_token = live.create_tenant("acme")
    before = weights(database_url)
    callers = {
        "acme's token": live.client(acme_token),
        "default's token": live.client(live.token_for("default")),
    }
    for who, client in callers.items():
        for name in ("acme", "default", "evil"):
            response = client.patch(f"/api/v1/tenants/{name}", json={"weight": 1_000_000})
            assert response.status_code == 403, (who, name, response.text)
        assert client.post("/api/v1/tenants", json={"name": "evil", "weight": 1_000_000}).status_code == 403
    for client in (live.client(), live.client("ft_" + "x" * 43)):
        response = client.patch("/api/v1/tenants/acme", json={"weight": 1_000_000})
        assert response.status_code == 401 and response.headers["www-authenticate"].startswith("Bearer")
    # The old open route is gone for everyone.
    assert live.client(acme_token).put("/api/v1/tenants/evil", json={"weight": 1_000_000}).status_code == 405
    assert weights(database_url) == before
    assert admin.patch("/api/v1/tenants/acme", json={"weight": 5}).status_code == 200
    assert weights(database_url) == {**before, "acme": 5.0}


def test_tenant_creation_errors_name_the_field(admin: httpx.Client, database_url: str) -> None:
    assert admin.post("/api/v1/tenants", json={"name": "acme", "weight": 2}).status_code == 201
    before = row_counts(database_url)
    for body, status, field in [
        ({"name": "acme"}, 409, "name"),
        ({"name": "default"}, 409, "name"),
        ({"name": "new", "weight": 0}, 422, "weight"),
        ({"name": "new", "weight": -3}, 422, "weight"),
        ({"name": "a/b"}, 422, "name"),
        ({"name": "new", "max_trials_per_study": 0}, 422, "max_trials_per_study"),
    ]:
        response = admin.post("/api/v1/tenants", json=body)
        assert response.status_code == status, (body, response.text)
        assert ["body", field] in [loc[:2] for loc in field_of(response)], response.text
    assert row_counts(database_url) == before


def test_a_study_for_an_unknown_tenant_is_422_naming_tenant(live: LiveApi, admin: httpx.Client, database_url: str) -> None:
    live.create_tenant("acme")
    _, other_token = live.create_tenant("other")
    before = row_counts(database_url)
    missing = admin.post("/api/v1/studies", json={**VALID, "tenant": "nobody"})
    assert missing.status_code == 422 and field_of(missing) == [["body", "tenant"]]
    assert "tenant 'nobody' does not exist" in missing.text
    # Another tenant's name reads exactly like an unknown one from a tenant's token.
    foreign = live.client(other_token).post("/api/v1/studies", json={**VALID, "tenant": "acme"})
    assert foreign.status_code == 422 and field_of(foreign) == [["body", "tenant"]]
    assert foreign.json()["detail"][0]["msg"] == "tenant 'acme' does not exist"
    assert row_counts(database_url) == before
    # The admin's study goes to the tenant it names, `default` otherwise; a tenant's to itself.
    assert admin.post("/api/v1/studies", json={**VALID, "tenant": "acme"}).json()["tenant"] == "acme"
    assert admin.post("/api/v1/studies", json=VALID).json()["tenant"] == "default"
    assert live.client(other_token).post("/api/v1/studies", json=VALID).json()["tenant"] == "other"
    assert live.client(other_token).post("/api/v1/studies", json={**VALID, "tenant": "other"}).status_code == 201


def test_quotas_hold_on_study_creation(live: LiveApi, admin: httpx.Client, database_url: str) -> None:
    _, token = live.create_tenant("small", max_running_studies=2, max_trials_per_study=5)
    client = live.client(token)
    before = row_counts(database_url)
    response = client.post("/api/v1/studies", json={**VALID, "n_trials": 6})
    assert response.status_code == 422 and field_of(response) == [["body", "n_trials"]]
    assert "max_trials_per_study=5" in response.text
    assert row_counts(database_url) == before
    assert client.post("/api/v1/studies", json={**VALID, "n_trials": 5}).status_code == 201
    assert client.post("/api/v1/studies", json=VALID).status_code == 201
    before = row_counts(database_url)
    for caller in (client, admin):  # the admin acting for the tenant is held to its quota too
        response = caller.post("/api/v1/studies", json={**VALID, "tenant": "small"})
        assert response.status_code == 409, response.text
        assert field_of(response) == [["tenant", "max_running_studies"]]
    assert row_counts(database_url) == before
    # Raising the quota lets the next one in.
    assert admin.patch("/api/v1/tenants/small", json={"max_running_studies": 3}).status_code == 200
    assert client.post("/api/v1/studies", json=VALID).status_code == 201


def test_a_quota_below_what_runs_is_409_naming_the_quota(live: LiveApi, admin: httpx.Client) -> None:
    _, token = live.create_tenant("busy")
    client = live.client(token)
    for n_trials in (4, 8):
        assert client.post("/api/v1/studies", json={**VALID, "n_trials": n_trials}).status_code == 201
    for body, field in [({"max_running_studies": 1}, "max_running_studies"),
                        ({"max_running_studies": 0}, "max_running_studies"),
                        ({"max_trials_per_study": 7}, "max_trials_per_study"),
                        ({"weight": 2, "max_trials_per_study": 7}, "max_trials_per_study")]:
        response = admin.patch("/api/v1/tenants/busy", json=body)
        assert response.status_code == 409, (body, response.text)
        assert field_of(response) == [["body", field]]
    # Nothing changed, not even the weight sent beside the refused quota.
    busy = next(t for t in admin.get("/api/v1/tenants").json() if t["name"] == "busy")
    assert busy == {"name": "busy", "weight": 1.0, "max_running_studies": None, "max_trials_per_study": None, "code_upload": False}
    # At what runs is fine.
    response = admin.patch("/api/v1/tenants/busy", json={"max_running_studies": 2, "max_trials_per_study": 8})
    assert response.status_code == 200


def test_a_revoked_token_is_refused(live: LiveApi, admin: httpx.Client) -> None:
    _, first = live.create_tenant("acme")
    created = live.client(first).post("/api/v1/tenants/acme/tokens", json={"label": "laptop"})
    assert created.status_code == 201
    second = created.json()
    assert second["label"] == "laptop" and second["tenant"] == "acme" and second["revoked_at"] is None
    laptop = live.client(second["token"])
    assert laptop.get("/api/v1/studies").status_code == 200

    response = live.client(first).delete(f"/api/v1/tokens/{second['id']}")
    assert response.status_code == 200 and response.json()["revoked_at"] is not None
    for path in ("/api/v1/studies", "/api/v1/tenants", "/api/v1/arrays", "/api/v1/tenants/acme/tokens"):
        refused = laptop.get(path)
        assert refused.status_code == 401, path
        assert refused.headers["www-authenticate"].startswith("Bearer")
    # The tenant's other token still works, and lists both, the revoked one marked.
    tokens = live.client(first).get("/api/v1/tenants/acme/tokens").json()
    assert [(t["id"], t["revoked_at"] is not None) for t in tokens] == [(tokens[0]["id"], False), (second["id"], True)]
    assert all("token" not in t for t in tokens)
    # The admin revokes a tenant's last token: the tenant is locked out until it gets a new one.
    assert admin.delete(f"/api/v1/tokens/{tokens[0]['id']}").status_code == 200
    assert live.client(first).get("/api/v1/studies").status_code == 401


def test_missing_and_malformed_credentials_are_401(live: LiveApi) -> None:
    for headers in ({}, {"Authorization": "Basic YWRtaW46YWRtaW4="}, {"Authorization": "Bearer"},
                    {"Authorization": "Bearer not-a-token"}, {"Authorization": f"Bearer {live.admin_token}x"}):
        response = httpx.get(f"{live.url}/api/v1/studies", headers=headers)
        assert response.status_code == 401, headers
        assert response.headers["www-authenticate"].startswith("Bearer")
    # 401 comes before validating the request: nothing about the route's input leaks either.
    assert httpx.post(f"{live.url}/api/v1/studies", json={"n_trials": -1}).status_code == 401


def test_tokens_are_stored_only_as_their_sha256(live: LiveApi, database_url: str) -> None:
    _, token = live.create_tenant("acme")
    with get_engine(database_url).connect() as conn:
        rows = [tuple(r) for r in conn.execute(sa.text("SELECT * FROM ft_tokens"))]
    assert hashlib.sha256(token.encode()).hexdigest() in {v for row in rows for v in row}
    assert not any(token in str(v) for row in rows for v in row)
    assert token.startswith("ft_") and len(token) >= 40


def test_workload_module_paths_are_refused_unless_enabled(live: LiveApi, api: httpx.Client, database_url: str) -> None:
    sys.modules.pop(PATH_WORKLOAD.split(":")[0], None)
    before = row_counts(database_url)
    response = api.post("/api/v1/studies", json={**VALID, "workload": PATH_WORKLOAD})
    assert response.status_code == 422
    assert field_of(response) == [["body", "workload"]]
    assert "importing workloads is disabled" in response.text
    assert PATH_WORKLOAD.split(":")[0] not in sys.modules, "the refused module was imported"
    assert row_counts(database_url) == before
    # Registered workloads are still fine.
    assert api.post("/api/v1/studies", json=VALID).status_code == 201


def test_an_operator_may_enable_workload_imports(database_url: str) -> None:
    sys.modules.pop(PATH_WORKLOAD.split(":")[0], None)
    for live in live_api(database_url, allow_workload_imports=True):
        client = live.client(live.token_for("default"))
        response = client.post("/api/v1/studies", json={**VALID, "workload": PATH_WORKLOAD})
        assert response.status_code == 201, response.text
        assert response.json()["workload"] == PATH_WORKLOAD
        # A path that does not import is still a 422 naming the field.
        response = client.post("/api/v1/studies", json={**VALID, "workload": "tests.server.no_such_module:X"})
        assert response.status_code == 422 and field_of(response) == [["body", "workload"]]
        assert "cannot import workload" in response.text


def test_uvicorn_access_log_never_shows_a_token(live: LiveApi) -> None:
    """`fusetune serve` logs access lines (uvicorn's default): method, path, status, never headers."""
    token = live.token_for("default")
    config = uvicorn.Config(live.app, host="127.0.0.1", port=free_port(), log_level="info", access_log=True)
    server = uvicorn.Server(config)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for name in ("uvicorn.access", "uvicorn.error", "fusetune"):
        logging.getLogger(name).addHandler(handler)
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        url = f"http://127.0.0.1:{config.port}"
        assert httpx.get(f"{url}/api/v1/studies", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        assert httpx.get(f"{url}/api/v1/studies", headers={"Authorization": f"Bearer {token}x"}).status_code == 401
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        for name in ("uvicorn.access", "uvicorn.error", "fusetune"):
            logging.getLogger(name).removeHandler(handler)
    access = [r.getMessage() for r in records if r.name == "uvicorn.access"]
    assert sum("GET /api/v1/studies" in line for line in access) == 2, access
    for record in records:
        text = record.getMessage()
        assert token not in text and live.admin_token not in text, text
