"""``/metrics`` labels requests with known values only: random methods and paths add no series.

``/metrics`` is open by default, so were a request's method token or path a label, anyone
could grow the exposition (and Prometheus' memory) without bound. The test sends hundreds of
random method tokens, to known and made-up paths, over real HTTP (uvicorn's h11 parser passes
any token through to the app), and checks that the series set stays what known labels allow.
"""

from __future__ import annotations

import random
import re
import string

import httpx

from fusetune.server.api.errors import route_table
from fusetune.server.metrics import METHODS, OTHER_METHOD, UNMATCHED
from tests.server.conftest import LiveApi

_SERIES = re.compile(r'^fusetune_http_request_duration_seconds_count\{method="([^"]*)",route="([^"]*)",status="([^"]*)"\}', re.M)
_TOKEN_CHARS = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"  # RFC 9110's tchar


def _series(client: httpx.Client) -> set[tuple[str, str, str]]:
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return set(_SERIES.findall(response.text))


def _random_requests(client: httpx.Client, rng: random.Random, paths: list[str], count: int) -> None:
    for _ in range(count):
        method = "".join(rng.choice(_TOKEN_CHARS) for _ in range(rng.randint(1, 24)))
        path = rng.choice([*paths, f"/{rng.randrange(10**9)}", f"/api/v1/{rng.randrange(10**9)}/x"])
        response = client.request(method, path)
        assert response.status_code < 500, (method, path, response.status_code, response.text)


def test_random_methods_and_paths_add_no_series(live: LiveApi) -> None:
    rng = random.Random(20240529)
    client = live.client(live.admin_token)
    templates = {path for path, _, _ in route_table(live.app)}
    paths = ["/healthz", "/api/v1/studies", "/api/v1/studies/1", "/api/v1/tenants/default/tokens", "/metrics"]

    _series(client)  # its own GET /metrics series, before the first count
    _random_requests(client, rng, paths, 150)
    first = _series(client)
    _random_requests(client, rng, paths, 300)
    second = _series(client)

    assert first == second, sorted(second - first)
    methods = {m for m, _, _ in second}
    assert methods <= METHODS | {OTHER_METHOD}, methods
    assert OTHER_METHOD in methods  # the random tokens were counted, under one label
    routes = {r for _, r, _ in second}
    assert routes <= templates | {UNMATCHED}, routes - templates
    assert {"/api/v1/studies", "/api/v1/studies/{study_id}", UNMATCHED} <= routes


def test_a_known_method_on_a_known_path_keeps_its_labels(live: LiveApi) -> None:
    client = live.client(live.admin_token)
    assert client.get("/api/v1/studies/1").status_code == 404
    assert client.request("PURGE", "/api/v1/studies/1").status_code == 405
    found = _series(client)
    assert ("GET", "/api/v1/studies/{study_id}", "404") in found
    assert (OTHER_METHOD, "/api/v1/studies/{study_id}", "405") in found
