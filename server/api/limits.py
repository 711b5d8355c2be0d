"""What a request body may be: at most ``FUSETUNE_MAX_BODY_BYTES``, and JSON on write routes.

The one exception is the upload of a code package (``PUT /api/v1/packages/{digest}``): a zip
(``Content-Type: application/zip``, 415 otherwise) of at most ``FUSETUNE_PACKAGE_MAX_BYTES``,
which is not read here but counted as the route reads it, after it has authenticated the
caller (413 at the first byte over the limit, or at once from its ``Content-Length``).

* A body over the limit is a 413, whether its ``Content-Length`` says so (answered before
  anything is read) or it is sent in chunks (counted as they arrive; the request stops at
  the first byte over the limit). A body under it is read here and handed on unchanged.
* A body that has not arrived ``FUSETUNE_BODY_TIMEOUT_S`` after its first read is a 408: a
  connection that trickles its body, or stops sending it, holds nothing for longer (before
  authentication, a body is buffered here). With ``FUSETUNE_MAX_CONNECTIONS`` (uvicorn's
  ``limit_concurrency``) this bounds what unauthenticated connections can make the server hold.
* A ``POST``, ``PUT``, ``PATCH`` or ``DELETE`` whose body is not JSON is a 415: a
  ``Content-Type`` other than ``application/json`` (or ``application/*+json``), or a body
  with no ``Content-Type`` at all. A cross-site HTML form can send only form data or text,
  so no web page can make a browser create studies with the cookies or tokens it holds.
"""

from __future__ import annotations

import asyncio
import re

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: The upload of a code package, and what it takes.
PACKAGE_UPLOAD = re.compile(r"^/api/v1/packages/[^/]+/?$")
ZIP = "application/zip"


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _package_too_large(max_bytes: int) -> str:
    return f"the package is larger than {max_bytes} bytes (FUSETUNE_PACKAGE_MAX_BYTES)"


class RequestBodyLimits:
    """ASGI middleware enforcing the body limits (413) and JSON-only writes (415)."""

    def __init__(self, app: ASGIApp, max_bytes: int, package_max_bytes: int | None = None, body_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.package_max_bytes = package_max_bytes if package_max_bytes is not None else max_bytes
        self.body_timeout_s = body_timeout_s

    def _late(self) -> str:
        return f"the request body did not arrive within {self.body_timeout_s:g} s (FUSETUNE_BODY_TIMEOUT_S)"

    def _deadline(self, receive: Receive) -> Receive:
        """``receive`` that gives up (TimeoutError) once the body has taken ``body_timeout_s``:
        a connection that trickles its body, or stops sending it, cannot hold what it sent."""
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def timed() -> Message:
            return await asyncio.wait_for(receive(), timeout=max(0.0, deadline - asyncio.get_running_loop().time()))

        return timed

    def _too_large(self) -> JSONResponse:
        return JSONResponse(
            {"detail": f"the request body is larger than {self.max_bytes} bytes (FUSETUNE_MAX_BODY_BYTES)"}, status_code=413
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if PACKAGE_UPLOAD.match(scope["path"]):
            if scope["method"] == "PUT":
                await self._package(scope, receive, send)
            else:  # GET, HEAD, or a method the route has not: the router answers (405), not a 415
                await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if length is not None and not chunked:
            try:
                declared = int(length)
            except ValueError:
                await JSONResponse({"detail": "Content-Length is not a number"}, status_code=400)(scope, receive, send)
                return
            if declared > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
        has_body = chunked or (length is not None and length.strip() != "0")
        content_type = headers.get("content-type")
        if scope["method"] in WRITES and (content_type is not None or has_body) and not is_json(content_type or ""):
            got = f"Content-Type {content_type!r}" if content_type is not None else "a body with no Content-Type"
            await JSONResponse(
                {"detail": f"the API takes JSON bodies (Content-Type: application/json), not {got}"}, status_code=415
            )(scope, receive, send)
            return
        if not has_body:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        timed = self._deadline(receive)
        while True:
            try:
                message = await timed()
            except TimeoutError:
                await JSONResponse({"detail": self._late()}, status_code=408)(scope, receive, send)
                return
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # http.disconnect, when it comes

        await self.app(scope, replay, send)

    async def _package(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A package's upload: a zip within ``FUSETUNE_PACKAGE_MAX_BYTES``, counted as the route reads it."""
        headers = Headers(scope=scope)
        limit = self.package_max_bytes
        length = headers.get("content-length")
        if length is not None and "chunked" not in headers.get("transfer-encoding", "").lower():
            if not length.strip().isdigit():
                await JSONResponse({"detail": "Content-Length is not a number"}, status_code=400)(scope, receive, send)
                return
            if int(length) > limit:
                await JSONResponse({"detail": _package_too_large(limit)}, status_code=413)(scope, receive, send)
                return
        # The Content-Type is the route's to check, after authentication (a 401 comes first).
        size = 0
        timed = self._deadline(receive)

        async def counted() -> Message:
            nonlocal size
            try:
                message = await timed()
            except TimeoutError:  # raised in the route's read of the body: its answer is the 408
                raise HTTPException(408, self._late()) from None
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit:  # raised in the route's read of the body: its answer is the 413
                    raise HTTPException(413, _package_too_large(limit))
            return message

        await self.app(scope, counted, send)
