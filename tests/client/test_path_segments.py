"""The client sends text it puts in a URL path as one percent-encoded segment.

A user attr's key is any text but NUL: a ``/``, ``?``, ``#``, ``%``, space, dot segment or
non-ASCII character in it must reach the service as part of the key, not as a path, a query,
a fragment or an escape. Each key is set through ``Client.set_study_user_attr`` against the
live API (SQLite and PostgreSQL) and read back from the study.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fusetune.client import Client
from fusetune.client._client import segment
from tests.server.conftest import LiveApi, live_api

KEYS = [
    "a/b",
    "/leading/and/trailing/",
    "what?x=1&y=2",
    "#fragment",
    "100%",
    "%2F",
    "%zz",
    "with spaces  and\ttab",
    "\n",
    "line\nbreaks\r\n",
    "ünïcödé ключ 键 🔑",
    ".",
    "..",
    "../../tenants",
    "a+b",
    "semi;colon,comma=eq",
    "back\\slash",
    "quote\"'`",
    "<script>",
]


@pytest.fixture
def live(database_url: str) -> Iterator[LiveApi]:
    yield from live_api(database_url)


def test_user_attr_keys_reach_the_service_as_sent(live: LiveApi) -> None:
    client = Client(live.url, token=live.admin_token)
    study = client.create_study("digits-mlp", 2, epochs=1)
    for k, key in enumerate(KEYS):
        answer = client.set_study_user_attr(study["id"], key, k)
        assert answer["user_attrs"].get(key) == k, (key, answer["user_attrs"])
    assert client.study(study["id"])["user_attrs"] == {key: k for k, key in enumerate(KEYS)}
    for key in ["", "nul\x00inside"]:  # no path segment holds them: refused here, naming the key, not a 404
        with pytest.raises(ValueError, match="^key: "):
            client.set_study_user_attr(study["id"], key, 1)
    client.close()


def test_a_segment_has_no_character_that_ends_or_escapes_it() -> None:
    for key in KEYS:
        encoded = segment(key)
        assert not set(encoded) & set("/?#. \t\\\"'`<>;,=+&"), encoded
        assert encoded not in (".", "..")
