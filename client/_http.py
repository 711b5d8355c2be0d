"""The connection under every :class:`~fusetune.client.Client` call: the service's URL, the
bearer token, one request and its error, and the pages of a listing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Self
from urllib.parse import quote

import httpx

#: Rows per page when the client reads a whole listing (the service's most).
PAGE_SIZE = 1000
#: The service a client talks to when no ``url`` is given and ``FUSETUNE_URL`` is unset.
DEFAULT_URL = "http://127.0.0.1:8000"


def service_url(url: str | None = None) -> str:
    """``url``, else ``FUSETUNE_URL``, else :data:`DEFAULT_URL`."""
    return url or os.environ.get("FUSETUNE_URL", DEFAULT_URL)


class FusetuneError(RuntimeError):
    """The service answered with an error; ``status_code`` and ``detail`` say which."""

    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


def segment(text: str) -> str:
    """``text`` as one path segment of a URL: every character but letters, digits, ``-``,
    ``_`` and ``~`` percent-encoded, so a ``/``, ``?``, ``#`` or ``%`` in it stays in it, and
    ``.`` too (httpx would resolve a ``.`` or ``..`` segment away)."""
    return quote(text, safe="").replace(".", "%2E")


def _failure(response: httpx.Response) -> FusetuneError:
    """The error an answer of the service says."""
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text
    return FusetuneError(response.status_code, detail)


class Connection:
    """One service and one token: the base of the client's groups of calls.

    ``url`` is ``FUSETUNE_URL`` when omitted; ``token`` is a tenant's (or the admin's) bearer
    token, ``FUSETUNE_TOKEN`` when omitted.
    """

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self.url = service_url(url).rstrip("/")
        token = token if token is not None else os.environ.get("FUSETUNE_TOKEN")
        self.token = token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        if response.is_error:
            raise _failure(response)
        return response.json() if response.content else None  # 204: no body

    def pages(self, path: str, params: dict[str, Any] | None = None) -> Iterator[list[dict[str, Any]]]:
        """Each page of a listing route (``/api/v1/studies``, ``.../trials``, ...), following
        the ``Link: <...>; rel="next"`` header of each until the last page."""
        url: str | None = path
        while url is not None:
            response = self._http.get(url, params=params)
            if response.is_error:
                raise _failure(response)
            yield response.json()
            url, params = response.links.get("next", {}).get("url"), None  # the link carries the query

    def _listing(self, path: str, **params: Any) -> list[dict[str, Any]]:
        """Every row of a listing; ``params`` left None are not sent."""
        query = {"limit": PAGE_SIZE, **{k: v for k, v in params.items() if v is not None}}
        return [row for page in self.pages(path, query) for row in page]

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz")
