"""Shared fixtures: one local Ray per session, databases on SQLite and PostgreSQL, live servers."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

if TYPE_CHECKING:
    from fusetune.client import Client

POSTGRES_ENV = "FUSETUNE_TEST_POSTGRES_URL"


#: Every port :func:`free_port` has handed out in this process. The kernel may give a port
#: back again once its probe socket is closed, and two of one test's ports alike (say a Ray
#: head's GCS port and a node's agent port) fail the start ("port ... used by other
#: components"), so no port is handed out twice.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on now, and that this process has not handed out."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@contextmanager
def running_service(ray_address: str, database_url: str, **settings: object) -> Iterator[Client]:
    """A live uvicorn serving the whole service (API, scheduling loop, Ray workers).

    Yields a client authenticated as the tenant ``default``, with a token made by the
    service's admin.
    """
    import secrets

    from fusetune.client import Client
    from fusetune.server.cli import BackgroundServer
    from fusetune.server.settings import Settings

    admin_token = secrets.token_urlsafe(32)
    config = Settings(
        database_url=database_url, port=free_port(), ray_address=ray_address, admin_token=admin_token, **settings
    )
    server = BackgroundServer(config).start()
    try:
        with Client(server.url, token=admin_token) as admin:
            token = admin.create_token("default", label="tests")["token"]
        with Client(server.url, token=token) as client:
            yield client
    finally:
        server.stop()


def members_at_once(database_url: str, study_id: int) -> dict[int, int]:
    """The most members each of the study's arrays trained at once, from its events.

    An array's ``size`` counts every trial it trained: an array whose members end goes on
    with their successors (docs/architecture.md), so it can train more trials than it ever
    holds at one time.
    """
    from fusetune.server.db import Event, get_sessionmaker

    with get_sessionmaker(database_url)() as session:
        timeline = session.execute(
            sa.select(Event.array_id, Event.kind)
            .where(Event.study_id == study_id, Event.kind.in_(["trial.started", "trial.ended"]), Event.array_id.is_not(None))
            .order_by(Event.id)
        ).all()
    now: dict[int, int] = {}
    widest: dict[int, int] = {}
    for array_id, kind in timeline:
        now[array_id] = now.get(array_id, 0) + (1 if kind == "trial.started" else -1)
        widest[array_id] = max(widest.get(array_id, 0), now[array_id])
    return widest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """A local Ray instance for the whole test session; yields its address."""
    import ray

    # Four logical CPUs on this 2-core machine, so tests can run four one-thread CPU workers.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _postgres_database() -> Iterator[str]:
    """A fresh, empty PostgreSQL database, dropped afterwards."""
    base = os.environ.get(POSTGRES_ENV)
    if not base:
        pytest.skip(f"{POSTGRES_ENV} is not set: no PostgreSQL server to test against")
    name = f"fusetune_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        from fusetune.server.db import get_engine, get_loop_sessionmaker, get_optuna_storage, get_read_engine

        url = make_url(base).set(database=name).render_as_string(hide_password=False)
        for engine in (get_engine, get_read_engine):
            if engine.cache_info().currsize:
                engine(url).dispose()
        if get_loop_sessionmaker.cache_info().currsize:
            get_loop_sessionmaker(url).kw["bind"].dispose()
        get_optuna_storage.cache_clear()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _database(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'fusetune.db'}"
    else:
        yield from _postgres_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An empty database, once on SQLite and once on PostgreSQL."""
    yield from _database(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def module_database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One database for a whole test module, once on SQLite and once on PostgreSQL: for modules
    whose tests share one live service (starting one, with its workers, takes 8-15 s), and so
    must each work in studies of their own names."""
    yield from _database(request.param, tmp_path_factory)
