"""Events of studies' trials and arrays: written by the scheduling loop, streamed as SSE.

The coordinator calls :func:`record` inside the transactions it already makes (an
array-epoch's report and its ``trial.reported`` events commit together, or neither), so an
event is stored exactly when what it says is true in the database. Only the coordinator's
thread writes events, one transaction after the other, so ids are committed in increasing
order: a reader that has seen id N has seen every earlier event, and ``Last-Event-ID: N``
resumes exactly after it. :func:`stream` serves ``GET /api/v1/studies/{id}/events`` and
``GET /api/v1/events`` from the table (any API process can, with or without a scheduling
loop); :func:`prune` drops events older than the retention.

A stream waits for new events on this process's doorbell: a transaction that recorded
events rings it as it commits (a session ``after_commit`` hook), and the streams of those
events' studies and tenants read the table at once. Events another process writes (a second
API process, a scheduling loop elsewhere) are found by polling, every
``FUSETUNE_EVENTS_POLL_INTERVAL_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, event, func, select
from sqlalchemy.orm import Session, sessionmaker
from sse_starlette import ServerSentEvent
from starlette.concurrency import run_in_threadpool

from fusetune.server.db import Event, retry_disconnected, utcnow
from fusetune.server.db.bulk import add_rows, rowcount
from fusetune.server.db.models import table_of
from fusetune.server.schemas import EventOut

#: Every kind of event, in the order a trial meets them.
KINDS = (
    "trial.asked",  # the sampler asked it (or it was enqueued); data: number, params, state
    "trial.started",  # it began training in an array (also when it joins or resumes in one)
    "trial.reported",  # one epoch's intermediate value; data: step, value
    "trial.ended",  # COMPLETE, PRUNED or FAIL; data: state, value, error
    "array.started",  # data: trial_ids, worker, signature
    "array.changed",  # members joined, left (ended, pruned, preempted) or were offered
    "array.ended",  # COMPLETE or FAIL; data: state, error, requeued
    "study.completed",  # every trial has ended
    "study.deleted",  # its rows are gone (it was hidden, 404, from the delete on); data: name
)

_events = table_of(Event)

#: Most events one read of the table returns; a stream reads again at once when it was full.
BATCH = 500

#: ``Session.info`` key: the (tenant, study id, kind) of the events the session's transaction recorded.
_RECORDED = "fusetune.events.recorded"


class _Doorbell:
    """Wakes this process's open streams when events of their scope have been committed.

    Streams wait on event loops; the transactions that record events commit on other
    threads (the scheduling loop's, a threadpool's), so a ring hands each matching stream's
    wake-up to its own loop (``call_soon_threadsafe``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[
            asyncio.Event, tuple[asyncio.AbstractEventLoop, str | None, int | None, Collection[str] | None]
        ] = {}

    def subscribe(self, as_tenant: str | None, study_id: int | None, kinds: Collection[str] | None = None) -> asyncio.Event:
        """An event set whenever events of this scope (None: any tenant, any study, any kind) commit."""
        bell = asyncio.Event()
        with self._lock:
            self._waiting[bell] = (asyncio.get_running_loop(), as_tenant, study_id, kinds or None)
        return bell

    def unsubscribe(self, bell: asyncio.Event) -> None:
        with self._lock:
            self._waiting.pop(bell, None)

    def ring(self, recorded: Iterable[tuple[str, int, str]]) -> None:
        scopes = set(recorded)
        with self._lock:
            waiting = list(self._waiting.items())
        for bell, (loop, as_tenant, study_id, kinds) in waiting:
            if any(
                (as_tenant is None or as_tenant == t) and (study_id is None or study_id == s) and (kinds is None or k in kinds)
                for t, s, k in scopes
            ):
                with contextlib.suppress(RuntimeError):  # its loop has closed: the stream is gone
                    loop.call_soon_threadsafe(bell.set)


_doorbell = _Doorbell()


@event.listens_for(Session, "after_commit")
def _ring_after_commit(session: Session) -> None:
    recorded = session.info.pop(_RECORDED, None)
    if recorded:
        _doorbell.ring(recorded)


@event.listens_for(Session, "after_rollback")
def _forget_after_rollback(session: Session) -> None:
    session.info.pop(_RECORDED, None)  # rolled back: those events were never stored


def record(
    session: Session,
    kind: str,
    *,
    tenant: str,
    study_id: int,
    trial_id: int | None = None,
    array_id: int | None = None,
    **data: Any,
) -> None:
    """Add an event to the caller's transaction (it commits, or rolls back, with it).

    The transaction's events are written together as it commits, in the order they were
    recorded (:func:`~fusetune.server.db.bulk.add_rows`: an array-epoch records one event per
    member, and the loop records several array-epochs in one transaction).
    """
    assert kind in KINDS, kind
    session.info.setdefault(_RECORDED, set()).add((tenant, study_id, kind))
    add_rows(session, _events, [
        {"tenant": tenant, "study_id": study_id, "kind": kind, "trial_id": trial_id, "array_id": array_id, "data": data,
         "created_at": utcnow()}
    ])


def prune(session: Session, retention_s: float) -> int:
    """Delete the events older than ``retention_s`` seconds, in the caller's transaction."""
    cutoff = utcnow() - timedelta(seconds=retention_s)
    return rowcount(session.execute(delete(Event).where(Event.created_at < cutoff)))


def _scope(query: Any, as_tenant: str | None, study_id: int | None, kinds: Collection[str] | None = None) -> Any:
    if as_tenant is not None:
        query = query.where(Event.tenant == as_tenant)
    if study_id is not None:
        query = query.where(Event.study_id == study_id)
    if kinds:
        query = query.where(Event.kind.in_(sorted(kinds)))
    return query


def read(
    session: Session, after: int, *, as_tenant: str | None = None, study_id: int | None = None,
    kinds: Collection[str] | None = None, limit: int = BATCH,
) -> list[EventOut]:
    """The events after id ``after``, oldest first: a tenant's own, or one study's; only
    those of ``kinds`` when given (None or empty: every kind)."""
    query = _scope(select(Event).where(Event.id > after), as_tenant, study_id, kinds).order_by(Event.id).limit(limit)
    return [EventOut.model_validate(e) for e in session.scalars(query)]


def earlier_studys_end(session: Session, study_id: int) -> int:
    """The id of the ``study.deleted`` event of an earlier study with this id, 0 if none.

    SQLite gives a new row the id after the largest one left, so deleting the newest study
    hands its id to the next one; its events stay (until their retention), and ended with its
    ``study.deleted``. A live study's stream starts after that event: it is another study's
    history. PostgreSQL's sequences never reuse an id, so there it is 0 without a query (the
    query reads every event of the study, as no index has the kind).
    """
    if session.get_bind().dialect.name != "sqlite":
        return 0
    query = select(func.max(Event.id)).where(Event.study_id == study_id, Event.kind == "study.deleted")
    return session.scalar(query) or 0


def last_id(session: Session) -> int:
    """The newest event's id (0 when there are none): a stream that names no Last-Event-ID starts after it."""
    return session.scalar(select(func.max(Event.id))) or 0


async def stream(
    sessions: sessionmaker[Session],
    after: int | None,
    *,
    as_tenant: str | None,
    study_id: int | None,
    follow: bool,
    poll_interval_s: float,
    max_stream_s: float,
    kinds: Collection[str] | None = None,
    authorized: Callable[[Session], bool] | None = None,
    recheck_s: float = math.inf,
) -> AsyncIterator[bytes]:
    """Server-sent events after id ``after``, encoded: each chunk is the events of one read.

    ``kinds``: only events of these kinds (a client waiting for ``study.completed`` is sent
    nothing else; ids still resume exactly, the others are merely skipped).
    ``after`` None: only events that happen from now on. ``follow`` false: the stored
    events, then the stream ends; otherwise it waits for new ones (woken as this process
    commits them, and polling the table every ``poll_interval_s`` for other processes'),
    and ends after ``max_stream_s`` (an EventSource reconnects with ``Last-Event-ID`` and
    loses nothing). ``authorized`` (whether the stream's token still authenticates) is asked
    again at a read at least every ``recheck_s`` seconds: the stream ends when it says no, so
    a revoked token reads nothing more (its reconnect is a 401). Each database read runs on a
    worker thread, with a session of its own, so an open stream holds no connection while it waits.
    """

    def fetch(after: int | None, recheck: bool, first: bool) -> tuple[int, list[EventOut]] | None:
        def once() -> tuple[int, list[EventOut]] | None:
            with sessions() as session:
                if recheck and authorized is not None and not authorized(session):
                    return None
                if after is None:
                    return last_id(session), []
                start = after
                if study_id is not None and first:
                    # Once: while this study lives, no other study takes its id.
                    start = max(after, earlier_studys_end(session, study_id))
                return start, read(session, start, as_tenant=as_tenant, study_id=study_id, kinds=kinds)

        # ``sessions`` are the service's read sessions (autocommit, no pre-ping): a read is
        # one round trip, where a pinged transaction was four. A sweep's end reaches its
        # client through one. A connection that died is replaced and the read runs again.
        return retry_disconnected(once, lambda: None)

    deadline = time.monotonic() + max_stream_s
    recheck_at = time.monotonic() + recheck_s
    bell = _doorbell.subscribe(as_tenant, study_id, kinds) if follow else None
    first = True
    try:
        while True:
            if bell is not None:
                bell.clear()  # before the read: a commit during it rings for the next one
            recheck = time.monotonic() >= recheck_at
            if recheck:
                recheck_at = time.monotonic() + recheck_s
            fetched = await run_in_threadpool(fetch, after, recheck, first)
            first = False
            if fetched is None:
                return  # its token no longer authenticates
            after, batch = fetched
            if batch:
                # One chunk per read, not one send per event: a sweep's hundreds of events
                # each went through the ASGI stack on their own, the largest cost of a
                # watched sweep in the server's event loop.
                after = batch[-1].id
                yield b"".join(ServerSentEvent(id=str(e.id), event=e.kind, data=e.model_dump_json()).encode() for e in batch)
            if len(batch) == BATCH:
                continue  # more are stored: read on before waiting
            now = time.monotonic()
            if bell is None or now >= deadline:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(bell.wait(), max(0.0, min(poll_interval_s, deadline - now, recheck_at - now)))
    finally:
        if bell is not None:
            _doorbell.unsubscribe(bell)
