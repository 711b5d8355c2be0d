"""The scheduling loop's thread: its turns, its inbox, and how it waits out a failing database.

One background thread runs every turn of the loop (``SchedulingLoop.turn``), and it alone
touches the loop's state and the studies' mirrors; other threads hand it work through the
inbox (:meth:`LoopThread.call`, :meth:`LoopThread.post`). A turn that fails because the
database cannot be reached is retried with a growing delay (nothing is lost: the workers'
reports wait in the recorder's backlog); one that fails because another server has become
the scheduler of record (``server/fencing.py``) stops the loop for good.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from sqlalchemy import exc as sa_exc

from fusetune.server.errors import Unavailable
from fusetune.server.fencing import StaleScheduler

__all__ = ["LoopThread", "database_unavailable", "stale"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")
#: While the database is unreachable the loop retries at most this far apart.
_MAX_DB_RETRY_S = 5.0


def _caused_by(exc: BaseException | None, test: Callable[[BaseException], bool]) -> bool:
    """Whether ``exc`` or one of what caused it (eight deep at most) passes ``test``."""
    seen = 0
    while exc is not None and seen < 8:
        if test(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _unusable(exc: BaseException) -> bool:
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError, StaleScheduler)):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated


def database_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it, e.g. under Optuna's StorageInternalError) says the
    database cannot be used now: worth retrying, unlike a bug or bad data. A scheduler that
    another has replaced (:class:`~fusetune.server.fencing.StaleScheduler`) counts too: like
    an outage, it is no study's fault, and the loop stops on it."""
    return _caused_by(exc, _unusable)


def stale(exc: BaseException | None) -> bool:
    """Whether ``exc``, or what caused it, says another server is the scheduler of record now."""
    return _caused_by(exc, lambda e: isinstance(e, StaleScheduler))


class LoopThread:
    """Runs ``turn`` again and again on a thread of its own (see the module docstring).

    Args:
        turn: one turn of the loop; it waits (:meth:`wait`) for what comes next itself.
        poll_interval_s: the pause after a turn that failed for a reason other than the database.
        db_retry_s: the first pause while the database is unreachable (doubling, up to 5 s).
        fenced: called, on the loop's thread, when another server took over and the loop stopped.
    """

    def __init__(self, turn: Callable[[], None], poll_interval_s: float, db_retry_s: float) -> None:
        self._turn = turn
        self.poll_interval_s = poll_interval_s
        self.db_retry_s = db_retry_s
        self.fenced: Callable[[], None] | None = None
        self.stopped = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._inbox: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fusetune-coordinator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- waking and waiting ------------------------------------------------------------------------
    def wake(self) -> None:
        """Run a turn now (a study was created, a slot freed), not at the next poll."""
        self._wake.set()

    def woken(self) -> bool:
        """Whether :meth:`wake` was called since the last look (which clears it)."""
        if self._wake.is_set():
            self._wake.clear()
            return True
        return False

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for :meth:`wake`."""
        self._wake.wait(timeout)

    # -- the inbox ---------------------------------------------------------------------------------
    def call(self, fn: Callable[[], _T], timeout: float) -> _T:
        """Run ``fn`` on the loop's thread and return its result (any other thread).

        Raises:
            service.Unavailable: the loop has stopped, or did not take ``fn`` up within
                ``timeout`` seconds; ``fn`` is withdrawn and never runs, so a request answered
                503 changed nothing. One the loop has begun is waited for.
        """
        if self.stopped.is_set():
            raise Unavailable("this server's scheduling loop has stopped; another server may schedule now")
        if not self.running:
            return fn()  # no loop (tests drive the turns themselves): this thread is the only one
        future: Future[_T] = Future()
        self._inbox.put((fn, future))
        self._wake.set()
        try:
            return future.result(timeout)
        except FutureTimeout:
            if not future.cancel():
                return future.result()  # the loop is running it: its answer is the request's
            raise Unavailable("the scheduling loop is busy and did not take this request up; nothing was done") from None

    def post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the loop's thread at its next turn, without waiting for it (any thread)."""
        self._inbox.put((fn, Future()))
        self._wake.set()

    def run_inbox(self) -> None:
        """Run what other threads handed over, in order (on the loop's thread)."""
        while True:
            try:
                fn, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue  # its caller stopped waiting and was told nothing was done
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller's thread raises it
                future.set_exception(exc)

    # -- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0  # database errors in a row
        while not self.stopped.is_set():
            try:
                self._turn()
                failures = 0
            except Exception as exc:  # keep scheduling; the error is in the log and the next turn retries
                if stale(exc):
                    # Another server schedules now: nothing this loop writes would land. It
                    # stops, and its server steps down to a standby (its workers go too).
                    log.error("%s: this server stops scheduling", exc)
                    self.stopped.set()
                    if self.fenced is not None:
                        self.fenced()
                    return
                if not database_unavailable(exc):
                    log.exception("scheduling step failed")
                    self.stopped.wait(self.poll_interval_s)
                    continue
                # The database is unreachable: workers train on, their reports wait in the
                # backlog (nothing is lost), and the loop retries with a growing delay.
                failures += 1
                delay = min(_MAX_DB_RETRY_S, self.db_retry_s * 2 ** min(failures - 1, 10))
                log.warning("database unavailable (%s): retrying in %.1f s", type(exc).__name__, delay)
                self.stopped.wait(delay)
