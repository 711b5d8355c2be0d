"""Warnings on a study: what its user should know of how its trials train.

Fusion says two things a sweep's user should hear of, though neither fails a trial: a module
the fused model runs once per member (vmap cannot run it: exact, but without fusion's
speed-up), and a model that fuses by neither path (its trials train unfused, one per array).
Each is kept once, in the order it came, in the Optuna study's system attr
``fusetune:warnings`` (a list of strings), written in the caller's transaction; the API
shows it as ``StudyOut.warnings``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import optuna
from sqlalchemy.orm import Session

from fusetune.server import mirror
from fusetune.server.db import Study
from fusetune.server.schemas import WARNINGS_ATTR

__all__ = ["StudyWarnings"]

log = logging.getLogger(__name__)

#: A study keeps its first warnings only: each names a module of one model, and a sweep's
#: models are few classes.
MAX_WARNINGS = 20


class StudyWarnings:
    """The studies' warnings, as this process last wrote them (read once per study)."""

    def __init__(self, storage: optuna.storages.RDBStorage) -> None:
        self.storage = storage
        # Study id -> its warnings as written, maybe not committed yet: forgotten when a
        # transaction rolls back (rolled_back), and read again.
        self._written: dict[int, list[str]] = {}

    def add(self, session: Session, study_id: int, texts: Sequence[str]) -> None:
        """Add ``texts`` the study does not have yet to its warnings, in the caller's transaction."""
        known = self._written.get(study_id)
        if known is not None and all(t in known for t in texts):
            return
        study = session.get(Study, study_id)
        if study is None:
            return  # deleted meanwhile: nobody will read it
        if known is None:  # an earlier process may have written some
            stored = self.storage.get_study_system_attrs(study.optuna_study_id).get(WARNINGS_ATTR)
            known = [str(t) for t in stored] if isinstance(stored, list) else []
        new = [t for t in dict.fromkeys(texts) if t not in known][: max(0, MAX_WARNINGS - len(known))]
        self._written[study_id] = known = [*known, *new]
        if new:
            mirror.set_study_system_attr(session, study.optuna_study_id, WARNINGS_ATTR, known)
            for text in new:
                log.warning("study %d: %s", study_id, text)

    def rolled_back(self) -> None:
        """The transaction that wrote warnings rolled back: read each study's again."""
        self._written.clear()
