from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from fusetune.server.cli import BackgroundServer
from fusetune.server.settings import Settings
from tests.conftest import free_port


@pytest.fixture
def api(database_url: str) -> Iterator[httpx.Client]:
    """HTTP client of a live uvicorn serving the API alone (no Ray, no scheduling loop)."""
    settings = Settings(database_url=database_url, port=free_port())
    server = BackgroundServer(settings, schedule=False).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            yield client
    finally:
        server.stop()
