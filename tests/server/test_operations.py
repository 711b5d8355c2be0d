"""Operations over real HTTP: body limits, JSON-only writes, ids past the database's range,
405's Allow, /healthz and the other routes when the database is down, /metrics against the
database, timezone-aware datetimes, and the event streams' scoping and resumption."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pydantic
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from fusetune.client import Client
from fusetune.server import events
from fusetune.server.db import (
    Array,
    ArrayMember,
    ArrayState,
    Event,
    Study,
    StudyState,
    Trial,
    TrialState,
    get_engine,
    get_optuna_storage,
    get_read_engine,
    get_sessionmaker,
    utcnow,
)
from fusetune.server.settings import Settings
from tests.conftest import POSTGRES_ENV
from tests.server.conftest import LiveApi, live_api
from tests.sse import events_of, parse

STUDY = {"workload": "digits-mlp", "n_trials": 4, "epochs": 1}
METRICS_TOKEN = "metrics-" + "x" * 24


@pytest.fixture
def small(database_url: str) -> Iterator[LiveApi]:
    """The API with a 1 KiB body limit and a metrics token."""
    yield from live_api(database_url, max_body_bytes=1024, metrics_token=METRICS_TOKEN)


def study_rows(url: str) -> int:
    with get_engine(url).connect() as conn:
        return conn.execute(sa.text("SELECT COUNT(*) FROM ft_studies")).scalar_one()


def test_a_body_over_the_limit_is_413_by_content_length_and_in_chunks(small: LiveApi) -> None:
    api = small.client(small.token_for("default"))
    big = {**STUDY, "name": "big", "search_space": {f"p{i}": '{"name": "FloatDistribution", "attributes": {"low": 0, "high": 1}}' for i in range(40)}}
    body = json.dumps(big).encode()
    assert len(body) > 1024
    response = api.post("/api/v1/studies", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text
    assert "1024 bytes" in response.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding: chunked
        for i in range(0, len(body), 100):
            yield body[i : i + 100]

    response = api.post("/api/v1/studies", content=chunks(), headers={"content-type": "application/json"})
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert response.status_code == 413, response.text
    assert study_rows(small.database_url) == 0
    # A body under the limit, chunked too, goes through unchanged.
    small_body = json.dumps({**STUDY, "name": "small"}).encode()
    response = api.post("/api/v1/studies", content=iter([small_body[:10], small_body[10:]]), headers={"content-type": "application/json"})
    assert response.status_code == 201, response.text
    assert response.json()["name"] == "small"


def _answer(sock: socket.socket) -> bytes:
    """What the server answers on ``sock``, once it has answered (never a guessed duration)."""
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        answer += chunk
    return answer


@pytest.fixture
def impatient(database_url: str) -> Iterator[LiveApi]:
    """Bodies must arrive within 0.5 s, and a request's head within 0.5 s of the connection
    opening or of its last response (the settings shortened: the test waits for the 408 or the
    close, not for a default's 30 or 15 s), and two connections at most."""
    yield from live_api(database_url, body_timeout_s=0.5, header_timeout_s=0.5, max_connections=2)


def test_a_body_that_stops_arriving_is_408_and_connections_past_the_limit_are_503(impatient: LiveApi) -> None:
    """Before authentication a body is buffered: a connection that stops sending it, or many of
    them, could hold the server's memory; they hold it for FUSETUNE_BODY_TIMEOUT_S at most,
    FUSETUNE_MAX_CONNECTIONS of them."""
    where = urlsplit(impatient.url)
    address = (where.hostname, where.port)
    with socket.create_connection(address, timeout=60) as sock:  # no token: unauthenticated
        sock.sendall(b"POST /api/v1/studies HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n")  # and nothing more
        answer = _answer(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"FUSETUNE_BODY_TIMEOUT_S" in answer
    held: list[socket.socket] = []
    try:
        for _ in range(10):  # connections held open, each once it has been answered
            held.append(socket.create_connection(address, timeout=60))
            held[-1].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            if _answer(held[-1]).startswith(b"HTTP/1.1 503"):
                break
        else:
            pytest.fail("10 connections open and none refused")
        assert len(held) <= 3
    finally:
        for sock in held:
            sock.close()
    # Room again once the server has seen them close (polled: the close is the event).
    deadline = time.monotonic() + 60
    while httpx.get(f"{impatient.url}/healthz", timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "the closed connections still count"
        time.sleep(0.05)


def test_connections_that_never_finish_a_request_head_are_closed(impatient: LiveApi) -> None:
    """Two connections fill FUSETUNE_MAX_CONNECTIONS: one sends nothing, one a header line and
    then nothing (a slowloris); a third is answered once, then trickles its next head. Each is
    closed by the server past FUSETUNE_HEADER_TIMEOUT_S (the close is the event waited for), and
    the service answers again: before, they held it at 503 for as long as they stayed open."""
    where = urlsplit(impatient.url)
    address = (where.hostname, where.port)
    with socket.create_connection(address, timeout=60) as silent, socket.create_connection(address, timeout=60) as slow:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert silent.recv(4096) == b"" and slow.recv(4096) == b""  # closed, with nothing said
    deadline = time.monotonic() + 60
    while (status := httpx.get(f"{impatient.url}/healthz", timeout=60).status_code) != 200:
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    with socket.create_connection(address, timeout=60) as reused:
        reused.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(reused).startswith(b"HTTP/1.1 200")
        reused.sendall(b"GET /healthz HTTP/1.1\r\n")  # the next head, never finished
        assert reused.recv(4096) == b""


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/x-www-form-urlencoded", "workload=digits-mlp&n_trials=4"),
        ("application/x-www-form-urlencoded", json.dumps(STUDY)),  # what `curl -d @sweep.json` sends
        ("multipart/form-data; boundary=x", '--x\r\nContent-Disposition: form-data; name="workload"\r\n\r\ndigits-mlp\r\n--x--\r\n'),
        ("text/plain", json.dumps(STUDY)),  # a cross-site form's enctype=text/plain
        (None, json.dumps(STUDY)),
    ],
)
def test_a_write_whose_body_is_not_json_is_415(api: httpx.Client, database_url: str, content_type: str | None, body: str) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = api.post("/api/v1/studies", content=body.encode(), headers=headers)
    assert response.request.headers.get("content-type") == content_type
    assert response.status_code == 415, response.text
    assert "application/json" in response.json()["detail"]
    assert study_rows(database_url) == 0
    # JSON with a charset, or a +json type, is JSON.
    ok = api.post("/api/v1/studies", content=json.dumps(STUDY).encode(), headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 201, ok.text


@pytest.mark.parametrize("escape", ["%FF", "%C0%80", "%ED%A0%80", "a%E9b"])
def test_a_path_that_is_not_utf8_is_422_not_a_mangled_key(api: httpx.Client, escape: str) -> None:
    """Starlette would decode each bad byte as U+FFFD: distinct keys became one, stored."""
    created = api.post("/api/v1/studies", json=STUDY).json()
    response = api.put(f"/api/v1/studies/{created['id']}/user_attrs/{escape}", json={"value": 1})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["path"], response.text
    assert api.get(f"/api/v1/studies/{created['id']}").json()["user_attrs"] == {}
    ok = api.put(f"/api/v1/studies/{created['id']}/user_attrs/caf%C3%A9", json={"value": 1})
    assert ok.status_code == 200 and ok.json()["user_attrs"] == {"café": 1}, ok.text


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ('{"workload": "digits-mlp", "n_trials": NaN, "epochs": 1}', ["body", "n_trials"]),
        ('{"workload": "digits-mlp", "n_trials": 4, "epochs": Infinity}', ["body", "epochs"]),
        ('{"workload": "digits-mlp", "n_trials": 4, "epochs": 1e999}', ["body", "epochs"]),
        # Fields that take any float: stored as null if let through.
        ('{"workload": "digits-mlp", "n_trials": 4, "max_norm": 1e999}', ["body", "max_norm"]),
        ('{"workload": "digits-mlp", "n_trials": 4, "optimizer": {"name": "SGD", "kwargs": {"lr": -Infinity}}}',
         ["body", "optimizer", "kwargs", "lr"]),
        ('{"workload": "digits-mlp", "n_trials": 4, "sampler": {"name": "TPESampler", "kwargs": {"seed": NaN}}}',
         ["body", "sampler", "kwargs", "seed"]),
        ('[1, NaN]', ["body", 1]),
        ("NaN", ["body"]),
        # A lone surrogate escape: no UTF-8 text, so no answer could write it back.
        ('{"workload": "digits-mlp", "n_trials": 4, "name": "a\\ud800"}', ["body", "name"]),
        ('{"workload": "digits-mlp", "n_trials": 4, "search_space": {"a\\udc00b": {"type": "float", "low": 0.1, "high": 1}}}',
         ["body", "search_space", "a\\udc00b"]),
        ('{"workload": "digits-mlp", "n_trials": 4, "search_space": {"hidden": {"type": "categorical", "choices": [32, "a\\ud800"]}}}',
         ["body", "search_space", "hidden", "choices", 1]),
        ('{"workload": "digits-mlp", "n_trials": 4, "sampler": {"name": "TPESampler", "kwargs": {"x\\ud800": 1}}}',
         ["body", "sampler", "kwargs", "x\\ud800"]),
        ('{"a": [[[{"b": [1, 2, {"c": "\\udfff"}]}]]]}', ["body", "a", 0, 0, 0, "b", 2, "c"]),
        # An integer past a double (JavaScript reads it as Infinity), and one past Python's
        # 4,300 digits for int() (a 400 naming nothing, before authentication).
        ('{"workload": "digits-mlp", "n_trials": 4, "user_attrs": {"x": 1' + "0" * 309 + '}}', ["body", "user_attrs", "x"]),
        ('{"workload": "digits-mlp", "n_trials": 4, "user_attrs": {"x": [-' + "9" * 5000 + ']}}', ["body", "user_attrs", "x", 0]),
    ],
)
def test_a_body_with_what_json_lacks_is_422_naming_the_field(api: httpx.Client, database_url: str, body: str, loc: list) -> None:
    """NaN, Infinity and numbers past a double are not JSON, nor is a lone surrogate text,
    though Python's parser reads them; nothing is written."""
    response = api.post("/api/v1/studies", content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert [e["loc"] for e in response.json()["detail"]] == [loc]
    assert study_rows(database_url) == 0
    created = api.post("/api/v1/studies", json=STUDY).json()
    response = api.patch(f"/api/v1/studies/{created['id']}", content=b'{"n_trials": NaN}', headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "n_trials"], response.text
    # The largest integer a double holds is a number like any other.
    top = api.put(f"/api/v1/studies/{created['id']}/user_attrs/top", content=b'{"value": %d}' % int(sys.float_info.max),
                  headers={"content-type": "application/json"})
    assert top.status_code == 200, top.text
    # A finite number in exponent form is a number like any other.
    body = b'{"workload": "digits-mlp", "n_trials": 4, "max_norm": 1e3}'
    response = api.post("/api/v1/studies", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 201 and response.json()["max_norm"] == 1000.0, response.text


def test_a_key_given_twice_counts_once_the_last_as_json_parse_reads_it(api: httpx.Client) -> None:
    raw = b'{"workload": "digits-mlp", "n_trials": 4, "n_trials": 5}'
    response = api.post("/api/v1/studies", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 201 and response.json()["n_trials"] == 5, response.text


def test_a_body_that_is_not_utf8_or_nests_too_deep_is_422_and_a_bom_is_ignored(api: httpx.Client, database_url: str) -> None:
    for raw in (b'{"workload": "digits-mlp", "n_trials": 4, "name": "caf\xe9"}', json.dumps(STUDY).encode("utf-16")):
        response = api.post("/api/v1/studies", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body"], response.text
        assert "not UTF-8" in response.text
    # Nested past what the parser reads (a thousand levels): refused as the body, not a 400.
    response = api.post("/api/v1/studies", content=b"[" * 5000 + b"]" * 5000, headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body"], response.text
    assert study_rows(database_url) == 0
    response = api.post("/api/v1/studies", content=b"\xef\xbb\xbf" + json.dumps(STUDY).encode(), headers={"content-type": "application/json"})
    assert response.status_code == 201, response.text


@pytest.mark.parametrize("bad", [2**31, 2**63, 99999999999999999999, 0, -1])
def test_ids_past_the_databases_integers_are_422_naming_them(api: httpx.Client, bad: int) -> None:
    for template, name in [
        ("/api/v1/studies/{}", "study_id"),
        ("/api/v1/studies/{}/trials", "study_id"),
        ("/api/v1/studies/{}/events", "study_id"),
        ("/api/v1/trials/{}", "trial_id"),
    ]:
        response = api.get(template.format(bad))
        assert response.status_code == 422, (template, response.text)
        assert [e["loc"] for e in response.json()["detail"]] == [["path", name]]
    response = api.delete(f"/api/v1/tokens/{bad}")
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["path", "token_id"]
    response = api.get("/api/v1/arrays", params={"study_id": bad})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["query", "study_id"]
    # The largest id the database holds is merely missing.
    assert api.get(f"/api/v1/studies/{2**31 - 1}").status_code == 404


def test_event_ids_past_int64_are_422_naming_them(api: httpx.Client) -> None:
    response = api.get("/api/v1/events", params={"follow": "false"}, headers={"Last-Event-ID": str(2**63)})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["header", "Last-Event-ID"]
    response = api.get("/api/v1/events", params={"follow": "false", "after": -1})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["query", "after"]
    response = api.get("/api/v1/events", params={"follow": "false"}, headers={"Last-Event-ID": str(2**63 - 1)})
    assert response.status_code == 200 and events_of(response.text) == []


def test_405_allows_every_method_of_the_path(api: httpx.Client) -> None:
    for method, path, allowed in [
        ("DELETE", "/api/v1/studies", {"GET", "POST"}),
        ("PUT", "/api/v1/tenants", {"GET", "POST"}),
        ("POST", "/api/v1/trials/1", {"GET"}),
        ("PUT", "/healthz", {"GET"}),
    ]:
        response = api.request(method, path)
        assert response.status_code == 405, (method, path)
        assert set(response.headers["allow"].split(", ")) >= allowed, (path, response.headers["allow"])
        assert method not in response.headers["allow"]


@contextmanager
def unreachable(url: str) -> Iterator[None]:
    """Make the database refuse new connections (and drop the app's), then restore it."""
    engines = (get_engine(url), get_read_engine(url))  # the writes' and the reads'
    if engines[0].dialect.name == "sqlite":
        folder = Path(make_url(url).database).parent
        moved = folder.with_name(folder.name + "-gone")
        for engine in engines:
            engine.dispose()
        os.rename(folder, moved)
        try:
            yield
        finally:
            os.rename(moved, folder)
            for engine in engines:
                engine.dispose()
        return
    name = make_url(url).database
    admin = sa.create_engine(os.environ[POSTGRES_ENV], isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false'))
        conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"), {"n": name})
    try:
        yield
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true'))
        admin.dispose()
        for engine in engines:
            engine.dispose()


def test_healthz_and_the_api_answer_503_while_the_database_is_unreachable(live: LiveApi, api: httpx.Client) -> None:
    assert live.client().get("/healthz").status_code == 200
    with unreachable(live.database_url):
        response = live.client().get("/healthz")
        assert response.status_code == 503, response.text
        assert response.json()["detail"].startswith("the database is unreachable: ")
        response = api.get("/api/v1/studies")  # authenticating reads the database
        assert response.status_code == 503, response.text
        assert live.client().get("/metrics").status_code == 503
    assert live.client().get("/healthz").status_code == 200
    assert api.get("/api/v1/studies").status_code == 200


def test_more_concurrent_reads_than_pooled_connections_all_answer(live: LiveApi, api: httpx.Client) -> None:
    """Ten times the requests the connection pool has connections for, all at once, each with a
    token to look up: every one answers 200. (When the token lookup and the route shared a
    session, a request held its connection between their two threads, and the threadpool could
    fill with requests waiting for connections that only requests waiting for a thread held:
    the pool's 30 s timeout then answered 503.)"""
    import asyncio

    pooled = get_read_engine(live.database_url).pool
    n = 10 * (pooled.size() + pooled._max_overflow)  # type: ignore[attr-defined]
    token = api.headers["Authorization"]

    async def everyone() -> list[int]:
        async with httpx.AsyncClient(base_url=live.url, headers={"Authorization": token}, timeout=120,
                                     limits=httpx.Limits(max_connections=n)) as client:
            answers = await asyncio.gather(*(client.get("/api/v1/studies") for _ in range(n)))
        return [a.status_code if a.status_code == 200 else (a.status_code, a.text[:300]) for a in answers]

    assert api.get("/api/v1/studies").status_code == 200  # the engine and its pool exist
    codes = asyncio.run(everyone())
    assert codes == [200] * n, [c for c in codes if c != 200][:3]


def _scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_metrics_match_the_database_and_need_the_metrics_token(small: LiveApi) -> None:
    api = small.client(small.token_for("default"))
    assert small.client().get("/metrics").status_code == 401
    assert small.client(small.admin_token).get("/metrics").status_code == 401  # not a metrics token
    study_id = api.post("/api/v1/studies", json={**STUDY, "name": "m"}).json()["id"]
    url = small.database_url
    storage = get_optuna_storage(url)
    states = [TrialState.WAITING, TrialState.RUNNING, TrialState.RUNNING, TrialState.COMPLETE, TrialState.FAIL]
    with get_sessionmaker(url)() as session:  # trials and arrays as the coordinator writes them
        optuna_study_id = session.get(Study, study_id).optuna_study_id
        trials = []
        for number, state in enumerate(states):
            trial = Trial(study_id=study_id, optuna_trial_id=storage.create_new_trial(optuna_study_id), number=number,
                          params={}, signature="s" * 64, state=state)
            session.add(trial)
            trials.append(trial)
        session.flush()
        session.add(Array(study_id=study_id, signature="s" * 64, members=[ArrayMember(slot=0, trial_id=trials[1].id)]))
        session.add(Array(study_id=study_id, signature="s" * 64, state=ArrayState.COMPLETE,
                          members=[ArrayMember(slot=0, trial_id=trials[3].id)]))
        session.commit()
    metrics = small.client(METRICS_TOKEN)
    api.get("/api/v1/studies")
    samples = _scrape(metrics)
    with get_sessionmaker(url)() as session:
        counts = dict(session.execute(select(Trial.state, func.count()).group_by(Trial.state)).all())
        running = session.scalar(select(func.count()).select_from(Array).where(Array.state == ArrayState.RUNNING))
    for state in TrialState:
        assert samples[("fusetune_trials", (("state", state.value),))] == counts.get(state, 0), state
    assert counts[TrialState.RUNNING] == 2 and running == 1
    assert samples[("fusetune_arrays_running", ())] == running
    assert samples[("fusetune_studies", (("state", "RUNNING"),))] == 1
    # The API alone has no workers and records no reports.
    assert samples[("fusetune_workers", (("state", "busy"),))] == 0
    assert samples[("fusetune_worker_utilization_ratio", ())] == 0
    assert samples[("fusetune_epoch_reports_total", ())] == 0
    latency = {labels: v for (name, labels), v in samples.items() if name == "fusetune_http_request_duration_seconds_count"}
    assert latency[(("method", "GET"), ("route", "/api/v1/studies"), ("status", "200"))] >= 1
    assert latency[(("method", "GET"), ("route", "/metrics"), ("status", "401"))] == 2


def test_datetimes_are_rfc3339_with_an_offset(api: httpx.Client) -> None:
    from datetime import datetime

    study = api.post("/api/v1/studies", json={**STUDY, "name": "when"}).json()
    for stamp in (study["created_at"], api.get(f"/api/v1/studies/{study['id']}").json()["created_at"]):
        parsed = datetime.fromisoformat(stamp)
        assert parsed.utcoffset() is not None and parsed.utcoffset().total_seconds() == 0, stamp
    token = api.get("/api/v1/tenants/default/tokens").json()[0]
    assert datetime.fromisoformat(token["created_at"]).tzinfo is not None


# -- events ------------------------------------------------------------------------------------


def _two_tenants(live: LiveApi) -> tuple[dict[str, httpx.Client], dict[str, int]]:
    clients, studies = {}, {}
    for name in ("acme", "umbrella"):
        _, token = live.create_tenant(name)
        clients[name] = live.client(token)
        studies[name] = clients[name].post("/api/v1/studies", json={**STUDY, "name": f"{name}-study"}).json()["id"]
    return clients, studies


def _record(url: str, tenant: str, study_id: int, kinds: list[str]) -> None:
    """Events as the coordinator writes them: one transaction, through events.record."""
    with get_sessionmaker(url)() as session:
        for step, kind in enumerate(kinds):
            events.record(session, kind, tenant=tenant, study_id=study_id, trial_id=1, step=step)
        session.commit()


def test_a_tenant_sees_only_its_own_events_and_resumes_after_the_last_seen(live: LiveApi) -> None:
    clients, studies = _two_tenants(live)
    _record(live.database_url, "acme", studies["acme"], ["trial.asked", "trial.started"])
    _record(live.database_url, "umbrella", studies["umbrella"], ["trial.asked"])
    _record(live.database_url, "acme", studies["acme"], ["trial.reported", "trial.ended"])
    stored = {"follow": "false", "after": 0}

    acme = events_of(clients["acme"].get("/api/v1/events", params=stored).text)
    assert [e["event"] for e in acme] == ["trial.asked", "trial.started", "trial.reported", "trial.ended"]
    assert {e["data"]["tenant"] for e in acme} == {"acme"}
    ids = [int(e["id"]) for e in acme]
    assert ids == sorted(ids) and [e["data"]["id"] for e in acme] == ids
    assert [e["data"]["data"]["step"] for e in acme] == [0, 1, 0, 1]

    umbrella = events_of(clients["umbrella"].get("/api/v1/events", params=stored).text)
    assert [(e["event"], e["data"]["study_id"]) for e in umbrella] == [("trial.asked", studies["umbrella"])]
    # Another tenant's study does not exist for it; the admin sees both tenants.
    foreign = clients["umbrella"].get(f"/api/v1/studies/{studies['acme']}/events", params=stored)
    assert foreign.status_code == 404
    assert foreign.json() == {"detail": f"study {studies['acme']} does not exist"}
    everyone = events_of(live.client(live.admin_token).get("/api/v1/events", params=stored).text)
    assert len(everyone) == 5

    # Last-Event-ID resumes exactly after it (and wins over ?after=).
    for seen in range(len(acme)):
        again = clients["acme"].get("/api/v1/events", params=stored, headers={"Last-Event-ID": acme[seen]["id"]})
        assert events_of(again.text) == acme[seen + 1 :]
    per_study = events_of(clients["acme"].get(f"/api/v1/studies/{studies['acme']}/events", params=stored).text)
    assert per_study == acme
    # Without an id a stream starts with what happens next.
    assert events_of(clients["acme"].get("/api/v1/events", params={"follow": "false"}).text) == []


def test_a_studys_stream_holds_none_of_an_earlier_study_that_had_its_id(live: LiveApi) -> None:
    """SQLite gives the newest deleted study's id to the next study; the events of the deleted
    one, which ended with its study.deleted, are not the new study's history. (On PostgreSQL
    no id comes back, and the same events would be the study's own: the test writes them
    only where ids are reused.)"""
    clients, studies = _two_tenants(live)
    acme, study = clients["acme"], studies["acme"]
    if make_url(live.database_url).get_backend_name() == "sqlite":
        _record(live.database_url, "acme", study, ["trial.asked", "trial.ended", "study.completed", "study.deleted"])
    _record(live.database_url, "acme", study, ["trial.asked", "trial.started"])  # the study's own
    stored = {"follow": "false", "after": 0}
    own = events_of(acme.get(f"/api/v1/studies/{study}/events", params=stored).text)
    assert [e["event"] for e in own] == ["trial.asked", "trial.started"]
    # The tenant's stream is the record of both, in order.
    every = [e["event"] for e in events_of(acme.get("/api/v1/events", params=stored).text)]
    assert every[-2:] == ["trial.asked", "trial.started"]
    # And a study whose id was never another's starts at its first event, as ever.
    _record(live.database_url, "umbrella", studies["umbrella"], ["trial.asked"])
    theirs = events_of(clients["umbrella"].get(f"/api/v1/studies/{studies['umbrella']}/events", params=stored).text)
    assert [e["event"] for e in theirs] == ["trial.asked"]


def test_a_followed_stream_delivers_new_events_as_they_are_committed(live: LiveApi) -> None:
    clients, studies = _two_tenants(live)
    _record(live.database_url, "acme", studies["acme"], ["trial.asked"])
    got: list[dict] = []

    with clients["acme"].stream("GET", f"/api/v1/studies/{studies['acme']}/events", params={"after": 0}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for event in parse(response.iter_lines()):
            got.append(event)
            if len(got) == 1:
                # Written while the stream is open: another tenant's, then this study's.
                _record(live.database_url, "umbrella", studies["umbrella"], ["trial.asked"])
                _record(live.database_url, "acme", studies["acme"], ["trial.started", "trial.reported"])
            if len(got) == 3:
                break
    assert [e["event"] for e in got] == ["trial.asked", "trial.started", "trial.reported"]
    assert {e["data"]["tenant"] for e in got} == {"acme"}


def test_a_stream_of_some_kinds_sends_only_those_and_resumes_by_id(slow_polling: LiveApi) -> None:
    """``?kind=`` narrows a stream: a client waiting for ``study.completed`` is sent nothing
    else, and is woken when one commits (an hour between polls here); ids resume as ever."""
    clients, studies = _two_tenants(slow_polling)
    acme, url = clients["acme"], f"/api/v1/studies/{studies['acme']}/events"
    _record(slow_polling.database_url, "acme", studies["acme"], ["trial.asked", "trial.started", "trial.reported", "trial.ended"])
    every = events_of(acme.get(url, params={"follow": "false", "after": 0}).text)
    some = {"follow": "false", "after": 0, "kind": ["trial.ended", "trial.started"]}
    got = events_of(acme.get(url, params=some).text)
    assert got == [every[1], every[3]]
    assert events_of(acme.get(url, params=some, headers={"Last-Event-ID": got[0]["id"]}).text) == got[1:]
    assert events_of(acme.get("/api/v1/events", params=some).text) == got

    seen: list[dict] = []
    with acme.stream("GET", url, params={"after": every[-1]["id"], "kind": "study.completed"}) as response:
        _record(slow_polling.database_url, "acme", studies["acme"], ["trial.reported"])
        _record(slow_polling.database_url, "acme", studies["acme"], ["trial.ended", "study.completed"])
        for event in parse(response.iter_lines()):
            seen.append(event)
            break
    assert [e["event"] for e in seen] == ["study.completed"]

    response = acme.get(url, params={"follow": "false", "kind": "trial.finished"})
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["query", "kind", 0]


@pytest.fixture
def slow_polling(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    """The API with an hour between a stream's reads of the table."""
    yield from live_api(database_url, artifact_dir=tmp_path_factory.mktemp("artifacts"), events_poll_interval_s=3600.0)


def test_events_committed_in_this_process_wake_its_streams_at_once(slow_polling: LiveApi) -> None:
    """A stream waits for the commit itself, not for its next poll: with an hour between
    polls, each event still arrives (the suite's timeout would end a stream that polls)."""
    clients, studies = _two_tenants(slow_polling)
    _record(slow_polling.database_url, "acme", studies["acme"], ["trial.asked"])
    got: list[dict] = []
    with clients["acme"].stream("GET", f"/api/v1/studies/{studies['acme']}/events", params={"after": 0}) as response:
        for event in parse(response.iter_lines()):
            got.append(event)
            if len(got) == 1:
                # Another tenant's event, a rolled-back one, then two of this study's, one at a time.
                _record(slow_polling.database_url, "umbrella", studies["umbrella"], ["trial.asked"])
                with get_sessionmaker(slow_polling.database_url)() as session:
                    events.record(session, "trial.ended", tenant="acme", study_id=studies["acme"], trial_id=1)
                    session.rollback()
                _record(slow_polling.database_url, "acme", studies["acme"], ["trial.started"])
            elif len(got) == 2:
                _record(slow_polling.database_url, "acme", studies["acme"], ["trial.reported"])
            elif len(got) == 3:
                break
    assert [e["event"] for e in got] == ["trial.asked", "trial.started", "trial.reported"]


def test_client_wait_returns_as_the_study_completes_not_at_its_next_poll(slow_polling: LiveApi) -> None:
    """``Client.wait`` follows the study's ``study.completed`` event: with an hour between its
    own reads and the server's, the end committed after its first read still returns it."""
    clients, studies = _two_tenants(slow_polling)
    token = clients["acme"].headers["Authorization"].removeprefix("Bearer ")
    reads: list[str] = []

    def complete_after_the_first_read(study: dict) -> None:
        reads.append(study["state"])
        if len(reads) == 1:  # the scheduling loop's part: the study ends, its event commits with it
            with get_sessionmaker(slow_polling.database_url)() as session:
                row = session.get(Study, studies["acme"])
                row.state, row.completed_at = StudyState.COMPLETE, utcnow()
                events.record(session, "study.completed", tenant="acme", study_id=row.id, state="COMPLETE")
                session.commit()

    with Client(slow_polling.url, token=token) as client:
        done = client.wait(studies["acme"], timeout=600, poll=3600, on_poll=complete_after_the_first_read)
    assert done["state"] == "COMPLETE" and done["completed_at"] is not None
    assert reads == ["RUNNING", "COMPLETE"]


def test_events_past_the_retention_are_pruned(database_url: str) -> None:
    from datetime import timedelta

    from fusetune.server.db import upgrade, utcnow

    upgrade(database_url)
    with get_sessionmaker(database_url)() as session:
        session.add(Event(tenant="default", study_id=1, kind="trial.asked", data={}, created_at=utcnow() - timedelta(days=8)))
        events.record(session, "trial.started", tenant="default", study_id=1)
        session.commit()
        assert events.prune(session, retention_s=7 * 24 * 3600) == 1
        session.commit()
        assert [e.kind for e in session.scalars(select(Event))] == ["trial.started"]


def test_a_connection_pool_busy_for_its_whole_timeout_is_a_503_with_retry_after(tmp_path: Path) -> None:
    """Overload (every pooled connection checked out past the pool's timeout) is not a bug: 503."""
    import asyncio

    from starlette.requests import Request

    from fusetune.server.app import create_app

    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'pool.db'}"), schedule=False)
    small = sa.create_engine(f"sqlite:///{tmp_path / 'pool.db'}", pool_size=1, max_overflow=0, pool_timeout=0.05)
    with small.connect(), pytest.raises(sa.exc.TimeoutError) as exhausted:
        small.connect()
    small.dispose()
    handler = app.exception_handlers[sa.exc.TimeoutError]
    response = asyncio.run(handler(Request({"type": "http", "method": "GET", "path": "/api/v1/studies", "headers": []}), exhausted.value))
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert json.loads(response.body)["detail"].startswith("the server is overloaded: QueuePool limit")


def test_an_unknown_log_level_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """FUSETUNE_LOG_LEVEL takes Python's level names; anything else fails, naming the setting."""
    monkeypatch.setenv("FUSETUNE_LOG_LEVEL", "LOUD")
    with pytest.raises(pydantic.ValidationError, match="log_level"):
        Settings()
    monkeypatch.setenv("FUSETUNE_LOG_LEVEL", "INFO")
    assert Settings().log_level == "INFO"
