"""Rows held back to the commit (server/db/bulk.py): one statement per table, on SQLite and PostgreSQL."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from fusetune.server.db.bulk import add_rows, add_updates, insert_returning, write_pending

metadata = sa.MetaData()
items = sa.Table(
    "bulk_items", metadata,
    sa.Column("id", sa.Integer, primary_key=True), sa.Column("state", sa.String(16)), sa.Column("value", sa.Float),
)


def _rows(engine: sa.Engine | sa.Connection) -> list[tuple]:
    if isinstance(engine, sa.Connection):  # inside the transaction
        return [tuple(r) for r in engine.execute(sa.select(items).order_by(items.c.id))]
    with engine.connect() as conn:
        return _rows(conn)


def test_held_back_changes_are_written_at_commit_in_order_and_dropped_on_rollback(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    metadata.create_all(engine)
    statements: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda conn, cursor, statement, *rest: statements.append(statement))
    try:
        with Session(engine) as session:
            add_rows(session, items, [{"id": i, "state": "RUNNING", "value": None} for i in (1, 2, 3)])
            write_pending(session, items)  # the rows exist before they are changed
            add_updates(session, items, "id", [{"id": 1, "state": "COMPLETE", "value": 0.5}])
            add_updates(session, items, "id", [{"id": 2, "state": "PRUNED", "value": 0.25}, {"id": 1, "state": "FAIL", "value": None}])
            assert _rows(session.connection()) == [(1, "RUNNING", None), (2, "RUNNING", None), (3, "RUNNING", None)]
            statements.clear()
            session.commit()
        assert _rows(engine) == [(1, "FAIL", None), (2, "PRUNED", 0.25), (3, "RUNNING", None)]  # the later change wins
        assert sum(s.lstrip().upper().startswith("UPDATE") for s in statements) == 1  # one executemany for all three

        with Session(engine) as session:  # changes to other columns keep their order too
            add_updates(session, items, "id", [{"id": 3, "state": "COMPLETE", "value": 1.0}])
            add_updates(session, items, "id", [{"id": 3, "state": "PRUNED"}])
            add_updates(session, items, "id", [{"id": 3, "state": "FAIL", "value": 2.0}])
            session.commit()
        assert _rows(engine)[2] == (3, "FAIL", 2.0)
        with Session(engine) as session:
            add_updates(session, items, "id", [{"id": 3, "state": "RUNNING", "value": None}])
            session.commit()

        with Session(engine) as session:
            add_updates(session, items, "id", [{"id": 3, "state": "COMPLETE", "value": 1.0}])
            add_rows(session, items, [{"id": 4, "state": "WAITING", "value": None}])
            session.rollback()
            session.commit()  # nothing is left to write
        assert _rows(engine)[2:] == [(3, "RUNNING", None)]
    finally:
        metadata.drop_all(engine)
        engine.dispose()


def _clock() -> str:
    return "model default"


numbered = sa.Table(
    "bulk_numbered", metadata,
    sa.Column("id", sa.Integer, primary_key=True), sa.Column("number", sa.Integer),
    sa.Column("note", sa.String(32), nullable=False, default=_clock),
)


def test_inserted_rows_get_increasing_ids_in_their_order_and_their_model_defaults(database_url: str) -> None:
    """insert_returning: one batch's ids follow its rows' order (Optuna numbers a study's trials
    in id order), after any row already there, and a column a row leaves out takes the model's
    default, on PostgreSQL (ids from the sequence, rows by COPY) as on SQLite."""
    engine = sa.create_engine(database_url)
    metadata.create_all(engine)
    try:
        with Session(engine) as session:
            first = insert_returning(session, numbered, [{"number": n} for n in range(3)])
            second = insert_returning(session, numbered, [{"number": n, "note": "given"} for n in range(3, 67)])
            session.commit()
        assert first == sorted(first) and second == sorted(second) and max(first) < min(second)
        with engine.connect() as conn:
            stored = conn.execute(sa.select(numbered.c.id, numbered.c.number, numbered.c.note).order_by(numbered.c.id)).all()
        assert [tuple(r) for r in stored] == [
            *((i, n, "model default") for i, n in zip(first, range(3), strict=True)),
            *((i, n, "given") for i, n in zip(second, range(3, 67), strict=True)),
        ]
        with Session(engine) as session:  # and none of it when the transaction rolls back
            insert_returning(session, numbered, [{"number": 99}])
            session.rollback()
        with engine.connect() as conn:
            assert conn.scalar(sa.select(sa.func.count()).select_from(numbered)) == 67
    finally:
        metadata.drop_all(engine)
        engine.dispose()
