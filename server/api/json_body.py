"""Request bodies are JSON as RFC 8259 defines it: numbers are finite.

Python's ``json.loads``, which FastAPI parses bodies with, also reads ``NaN``, ``Infinity``
and ``-Infinity``, and a number too large for a double (``1e999``) as an infinity. None of
these is JSON, no field of the API means them, and they would go wrong later: a refused
field's 422 echoes its input, which cannot be written back as JSON (a 500), and an accepted
one would be stored as ``null`` (data silently changed). So a body with one is a 422 naming
the field it is in, before any route sees it. The routes get the parsed body from this
request class (:class:`StrictJSONRequest`), which FastAPI's own body handling then uses.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import HTTPException, Request, status


def _non_finite(body: Any) -> tuple[tuple[str | int, ...], float] | None:
    """The path of the first non-finite number in a parsed body, and the number; ``None`` if none.

    Walked with a stack, not recursion: a body may nest as deep as the JSON parser allows,
    deeper than the frames left to a recursive walk inside the ASGI stack.
    """
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                return path, value
        elif isinstance(value, dict):
            stack.extend(((*path, k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(value))))
    return None


class StrictJSONRequest(Request):
    """A request whose JSON body is refused (422, naming the field) if it holds a non-finite number."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = json.loads(await self.body())  # JSONDecodeError: FastAPI's own 422
            found = _non_finite(body)
            if found is not None:
                path, number = found
                raise HTTPException(
                    status.HTTP_422_UNPROCESSABLE_CONTENT,
                    [{
                        "loc": ["body", *path],
                        "msg": f"{number} is not a JSON number: JSON has no NaN or Infinity, and numbers "
                        "must fit a double",
                        "type": "finite_number",
                    }],
                )
            self._json = body
        return self._json
