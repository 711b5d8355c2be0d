"""Shared fixtures: one local Ray per session, databases on SQLite and PostgreSQL, live servers."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

if TYPE_CHECKING:
    from fusetune.client import Client

POSTGRES_ENV = "FUSETUNE_TEST_POSTGRES_URL"

# The suite runs more torch threads than the machine has cores (two pytest processes, each with
# a Ray of four logical CPUs on two cores, and their services' workers). OpenMP's threads
# spin-wait for their next task by default, taking the cores the others' need: on the 2-core
# machine, three 2-thread processes trained an epoch 5-7x slower than with idle threads asleep.
# Set before this process loads torch; Ray's workers and the services the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _port_block() -> Iterator[int]:
    """The ports this test process hands out: its own block of those between Ray's worker
    ports (10002-19999) and the kernel's ephemeral range.

    Ray picks the ports of the node components a test leaves to it as ``bind(0)`` does, and
    every outgoing connection takes its local port, from the ephemeral range; a port probed
    there with ``bind(0)`` and closed may be handed out again, to this process or another
    (a Ray head's GCS port and a node's agent port once came back alike: "port ... used by
    other components"). Below that range, each pytest-xdist process in a block of its own
    and each port once, no two of the suite's services are given one port.
    """
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = (ephemeral - 20000) // processes
    yield from range(20000 + index * size, 20000 + (index + 1) * size)


_PORTS = _port_block()


def free_port() -> int:
    """A loopback port nothing listens on now, never handed out before in this test session."""
    for port in _PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # something of this machine's listens there
                continue
        return port
    raise RuntimeError("this test process has handed out every port of its block (tests/conftest.py)")


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
