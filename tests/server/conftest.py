from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from fastapi import FastAPI

from fusetune.server.cli import BackgroundServer
from fusetune.server.settings import Settings
from tests.conftest import free_port


@dataclass
class LiveApi:
    """A live uvicorn serving the API alone, with an admin token; hands out HTTP clients."""

    url: str
    app: FastAPI
    admin_token: str
    database_url: str
    _clients: list[httpx.Client] = field(default_factory=list)

    def client(self, token: str | None = None) -> httpx.Client:
        """An HTTP client sending ``token`` as its bearer token (none: no Authorization header)."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        client = httpx.Client(base_url=self.url, timeout=30, headers=headers)
        self._clients.append(client)
        return client

    def create_tenant(self, name: str, **fields: object) -> tuple[dict, str]:
        """A new tenant through the admin route: its record and its first token."""
        response = self.client(self.admin_token).post("/api/v1/tenants", json={"name": name, **fields})
        assert response.status_code == 201, response.text
        body = response.json()
        return body["tenant"], body["token"]["token"]

    def token_for(self, tenant: str) -> str:
        """Another token of an existing tenant, through the admin."""
        response = self.client(self.admin_token).post(f"/api/v1/tenants/{tenant}/tokens", json={})
        assert response.status_code == 201, response.text
        return response.json()["token"]


def live_api(database_url: str, **settings: object) -> Iterator[LiveApi]:
    admin_token = secrets.token_urlsafe(32)
    config = Settings(database_url=database_url, port=free_port(), admin_token=admin_token, **settings)
    server = BackgroundServer(config, schedule=False).start()
    live = LiveApi(url=server.url, app=server.app, admin_token=admin_token, database_url=database_url)
    try:
        yield live
    finally:
        for client in live._clients:
            client.close()
        server.stop()


@pytest.fixture
def live(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    """The API alone (no Ray, no scheduling loop) on an empty database, with an admin token
    and an artifact directory of its own."""
    yield from live_api(database_url, artifact_dir=tmp_path_factory.mktemp("artifacts"))


@pytest.fixture
def admin(live: LiveApi) -> httpx.Client:
    """HTTP client authenticated as the admin."""
    return live.client(live.admin_token)


@pytest.fixture
def api(live: LiveApi) -> httpx.Client:
    """HTTP client authenticated as the tenant ``default`` (which every database has)."""
    return live.client(live.token_for("default"))
