"""Every route of the app × every kind of caller: the status each gets.

The table ``RULES`` is keyed by (method, path) and must name exactly the app's routes: a new
route without a rule here fails ``test_every_route_has_a_rule``. Callers:

* ``owner``: a token of the tenant that owns the resources the request names;
* ``other``: a token of another tenant (its requests name the owner's resources);
* ``admin``: the ``FUSETUNE_ADMIN_TOKEN``;
* ``none``, ``bad``, ``revoked``: no token, a made-up one, a revoked token of the owner.

The rules: no valid token is 401 everywhere but ``/healthz``; admin routes are 403 for any
tenant; another tenant's resources are 404, never 403.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from fusetune.server import events
from fusetune.server.db import Array, ArrayMember, Study, Trial, get_optuna_storage, get_sessionmaker
from tests.server.conftest import LiveApi

ACTORS = ("owner", "other", "admin", "none", "bad", "revoked")
UNAUTHENTICATED = {"none": 401, "bad": 401, "revoked": 401}
STUDY = {"workload": "digits-mlp", "n_trials": 2, "epochs": 1}


@dataclass
class World:
    """The owner's study (with one trial in one array), both tenants' tokens, the admin's."""

    live: LiveApi
    tokens: dict[str, str | None]
    study_id: int
    trial_id: int
    array_id: int
    package: tuple[str, bytes]  # the owner's code package: its digest and zip
    serial: int = 0
    spare_tokens: dict[str, int] = field(default_factory=dict)

    def unique(self, stem: str) -> str:
        self.serial += 1
        return f"{stem}-{self.serial}"

    def fresh_owner_token(self) -> tuple[int, str]:
        response = self.live.client(self.live.admin_token).post("/api/v1/tenants/owner/tokens", json={})
        assert response.status_code == 201
        return response.json()["id"], response.json()["token"]


@dataclass
class Rule:
    """How one route is called, and what each caller gets."""

    call: Callable[[World, str], tuple[str, dict[str, Any]]]  # -> (path with ids, httpx kwargs)
    expect: dict[str, int]
    #: Further checks on the answer (called for every caller, whatever the status).
    check: Callable[[World, str, httpx.Response], None] | None = None


def ids(world: World) -> dict[str, Any]:
    return {"study_id": world.study_id, "trial_id": world.trial_id, "name": "owner", "key": "note"}


def path(template: str) -> Callable[[World, str], tuple[str, dict[str, Any]]]:
    return lambda world, actor: (template.format(**ids(world)), {})


def sees(listing: str) -> Callable[[World, str, httpx.Response], None]:
    """A listing shows the owner's resource to the owner and the admin, never to the other tenant."""

    def check(world: World, actor: str, response: httpx.Response) -> None:
        if response.status_code != 200:
            return
        own = {"studies": world.study_id, "arrays": world.array_id}[listing]
        found = own in [item["id"] for item in response.json()]
        assert found == (actor in ("owner", "admin")), (listing, actor, response.json())

    return check


def tenants_seen(world: World, actor: str, response: httpx.Response) -> None:
    if response.status_code != 200:
        return
    names = [t["name"] for t in response.json()]
    assert names == {"owner": ["owner"], "other": ["other"], "admin": ["default", "other", "owner"]}[actor]


def create_study(world: World, actor: str) -> tuple[str, dict[str, Any]]:
    return "/api/v1/studies", {"json": {**STUDY, "tenant": "owner", "name": world.unique(actor)}}


def create_tenant(world: World, actor: str) -> tuple[str, dict[str, Any]]:
    return "/api/v1/tenants", {"json": {"name": world.unique(f"by-{actor}"), "weight": 2}}


def revoke(world: World, actor: str) -> tuple[str, dict[str, Any]]:
    token_id, token = world.fresh_owner_token()
    world.spare_tokens[token] = token_id
    return f"/api/v1/tokens/{token_id}", {}


def revoked_only_when_allowed(world: World, actor: str, response: httpx.Response) -> None:
    """The token the request named is revoked if the answer says so, and works on otherwise."""
    token = next(t for t, i in world.spare_tokens.items() if response.request.url.path.endswith(f"/{i}"))
    status = world.live.client(token).get("/api/v1/studies").status_code
    assert status == (401 if response.status_code == 200 else 200), (actor, response.status_code)


def package_path(world: World, actor: str) -> tuple[str, dict[str, Any]]:
    return f"/api/v1/packages/{world.package[0]}", {}


