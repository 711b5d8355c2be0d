"""What routes depend on: the request's database session, and who the request acts for.

Every route under ``/api/v1`` authenticates (the routers carry :func:`authenticate` as a
dependency, so a new route does too); ``/healthz`` does not. The rules:

* no token, an unknown one or a revoked one: 401 with ``WWW-Authenticate: Bearer``;
* the admin (``FUSETUNE_ADMIN_TOKEN``) may do everything;
* admin routes (creating tenants, changing weights and quotas) are not a tenant's
  resources: a tenant's token gets 403 there, whatever it names;
* a tenant's resources (its studies, trials, arrays, tokens): another tenant's answer 404,
  exactly as a missing one does, so ids leak nothing.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, HTTPException, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from fusetune.server.api.json_body import StrictJSONRequest
from fusetune.server.auth import Principal, principal_for
from fusetune.server.db import retry_disconnected
from fusetune.server.settings import Settings

if TYPE_CHECKING:
    from fusetune.server.loop import SchedulingLoop

# Dependencies that do no I/O are coroutines: FastAPI runs a plain function in its threadpool,
# a hand-off to a thread and back per dependency and request, which under 200 pollers cost
# more than their SQL (docs/benchmarks.md, REST reads).
bearer = HTTPBearer(
    auto_error=False,
    description="A tenant's token (`fusetune tenants create`), or the admin's (`FUSETUNE_ADMIN_TOKEN`).",
)


#: Methods whose routes only read: their sessions autocommit (``get_read_sessionmaker``).
READ_METHODS = frozenset({"GET", "HEAD"})
_READS = "fusetune.reads"  # a session's info key: it is a read route's (it may run again)


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request's session: made on the event loop (no I/O until its first statement, which
    runs in the route's thread), and closed there too when closing has nothing to send.

    A plain generator would cost two more thread hand-offs per request, one to open and one
    to close. A read's session autocommits, so closing it sends nothing; a write's has
    committed (no transaction left) unless the route failed part way, and only then is its
    rollback sent, from the threadpool, never from the event loop.
    """
    reads = request.method in READ_METHODS
    session = (request.app.state.read_sessions if reads else request.app.state.sessions)()
    session.info[_READS] = reads
    try:
        yield session
    finally:
        if reads or not session.in_transaction():
            session.close()
        else:
            await run_in_threadpool(session.close)


async def get_url(request: Request) -> str:
    return request.app.state.settings.database_url


def _closing_sessions(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """``endpoint``, closing the sessions it was given in its own thread as it returns."""
    if inspect.iscoroutinefunction(endpoint):
        return endpoint

    @functools.wraps(endpoint)  # FastAPI reads the parameters of the wrapped function
    def run(*args: Any, **kwargs: Any) -> Any:
        sessions = [value for value in kwargs.values() if isinstance(value, Session)]

        def close() -> None:
            for session in sessions:
                session.close()

        try:
            if sessions and all(s.info.get(_READS) for s in sessions):
                # A read route runs again on a new connection when its own had died.
                return retry_disconnected(lambda: endpoint(*args, **kwargs), close)
            return endpoint(*args, **kwargs)
        finally:
            close()

    return run


class SessionRoute(APIRoute):
    """A route whose session gives its connection back before the route's thread returns.

    FastAPI validates a plain function's answer against its ``response_model`` in another
    thread hand-off, after the route and before the dependencies' exits. A session still open
    then would hold its connection while waiting for a thread; under load the threadpool can
    fill with requests waiting for connections that only those requests hold, until the pool's
    30 s timeout answers 503 (``tests/server/test_operations.py``). Every router of the API
    makes its routes with this class; the answers are pydantic models, read before the close.
    Its requests' JSON bodies hold finite numbers only (:mod:`fusetune.server.api.json_body`).
    """

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, _closing_sessions(endpoint), **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler, given the request as a :class:`StrictJSONRequest` (finite numbers only)."""
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive, request._send))

        return strict


async def get_app_settings(request: Request) -> Settings:
    return request.app.state.settings


def authenticate(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)
) -> Principal:
    """The principal of the request's bearer token; 401 without a valid one.

    The token is looked up with a read session of its own, whose connection goes back to the
    pool before the route runs. Were it the route's session, a request would hold a connection
    between its two threads (this dependency's and the route's): under load every thread could
    then wait for a connection that only a request waiting for a thread would give back, until
    the pool's timeout (200 pollers at 160 polls/s did exactly that, answering 503s).
    """
    if credentials is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "this route needs a bearer token: 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    admin = request.app.state.settings.admin_token
    with request.app.state.read_sessions() as session:
        principal = retry_disconnected(
            lambda: principal_for(session, credentials.credentials, admin.get_secret_value() if admin else None), session.close
        )
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "the bearer token is not valid (unknown or revoked)",
            headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
        )
    return principal


async def require_admin(principal: Principal = Depends(authenticate)) -> Principal:
    """The admin only: 403 for a tenant's token (admin routes are no tenant's resources)."""
    if not principal.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "only the admin (FUSETUNE_ADMIN_TOKEN) may do this")
    return principal


async def get_loop(request: Request) -> SchedulingLoop | None:
    """This server's scheduling loop; None when it runs the API alone or stands by."""
    return request.app.state.loop


# The routes' typed dependencies, as FastAPI's full-stack template writes them: a parameter
# annotated with one of these gets its value from the request.
SessionDep = Annotated[Session, Depends(get_session)]
UrlDep = Annotated[str, Depends(get_url)]
PrincipalDep = Annotated[Principal, Depends(authenticate)]
AdminDep = Annotated[Principal, Depends(require_admin)]
SettingsDep = Annotated[Settings, Depends(get_app_settings)]
LoopDep = Annotated["SchedulingLoop | None", Depends(get_loop)]
