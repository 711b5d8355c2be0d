"""What every part of the scheduling loop shares: its settings, its workers, its sessions,
the state it keeps of the arrays it runs, the studies' mirrors and the code packages' runtime. One object, made by the
loop's facade (``server/loop/__init__.py``) and handed to each part."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import optuna
from sqlalchemy.orm import Session, sessionmaker

from fusetune.server.loop.mirrors import Mirrors
from fusetune.server.loop.packages import PackageRuntime
from fusetune.server.loop.state import LoopState
from fusetune.server.purge import Purge, StudyPurger
from fusetune.server.settings import Settings
from fusetune.workers.pool import WorkerPool

__all__ = ["LoopContext"]


@dataclass
class LoopContext:
    """The loop's shared parts. ``sessions`` are fenced once the loop is set up
    (``server/fencing.py``): every commit of every part checks the scheduler's epoch."""

    settings: Settings
    pool: WorkerPool
    storage: optuna.storages.RDBStorage
    state: LoopState
    mirrors: Mirrors
    sessions: sessionmaker[Session]
    wake: Callable[[], None]
    packages: PackageRuntime
    purger: StudyPurger | None = None

    def purge(self, purge: Purge, *, now: bool = False) -> None:
        """Have a hidden study's artifacts and rows removed: on the purger's thread, or at once
        on this one (``now``, a study of one batch at most)."""
        if self.purger is None:
            raise RuntimeError("the scheduling loop is not set up")
        if now:
            self.purger.purge(purge)
        else:
            self.purger.submit(purge)