def upload(world: World, actor: str) -> tuple[str, dict[str, Any]]:
    digest, data = world.package
    return f"/api/v1/packages/{digest}", {"content": data, "headers": {"Content-Type": "application/zip"}}


def package_served(world: World, actor: str, response: httpx.Response) -> None:
    if response.status_code == 200:
        assert response.content == world.package[1]


def reweigh(world: World, actor: str) -> tuple[str, dict[str, Any]]:
    return "/api/v1/tenants/owner", {"json": {"weight": 2}}


def user_attr(world: World, actor: str) -> tuple[str, dict[str, Any]]:
    return f"/api/v1/studies/{world.study_id}/user_attrs/note", {"json": {"value": actor}}


def study_unchanged(world: World, actor: str, response: httpx.Response) -> None:
    """A lifecycle action that was refused left the owner's study as it was."""
    if response.status_code < 300:
        return
    study = world.live.client(world.live.admin_token).get(f"/api/v1/studies/{world.study_id}")
    assert study.status_code == 200, (actor, study.text)
    assert (study.json()["state"], study.json()["n_trials"]) == ("RUNNING", STUDY["n_trials"]), (actor, study.json())


def trials_seen(world: World, actor: str, response: httpx.Response) -> None:
    if response.status_code == 200:
        assert [t["id"] for t in response.json()] == [world.trial_id]


def saved_weights(world: World) -> Path:
    """Where the world's trial's weights are, as a worker saves them: <artifact dir>/<study>/trial-<n>.pt."""
    return Path(world.live.app.state.settings.artifact_dir) / "owned" / "trial-0.pt"


def state_dict_served(world: World, actor: str, response: httpx.Response) -> None:
    if response.status_code == 200:
        assert response.content == saved_weights(world).read_bytes()


def events_seen(world: World, actor: str, response: httpx.Response) -> None:
    """The owner's event (the world writes one) reaches the owner and the admin, never the other tenant."""
    if response.status_code != 200:
        return
    assert response.headers["content-type"].startswith("text/event-stream")
    seen = [line for line in response.text.splitlines() if line.startswith("event: ")]
    assert seen == (["event: trial.asked"] if actor in ("owner", "admin") else []), (actor, response.text)


def dashboard_page_is_public(world: World, actor: str, response: httpx.Response) -> None:
    """The page is HTML, and its scripts come without a token too (they hold no data)."""
    assert response.headers["content-type"].startswith("text/html")
    assert "dashboard/app.js" in response.text
    for asset in ("/dashboard/app.js", "/dashboard/vendor/echarts-6.1.0/echarts.esm.min.js"):
        got = world.live.client(world.tokens[actor]).get(asset)
        assert got.status_code == 200 and "javascript" in got.headers["content-type"], (asset, got.status_code)


def timeline_seen(world: World, actor: str, response: httpx.Response) -> None:
    if response.status_code == 200:
        arrays = response.json()["arrays"]
        assert [(a["id"], [m["trial_id"] for m in a["members"]]) for a in arrays] == [(world.array_id, [world.trial_id])]


def cluster_seen(world: World, actor: str, response: httpx.Response) -> None:
    """A tenant sees its own share, and the other tenants only summed up; the admin every tenant."""
    if response.status_code != 200:
        return
    body = response.json()
    names = [t["name"] for t in body["tenants"]]
    if actor == "admin":  # every tenant, those the matrix's other rules made included
        assert {"default", "other", "owner"} <= set(names), names
    else:
        assert names == [actor], names
    assert (body["others"] is None) == (actor == "admin")


