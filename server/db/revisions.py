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

The stamps live in ``ft_trial_revisions`` (:class:`~.models.TrialRevision`, read as
``Trial.revision``), one narrow row per trial: restamping a trial rewrites that row only,
never the wide trial row and its indexes. What stamps, without the writer having to remember
it (the hooks below, on every Session):

* a flush of ``Trial`` objects that are new or have changed columns;
* ``session.execute(update(Trial) ...)`` statements (the trials they will change are read
  first, with the statement's own condition: under the counter's lock nothing else changes
  them in between) and ``insert(Trial)`` statements (every trial whose id is above the
  highest before the first insert of the transaction: no other transaction inserts trials
  while this one holds the counter), and :func:`inserting_trials` for trial rows written
  another way (``COPY``);
* :func:`touch_trials`, for changes that live in Optuna's tables only: the control plane's
  ``_record_epoch`` touches every member it records an intermediate value for.

One transaction takes one revision however many trials it changes (the coordinator's
array-epoch transaction stamps all its members with one number), and takes the counter's
lock before the first trial row it writes, so trial writers queue on the counter rather
than deadlock on each other's rows. The stamps are written as the transaction commits, in
one statement.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import event, func, insert, select, text, update
from sqlalchemy.orm import ORMExecuteState, Session, UOWTransaction

from fusetune.server.db.models import table_of

from .models import Revision, Trial, TrialRevision

__all__ = ["current_revision", "inserting_trials", "next_revision", "touch_trials"]

#: Key of the transaction's revision in ``Session.info`` (cleared when the transaction ends).
_INFO_KEY = "fusetune.revision"
#: Key of the trials the transaction changed, in ``Session.info`` (stamped as it commits):
#: those with a stamp row already (a set of ids), and those it created (trial id -> study id).
_TOUCHED_KEY = "fusetune.touched"
_CREATED_KEY = "fusetune.created"
#: Key of the highest trial id before the transaction's first ``insert(Trial)``, in ``Session.info``.
_INSERTED_AFTER_KEY = "fusetune.inserted_after"
#: Key of the ``Trial`` objects a flush is writing, from before to after it, in ``Session.info``.
_FLUSHING_KEY = "fusetune.flushing"
_COUNTER_ID = 1
_SQLITE_CHUNK = 10_000
_trials = table_of(Trial)
_stamps = table_of(TrialRevision)
_counter = table_of(Revision)

# A new trial's stamp row, in both dialects (an upsert: a trial created and changed again
# within one transaction is stamped once), and every other change: an UPDATE, with all
# the trials as one array parameter on PostgreSQL (one statement, however many).
_UPSERT = " ON CONFLICT (trial_id) DO UPDATE SET revision = excluded.revision"
_STAMP_CREATED = text("INSERT INTO ft_trial_revisions (trial_id, study_id, revision) VALUES (:id, :study, :revision)" + _UPSERT)
_STAMP_INSERTED = text(
    "INSERT INTO ft_trial_revisions (trial_id, study_id, revision) "
    "SELECT id, study_id, :revision FROM ft_trials WHERE id > :after" + _UPSERT
)
_STAMP_ARRAY = text("UPDATE ft_trial_revisions SET revision = :revision WHERE trial_id = ANY(CAST(:ids AS INTEGER[]))")


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
            start = connection.execute(select(func.coalesce(func.max(_stamps.c.revision), 0))).scalar_one() + 1
            connection.execute(insert(_counter).values(id=_COUNTER_ID, value=start))
            revision = start
        session.info[_INFO_KEY] = revision
    return revision


def current_revision(session: Session) -> int:
    """The newest committed revision this session can see (0 before any)."""
    return session.scalar(select(_counter.c.value).where(_counter.c.id == _COUNTER_ID)) or 0


def touch_trials(session: Session, trial_ids: Iterable[int]) -> None:
    """Stamp these trials (fusetune ids) as changed in this transaction, e.g. because their
    Optuna trials got intermediate values or attrs.

    The stamps are written as the transaction commits, with one statement for every trial
    touched in it (the loop records several array-epochs in one transaction).
    """
    ids = set(trial_ids)
    if ids:
        if not session.in_transaction():
            session.connection()  # begins the transaction the stamps belong to
        session.info.setdefault(_TOUCHED_KEY, set()).update(ids)


