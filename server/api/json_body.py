"""Request bodies are JSON as RFC 8259 defines it, and text the service can write back.

Python's ``json.loads``, which FastAPI parses bodies with, reads more than JSON:

* ``NaN``, ``Infinity`` and ``-Infinity``, and a number too large for a double (``1e999``)
  as an infinity. No field of the API means them: a refused field's 422 echoes its input,
  which cannot be written back as JSON (a 500), and an accepted one was stored as ``null``.
* a lone UTF-16 surrogate escape (``"\\ud800"``), a string no UTF-8 encodes: stored, it made
  every answer that reads it back a 500 (one tenant's study name broke the admin's listing).
* the same key twice in an object, the last one winning, where RFC 8259 leaves it undefined
  and another parser may keep the first: the request would mean two things.
* bytes in UTF-16 or UTF-32, which it guesses from the first bytes; RFC 8259 asks for UTF-8.

So a body with any of these is a 422 naming where it is (``loc``), before a route sees it.
The routes get the parsed body from this request class (:class:`StrictJSONRequest`), which
FastAPI's own body handling then uses.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi import HTTPException, Request, status

#: A UTF-16 surrogate code point, which only a ``\\u`` escape can put into a parsed string.
_SURROGATE = re.compile("[\ud800-\udfff]")

Path = tuple[str | int, ...]


class _Refused(Exception):
    def __init__(self, path: Path, msg: str, kind: str) -> None:
        super().__init__(msg)
        self.path, self.msg, self.kind = path, msg, kind


class _Object(dict[str, Any]):
    """A parsed object that remembers a key it was given twice (the walk refuses it, with its path)."""

    repeated: str | None = None


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    out = _Object()
    for key, value in pairs:
        if key in out and out.repeated is None:
            out.repeated = key
        out[key] = value
    return out


def _text(value: str, path: Path) -> None:
    if _SURROGATE.search(value):
        raise _Refused(path, "a lone UTF-16 surrogate escape is no character: the text cannot be stored", "unicode_surrogate")


def _check(body: Any) -> None:
    """Raise :class:`_Refused` at the first thing refused, depth first, in document order.

    Walked with a stack, not recursion: a body may nest as deep as the JSON parser allows,
    deeper than the frames left to a recursive walk inside the ASGI stack.
    """
    stack: list[tuple[Path, Any]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _Refused(
                    path, f"{value} is not a JSON number: JSON has no NaN or Infinity, and numbers must fit a double",
                    "finite_number",
                )
        elif isinstance(value, str):
            _text(value, path)
        elif isinstance(value, dict):
            if isinstance(value, _Object) and value.repeated is not None:
                raise _Refused((*path, value.repeated), f"the key {value.repeated!r} is given twice in one object", "duplicate_key")
            for key in value:
                _text(key, (*path, key))
            stack.extend(((*path, k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(value))))


def _printable(part: str | int) -> str | int:
    """A path component as the 422 can write it: a surrogate in a key shown as its escape."""
    return part.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(part, str) else part


class StrictJSONRequest(Request):
    """A request whose JSON body is refused (422, naming where) if it holds what is not JSON's
    or not text: a non-finite number, a lone surrogate, a key given twice."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                # RFC 8259: JSON between systems is UTF-8 (a BOM may be ignored). Python's parser
                # would also guess UTF-16 and UTF-32; bytes that are no UTF-8 were a 400 naming nothing.
                text = (await self.body()).decode("utf-8-sig")
            except UnicodeDecodeError as exc:
                raise HTTPException(
                    status.HTTP_422_UNPROCESSABLE_CONTENT,
                    [{"loc": ["body"], "msg": f"the body is not UTF-8 text: {exc.reason} at byte {exc.start}", "type": "utf8"}],
                ) from None
            body = json.loads(text, object_pairs_hook=_object)  # JSONDecodeError: FastAPI's own 422
            try:
                _check(body)
            except _Refused as refused:
                raise HTTPException(
                    status.HTTP_422_UNPROCESSABLE_CONTENT,
                    [{"loc": ["body", *map(_printable, refused.path)], "msg": refused.msg, "type": refused.kind}],
                ) from None
            self._json = body
        return self._json