#: (method, path) -> rule. Every route of the app, no more and no fewer.
RULES: dict[tuple[str, str], Rule] = {
    ("GET", "/healthz"): Rule(path("/healthz"), {actor: 200 for actor in ACTORS}),
    ("POST", "/api/v1/studies"): Rule(create_study, {"owner": 201, "other": 422, "admin": 201, **UNAUTHENTICATED}),
    ("GET", "/api/v1/studies"): Rule(
        lambda w, a: ("/api/v1/studies", {"params": {"tenant": "owner"}}),
        {"owner": 200, "other": 200, "admin": 200, **UNAUTHENTICATED},
        sees("studies"),
    ),
    ("GET", "/api/v1/studies/{study_id}"): Rule(
        path("/api/v1/studies/{study_id}"), {"owner": 200, "other": 404, "admin": 200, **UNAUTHENTICATED}
    ),
    ("GET", "/api/v1/studies/{study_id}/trials"): Rule(
        path("/api/v1/studies/{study_id}/trials"), {"owner": 200, "other": 404, "admin": 200, **UNAUTHENTICATED},
        trials_seen,
    ),
    ("GET", "/api/v1/trials/{trial_id}"): Rule(
        path("/api/v1/trials/{trial_id}"), {"owner": 200, "other": 404, "admin": 200, **UNAUTHENTICATED}
    ),
    ("GET", "/api/v1/trials/{trial_id}/state_dict"): Rule(
        path("/api/v1/trials/{trial_id}/state_dict"), {"owner": 200, "other": 404, "admin": 200, **UNAUTHENTICATED},
        state_dict_served,
    ),
    ("PUT", "/api/v1/studies/{study_id}/user_attrs/{key:text}"): Rule(
        user_attr, {"owner": 200, "other": 404, "admin": 200, **UNAUTHENTICATED}
    ),
    # The API alone runs no scheduling loop: past the scoping, enqueueing is a 503, and pruning
    # decisions on a study whose own pruner decides a 409; another tenant gets 404 before that.
    ("POST", "/api/v1/studies/{study_id}/trials"): Rule(
        lambda w, a: (f"/api/v1/studies/{w.study_id}/trials", {"json": {"params": {"lr": 0.1}}}),
        {"owner": 503, "other": 404, "admin": 503, **UNAUTHENTICATED},
    ),
    ("POST", "/api/v1/trials/{trial_id}/pruning"): Rule(
        lambda w, a: (f"/api/v1/trials/{w.trial_id}/pruning", {"json": {"step": 0, "prune": True}}),
        {"owner": 409, "other": 404, "admin": 409, **UNAUTHENTICATED},
    ),
    # The study's lifecycle is the scheduling loop's (the API alone runs none): past the
    # scoping, a 503; another tenant gets 404 first, and nothing changes either way.
    **{
        ("POST", f"/api/v1/studies/{{study_id}}/{action}"): Rule(
            path(f"/api/v1/studies/{{study_id}}/{action}"),
            {"owner": 503, "other": 404, "admin": 503, **UNAUTHENTICATED},
            study_unchanged,
        )
        for action in ("pause", "resume", "cancel")
    },
    ("PATCH", "/api/v1/studies/{study_id}"): Rule(
        lambda w, a: (f"/api/v1/studies/{w.study_id}", {"json": {"n_trials": 5}}),
        {"owner": 503, "other": 404, "admin": 503, **UNAUTHENTICATED},
        study_unchanged,
    ),
    ("DELETE", "/api/v1/studies/{study_id}"): Rule(
        path("/api/v1/studies/{study_id}"), {"owner": 503, "other": 404, "admin": 503, **UNAUTHENTICATED}, study_unchanged
    ),
    ("GET", "/api/v1/arrays"): Rule(
        lambda w, a: ("/api/v1/arrays", {}), {"owner": 200, "other": 200, "admin": 200, **UNAUTHENTICATED}, sees("arrays")
    ),
    ("GET", "/api/v1/tenants"): Rule(
        path("/api/v1/tenants"), {"owner": 200, "other": 200, "admin": 200, **UNAUTHENTICATED}, tenants_seen
    ),
    ("POST", "/api/v1/tenants"): Rule(create_tenant, {"owner": 403, "other": 403, "admin": 201, **UNAUTHENTICATED}),
    ("PATCH", "/api/v1/tenants/{name}"): Rule(reweigh, {"owner": 403, "other": 403, "admin": 200, **UNAUTHENTICATED}),
    ("GET", "/api/v1/tenants/{name}/tokens"): Rule(
        path("/api/v1/tenants/{name}/tokens"), {"owner": 200, "other": 404, "admin": 200, **UNAUTHENTICATED}
    ),
    ("POST", "/api/v1/tenants/{name}/tokens"): Rule(
        lambda w, a: ("/api/v1/tenants/owner/tokens", {"json": {"label": a}}),
        {"owner": 201, "other": 404, "admin": 201, **UNAUTHENTICATED},
    ),
    ("DELETE", "/api/v1/tokens/{token_id}"): Rule(
        revoke, {"owner": 200, "other": 404, "admin": 200, **UNAUTHENTICATED}, revoked_only_when_allowed
    ),
    # The web dashboard: the page and its assets hold no data, so they need no token (every
    # caller, a bad or revoked token included, gets them); what it shows comes from the routes
    # below and the rest of /api/v1, under the same rules as any client.
    ("GET", "/"): Rule(path("/"), {actor: 200 for actor in ACTORS}, dashboard_page_is_public),
    ("GET", "/api/v1/studies/{study_id}/importances"): Rule(
        path("/api/v1/studies/{study_id}/importances"), {"owner": 200, "other": 404, "admin": 200, **UNAUTHENTICATED}
    ),
    ("GET", "/api/v1/studies/{study_id}/timeline"): Rule(
        path("/api/v1/studies/{study_id}/timeline"), {"owner": 200, "other": 404, "admin": 200, **UNAUTHENTICATED},
        timeline_seen,
    ),
    ("GET", "/api/v1/cluster"): Rule(
        path("/api/v1/cluster"), {"owner": 200, "other": 200, "admin": 200, **UNAUTHENTICATED}, cluster_seen
    ),
    # Event streams: `follow=false` sends the stored events and ends. A tenant's stream shows
    # only its own tenant's; another tenant's study is a 404.
    ("GET", "/api/v1/studies/{study_id}/events"): Rule(
        lambda w, a: (f"/api/v1/studies/{w.study_id}/events", {"params": {"after": 0, "follow": "false"}}),
        {"owner": 200, "other": 404, "admin": 200, **UNAUTHENTICATED}, events_seen,
    ),
    ("GET", "/api/v1/events"): Rule(
        lambda w, a: ("/api/v1/events", {"params": {"after": 0, "follow": "false"}}),
        {"owner": 200, "other": 200, "admin": 200, **UNAUTHENTICATED}, events_seen,
    ),
    # Uploading takes the admin's code_upload grant, which the owner has and the other tenant
    # (and `default`, whom the admin acts for by default) has not: 403 naming it. The owner's
    # upload is of bytes it uploaded before: 200, nothing stored again.
    ("PUT", "/api/v1/packages/{digest}"): Rule(upload, {"owner": 200, "other": 403, "admin": 403, **UNAUTHENTICATED}),
    ("HEAD", "/api/v1/packages/{digest}"): Rule(package_path, {"owner": 200, "other": 404, "admin": 200, **UNAUTHENTICATED}),
    ("GET", "/api/v1/packages/{digest}"): Rule(
        package_path, {"owner": 200, "other": 404, "admin": 200, **UNAUTHENTICATED}, package_served
    ),
    # Open like /healthz while FUSETUNE_METRICS_TOKEN is unset (tests/server/test_operations.py sets it).
    ("GET", "/metrics"): Rule(path("/metrics"), {actor: 200 for actor in ACTORS}),
}


