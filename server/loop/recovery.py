"""Recovery: what a scheduler finds in the database when it starts, and puts right.

A new scheduler (a fresh service, a restart, a standby taking over) knows nothing of what an
earlier one left running: the arrays recorded RUNNING are gone with their processes. Their
unfinished trials wait again, and resume from the checkpoints their workers reported
(``ft_trials.checkpoint_epoch``) in whichever array they get next. The workers are
registered (``ft_workers``), and deleted studies whose rows were still being removed are
handed back to the purger.
"""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from fusetune.server import events
from fusetune.server.loop import rows
from fusetune.server.loop.state import LoopState
from fusetune.server.purge import Purge
from fusetune.workers.pool import WorkerPool

__all__ = ["hidden_studies", "recover", "register_workers"]

_RESTARTED = "the service restarted while this array trained"


def register_workers(sessions: sessionmaker[Session], pool: WorkerPool, state: LoopState) -> None:
    """Write the pool's workers to ``ft_workers`` (each new one made, each seen now)."""
    with sessions.begin() as session:
        for w in pool.workers:
            state.worker_ids[w.name] = rows.register_worker(session, w.name, w.device_type, w.node)


def recover(sessions: sessionmaker[Session]) -> None:
    """Arrays left RUNNING by a previous server process are gone: they end FAIL, and their
    unfinished trials wait again, in one transaction."""
    with sessions.begin() as session:
        found = rows.running_arrays(session)
        if not found:
            return
        for array_id, study_id, tenant in found:
            events.record(session, "array.ended", tenant=tenant, study_id=study_id, array_id=array_id, state="FAIL", error=_RESTARTED)
        orphans = [array_id for array_id, _, _ in found]
        rows.end_arrays(session, orphans, _RESTARTED)
        rows.requeue_arrays(session, orphans)


def hidden_studies(sessions: sessionmaker[Session]) -> list[Purge]:
    """The studies deleted before a restart whose rows are not all gone yet."""
    with sessions() as session:
        return [Purge(study_id, optuna_id, name) for study_id, optuna_id, name in rows.hidden_studies(session)]
