"""Cursor pagination of the list routes: ``limit``, an ``after`` cursor, and a ``Link`` header
(RFC 8288, ``rel="next"``) naming the next page.

A page is read by keyset ("the rows after this row's sort key"), never by offset, so a page
costs the same at the start and the end of 100,000 trials, and rows that are added or change
between two requests are neither skipped nor repeated because of it. The response body stays
a JSON list, as before pagination: a client that wants more follows the ``Link`` header, and
the last page has none.

A cursor is the position of the page's last row: its key in every order its listing can be
sorted by (:class:`CursorFormat`), so the next page is "the rows after that row" in whatever
order the request asks. Each listing's cursors have a regular grammar that its ``after``
parameter states as its OpenAPI ``pattern``: every string the pattern matches is a position
the listing accepts, and any other is a 422 naming ``after`` (FastAPI's, before the route
runs). A client takes cursors from the ``Link`` header and never needs to build one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, Generic, TypeVar

from fastapi import Query, Request, Response
from pydantic import BaseModel, TypeAdapter

from fusetune.server.params import DECIMAL

__all__ = [
    "DEFAULT_LIMIT",
    "ID_CURSOR",
    "LINK_HEADER",
    "MAX_LIMIT",
    "NAME_CURSOR",
    "TRIAL_CURSOR",
    "CursorFormat",
    "Page",
    "PageParams",
    "TrialKey",
    "json_page",
    "page_params",
    "paged",
]

#: Rows per page when a request names no ``limit``, and the most it may name.
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000

T = TypeVar("T")
K = TypeVar("K")

#: How list routes document the header in the OpenAPI document.
LINK_HEADER = {
    "Link": {
        "description": 'The next page, as `<URL>; rel="next"` (RFC 8288); absent on the last page.',
        "schema": {"type": "string"},
    }
}

# The grammar's pieces. Integers have at most 18 digits, so every one is below 2**63 and
# the database can compare it (SQLite binds nothing wider). A float is Python's repr without
# the exponent's "+" (a "+" in a query string reads as a space); one past float's range is
# infinite, which the databases compare too: a position after every finite value.
_INT = r"[0-9]{1,18}"
_FLOAT = r"-?[0-9]{1,17}(\.[0-9]{1,24})?(e-?[0-9]{1,3})?"
_NO_VALUE = "n"


@dataclass(frozen=True)
class TrialKey:
    """A trial's position in every order of a study's trials: by number, revision and value."""

    number: int
    id: int
    revision: int
    value: float | None  # None: in the run of trials without a value, which comes last


@dataclass(frozen=True)
class CursorFormat(Generic[K]):
    """The cursors of one listing: a regular grammar, its key's encoding and decoding.

    ``pattern`` (a full-match regular expression, ECMA-262 and Rust alike) is what the
    listing's ``after`` parameter states in the OpenAPI document and what FastAPI checks;
    ``decode`` turns every string it matches into a key, and ``encode`` gives a key's cursor.
    """

    pattern: str
    example: str
    encode: Callable[[K], str]
    decode: Callable[[str], K]

    def __post_init__(self) -> None:
        assert re.fullmatch(self.pattern, self.example) and self.encode(self.decode(self.example)) == self.example


def _float_text(value: float) -> str:
    """``value`` in the cursor grammar: its repr, which reads back as the same float."""
    if math.isnan(value):
        raise ValueError("a NaN has no position: Optuna stores no NaN value")
    if math.isinf(value):
        return "1e999" if value > 0 else "-1e999"  # reads back as the same infinity
    return repr(float(value)).replace("e+", "e")


def _encode_trial(key: TrialKey) -> str:
    value = _NO_VALUE if key.value is None else _float_text(key.value)
    return f"{key.number}_{key.id}_{key.revision}_{value}"


def _decode_trial(cursor: str) -> TrialKey:
    number, id_, revision, value = cursor.split("_")
    return TrialKey(int(number), int(id_), int(revision), None if value == _NO_VALUE else float(value))


#: Listings by integer id (studies, arrays, a tenant's tokens): the last row's id.
ID_CURSOR: CursorFormat[int] = CursorFormat(f"^{_INT}$", "42", str, int)
#: Listings by name (tenants): the last row's name (a tenant name's grammar).
NAME_CURSOR: CursorFormat[str] = CursorFormat(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$", "team-a", lambda name: name, lambda cursor: cursor
)
#: A study's trials: ``<number>_<id>_<revision>_<value>`` of the last row, ``n`` for no value.
TRIAL_CURSOR: CursorFormat[TrialKey] = CursorFormat(
    f"^{_INT}_{_INT}_{_INT}_({_NO_VALUE}|{_FLOAT})$", "7_1234_98765_0.8125", _encode_trial, _decode_trial
)


@dataclass
class Page(Generic[T]):
    """One page of a listing: its rows, and the ``after`` cursor of the next page (None: last)."""

    items: list[T]
    next: str | None = None


@dataclass(frozen=True)
class PageParams:
    """A request's page: at most ``limit`` rows after the cursor ``after`` (None: from the start)."""

    limit: int = DEFAULT_LIMIT
    after: str | None = None


def page_params(cursor: CursorFormat[Any]) -> Callable[..., Any]:
    """The dependency reading ``limit`` and ``after`` of a listing whose cursors are ``cursor``'s."""

    async def dependency(
        limit: Annotated[int, Query(
            ge=1, le=MAX_LIMIT, description=f"Rows per page (default {DEFAULT_LIMIT}, at most {MAX_LIMIT})."
        ), DECIMAL] = DEFAULT_LIMIT,
        after: str = Query(  # not nullable in the document: absent is None
            None, pattern=cursor.pattern, examples=[cursor.example],
            description="The position to read on from: the cursor in the previous page's `Link: <...>; rel=\"next\"` "
            "header (the last row's position in every order of the listing, so it works with any `sort`).",
        ),
    ) -> PageParams:
        return PageParams(limit=limit, after=after)

    return dependency


def _next_link(request: Request, cursor: str) -> str:
    url = request.url.include_query_params(after=cursor)
    return f'<{url.path}?{url.query}>; rel="next"'


@lru_cache(maxsize=32)
def _list_adapter(model: type[BaseModel]) -> TypeAdapter[list[Any]]:
    return TypeAdapter(list[model])  # type: ignore[valid-type]


def json_page(page: Page[Any], request: Request, model: type[BaseModel]) -> Response:
    """The page as its JSON response, serialised once by pydantic: what FastAPI makes of a
    route's ``response_model`` for the same rows, without validating them a second time and
    going through plain Python objects (a page of 100 trials: about 1 ms instead of 4)."""
    headers = {"Link": _next_link(request, page.next)} if page.next is not None else None
    return Response(_list_adapter(model).dump_json(page.items), media_type="application/json", headers=headers)


def paged(page: Page[T], request: Request, response: Response) -> list[T]:
    """The page's rows, with a ``Link`` header to the next page when there is one.

    The link is the request's own path and query with ``after`` replaced (a relative
    reference, so it survives proxies that rewrite the host).
    """
    if page.next is not None:
        response.headers["Link"] = _next_link(request, page.next)
    return page.items