def app_routes(app: FastAPI) -> set[tuple[str, str]]:
    """(method, path) of every APIRoute the app serves, routers included."""
    try:  # FastAPI >= 0.16x keeps included routers nested in app.routes
        from fastapi.routing import iter_route_contexts

        contexts = list(iter_route_contexts(app.routes))
        routes = [(c.original_route, c.path, c.methods) for c in contexts]
    except ImportError:
        routes = [(r, r.path, getattr(r, "methods", None)) for r in app.routes]
    return {(method, p) for route, p, methods in routes if isinstance(route, APIRoute) for method in methods}


@pytest.fixture
def world(live: LiveApi, database_url: str) -> World:
    _, owner = live.create_tenant("owner")
    _, other = live.create_tenant("other")
    response = live.client(live.admin_token).post("/api/v1/tenants/owner/tokens", json={"label": "revoked"})
    revoked_id, revoked = response.json()["id"], response.json()["token"]
    assert live.client(owner).delete(f"/api/v1/tokens/{revoked_id}").status_code == 200
    study = live.client(owner).post("/api/v1/studies", json={**STUDY, "name": "owned"})
    assert study.status_code == 201, study.text
    study_id = study.json()["id"]
    # One trial in one array and its event, written as the coordinator would (the API alone runs no loop).
    sessions = get_sessionmaker(database_url)
    with sessions() as session:
        optuna_study = session.get(Study, study_id)
        storage = get_optuna_storage(database_url)
        optuna_trial_id = storage.create_new_trial(optuna_study.optuna_study_id)
        storage.set_trial_param(optuna_trial_id, "lr", 0.1, optuna.distributions.FloatDistribution(0.01, 1.0))
        weights = Path(live.app.state.settings.artifact_dir) / "owned" / "trial-0.pt"
        weights.parent.mkdir(parents=True)
        weights.write_bytes(b"the weights a worker saved")  # served as they are
        storage.set_trial_user_attr(optuna_trial_id, "state_dict", str(weights.resolve()))
        trial = Trial(study_id=study_id, optuna_trial_id=optuna_trial_id, number=0, params={"lr": 0.1}, signature="s" * 64)
        session.add(trial)
        session.flush()
        array = Array(study_id=study_id, signature="s" * 64, members=[ArrayMember(slot=0, trial_id=trial.id)])
        session.add(array)
        session.flush()
        events.record(session, "trial.asked", tenant="owner", study_id=study_id, trial_id=trial.id, number=0, params={"lr": 0.1})
        session.commit()
        trial_id, array_id = trial.id, array.id
    # The owner may upload code, and has uploaded a package (the service's own digits MLP,
    # packaged as a user's workload is).
    from fusetune.client import package
    from fusetune.workers.workloads import get_workload

    assert live.client(live.admin_token).patch("/api/v1/tenants/owner", json={"code_upload": True}).status_code == 200
    pkg = package(get_workload("digits-mlp"))
    put = live.client(owner).put(f"/api/v1/packages/{pkg.digest}", content=pkg.data, headers={"Content-Type": "application/zip"})
    assert put.status_code == 201, put.text
    tokens = {
        "owner": owner,
        "other": other,
        "admin": live.admin_token,
        "none": None,
        "bad": "ft_" + secrets.token_urlsafe(32),
        "revoked": revoked,
    }
    return World(live=live, tokens=tokens, study_id=study_id, trial_id=trial_id, array_id=array_id, package=(pkg.digest, pkg.data))


