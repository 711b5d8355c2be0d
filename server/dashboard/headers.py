"""Security headers on the service's answers: the page, its static files and the API's.

The dashboard builds its DOM from text (``static/util.js``: every string from the API is a
text node), so a tenant's param names, choices, user attrs or errors never become markup. The
Content-Security-Policy is the layer beneath: should markup ever get in, no script of it runs.

* ``script-src 'self'``: only the page's own module files; no inline script or event handler
  attribute, no ``eval``, no ``javascript:`` URL (the page has none of them).
* ``style-src 'self' 'unsafe-inline'``: ECharts' tooltips and uPlot set ``style`` attributes.
  Inline styles cannot run script.
* ``img-src 'self' data:``: the page's icon is ``data:,``.
* ``connect-src 'self'``: ``fetch`` reaches this service only, so nothing can carry a token
  elsewhere. ``object-src 'none'``, ``base-uri 'none'``, ``frame-ancestors 'none'`` (no page may
  frame the dashboard), ``form-action 'self'``.

With it: ``X-Content-Type-Options: nosniff`` (a JSON answer is never read as HTML or script),
``Referrer-Policy: no-referrer`` and ``X-Frame-Options: DENY`` for browsers without
``frame-ancestors``.

FastAPI's own API reference pages (``/docs``, ``/redoc``) load Swagger UI and ReDoc from a CDN
with an inline script; they get the directives that do not break them, and show no tenant's
data (the OpenAPI document only).
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "font-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
        "form-action 'self'",
    ]
)
#: The API reference pages' (inline script, assets from a CDN).
DOCS_CONTENT_SECURITY_POLICY = "object-src 'none'; base-uri 'none'; frame-ancestors 'none'"

HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


class SecurityHeaders:
    """ASGI middleware adding the headers above to every HTTP answer (streams included) that
    does not set them itself."""

    def __init__(self, app: ASGIApp, docs_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.docs_paths = docs_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = DOCS_CONTENT_SECURITY_POLICY if scope["path"] in self.docs_paths else CONTENT_SECURITY_POLICY

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers.setdefault("Content-Security-Policy", policy)
                for name, value in HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)
