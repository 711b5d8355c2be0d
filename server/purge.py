"""Removing a deleted study: its artifacts, then its rows, table by table, in small batches,
on a thread of its own.

A study of 100,000 trials x 20 epochs is about 3 million rows across Optuna's tables and
fusetune's. Removed in one transaction on the scheduling loop's thread (as Optuna's
``delete_study`` does, through its ORM cascade, which loads every row), it stalled every
other study's scheduling for minutes. Here the loop only hides the study (one short
transaction: the API answers 404 for it at once, and its Optuna study no longer answers to
its name); the purger then removes the artifact folder and the rows, ``batch_trials`` trials
at a time, each batch a short transaction of its own, so the loop's transactions interleave
with them. The study's own row goes last, handed back to the loop (which alone writes
events, in commit order): a study whose row is still there after a restart is purged again
from where it was.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Select, delete, select
from sqlalchemy.orm import Session, sessionmaker

from fusetune.server import mirror
from fusetune.server.db import Array, ArrayMember, Trial, TrialRevision
from fusetune.server.db.bulk import rowcount
from fusetune.workers.store import get_store

__all__ = ["Purge", "StudyPurger"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Purge:
    """A hidden study to remove: fusetune's id, Optuna's id and the study's artifact folder."""

    study_id: int
    optuna_study_id: int
    name: str


class StudyPurger:
    """Removes hidden studies one after the other, on its own thread.

    Args:
        sessions: the scheduler's (fenced) sessions: a scheduler replaced by another stops
            purging with its first refused batch, and the new one takes the study over.
        artifact_uri: the artifact store the study's folder is in.
        batch_trials: trials (with all their rows) removed per transaction.
        finish: called (on the purger's thread) with each :class:`Purge` whose every trial,
            array and artifact is gone, to have the study's own rows removed (the scheduling
            loop does it, on its thread).
    """

    def __init__(
        self, sessions: sessionmaker[Session], artifact_uri: str, batch_trials: int, finish: Callable[[Purge], None]
    ) -> None:
        self.sessions = sessions
        self.artifact_uri = artifact_uri
        self.batch_trials = batch_trials
        self.finish = finish
        self._queue: queue.SimpleQueue[Purge | None] = queue.SimpleQueue()
        self._queued: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="fusetune-purger", daemon=True)
        self._thread.start()

    def submit(self, purge: Purge) -> None:
        """Remove ``purge``'s study (once, however often it is submitted before it is done)."""
        if purge.study_id not in self._queued:
            self._queued.add(purge.study_id)
            self._queue.put(purge)

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while (purge := self._queue.get()) is not None:
            try:
                self.purge(purge)
                self.finish(purge)
            except Exception:  # a restart purges it again (its row is still there)
                log.exception("study %d: its rows could not all be removed", purge.study_id)
            finally:
                self._queued.discard(purge.study_id)

    def purge(self, purge: Purge) -> None:
        """Remove the study's artifacts, trials and arrays now, on the caller's thread (the
        purger's, or the loop's for a study of one batch at most); its own rows stay."""
        store = get_store(self.artifact_uri)
        try:
            store.delete_dir(purge.name)  # nothing of it runs: nothing writes there any more
        except OSError as exc:
            log.warning("could not remove %s: %s", store.location(purge.name), exc)
        removed = 0
        while batch := self._batch(purge):
            removed += batch
        with self.sessions.begin() as session:  # trials that had no Optuna trial, then the arrays
            removed += self._delete_fusetune_trials(session, select(Trial.id).where(Trial.study_id == purge.study_id))
            arrays = select(Array.id).where(Array.study_id == purge.study_id).scalar_subquery()
            removed += rowcount(session.execute(delete(ArrayMember).where(ArrayMember.array_id.in_(arrays))))
            removed += rowcount(session.execute(delete(Array).where(Array.study_id == purge.study_id)))
        log.info("study %d (%s): %d rows removed", purge.study_id, purge.name, removed)

    def _batch(self, purge: Purge) -> int:
        """Remove the next ``batch_trials`` trials of the study, in one transaction; 0 when none is left."""
        with self.sessions.begin() as session:
            optuna_ids = mirror.some_trial_ids(session, purge.optuna_study_id, self.batch_trials)
            if not optuna_ids:
                return 0
            ours = select(Trial.id).where(Trial.optuna_trial_id.in_(optuna_ids))
            removed = self._delete_fusetune_trials(session, ours)
            return removed + mirror.delete_trials(session, optuna_ids)

    @staticmethod
    def _delete_fusetune_trials(session: Session, ids: Select[int]) -> int:
        """Remove fusetune's trials that ``ids`` selects, with their revisions and array slots."""
        trial_ids = list(session.scalars(ids))
        if not trial_ids:
            return 0
        removed = 0
        for model, column in ((TrialRevision, TrialRevision.trial_id), (ArrayMember, ArrayMember.trial_id), (Trial, Trial.id)):
            removed += rowcount(session.execute(delete(model).where(column.in_(trial_ids))))
        return removed
