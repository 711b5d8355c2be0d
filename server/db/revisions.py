"""Trial revisions: one change sequence, so that a poller reads only the trials that changed.

Every transaction that changes a trial stamps it with the transaction's **revision**, the
next value of the one counter row ``ft_revision``, taken by updating that row: the row stays
locked until the transaction commits (SQLite locks the whole database for a writer anyway),
so the next writer gets a higher revision only after this one has committed. Revisions are
therefore committed in increasing order, and a reader that sees revision N also sees every
change numbered below N. ``GET /studies/{id}/trials?updated_since=N`` returns the trials
whose ``revision`` is above N, in revision order, and a poller that keeps the highest
revision it has read misses no change and reads each one once. A timestamp would not do:
two transactions can commit in the other order than they read the clock, and a cursor such
as "from the oldest unfinished trial on" makes one slow early trial re-read every later one.

What stamps, without the writer having to remember it (the hooks below, on every Session):

* a flush of ``Trial`` objects that are new or have changed columns;
* ``session.execute(update(Trial) ...)`` and ``insert(Trial)`` statements (the revision is
  added to the statement's values);
* :func:`touch_trials`, for changes that live in Optuna's tables only: the control plane's
  ``_record_epoch`` touches every member it records an intermediate value for.

One transaction takes one revision however many trials it changes (the coordinator's
array-epoch transaction stamps all its members with one number), and takes the counter's
lock before the first trial row it writes, so trial writers queue on the counter rather
than deadlock on each other's rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import BigInteger, any_, event, func, insert, literal, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import ORMExecuteState, Session, UOWTransaction

from .models import Revision, Trial

__all__ = ["current_revision", "next_revision", "touch_trials"]

#: Key of the transaction's revision in ``Session.info`` (cleared when the transaction ends).
_INFO_KEY = "fusetune.revision"
#: Key of the trials :func:`touch_trials` will stamp at commit, in ``Session.info``.
_TOUCHED_KEY = "fusetune.touched"
_COUNTER_ID = 1
_trials = Trial.__table__
_counter = Revision.__table__


def next_revision(session: Session) -> int:
    """The revision of the session's current transaction: taken on first use, then reused.

    Taking it locks the counter row until the transaction ends.
    """
    revision = session.info.get(_INFO_KEY)
    if revision is None:
        connection = session.connection()
        revision = connection.execute(
            update(_counter).where(_counter.c.id == _COUNTER_ID).values(value=_counter.c.value + 1).returning(_counter.c.value)
        ).scalar()
        if revision is None:  # a database made without the migration that adds the row
            start = connection.execute(select(func.coalesce(func.max(_trials.c.revision), 0))).scalar_one() + 1
            connection.execute(insert(_counter).values(id=_COUNTER_ID, value=start))
            revision = start
        session.info[_INFO_KEY] = revision
    return revision


def current_revision(session: Session) -> int:
    """The newest committed revision this session can see (0 before any)."""
    return session.scalar(select(_counter.c.value).where(_counter.c.id == _COUNTER_ID)) or 0


def touch_trials(session: Session, trial_ids: Iterable[int]) -> None:
    """Stamp these trials (fusetune ids) as changed in this transaction, e.g. because
    their Optuna trials got intermediate values or attrs.

    The stamp is written as the transaction commits, with one statement for every trial
    touched in it (the loop records several array-epochs in one transaction).
    """
    ids = set(trial_ids)
    if ids:
        if not session.in_transaction():
            session.connection()  # begins the transaction the stamps belong to
        session.info.setdefault(_TOUCHED_KEY, set()).update(ids)


def _stamp(session: Session, trial_ids: Iterable[int]) -> None:
    ids = sorted(set(trial_ids))
    if not ids:
        return
    revision = next_revision(session)
    connection = session.connection()  # Core: no ORM bookkeeping, the loop's hot path
    if connection.dialect.name == "postgresql":  # one array parameter, not one per id
        which = _trials.c.id == any_(literal(ids, ARRAY(BigInteger)))
    else:
        which = _trials.c.id.in_(ids)
    connection.execute(update(_trials).where(which).values(revision=revision))


@event.listens_for(Session, "before_flush")
def _stamp_flushed_trials(session: Session, flush_context: UOWTransaction, instances: Any) -> None:
    changed = [obj for obj in session.new if isinstance(obj, Trial)]
    changed += [
        obj for obj in session.dirty if isinstance(obj, Trial) and session.is_modified(obj, include_collections=False)
    ]
    if changed:
        revision = next_revision(session)
        for obj in changed:
            obj.revision = revision


@event.listens_for(Session, "do_orm_execute")
def _stamp_statements(state: ORMExecuteState) -> Any:
    if not (state.is_update or state.is_insert):
        return None
    table = getattr(state.statement, "table", None)
    if getattr(table, "name", None) != _trials.name:
        return None
    revision = next_revision(state.session)
    if state.is_insert and isinstance(state.parameters, list):  # executemany: one dict per row
        return state.invoke_statement(params=[{**row, "revision": revision} for row in state.parameters])
    state.statement = state.statement.values(revision=revision)
    return None


@event.listens_for(Session, "before_commit")
def _stamp_touched(session: Session) -> None:
    _stamp(session, session.info.pop(_TOUCHED_KEY, ()))


@event.listens_for(Session, "after_transaction_end")
def _forget_revision(session: Session, transaction: Any) -> None:
    # Any end, savepoints too: a savepoint rolled back may have undone the counter's update.
    session.info.pop(_INFO_KEY, None)
    if transaction.parent is None:
        session.info.pop(_TOUCHED_KEY, None)  # ended without a commit
