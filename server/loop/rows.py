"""fusetune's rows as the scheduling loop reads and writes them: its one repository.

Every statement the loop sends to fusetune's own tables (``ft_studies``, ``ft_trials``,
``ft_arrays``, ``ft_array_members``, ``ft_workers``, ``ft_throughput``) is a function here,
named for what it means to the loop; Optuna's rows are the mirror's (``server/mirror.py``)
and events are ``server/events.py``'s. Each function works in the caller's transaction: the
caller commits, so that an array-epoch stays one transaction however many rows it touches.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import and_, bindparam, delete, func, insert, or_, select, update
from sqlalchemy.engine import Row
from sqlalchemy.orm import Session

from fusetune.server import events
from fusetune.server.db import Array, ArrayMember, ArrayState, Study, StudyState, Tenant, Throughput, Trial, TrialState, Worker, utcnow
from fusetune.server.db.bulk import insert_rows
from fusetune.server.db.models import table_of
from fusetune.server.db.revisions import next_revision
from fusetune.server.errors import NotFound

#: States in which a study's trials are ended, not trained (lifecycle): its running members
#: leave their arrays at the next epoch boundary and end, its waiting trials end at once.
STOPPING = frozenset({StudyState.CANCELLED, StudyState.FAILED, StudyState.DELETING})
UNFINISHED = (TrialState.WAITING, TrialState.RUNNING)

# -- studies ---------------------------------------------------------------------------------------
#: A round's read of its studies: the running ones, and the stopping ones not settled yet.
_ROUND_STUDIES = (
    select(Study)
    .where(or_(Study.state == StudyState.RUNNING, and_(Study.state.in_(STOPPING), Study.completed_at.is_(None))))
    .order_by(Study.id)
)


def round_studies(session: Session) -> Sequence[Study]:
    """The studies a scheduling round drives: running, or stopping and not settled yet."""
    return session.scalars(_ROUND_STUDIES).all()


def study(session: Session, study_id: int) -> Study:
    """The study ``study_id``; NotFound when it is gone (deleted since the request found it)."""
    found = session.get(Study, study_id)
    if found is None:
        raise NotFound(f"study {study_id} does not exist")
    return found


def hidden_studies(session: Session) -> list[tuple[int, int, str]]:
    """Deleted studies whose rows are still being removed: (id, Optuna id, name) each."""
    rows = session.execute(
        select(Study.id, Study.optuna_study_id, Study.name).where(Study.state == StudyState.DELETING, Study.completed_at.is_not(None))
    ).all()
    return [(r[0], r[1], r[2]) for r in rows]


def delete_study(session: Session, study_id: int) -> None:
    """Remove a study's own row (its trials and arrays are gone)."""
    session.execute(delete(Study).where(Study.id == study_id))


def tenant_weights(session: Session) -> list[tuple[str, float]]:
    return [(name, weight) for name, weight in session.execute(select(Tenant.name, Tenant.weight))]


# -- trials ----------------------------------------------------------------------------------------
def ask_counts(session: Session, study_id: int) -> tuple[int, int, int]:
    """A study's trials asked, waiting, and unfinished (waiting or running), in one read."""
    row = session.execute(
        select(
            func.count(),
            func.count().filter(Trial.state == TrialState.WAITING),
            func.count().filter(Trial.state.in_(UNFINISHED)),
        ).where(Trial.study_id == study_id)
    ).one()
    return int(row[0]), int(row[1]), int(row[2])


def asked(session: Session, study_id: int) -> int:
    return int(session.scalar(select(func.count()).where(Trial.study_id == study_id)) or 0)


def state_counts(session: Session, study_id: int) -> dict[TrialState, int]:
    """How many of a study's trials are in each state."""
    rows = session.execute(select(Trial.state, func.count()).where(Trial.study_id == study_id).group_by(Trial.state))
    return {state: int(n) for state, n in rows}


def first_failure(session: Session, study_id: int) -> str | None:
    """The error of the study's first failed trial."""
    return session.scalar(
        select(Trial.error).where(Trial.study_id == study_id, Trial.state == TrialState.FAIL).order_by(Trial.number).limit(1)
    )


def unfinished(session: Session) -> Sequence[Row[int, int, int, str, TrialState, int | None]]:
    """Every waiting or running trial of the running studies, as columns (a round reads them
    all, after every array-epoch that frees a slot: no ORM objects, no JSON to decode)."""
    return session.execute(
        select(Trial.id, Trial.study_id, Trial.number, Trial.signature, Trial.state, Trial.array_id)
        .join(Study, Trial.study_id == Study.id)
        .where(Study.state == StudyState.RUNNING, Trial.state.in_(UNFINISHED))
        .order_by(Study.id, Trial.number)
    ).all()