def inserting_trials(session: Session) -> None:
    """Stamp every trial row this transaction adds from now on, as it commits.

    What the hook does before an ``insert(Trial)`` statement, for writers that add trial rows
    another way (``bulk.insert_returning``'s ``COPY``): the counter's lock first, then the
    highest trial id before the transaction's first new trial.
    """
    next_revision(session)  # the counter's lock before any trial row is written
    if _INSERTED_AFTER_KEY not in session.info:
        session.info[_INSERTED_AFTER_KEY] = session.connection().execute(select(func.coalesce(func.max(_trials.c.id), 0))).scalar_one()


def _stamp(session: Session, touched: set[int], created: dict[int, int], inserted_after: int | None) -> None:
    if not touched and not created and inserted_after is None:
        return
    revision = next_revision(session)
    connection = session.connection()  # Core: no ORM bookkeeping, the loop's hot path
    if inserted_after is not None:
        connection.execute(_STAMP_INSERTED, {"revision": revision, "after": inserted_after})
    if created:
        connection.execute(_STAMP_CREATED, [{"id": t, "study": s, "revision": revision} for t, s in created.items()])
    touched -= created.keys()
    if not touched:
        return
    if connection.dialect.name == "postgresql":
        connection.execute(_STAMP_ARRAY, {"ids": sorted(touched), "revision": revision})
    else:  # in chunks: SQLite caps a statement's parameters (250,000 in this build)
        stamps, ids = table_of(TrialRevision), sorted(touched)
        for start in range(0, len(ids), _SQLITE_CHUNK):
            chunk = ids[start:start + _SQLITE_CHUNK]
            connection.execute(update(stamps).where(stamps.c.trial_id.in_(chunk)).values(revision=revision))


@event.listens_for(Session, "before_flush")
def _take_revision_for_flush(session: Session, flush_context: UOWTransaction, instances: Any) -> None:
    changed = [(obj, True) for obj in session.new if isinstance(obj, Trial)]
    changed += [
        (obj, False) for obj in session.dirty if isinstance(obj, Trial) and session.is_modified(obj, include_collections=False)
    ]
    if changed:
        next_revision(session)  # the counter's lock before the flush writes trial rows
        session.info.setdefault(_FLUSHING_KEY, []).extend(changed)


@event.listens_for(Session, "after_flush")
def _touch_flushed_trials(session: Session, flush_context: UOWTransaction) -> None:
    flushed = session.info.pop(_FLUSHING_KEY, None)
    if flushed:  # new trials have their ids now
        created = session.info.setdefault(_CREATED_KEY, {})
        touched = session.info.setdefault(_TOUCHED_KEY, set())
        for obj, new in flushed:
            if new:
                created[obj.id] = obj.study_id
            else:
                touched.add(obj.id)


@event.listens_for(Session, "do_orm_execute")
def _touch_statements(state: ORMExecuteState) -> None:
    if not (state.is_update or state.is_insert):
        return
    table = getattr(state.statement, "table", None)
    if getattr(table, "name", None) != _trials.name:
        return
    session = state.session
    if state.is_insert:
        inserting_trials(session)
        return
    next_revision(session)  # the counter's lock before the statement writes trial rows
    connection = session.connection()
    where = getattr(state.statement, "whereclause", None)  # an UPDATE's (checked above)
    if where is None and isinstance(state.parameters, list):  # an ORM bulk update by primary key
        changing = [row["id"] for row in state.parameters]
    else:
        found = select(_trials.c.id) if where is None else select(_trials.c.id).where(where)
        changing = list(connection.execute(found).scalars())
    session.info.setdefault(_TOUCHED_KEY, set()).update(changing)


@event.listens_for(Session, "before_commit")
def _stamp_touched(session: Session) -> None:
    session.flush()  # its trials are touched after the flush: a flush at the commit comes after this hook
    info = session.info
    _stamp(session, info.pop(_TOUCHED_KEY, set()), info.pop(_CREATED_KEY, {}), info.pop(_INSERTED_AFTER_KEY, None))


@event.listens_for(Session, "after_transaction_end")
def _forget_revision(session: Session, transaction: Any) -> None:
    # Any end, savepoints too: a savepoint rolled back may have undone the counter's update.
    session.info.pop(_INFO_KEY, None)
    if transaction.parent is None:  # ended without a commit
        session.info.pop(_TOUCHED_KEY, None)
        session.info.pop(_CREATED_KEY, None)
        session.info.pop(_INSERTED_AFTER_KEY, None)
        session.info.pop(_FLUSHING_KEY, None)
