"""Server-sent events, ``/api/v1``: one study's (``/studies/{id}/events``) or a tenant's (``/events``).

Each event's ``id`` is its ``ft_events`` id; a client that reconnects with ``Last-Event-ID``
(an EventSource does by itself) gets exactly the events after it. Without one, a stream
starts with what happens next; ``?after=0`` replays every stored event first. A tenant's
token sees only its own tenant's events (another tenant's study is a 404); the admin's sees
every tenant's. ``?kind=`` (repeatable) narrows a stream to those kinds: a client that waits
for ``study.completed`` reads, and wakes for, nothing else.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from sqlalchemy.orm import Session
from sse_starlette import EventSourceResponse

from fusetune.server import events, service
from fusetune.server.api.deps import SessionRoute, authenticate, get_session
from fusetune.server.api.errors import MAX_EVENT_ID, StudyId
from fusetune.server.auth import Principal

#: The kinds a stream may be narrowed to (``?kind=``): anything else is a 422 naming ``kind``.
EventKind = Literal[events.KINDS]  # type: ignore[valid-type]

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)], route_class=SessionRoute)

_STREAM = {
    200: {
        "description": "A text/event-stream: each event's `id` is the event's id, its `event` the kind, "
        "its `data` the JSON of an EventOut (see the EventOut schema).",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}

LastEventId = Header(
    None, alias="Last-Event-ID", ge=0, le=MAX_EVENT_ID,
    description="Resume after this event id (what an EventSource sends when it reconnects); wins over `after`.",
)
After = Query(None, ge=0, le=MAX_EVENT_ID, description="Start after this event id; 0: every stored event. Default: from now on.")
Kind = Query(
    None, description="Only events of these kinds (repeat the parameter): "
    + ", ".join(f"`{k}`" for k in events.KINDS) + ". Default: every kind.",
)
Follow = Query(True, description="Wait for new events (until the server's FUSETUNE_EVENTS_MAX_STREAM_S); false: "
               "send the stored ones after the id, then end.")


def _start(session: Session, last_event_id: int | None, after: int | None) -> int:
    """The id a stream starts after: ``Last-Event-ID``, else ``after``, else the newest event's
    now, as the request is answered (not when its body starts): a client that opens a stream
    and then reads the study misses nothing committed in between."""
    if last_event_id is not None:
        return last_event_id
    return after if after is not None else events.last_id(session)


def _respond(
    request: Request, after: int | None, as_tenant: str | None, study_id: int | None, follow: bool, kinds: list[EventKind] | None
) -> EventSourceResponse:
    settings = request.app.state.settings
    stream = events.stream(
        request.app.state.read_sessions, after, as_tenant=as_tenant, study_id=study_id, follow=follow,
        poll_interval_s=settings.events_poll_interval_s, max_stream_s=settings.events_max_stream_s,
        kinds={str(k) for k in kinds} if kinds else None,
    )
    # Proxies must pass events on as they come; `retry` tells an EventSource when to reconnect.
    return EventSourceResponse(stream, ping=15, headers={"X-Accel-Buffering": "no"})


@router.get("/studies/{study_id}/events", response_class=EventSourceResponse, responses=_STREAM, tags=["events"])
def study_events(
    request: Request,
    study_id: StudyId,
    after: int = After,  # not nullable in the document: absent is None
    follow: bool = Follow,
    kind: list[EventKind] | None = Kind,
    last_event_id: int = LastEventId,
    principal: Principal = Depends(authenticate),
    session: Session = Depends(get_session),
) -> EventSourceResponse:
    """The study's events as they happen: trial asked, started, reported, ended; array started, changed, ended."""
    service._study(session, study_id, principal.tenant)  # another tenant's reads as missing: 404
    start = _start(session, last_event_id, after)
    session.close()  # the stream reads with sessions of its own; hold no connection while it waits
    return _respond(request, start, principal.tenant, study_id, follow, kind)


@router.get("/events", response_class=EventSourceResponse, responses=_STREAM, tags=["events"])
def tenant_events(
    request: Request,
    after: int = After,  # not nullable in the document: absent is None
    follow: bool = Follow,
    kind: list[EventKind] | None = Kind,
    last_event_id: int = LastEventId,
    principal: Principal = Depends(authenticate),
    session: Session = Depends(get_session),
) -> EventSourceResponse:
    """Every event of the token's tenant (the admin's token: of every tenant), as they happen."""
    start = _start(session, last_event_id, after)
    session.close()
    return _respond(request, start, principal.tenant, None, follow, kind)
