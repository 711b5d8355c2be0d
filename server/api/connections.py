"""Connections that never finish a request's head are closed: uvicorn's ``limit_concurrency``
(``FUSETUNE_MAX_CONNECTIONS``) counts every open connection, and uvicorn closes an idle one
only after a response (its keep-alive timeout), so 1,024 sockets that sent nothing, or that
trickled a header line every few seconds (a slowloris), held the service at 503 for every
tenant for as long as they stayed open.

:class:`HeadDeadline` is uvicorn's own h11 protocol with one more timer: a request's line and
headers must arrive within ``FUSETUNE_HEADER_TIMEOUT_S`` of the connection opening, or of the
last response on it. A body has its own deadline (``FUSETUNE_BODY_TIMEOUT_S``,
:mod:`fusetune.server.api.limits`). What one address may open at once is a proxy's or a load
balancer's to limit (docs/security.md).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from fusetune.server.settings import Settings

__all__ = ["HeadDeadline", "uvicorn_options"]


class HeadDeadline(H11Protocol):
    """uvicorn's ``H11Protocol``, closing a connection whose request head is not complete
    ``header_timeout_s`` after it opened or after its last response."""

    header_timeout_s = 15.0  # set per server by uvicorn_options

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head was read: its app runs
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # the next request's head; a pipelined one read below disarms it
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _expired(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` that bound connections."""
    protocol = type("HeadDeadline", (HeadDeadline,), {"header_timeout_s": settings.header_timeout_s})
    return {"limit_concurrency": settings.max_connections, "http": protocol}
