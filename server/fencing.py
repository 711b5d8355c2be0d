"""Fencing: a scheduler that lost the database to another never writes again.

The scheduler lock (``server/leader.py``) says which server *should* schedule, but a lock is
only as good as its holder's knowledge of it. A lock session killed by an operator, a
database restart, a pooler in transaction mode (where a session's advisory lock is taken on
whichever server connection the pool lends, and never holds) or a long pause leave a server
scheduling that no longer holds the lock, while a standby takes it and re-queues the same
arrays. Both would then commit.

So the database decides. A new scheduler increments the one row of ``ft_scheduler``
(:func:`take_epoch`) and remembers the epoch it got; every commit of its sessions
(:func:`fence`) first updates that row *where the epoch is still its own*, in the same
transaction. On PostgreSQL the update holds the row's lock until the commit, so a
standby's increment waits for a commit in flight and every later commit of the old
scheduler finds the epoch changed; on SQLite the database's single writer orders them the
same way. A stale commit raises :class:`StaleScheduler` and rolls back: nothing it wrote
lands.
"""

from __future__ import annotations

import os
import socket

from sqlalchemy import event, insert, update
from sqlalchemy.orm import Session, sessionmaker

from fusetune.server.db.models import SchedulerFence, table_of, utcnow

__all__ = ["StaleScheduler", "fence", "take_epoch"]

_ROW = 1


class StaleScheduler(RuntimeError):
    """Another server has become the scheduler of record: this one must stop scheduling."""


def take_epoch(sessions: sessionmaker[Session]) -> int:
    """Become the scheduler of record: increment the fencing row's epoch and return it.

    Call it once the scheduler lock is held, before the loop writes anything (its recovery
    re-queues what the previous scheduler left running, and must not race that scheduler's
    last commits: they either committed before this increment, or are refused after it).
    """
    leader = f"{socket.gethostname()}:{os.getpid()}"
    table = table_of(SchedulerFence)
    with sessions.begin() as session:
        epoch = session.execute(
            update(table).where(table.c.id == _ROW).values(epoch=table.c.epoch + 1, leader=leader, since=utcnow())
            .returning(table.c.epoch)
        ).scalar_one_or_none()
        if epoch is None:  # the migration inserts the row; a table emptied by hand gets it back
            epoch = 1
            session.execute(insert(table).values(id=_ROW, epoch=epoch, leader=leader, since=utcnow()))
    return int(epoch)


def fence(sessions: sessionmaker[Session], epoch: int) -> sessionmaker[Session]:
    """Sessions like ``sessions``' whose every commit is refused (:class:`StaleScheduler`,
    the transaction rolled back) once the fencing row's epoch is no longer ``epoch``."""
    fenced: sessionmaker[Session] = sessionmaker(**sessions.kw)
    table = table_of(SchedulerFence)
    check = update(table).where(table.c.id == _ROW, table.c.epoch == epoch).values(epoch=epoch)

    @event.listens_for(fenced, "before_commit")
    def _check_epoch(session: Session) -> None:
        if session.connection().execute(check).rowcount != 1:
            raise StaleScheduler(f"scheduler epoch {epoch} is over: another server schedules on this database now")

    return fenced
