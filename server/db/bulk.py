"""Many rows into one table in the caller's transaction, at the cost of one statement.

The scheduling loop writes an array-epoch's intermediate values and its ``trial.reported``
events: dozens of rows per transaction, hundreds of transactions a minute. Through the ORM
or an ``executemany`` each row is a statement on the wire (psycopg pipelines them, but the
server still plans and runs each), and SQLAlchemy's multi-row ``VALUES`` form is too long
for psycopg to cache, so it is parsed again every time. PostgreSQL's ``COPY ... FROM STDIN``
takes the rows as one stream: 64 events in about 1.3 ms instead of 10 ms through the ORM
(measured on the 2-core box). Other databases (SQLite) take a Core ``executemany``, which
is already cheap in process.

:func:`add_rows` holds rows back until the transaction commits, so that what a transaction
adds to a table in many calls (an array-epoch's events, member by member; the intermediate
values of the several array-epochs the loop records together) is still one statement.
:func:`add_updates` does the same for rows changed one by one (the Optuna trials an array's
last epoch ends): one ``executemany`` per table and set of columns at the commit.

Values go through each column's own bind processing first (a JSON column's serialiser, an
enum's name, :class:`~fusetune.server.db.models.UTCDateTime`), so a row reads back exactly
as if the ORM had written it. Columns a row leaves out take their defaults: the model's
(``created_at``'s clock) and the server's (the id).

:func:`insert_returning` is :func:`insert_rows` for new rows whose ids the caller needs (the
trials a batch of asks adds to Optuna's table and to fusetune's): on PostgreSQL the ids are
drawn from the key's sequence first and the rows then go in by ``COPY``, where an
``INSERT ... RETURNING`` of 64 trials was four times as long (the same uncached parse).
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import JSON, Result, Table, bindparam, event, func, insert, select, update
from sqlalchemy.orm import Session, SessionTransaction

__all__ = ["add_rows", "add_updates", "insert_returning", "insert_rows", "rowcount", "write_pending"]


def rowcount(result: Result[Any]) -> int:
    """How many rows an UPDATE or DELETE changed (0 where the driver does not say)."""
    return int(getattr(result, "rowcount", 0) or 0)

#: Key, in ``Session.info``, of the rows :func:`add_rows` holds back: table -> rows, in order.
_PENDING = "fusetune.bulk"
#: Key, in ``Session.info``, of the changes :func:`add_updates` holds back: table -> runs of
#: changes to the same columns, in order, each ``((key column, changed columns), rows)``.
_UPDATES = "fusetune.bulk.updates"


def add_rows(session: Session, table: Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert ``rows`` into ``table`` when the session's transaction commits (or never, if it
    rolls back), after the rows added before them, in one :func:`insert_rows` per table.

    A statement of the same transaction that reads or changes the table must come after
    :func:`write_pending` (a query would not see the rows yet).
    """
    if rows:
        if not session.in_transaction():
            session.connection()  # begins the transaction the rows belong to
        session.info.setdefault(_PENDING, {}).setdefault(table, []).extend(rows)