def test_every_route_has_a_rule(live: LiveApi) -> None:
    routes = app_routes(live.app)
    assert {("GET", "/healthz"), ("POST", "/api/v1/tenants")} <= routes  # the table was read
    missing = sorted(routes - set(RULES))
    assert not missing, f"routes without an isolation rule in {__name__}.RULES: {missing}"
    assert sorted(set(RULES) - routes) == [], "rules for routes the app no longer has"


def test_isolation_matrix(world: World) -> None:
    assert set(RULES) == app_routes(world.live.app)
    got: dict[tuple[str, str, str], int] = {}
    failures = []
    for (method, template), rule in RULES.items():
        assert set(rule.expect) == set(ACTORS), (method, template)
        for actor in ACTORS:
            url, kwargs = rule.call(world, actor)
            response = world.live.client(world.tokens[actor]).request(method, url, **kwargs)
            got[(method, template, actor)] = response.status_code
            if response.status_code != rule.expect[actor]:
                failures.append(f"{method} {template} as {actor}: {response.status_code}, expected "
                                f"{rule.expect[actor]}: {response.text[:200]}")
                continue
            if response.status_code == 401:
                assert response.headers["www-authenticate"].startswith("Bearer"), (method, template, actor)
            if rule.check is not None:
                rule.check(world, actor, response)
    assert not failures, "\n".join(failures)
    assert len(got) == len(RULES) * len(ACTORS)


def test_another_tenants_ids_read_as_missing_ones(world: World) -> None:
    """A 404 for another tenant's resource is the 404 of a resource that does not exist."""
    other = world.live.client(world.tokens["other"])
    missing = 10**9
    for template, real in [
        ("/api/v1/studies/{}", world.study_id),
        ("/api/v1/studies/{}/trials", world.study_id),
        ("/api/v1/trials/{}", world.trial_id),
        ("/api/v1/trials/{}/state_dict", world.trial_id),
    ]:
        foreign = other.get(template.format(real))
        absent = other.get(template.format(missing))
        assert foreign.status_code == absent.status_code == 404
        assert foreign.json() == {"detail": absent.json()["detail"].replace(str(missing), str(real))}
    foreign = other.get("/api/v1/arrays", params={"study_id": world.study_id})
    absent = other.get("/api/v1/arrays", params={"study_id": missing})
    assert foreign.json() == {"detail": absent.json()["detail"].replace(str(missing), str(world.study_id))}
    foreign = other.get("/api/v1/tenants/owner/tokens")
    absent = other.get("/api/v1/tenants/nobody/tokens")
    assert foreign.json() == {"detail": absent.json()["detail"].replace("nobody", "owner")}
