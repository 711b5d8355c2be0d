"""An integer parameter's text is decimal digits, as the OpenAPI document's ``integer`` says:
``+1``, `` 1``, ``1_0`` and ``1.0`` are 422s naming the parameter, on paths, queries and headers
(pydantic alone would read each as 1); a boolean's is true or false (or 1 or 0), not ``yes``,
``on`` or ``t``."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import LiveApi

NOT_DECIMAL = ["+1", " 1", "1 ", "1_0", "1.0", "+0.0", "１"]


@pytest.fixture
def study_id(admin: httpx.Client) -> int:
    response = admin.post("/api/v1/studies", json={"workload": "digits-mlp", "n_trials": 2})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_integers_must_be_decimal_digits(live: LiveApi, admin: httpx.Client, study_id: int) -> None:
    for text in NOT_DECIMAL:
        cases = [
            (f"/api/v1/studies/{text}", {}, {}, ["path", "study_id"]),
            ("/api/v1/studies", {"limit": text}, {}, ["query", "limit"]),
            ("/api/v1/arrays", {"study_id": text}, {}, ["query", "study_id"]),
            (f"/api/v1/studies/{study_id}/trials", {"updated_since": text}, {}, ["query", "updated_since"]),
            ("/api/v1/events", {"follow": "false", "after": text}, {}, ["query", "after"]),
        ]
        if text.strip() == text and text.isascii():  # HTTP trims a header value's spaces; httpx sends ASCII only
            cases.append(("/api/v1/events", {"follow": "false"}, {"Last-Event-ID": text}, ["header", "Last-Event-ID"]))
        for path, params, headers, loc in cases:
            response = admin.get(path, params=params, headers=headers)
            assert response.status_code == 422, (text, path, response.text)
            assert loc in [e["loc"][:2] for e in response.json()["detail"]], (text, path, response.text)
    # The same numbers in decimal digits are read.
    assert admin.get(f"/api/v1/studies/{study_id}").status_code == 200
    assert admin.get("/api/v1/studies", params={"limit": "1"}).status_code == 200
    assert admin.get("/api/v1/events", params={"follow": "false"}, headers={"Last-Event-ID": "0"}).status_code == 200


def test_booleans_must_be_true_or_false(admin: httpx.Client) -> None:
    for text in ("yes", "no", "on", "off", "t", "f", "y", "n", "True", "FALSE", ""):
        response = admin.get("/api/v1/events", params={"follow": text, "after": 0})
        assert response.status_code == 422, (text, response.text)
        assert [e["loc"] for e in response.json()["detail"]] == [["query", "follow"]], response.text
    for text in ("false", "0"):
        assert admin.get("/api/v1/events", params={"follow": text, "after": 0}).status_code == 200
