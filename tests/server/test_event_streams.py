"""Event streams against the live API: a cap per tenant, and a revoked token's stream ends.

A tenant may hold ``FUSETUNE_EVENTS_MAX_STREAMS_PER_TENANT`` streams open (the admin as many,
counted apart); one more is a 429 with Retry-After that names the limit, and a stream that
ends gives its slot back. An open stream checks its token every
``FUSETUNE_EVENTS_AUTH_RECHECK_S`` (shortened here), so a revoked token's stream ends while
another token's stream of the same tenant goes on. Events are recorded in this process, as the
scheduling loop records them, so the doorbell wakes the streams.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from fusetune.server import events
from fusetune.server.db import get_sessionmaker
from tests.server.conftest import LiveApi, live_api

pytestmark = pytest.mark.slow

CAP = 2


@pytest.fixture
def served(database_url: str) -> Iterator[LiveApi]:
    """Streams that would stay open for ten minutes, checked against their token every 50 ms."""
    yield from live_api(
        database_url, events_max_streams_per_tenant=CAP, events_auth_recheck_s=0.05, events_max_stream_s=600.0
    )


def _open(stack: ExitStack, client: httpx.Client, path: str = "/api/v1/events") -> httpx.Response:
    """A stream, open once its headers have come (the server took its slot before answering)."""
    return stack.enter_context(client.stream("GET", path, timeout=httpx.Timeout(30, read=None)))


def _record(database_url: str, tenant: str, study_id: int) -> None:
    with get_sessionmaker(database_url)() as session:
        events.record(session, "trial.asked", tenant=tenant, study_id=study_id, number=0, params={}, state="WAITING")
        session.commit()


def _wait_until(condition: object, what: str) -> None:
    """Wait for ``condition()`` (the server's side of a closed stream), up to a deadline no
    healthy run comes near."""
    done = threading.Event()
    for _ in range(3000):
        if condition():  # type: ignore[operator]
            return
        done.wait(0.01)
    pytest.fail(f"timed out waiting for {what}")


def test_a_tenant_over_its_cap_gets_429_naming_the_limit(served: LiveApi) -> None:
    _, token = served.create_tenant("acme")
    _, other_token = served.create_tenant("other")
    acme, other, admin = served.client(token), served.client(other_token), served.client(served.admin_token)
    study = acme.post("/api/v1/studies", json={"workload": "digits-mlp", "n_trials": 2}).json()
    slots = served.app.state.event_streams
    with ExitStack() as first:
        assert _open(first, acme).status_code == 200
        with ExitStack() as second:
            # A study's stream counts against the same cap as the tenant's.
            assert _open(second, acme, f"/api/v1/studies/{study['id']}/events").status_code == 200
            assert slots.held("acme") == CAP
            for path in ("/api/v1/events", f"/api/v1/studies/{study['id']}/events"):
                refused = acme.get(path)
                assert refused.status_code == 429, refused.text
                assert int(refused.headers["Retry-After"]) > 0
                assert "FUSETUNE_EVENTS_MAX_STREAMS_PER_TENANT" in refused.json()["detail"]
                assert f"({CAP})" in refused.json()["detail"]
            # Other tenants and the admin each have slots of their own.
            with ExitStack() as others:
                assert _open(others, other).status_code == 200
                assert _open(others, admin).status_code == 200
                assert slots.held("other") == 1 and slots.held(None) == 1
        # A stream whose client left gives its slot back.
        _wait_until(lambda: slots.held("acme") == 1, "acme's closed stream to give its slot back")
        with ExitStack() as again:
            assert _open(again, acme).status_code == 200
    _wait_until(lambda: slots.held("acme") == 0 and slots.held("other") == 0 and slots.held(None) == 0, "every slot back")


def test_a_stream_that_ends_by_itself_gives_its_slot_back(served: LiveApi) -> None:
    _, token = served.create_tenant("acme")
    acme = served.client(token)
    for _ in range(CAP + 3):  # more stored-events reads than the cap: each gave its slot back
        response = acme.get("/api/v1/events", params={"follow": "false", "after": 0})
        assert response.status_code == 200, response.text
    _wait_until(lambda: served.app.state.event_streams.held("acme") == 0, "the slots back")


@pytest.mark.timeout(120)  # a stream the revocation does not end would stay open for ten minutes
@pytest.mark.parametrize("scope", ["tenant", "study"])
def test_a_revoked_tokens_open_stream_ends_and_others_go_on(served: LiveApi, database_url: str, scope: str) -> None:
    _, token = served.create_tenant("acme")
    spare = served.client(served.admin_token).post("/api/v1/tenants/acme/tokens", json={"label": "spare"}).json()
    study = served.client(token).post("/api/v1/studies", json={"workload": "digits-mlp", "n_trials": 2}).json()
    path = "/api/v1/events" if scope == "tenant" else f"/api/v1/studies/{study['id']}/events"
    doomed, kept = served.client(token), served.client(spare["token"])
    (token_id,) = [t["id"] for t in served.client(served.admin_token).get("/api/v1/tenants/acme/tokens").json()
                   if t["id"] != spare["id"]]
    with ExitStack() as stack:
        ending, going_on = _open(stack, doomed, path), _open(stack, kept, path)
        assert ending.status_code == going_on.status_code == 200
        assert served.client(served.admin_token).delete(f"/api/v1/tokens/{token_id}").status_code == 200
        # The revoked token's stream ends on its own (it would stay open for ten minutes).
        assert [line for line in ending.iter_lines() if line.startswith("data:")] == []
        # The other token's stream is still open: it gets the next event.
        _record(database_url, "acme", study["id"])
        lines = going_on.iter_lines()
        data = next(line for line in lines if line.startswith("data:"))
        assert json.loads(data.removeprefix("data:"))["kind"] == "trial.asked"
    assert doomed.get(path, params={"follow": "false"}).status_code == 401
    _wait_until(lambda: served.app.state.event_streams.held("acme") == 0, "the slots back")