def movable(session: Session) -> Sequence[Row[int, TrialState, int | None, int]]:
    """The running studies' unfinished trials with their study's epochs (a split's read)."""
    return session.execute(
        select(Trial.id, Trial.state, Trial.array_id, Study.epochs)
        .join(Study, Trial.study_id == Study.id)
        .where(Study.state == StudyState.RUNNING, Trial.state.in_(UNFINISHED))
    ).all()


def trials(session: Session, ids: Sequence[int]) -> list[Trial]:
    """The trials ``ids`` as ORM objects, in that order (one query)."""
    if not ids:
        return []
    found = {t.id: t for t in session.scalars(select(Trial).where(Trial.id.in_(ids)))}
    return [found[i] for i in ids]


def unfinished_of(session: Session, study_id: int) -> Sequence[Trial]:
    return session.scalars(select(Trial).where(Trial.study_id == study_id, Trial.state.in_(UNFINISHED)).order_by(Trial.number)).all()


def unfinished_in_arrays(session: Session, array_ids: Iterable[int]) -> list[tuple[int, int | None]]:
    """(trial id, array id) of the unfinished members of these arrays."""
    rows = session.execute(select(Trial.id, Trial.array_id).where(Trial.array_id.in_(list(array_ids)), Trial.state.in_(UNFINISHED)))
    return [(r[0], r[1]) for r in rows]


def ids_among(session: Session, study_id: int, trial_ids: Sequence[int]) -> list[int]:
    """Which of ``trial_ids`` are the study's."""
    if not trial_ids:
        return []
    return list(session.scalars(select(Trial.id).where(Trial.study_id == study_id, Trial.id.in_(trial_ids))))


def params_of(session: Session, trial_id: int) -> dict[str, Any]:
    return dict(session.scalar(select(Trial.params).where(Trial.id == trial_id)) or {})


def joined(session: Session, trial_ids: Sequence[int], now: Any) -> None:
    """Members that joined an array at a boundary run (started the first time they ever did)."""
    session.execute(
        update(Trial).where(Trial.id.in_(trial_ids)).values(state=TrialState.RUNNING, started_at=func.coalesce(Trial.started_at, now))
    )


def wait_again(session: Session, trial_ids: Sequence[int]) -> None:
    """Trials that left their array (preempted, paused, moved, its worker died) wait for the next."""
    session.execute(update(Trial).where(Trial.id.in_(trial_ids)).values(state=TrialState.WAITING, array_id=None, started_at=None))


def note_checkpoint(session: Session, trial_id: int, epoch: int) -> None:
    session.execute(update(Trial).where(Trial.id == trial_id).values(checkpoint_epoch=epoch))


def ending(
    session: Session, trial_id: int, state: TrialState, *, value: float | None = None, error: str | None = None,
    event: Mapping[str, Any],
) -> dict[str, Any]:
    """A trial's ``trial.ended`` event (``event``: its tenant, study and array; none if
    empty), and the parameters of its row's update for :func:`end_all`: an array-epoch ends
    all its members' rows in one statement, :func:`finish` one trial's."""
    value = value if value is not None and math.isfinite(value) else None
    if event:
        events.record(session, "trial.ended", **event, trial_id=trial_id, state=state.value, value=value, error=error)
    return {"ended_id": trial_id, "ended_state": state, "ended_value": value, "ended_error": error}


def end_all(session: Session, ends: Sequence[Mapping[str, Any]], now: Any) -> None:
    """End the trials :func:`ending` described, in one executemany (an array's last epoch ends
    all its members). The revision counter is taken first, as before any trial row is written
    (``server/db/revisions.py``: no deadlocks)."""
    if not ends:
        return
    next_revision(session)
    table = table_of(Trial)
    session.connection().execute(
        update(table)
        .where(table.c.id == bindparam("ended_id"))
        .values(state=bindparam("ended_state"), value=bindparam("ended_value"), error=bindparam("ended_error"), completed_at=now),
        list(ends),
    )


def finish(
    session: Session, trial_id: int, state: TrialState, now: Any, value: float | None = None, error: str | None = None,
    event: Mapping[str, Any] | None = None,
) -> None:
    """End one trial's row (Optuna's is the mirror's) with its ``trial.ended`` event (``event``:
    its tenant, study and array), in the same transaction."""
    end = ending(session, trial_id, state, value=value, error=error, event=event or {})
    session.execute(
        update(Trial).where(Trial.id == trial_id).values(state=state, completed_at=now, error=end["ended_error"], value=end["ended_value"])
    )