def add_updates(session: Session, table: Table, key: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Set, when the session's transaction commits, each row's values on the row of ``table``
    whose ``key`` column equals the row's ``key`` value, after the changes added before them.

    Held back like :func:`add_rows` (a statement of the same transaction that reads or
    changes the table must come after :func:`write_pending`).
    """
    if rows:
        if not session.in_transaction():
            session.connection()
        runs = session.info.setdefault(_UPDATES, {}).setdefault(table, [])
        for row in rows:
            shape = (key, tuple(sorted(c for c in row if c != key)))
            if runs and runs[-1][0] == shape:
                runs[-1][1].append(row)
            else:  # a change to other columns starts a new statement, so the order holds
                runs.append((shape, [row]))


def write_pending(session: Session, table: Table | None = None) -> None:
    """Write now what :func:`add_rows` and :func:`add_updates` hold back for ``table`` (every table: None)."""
    pending: dict[Table, list[Mapping[str, Any]]] = session.info.get(_PENDING, {})
    for held in [table] if table is not None else list(pending):
        rows = pending.pop(held, None)
        if rows:
            insert_rows(session, held, rows)
    changes: dict[Table, list[tuple[tuple[str, tuple[str, ...]], list[Mapping[str, Any]]]]] = session.info.get(_UPDATES, {})
    for held in [table] if table is not None else list(changes):
        for (key, columns), rows in changes.pop(held, []):
            # Bound names apart from the columns' own (SQLAlchemy reserves those for SET).
            statement = update(held).where(held.c[key] == bindparam(f"_{key}")).values({c: bindparam(f"_{c}") for c in columns})
            session.connection().execute(statement, [{f"_{k}": v for k, v in row.items()} for row in rows])


@event.listens_for(Session, "before_commit")
def _write_at_commit(session: Session) -> None:
    write_pending(session)


@event.listens_for(Session, "after_transaction_end")
def _drop_pending(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:  # ended without a commit: its rows go with it
        session.info.pop(_PENDING, None)
        session.info.pop(_UPDATES, None)


def _copy_processor(type_: Any, dialect: Any) -> Any:
    """How ``COPY`` takes a column's values: its own bind processing, except that JSON goes as
    the text the dialect's serialiser makes of it (what its processor stores, without the
    driver's wrapper around each value: a fifth of the time of an event row)."""
    if isinstance(type_, JSON):
        return dialect._json_serializer or json.dumps
    return type_._cached_bind_processor(dialect)


def insert_returning(session: Session, table: Table, rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Insert ``rows`` (dicts with the same keys, column names, no id) into ``table``, whose
    key is one integer column; returns their new ids, in the rows' order and increasing.

    Increasing in the rows' order: Optuna's storage lists a study's trials by id, and takes
    that order for their numbers'. Core statements, so no ORM hook sees them: a writer of
    fusetune's trials takes their revision itself (:func:`~.revisions.inserting_trials`).
    """
    if not rows:
        return []
    (key,) = table.primary_key.columns
    connection = session.connection()
    if connection.dialect.name != "postgresql":
        return list(connection.execute(insert(table).returning(key, sort_by_parameter_order=True), list(rows)).scalars())
    sequence = func.pg_get_serial_sequence(table.fullname, key.name)
    ids = sorted(connection.execute(select(func.nextval(sequence)).select_from(func.generate_series(1, len(rows)))).scalars())
    insert_rows(session, table, [{key.name: i, **row} for i, row in zip(ids, rows, strict=True)])
    return ids


def _model_defaults(table: Table, names: Sequence[str]) -> dict[str, Any]:
    """The model-side defaults (scalars and callables, as ``insert()`` applies them) of the
    columns of ``table`` that are not among ``names``."""
    defaults = {}
    for column in table.columns:
        default = column.default
        if column.name in names or default is None or not (default.is_scalar or default.is_callable):
            continue
        arg: Any = default.arg  # type: ignore[attr-defined]  # a scalar or callable default (checked above) has one
        defaults[column.name] = arg(None) if default.is_callable else arg
    return defaults


def insert_rows(session: Session, table: Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert ``rows`` (dicts with the same keys, column names) into ``table``."""
    if not rows:
        return
    connection = session.connection()
    dialect = connection.dialect
    if dialect.name != "postgresql":
        connection.execute(insert(table), list(rows))
        return
    defaults = _model_defaults(table, list(rows[0]))
    if defaults:  # COPY knows only the server's: evaluated once for the batch
        rows = [{**row, **defaults} for row in rows]
    names = list(rows[0])
    processors = [_copy_processor(table.c[name].type, dialect) for name in names]
    # Only the columns that have a processor are touched per row: an array-epoch's rows are
    # thousands (every member's value and event), and a comprehension over every column of
    # every row was a seventh of recording them.
    processed = [(i, process) for i, process in enumerate(processors) if process is not None]
    values_of = operator.itemgetter(*names)
    quoted = ", ".join(dialect.identifier_preparer.quote(name) for name in names)
    target = dialect.identifier_preparer.format_table(table)
    driver = connection.connection.driver_connection
    assert driver is not None  # a connection checked out of the pool has its driver's
    cursor = driver.cursor()
    with cursor.copy(f"COPY {target} ({quoted}) FROM STDIN") as copy:
        for row in rows:
            values = list(values_of(row)) if len(names) > 1 else [row[names[0]]]
            for i, process in processed:
                values[i] = process(values[i])
            copy.write_row(values)
