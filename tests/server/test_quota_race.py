"""A tenant's running-studies quota holds under concurrent creates, over real HTTP against
uvicorn, on SQLite and PostgreSQL: the creates that check the quota run one at a time (a row
lock on PostgreSQL, the database's write lock on SQLite, which ignores FOR UPDATE)."""

from __future__ import annotations

import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from fusetune.server.db import Tenant, get_engine, get_sessionmaker
from fusetune.server.errors import Conflict
from fusetune.server.quotas import check_running_quota, lock_tenant
from tests.server.conftest import LiveApi
from tests.server.test_studies_api import VALID, field_of

CALLERS = 12


def create_at_once(live: LiveApi, token: str, count: int) -> list[httpx.Response]:
    """``count`` study creates sent together: each thread has its own connection open and
    waits at a barrier, so the requests reach the server as close together as they can."""
    clients = [live.client(token) for _ in range(count)]
    for client in clients:  # connect first: the barrier then releases requests, not handshakes
        assert client.get("/api/v1/tenants").status_code == 200
    barrier = threading.Barrier(count)

    def create(client: httpx.Client) -> httpx.Response:
        barrier.wait()
        return client.post("/api/v1/studies", json=VALID)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(create, clients))


def running(url: str, tenant: str) -> int:
    with get_engine(url).connect() as conn:
        return conn.execute(
            sa.text("SELECT COUNT(*) FROM ft_studies WHERE tenant = :t AND state = 'RUNNING'"), {"t": tenant}
        ).scalar_one()


@pytest.mark.parametrize("quota", [1, 2])
def test_concurrent_creates_end_with_exactly_the_quota(live: LiveApi, database_url: str, quota: int) -> None:
    _, token = live.create_tenant("racer", max_running_studies=quota)
    responses = create_at_once(live, token, CALLERS)
    created = [r for r in responses if r.status_code == 201]
    refused = [r for r in responses if r.status_code != 201]
    assert len(created) == quota, [r.status_code for r in responses]
    for response in refused:
        assert response.status_code == 409, response.text
        assert field_of(response) == [["tenant", "max_running_studies"]]
        assert f"max_running_studies={quota}" in response.text
    assert running(database_url, "racer") == quota
    # A neighbour without a quota is not held up by the racer's: all of its creates pass.
    _, free = live.create_tenant("free")
    assert [r.status_code for r in create_at_once(live, free, 4)] == [201] * 4


def test_the_running_quota_check_holds_sqlites_write_lock_until_the_commit(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Another writer cannot begin while a quota is being checked, so it cannot insert a study
    between the count and the insert; with the lock gone, it can."""
    from fusetune.server.db import upgrade

    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'fusetune.db'}"
    upgrade(url)
    other = sqlite3.connect(make_url(url).database, timeout=0, isolation_level=None)
    try:
        with get_sessionmaker(url)() as session:
            tenant = lock_tenant(session, "default")
            assert isinstance(tenant, Tenant)
            check_running_quota(session, tenant)
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
            session.rollback()
        other.execute("BEGIN IMMEDIATE")  # the lock went with the rollback
        other.execute("ROLLBACK")
        # A tenant read before the lock is read again under it: a quota set meanwhile holds.
        with get_sessionmaker(url)() as session:
            tenant = session.get(Tenant, "default")
            assert tenant is not None and tenant.max_running_studies is None
            other.execute("UPDATE ft_tenants SET max_running_studies = 0 WHERE name = 'default'")  # autocommits
            with pytest.raises(Conflict, match="max_running_studies=0"):
                check_running_quota(session, tenant)
    finally:
        other.close()