def json_number(value: float | None) -> float | None:
    """A metric as JSON carries it: NaN and infinities are null."""
    return value if value is not None and math.isfinite(value) else None


# -- arrays ----------------------------------------------------------------------------------------
def start_array(session: Session, study_id: int, signature: str, worker_id: int | None, node: str | None, trial_ids: Sequence[int]) -> int:
    """A new array of these trials, which run in it from now: three statements, not the unit of
    work's flush of an array, its members and every trial (a third of a group's asks-to-start)."""
    array_id = session.execute(
        insert(Array).returning(Array.id), [{"study_id": study_id, "signature": signature, "worker_id": worker_id, "node": node}]
    ).scalar_one()
    insert_rows(session, table_of(ArrayMember), [{"array_id": array_id, "slot": i, "trial_id": t} for i, t in enumerate(trial_ids)])
    session.execute(  # the loaded trials are updated too (synchronize_session)
        update(Trial).where(Trial.id.in_(trial_ids)).values(array_id=array_id, state=TrialState.RUNNING, started_at=utcnow())
    )
    return int(array_id)


def offer(session: Session, array_id: int, trials: Sequence[Trial]) -> int:
    """Trials offered to a running array take its next slots; returns its study's id."""
    array = session.get(Array, array_id)
    assert array is not None
    first = len(array.members)
    array.members.extend(ArrayMember(slot=first + k, trial_id=t.id) for k, t in enumerate(trials))
    for t in trials:
        t.array_id = array_id
    return array.study_id


def end_arrays(session: Session, array_ids: Sequence[int], error: str) -> None:
    """Arrays that never ran on, or whose server is gone, end FAIL with ``error``."""
    session.execute(update(Array).where(Array.id.in_(array_ids)).values(state=ArrayState.FAIL, error=error, completed_at=utcnow()))


def running_arrays(session: Session) -> list[tuple[int, int, str]]:
    """(array id, study id, tenant) of every array recorded as running."""
    rows = session.execute(
        select(Array.id, Array.study_id, Study.tenant).join(Study, Array.study_id == Study.id).where(Array.state == ArrayState.RUNNING)
    ).all()
    return [(r[0], r[1], r[2]) for r in rows]


def requeue_arrays(session: Session, array_ids: Sequence[int]) -> None:
    """The unfinished trials of these arrays wait again (they resume from their checkpoints)."""
    session.execute(
        update(Trial).where(Trial.array_id.in_(array_ids), Trial.state.in_(UNFINISHED))
        .values(state=TrialState.WAITING, array_id=None, started_at=None)
    )


def never_joined(session: Session, array_id: int) -> None:
    """Trials offered to an array after its last boundary never joined it: they wait for another."""
    for trial in session.scalars(select(Trial).where(Trial.array_id == array_id, Trial.state == TrialState.WAITING)):
        trial.array_id = None
        session.execute(delete(ArrayMember).where(ArrayMember.array_id == array_id, ArrayMember.trial_id == trial.id))


def running_in(session: Session, array_id: int) -> Sequence[Trial]:
    return session.scalars(select(Trial).where(Trial.array_id == array_id, Trial.state == TrialState.RUNNING)).all()


def count_running_in(session: Session, array_id: int) -> int:
    return int(session.scalar(select(func.count()).where(Trial.array_id == array_id, Trial.state == TrialState.RUNNING)) or 0)


# -- workers and measured speeds ---------------------------------------------------------------------
def register_worker(session: Session, name: str, device_type: str, node: str) -> int:
    """The worker's row, made or refreshed (idle, seen now); returns its id."""
    row = session.scalar(select(Worker).where(Worker.name == name))
    if row is None:
        row = Worker(name=name, device_type=device_type, node=node)
        session.add(row)
    row.device_type, row.node, row.state, row.last_seen = device_type, node, "IDLE", utcnow()
    session.flush()
    return row.id


def throughput(session: Session) -> Sequence[Throughput]:
    return session.scalars(select(Throughput)).all()


def write_throughput(session: Session, observed: Mapping[tuple[str, str, int], tuple[float, int, bool]]) -> None:
    """One row per (signature, device type, B) measured: new, or its average updated."""
    for (signature, device_type, members), (rate, samples, new) in observed.items():
        if new:
            session.add(Throughput(signature=signature, device_type=device_type, members=members, models_steps_per_s=rate, samples=samples))
            continue
        rows = table_of(Throughput)
        session.connection().execute(
            update(rows)
            .where(rows.c.signature == signature, rows.c.device_type == device_type, rows.c.members == members)
            .values(models_steps_per_s=rate, samples=rows.c.samples + samples, updated_at=utcnow())
        )
