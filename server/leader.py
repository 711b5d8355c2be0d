"""One scheduler per database: the lock, and a standby server that takes over.

Every server serves the API; only the one that holds the database's scheduler lock runs the
scheduling loop (the one writer of trial results) and the Ray workers. On PostgreSQL the lock
is a session-level advisory lock held by a connection of its own; on SQLite it is a file lock
beside the database file. Both are released by the kernel or the database the moment the
process holding them dies (``kill -9`` included), so a standby server, which polls the lock
every ``FUSETUNE_LEADER_POLL_S``, takes over within that time: it starts its workers and its
scheduling loop, whose start-up re-queues the arrays the dead leader left running (their
members resume from their checkpoints in the artifact store).

A leader whose lock connection breaks (the database went away) tries to take the lock again;
when the database answers and another server holds the lock, it stops scheduling and becomes
a standby itself.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import filelock
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

if TYPE_CHECKING:
    from fastapi import FastAPI

    from fusetune.server.settings import Settings
    from fusetune.workers.pool import WorkerPool

log = logging.getLogger(__name__)

#: The advisory lock's key: one scheduler per PostgreSQL database (locks are per database).
LOCK_KEY = int.from_bytes(hashlib.sha256(b"fusetune:scheduler").digest()[:8], "big", signed=True)


class SchedulerLock:
    """The database's scheduler lock (see the module docstring); every call is non-blocking."""

    def __init__(self, url: str) -> None:
        self.url = url
        parsed = make_url(url)
        self.backend = parsed.get_backend_name()
        self._conn: Connection | None = None
        self._file: filelock.BaseFileLock | None = None
        if self.backend == "sqlite" and parsed.database not in (None, "", ":memory:"):
            # Not thread-local: the watcher thread checks the lock the serving thread took.
            self._file = filelock.FileLock(str(Path(parsed.database).resolve()) + ".scheduler.lock", thread_local=False)

    def acquire(self) -> bool:
        """Take the lock if it is free (or held by this object already)."""
        if self.backend == "postgresql":
            return self._acquire_advisory()
        if self._file is None:
            return True  # an in-memory SQLite database belongs to its one process
        if self._file.is_locked:
            return True
        try:
            self._file.acquire(timeout=0)
            return True
        except filelock.Timeout:
            return False

    def held(self) -> bool:
        """Whether this process still holds the lock (on PostgreSQL: its connection lives)."""
        if self.backend != "postgresql":
            return self._file is None or self._file.is_locked
        if self._conn is None:
            return False
        try:
            self._conn.execute(text("SELECT 1"))
            return True
        except Exception:
            self._drop()
            return False

    def release(self) -> None:
        if self._file is not None and self._file.is_locked:
            self._file.release(force=True)
        self._drop()

    def _acquire_advisory(self) -> bool:
        try:
            if self._conn is None:
                # Keepalives: a connection to a database that vanished fails within seconds,
                # not at the kernel's two-hour default.
                engine = create_engine(
                    self.url,
                    poolclass=NullPool,
                    connect_args={"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3,
                                  "connect_timeout": 5},
                )
                self._conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            return bool(self._conn.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": LOCK_KEY}).scalar())
        except Exception as exc:
            log.debug("scheduler lock: %s", exc)
            self._drop()
            return False

    def _drop(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                conn.close()
                conn.engine.dispose()
            except Exception:
                pass


class Leadership:
    """Runs the scheduling loop in this server while it holds the scheduler lock.

    :meth:`start` leads at once when the lock is free (the usual case: one server), else
    this server is a standby that serves the API and polls the lock. ``role`` is
    ``"leader"`` or ``"standby"``; ``GET /healthz`` shows it.
    """

    def __init__(self, app: FastAPI, settings: Settings, lock: SchedulerLock | None = None) -> None:
        self.app = app
        self.settings = settings
        self.lock = lock or SchedulerLock(settings.scheduler_lock_url or settings.database_url)
        self.role = "standby"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    def start(self) -> None:
        if self.lock.acquire():
            self._lead()
        else:
            log.warning("another server schedules on this database: serving the API as a standby")
        self._thread = threading.Thread(target=self._watch, name="fusetune-leadership", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._step_down()
        self.lock.release()

    def _lead(self) -> None:
        import ray

        from fusetune.server.loop import SchedulingLoop

        with self._guard:
            if not ray.is_initialized():
                # ray.init, from the main thread, replaces the SIGTERM handler with one that
                # raises SystemExit inside uvicorn's event loop: `docker stop` would then kill
                # the server mid-request, without the lifespan's shutdown (the pool, this lock).
                # uvicorn's own handler (a graceful shutdown) is put back.
                on_sigterm = signal.getsignal(signal.SIGTERM)
                ray.init(address=self.settings.ray_address, include_dashboard=False, log_to_driver=False)
                if threading.current_thread() is threading.main_thread() and on_sigterm is not None:
                    signal.signal(signal.SIGTERM, on_sigterm)
            pool = make_pool(self.settings)
            loop = SchedulingLoop(self.settings, pool)
            loop.on_fenced = self._fenced
            loop.start()  # takes a new fencing epoch before it writes anything
            self.app.state.pool, self.app.state.loop = pool, loop
            self.role = "leader"
        log.info("this server holds the scheduler lock: scheduling")

    def _fenced(self) -> None:
        """The database refused a commit of this server's loop: another server took a newer
        fencing epoch (server/fencing.py), though this one may still think it holds the lock
        (a killed lock session it has not noticed, a pooler that lends session locks to
        whoever). It steps down at once, on a thread of its own (the loop's thread calls
        this), lets the lock go, and stands by like any other server."""

        def step_down() -> None:
            self._step_down()
            self.lock.release()

        threading.Thread(target=step_down, name="fusetune-fenced", daemon=True).start()

    def _step_down(self) -> None:
        with self._guard:
            loop, pool = self.app.state.loop, self.app.state.pool
            self.app.state.loop = None
            self.role = "standby"
            if loop is not None:
                loop.stop()
            if pool is not None:
                pool.shutdown()
            self.app.state.pool = None

    def _watch(self) -> None:
        while not self._stop.wait(self.settings.leader_poll_s):
            try:
                if self.role == "standby":
                    if self.lock.acquire():
                        log.warning("the scheduler lock is free: taking over scheduling")
                        self._lead()
                elif not self.lock.held() and not self.lock.acquire() and self._database_answers():
                    log.error("another server took the scheduler lock: this one stops scheduling")
                    self._step_down()
            except Exception:
                log.exception("leadership check failed")

    def _database_answers(self) -> bool:
        from fusetune.server.db import get_engine

        try:
            with get_engine(self.settings.database_url).connect() as conn:
                conn.execute(text("SELECT 1"))
            return True
        except Exception:
            return False


def make_pool(settings: Settings) -> WorkerPool:
    """The worker pool as the settings configure it (CPU workers, Ray timeouts, heartbeats, the epoch deadline)."""
    from fusetune.workers.pool import WorkerPool

    return WorkerPool(
        cpu_workers=settings.cpu_workers,
        timeout_s=settings.ray_timeout_s,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        heartbeat_timeout_s=settings.heartbeat_timeout_s,
        epoch_timeout_s=settings.epoch_timeout_s,
        setup_grace_s=settings.package_load_timeout_s,
    )


def describe(app: Any) -> str:
    """This server's part in scheduling: ``leader``, ``standby``, or ``off`` (API only)."""
    leadership = getattr(app.state, "leadership", None)
    return leadership.role if leadership is not None else "off"
