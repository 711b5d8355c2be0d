"""Alembic environment for fusetune's own tables (``ft_*``); Optuna migrates its tables itself."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from fusetune.server.db.models import Base

config = context.config
target_metadata = Base.metadata
VERSION_TABLE = config.get_main_option("version_table") or "fusetune_alembic_version"


def include_object(obj, name, type_, reflected, compare_to):  # type: ignore[no-untyped-def]
    # The database also holds Optuna's tables: autogenerate must only look at ours.
    return type_ != "table" or name.startswith("ft_")


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        version_table=VERSION_TABLE,
        include_object=include_object,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url"))
        with engine.begin() as connection:
            _run(connection)
    else:
        _run(connection)


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        include_object=include_object,
        render_as_batch=True,  # SQLite can only ALTER tables by copying them
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
