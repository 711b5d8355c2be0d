"""Engines, sessions and schema migrations for one database URL."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

import fusetune.migrations as migrations
from fusetune.server.db.text import dumps

if TYPE_CHECKING:
    import optuna

T = TypeVar("T")

MIGRATIONS_DIR = Path(migrations.__file__).parent
#: Optuna keeps its own Alembic history in ``alembic_version``; ours must not share it.
VERSION_TABLE = "fusetune_alembic_version"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets the API read while the control plane writes; foreign keys are off by default.
    # In WAL mode synchronous=NORMAL syncs at checkpoints, not at every commit: a commit
    # survives the process crashing (only a power loss can undo the last ones), and an
    # array-epoch's transaction no longer waits for the disk.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def lock_for_write(session: Session) -> bool:
    """Take the database's write lock for the rest of ``session``'s transaction, before it
    reads what decides its writes (a quota's count): on SQLite, which has no row locks and
    ignores ``SELECT ... FOR UPDATE``. True when the transaction began here (what the session
    read before is older than the lock: read it again).

    pysqlite (in its default, legacy transaction control, which the write engine keeps)
    begins a transaction only at the first INSERT, UPDATE or DELETE, so two transactions
    could each count, find room, and both insert. ``BEGIN IMMEDIATE`` takes SQLite's one
    write lock at once, waiting up to the connection's timeout for another writer, so such
    transactions run one after the other. Only the transactions that ask for it pay: the
    scheduling loop's writes keep their deferred BEGIN (SQLAlchemy's documented pattern, a
    ``begin`` event, would make every transaction on the engine take the write lock, reads
    and all). On PostgreSQL this does nothing: callers lock the rows they read
    (``SELECT ... FOR UPDATE``). A transaction that has written already holds the lock.
    """
    connection = session.connection()
    if connection.dialect.name != "sqlite":
        return False
    dbapi = connection.connection.dbapi_connection
    if dbapi is None or dbapi.in_transaction:
        return False
    connection.exec_driver_sql("BEGIN IMMEDIATE")
    return True


def engine_kwargs(url: str) -> dict:
    """Connection options every engine on ``url`` (ours and Optuna's) should use."""
    # Every JSON column's text is storable (server/db/text.py), whatever a tenant's code said.
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 60, "check_same_thread": False}, "json_serializer": dumps}
    return {"pool_pre_ping": True, "json_serializer": dumps}


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    """One engine per database URL and process."""
    engine = create_engine(url, **engine_kwargs(url))
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


@lru_cache(maxsize=8)
def get_sessionmaker(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


@lru_cache(maxsize=8)
def get_loop_sessionmaker(url: str) -> sessionmaker[Session]:
    """Sessions for the scheduling loop (``server.loop``): like :func:`get_sessionmaker`,
    but on PostgreSQL without the pre-ping.

    The loop writes every array-epoch, and a sweep's start and end, in transactions of their
    own: a pre-ping is a round trip more for each, on the sweep's critical path. The loop
    needs no ping: a statement on a connection that died fails as the database being
    unavailable, which the loop retries on the next round with what it was writing kept
    (``Recorder.handle``), and the failure invalidates the pool's older connections.
    SQLite has no ping to drop: the loop shares the service's engine there.
    """
    if not url.startswith("postgresql"):
        return get_sessionmaker(url)
    return sessionmaker(create_engine(url, **{**engine_kwargs(url), "pool_pre_ping": False}), expire_on_commit=False)


@lru_cache(maxsize=8)
def get_read_engine(url: str) -> Engine:
    """One engine per database URL and process for requests that only read (GET): its
    statements autocommit.

    A read then sends no BEGIN and no closing ROLLBACK (two of a poll's round trips), and
    closing its session does no I/O, so the event loop can close it instead of a thread. On
    PostgreSQL each statement reads a snapshot of its own either way (READ COMMITTED)."""
    # No pre-ping: it is a round trip per checkout (two per poll, a token's and a route's
    # session), and a read can simply run again: a connection found dead invalidates the
    # pool's older ones, and the request's reads are retried once (``retry_disconnected``).
    engine = create_engine(url, isolation_level="AUTOCOMMIT", **{**engine_kwargs(url), "pool_pre_ping": False})
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


@lru_cache(maxsize=8)
def get_read_sessionmaker(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_read_engine(url), expire_on_commit=False)


def disconnected(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection a statement ran on had died (the database
    restarted, or closed it): a read may run again on a new one."""
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def retry_disconnected(read: Callable[[], T], reset: Callable[[], None]) -> T:
    """``read()``, and once more after ``reset()`` (closing its sessions) when the
    connection it read on had died. Only for reads, which a second run cannot double.

    The read engine does not ping a connection before each use (``get_read_engine``); this
    is the recovery that pinging bought. A second failure (the database is down) propagates.
    """
    try:
        return read()
    except DBAPIError as exc:
        if not disconnected(exc):
            raise
    reset()
    return read()


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    config.set_main_option("version_table", VERSION_TABLE)
    return config


def upgrade(url: str) -> None:
    """Apply every pending migration of fusetune's tables to the database at ``url``."""
    config = alembic_config(url)
    with get_engine(url).begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


@lru_cache(maxsize=8)
def get_optuna_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on the same database, so ``optuna.load_study`` sees every trial."""
    import optuna

    return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url))
