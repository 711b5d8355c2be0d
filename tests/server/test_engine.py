"""The scheduling loop's sessions: no pre-ping round trip, and a dead connection is a retry, not a loss."""

from __future__ import annotations

import os

import pytest
import sqlalchemy as sa

from fusetune.server.db import get_loop_sessionmaker, get_sessionmaker
from fusetune.server.loop.thread import database_unavailable
from tests.conftest import POSTGRES_ENV


def test_the_loop_shares_the_service_engine_on_sqlite(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    assert get_loop_sessionmaker(url) is get_sessionmaker(url)


def test_a_loop_connection_that_died_fails_as_unavailable_and_the_next_session_works(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not database_url.startswith("postgresql"):
        pytest.skip("SQLite has no server-side connection to kill")
    sessions = get_loop_sessionmaker(database_url)
    dialect = sessions.kw["bind"].dialect
    pings: list[object] = []
    ping = dialect.do_ping
    monkeypatch.setattr(dialect, "do_ping", lambda connection: pings.append(connection) or ping(connection))
    with sessions() as session:
        pid = session.scalar(sa.text("SELECT pg_backend_pid()"))
    with sessions() as session:  # the pooled connection again, with no ping before it
        assert session.scalar(sa.text("SELECT pg_backend_pid()")) == pid
    assert pings == []

    admin = sa.create_engine(os.environ[POSTGRES_ENV], isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    finally:
        admin.dispose()
    with sessions() as session, pytest.raises(sa.exc.DBAPIError) as failed:
        session.scalar(sa.text("SELECT 1"))
    assert database_unavailable(failed.value)  # what the loop retries on its next round
    with sessions() as session:
        assert session.scalar(sa.text("SELECT 1")) == 1
