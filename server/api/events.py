"""Server-sent events, ``/api/v1``: one study's (``/studies/{id}/events``) or a tenant's (``/events``).

Each event's ``id`` is its ``ft_events`` id; a client that reconnects with ``Last-Event-ID``
(an EventSource does by itself) gets exactly the events after it. Without one, a stream
starts with what happens next; ``?after=0`` replays every stored event first. A tenant's
token sees only its own tenant's events (another tenant's study is a 404); the admin's sees
every tenant's. ``?kind=`` (repeatable) narrows a stream to those kinds: a client that waits
for ``study.completed`` reads, and wakes for, nothing else.

A tenant holds at most ``FUSETUNE_EVENTS_MAX_STREAMS_PER_TENANT`` open streams in one API
process (the admin as many, counted apart): one more is a 429 with ``Retry-After`` that names
the limit, so no tenant can hold the server's connections and threads. An open stream checks
its token again every ``FUSETUNE_EVENTS_AUTH_RECHECK_S``, and ends once it is revoked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response, status
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy.orm import Session
from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

from fusetune.server import events, service
from fusetune.server.api.deps import PrincipalDep, SessionDep, SessionRoute, authenticate, bearer
from fusetune.server.api.errors import MAX_EVENT_ID, ErrorMessage, StudyId
from fusetune.server.auth import Principal, principal_for
from fusetune.server.params import BOOLEAN, DECIMAL
from fusetune.server.schemas import EventOut

#: The kinds a stream may be narrowed to (``?kind=``): anything else is a 422 naming ``kind``.
EventKind = Literal[events.KINDS]  # type: ignore[valid-type]

router = APIRouter(prefix="/api/v1", dependencies=[Depends(authenticate)], route_class=SessionRoute)

#: How long a client refused a stream (429) is told to wait: a slot frees as soon as any of
#: its tenant's streams ends, so a few seconds, not a stream's whole length.
RETRY_AFTER_S = 5

#: One event of the stream as Schemathesis and OpenAPI 3.2 read a text/event-stream: each
#: event an object of its fields, ``data`` the JSON of an EventOut.
EVENT_ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[0-9]+$", "description": "The event's id (EventOut.id)."},
        "event": {"type": "string", "enum": list(events.KINDS), "description": "The event's kind (EventOut.kind)."},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": EventOut.model_json_schema(mode="serialization"),
        },
        "retry": {"type": "integer", "minimum": 0},
    },
    "required": ["id", "event", "data"],
}

_STREAM: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "A text/event-stream: each event's `id` is the event's id, its `event` the kind, "
        "its `data` the JSON of the event (`itemSchema`).",
        "content": {"text/event-stream": {"itemSchema": EVENT_ITEM}},
    },
    429: {
        "description": "The token's tenant holds FUSETUNE_EVENTS_MAX_STREAMS_PER_TENANT open streams in this process.",
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ErrorMessage.__name__}"}}},
        "headers": {"Retry-After": {"schema": {"type": "integer", "minimum": 0}, "description": "Seconds to wait before trying again."}},
    },
}
#: The routes' declared response class shapes only the document (they return a _SlotStream):
#: one with a media type would make FastAPI describe the 200 as one string (`schema`), which
#: OpenAPI 3.2 and Schemathesis read as the whole stream's schema beside `itemSchema`.
_DOCUMENTED_AS = Response


class StreamSlots:
    """The event streams open in this process per tenant (None: the admin), at most ``limit`` each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str | None, int] = {}
        self._lock = threading.Lock()  # taken on the routes' threads, given back on the event loop

    def take(self, tenant: str | None) -> Callable[[], None]:
        """A slot of ``tenant``'s, and the function that gives it back (once, however often called).

        Raises:
            HTTPException: 429 with Retry-After when ``tenant`` holds ``limit`` streams.
        """
        with self._lock:
            held = self._open.get(tenant, 0)
            if held >= self.limit:
                who = "the admin" if tenant is None else f"tenant {tenant!r}"
                raise HTTPException(
                    status.HTTP_429_TOO_MANY_REQUESTS,
                    f"{who} holds {held} open event streams, the most FUSETUNE_EVENTS_MAX_STREAMS_PER_TENANT "
                    f"({self.limit}) allows; close one, or retry after {RETRY_AFTER_S} s",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            self._open[tenant] = held + 1
        given_back = threading.Event()

        def give_back() -> None:
            with self._lock:
                if not given_back.is_set():
                    given_back.set()
                    self._open[tenant] -= 1

        return give_back

    def held(self, tenant: str | None) -> int:
        """How many streams ``tenant`` holds open now."""
        with self._lock:
            return self._open.get(tenant, 0)


class _SlotStream(EventSourceResponse):
    """An event stream that gives its slot back when the ASGI call ends, however it ends (its
    last event, the client leaving, the server stopping): a generator's ``finally`` does not
    run for a stream whose client left before its first read."""

    def __init__(self, *args: Any, give_back: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._give_back = give_back

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._give_back()


# Not nullable in the document: absent is None. (The FieldInfo goes in Annotated, before DECIMAL:
# given as the default, FastAPI drops the Annotated validator.)
LastEventId = Annotated[int, Header(
    alias="Last-Event-ID", ge=0, le=MAX_EVENT_ID,
    description="Resume after this event id (what an EventSource sends when it reconnects); wins over `after`.",
), DECIMAL]
After = Annotated[int, Query(
    ge=0, le=MAX_EVENT_ID, description="Start after this event id; 0: every stored event. Default: from now on."
), DECIMAL]
Kind = Query(
    None, description="Only events of these kinds (repeat the parameter): "
    + ", ".join(f"`{k}`" for k in events.KINDS) + ". Default: every kind.",
)
Follow = Annotated[bool, Query(
    description="Wait for new events (until the server's FUSETUNE_EVENTS_MAX_STREAM_S); false: send the stored ones "
    "after the id, then end.",
), BOOLEAN]


def _start(session: Session, last_event_id: int | None, after: int | None) -> int:
    """The id a stream starts after: ``Last-Event-ID``, else ``after``, else the newest event's
    now, as the request is answered (not when its body starts): a client that opens a stream
    and then reads the study misses nothing committed in between."""
    if last_event_id is not None:
        return last_event_id
    return after if after is not None else events.last_id(session)


def _respond(
    request: Request, after: int | None, principal: Principal, token: str, study_id: int | None, follow: bool,
    kinds: list[EventKind] | None,
) -> EventSourceResponse:
    """The stream of the request's events, holding one of its tenant's slots while it is open
    and checking ``token`` again as it goes."""
    settings = request.app.state.settings
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    give_back = request.app.state.event_streams.take(principal.tenant)  # the last step: nothing after it can fail
    stream = events.stream(
        request.app.state.read_sessions, after, as_tenant=principal.tenant, study_id=study_id, follow=follow,
        poll_interval_s=settings.events_poll_interval_s, max_stream_s=settings.events_max_stream_s,
        kinds={str(k) for k in kinds} if kinds else None,
        authorized=lambda session: principal_for(session, token, admin) is not None,
        recheck_s=settings.events_auth_recheck_s,
    )
    # Proxies must pass events on as they come; `retry` tells an EventSource when to reconnect.
    return _SlotStream(stream, ping=15, headers={"X-Accel-Buffering": "no"}, give_back=give_back)


@router.get("/studies/{study_id}/events", response_class=_DOCUMENTED_AS, responses=_STREAM, tags=["events"])
def study_events(
    principal: PrincipalDep,
    session: SessionDep,
    request: Request,
    study_id: StudyId,
    after: After = None,  # type: ignore[assignment]
    follow: Follow = True,
    kind: list[EventKind] | None = Kind,
    last_event_id: LastEventId = None,  # type: ignore[assignment]
    credentials: HTTPAuthorizationCredentials = Depends(bearer),
) -> EventSourceResponse:
    """The study's events as they happen: trial asked, started, reported, ended; array started, changed, ended."""
    service._study(session, study_id, principal.tenant)  # another tenant's reads as missing: 404
    start = _start(session, last_event_id, after)
    session.close()  # the stream reads with sessions of its own; hold no connection while it waits
    return _respond(request, start, principal, credentials.credentials, study_id, follow, kind)


@router.get("/events", response_class=_DOCUMENTED_AS, responses=_STREAM, tags=["events"])
def tenant_events(
    principal: PrincipalDep,
    session: SessionDep,
    request: Request,
    after: After = None,  # type: ignore[assignment]
    follow: Follow = True,
    kind: list[EventKind] | None = Kind,
    last_event_id: LastEventId = None,  # type: ignore[assignment]
    credentials: HTTPAuthorizationCredentials = Depends(bearer),
) -> EventSourceResponse:
    """Every event of the token's tenant (the admin's token: of every tenant), as they happen."""
    start = _start(session, last_event_id, after)
    session.close()
    return _respond(request, start, principal, credentials.credentials, None, follow, kind)
