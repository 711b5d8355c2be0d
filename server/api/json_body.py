"""Request bodies are JSON as RFC 8259 defines it, and text the service can write back.

Python's ``json.loads``, which FastAPI parses bodies with, reads more than JSON:

* ``NaN``, ``Infinity`` and ``-Infinity``, and a number too large for a double (``1e999``)
  as an infinity; an integer too large for one (``1`` and 309 zeros) it read exactly, and one
  of more than 4,300 digits it refused with a ``ValueError`` that FastAPI made a 400 naming
  nothing (before the route authenticated). Integers are read here as Python's ``int``
  while they fit a double, else as an infinity, which is then refused as the others are. No field of the API means them: a refused field's 422 echoes its input,
  which cannot be written back as JSON (a 500), and an accepted one was stored as ``null``.
* a lone UTF-16 surrogate escape (``"\\ud800"``), a string no UTF-8 encodes: stored, it made
  every answer that reads it back a 500 (one tenant's study name broke the admin's listing).
* bytes in UTF-16 or UTF-32, which it guesses from the first bytes; RFC 8259 asks for UTF-8.

So a body with any of these is a 422 naming where it is (``loc``), before a route sees it.
The routes get the parsed body from this request class (:class:`StrictJSONRequest`), which
FastAPI's own body handling then uses. A key given twice in one object is left as Python
(and JavaScript's ``JSON.parse``) read it: the last one counts.

This runs on every body, before the route authenticates, so the check itself is C's: the
parsed body is written back once with ``json.dumps(allow_nan=False)`` and encoded as UTF-8,
as an answer would be (about what parsing it cost). Only a body that fails is walked, once,
to name the place.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from fastapi import HTTPException, Request, status

Path = tuple[str | int, ...]


def _writable(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _where(body: Any) -> tuple[Path, str, str]:
    """The first place, depth first in document order, that no answer could write back; its
    message and type. Walked with a stack of (parent, key) links, not recursion nor a tuple
    per item: a body may be as deep and as wide as the parser allows, and costs one pass."""
    nodes: list[tuple[int, str | int]] = [(-1, "")]  # (parent node, key in it); node 0 is the body

    def path(node: int) -> Path:
        parts: list[str | int] = []
        while node > 0:
            parent, key = nodes[node]
            parts.append(key)
            node = parent
        return tuple(reversed(parts))

    stack: list[tuple[int, Any]] = [(0, body)]
    while stack:
        node, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path(node), f"{value} is not a JSON number: JSON has no NaN or Infinity, and numbers must fit a double", "finite_number"
        if isinstance(value, str) and not _writable(value):
            return path(node), "a lone UTF-16 surrogate escape is no character: the text cannot be stored", "unicode_surrogate"
        items: Any = ()
        if isinstance(value, dict):
            for key in value:
                if not _writable(key):
                    nodes.append((node, key))
                    return path(len(nodes) - 1), "a lone UTF-16 surrogate escape is no character: the key cannot be stored", "unicode_surrogate"
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        children = []
        for key, child in items:
            if isinstance(child, (dict, list, str, float)):
                nodes.append((node, key))
                children.append((len(nodes) - 1, child))
        stack.extend(reversed(children))
    return (), "the body cannot be written back as JSON", "json_invalid"


#: Digits of the largest double's integer part: an integer literal with more is too large for one.
_DOUBLE_DIGITS = len(str(int(sys.float_info.max)))


def _integer(literal: str) -> int | float:
    """A JSON integer literal (``json.loads``'s ``parse_int``): its ``int`` while it fits a
    double, else an infinity (refused below, naming where), never ``int()`` of thousands of digits."""
    digits = len(literal) - literal.startswith("-")
    if digits < _DOUBLE_DIGITS:
        return int(literal)
    if digits == _DOUBLE_DIGITS and abs(value := int(literal)) <= sys.float_info.max:
        return value
    return -math.inf if literal.startswith("-") else math.inf


def _printable(part: str | int) -> str | int:
    """A path component as the 422 can write it: a surrogate in a key shown as its escape."""
    return part.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(part, str) else part


class StrictJSONRequest(Request):
    """A request whose JSON body is refused (422, naming where) if it is not UTF-8 or holds
    what JSON or UTF-8 text lacks: a non-finite number, a lone surrogate."""

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
            try:
                body = json.loads(text, parse_int=_integer)  # JSONDecodeError: FastAPI's own 422
            except RecursionError:  # nested past the parser's depth: FastAPI made it a 400 naming nothing
                raise HTTPException(
                    status.HTTP_422_UNPROCESSABLE_CONTENT,
                    [{"loc": ["body"], "msg": "the body nests arrays or objects too deep to read", "type": "json_depth"}],
                ) from None
            try:
                json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")
            except ValueError:  # a non-finite number, or (UnicodeEncodeError) a lone surrogate
                path, msg, kind = _where(body)
                raise HTTPException(
                    status.HTTP_422_UNPROCESSABLE_CONTENT,
                    [{"loc": ["body", *map(_printable, path)], "msg": msg, "type": kind}],
                ) from None
            self._json = body
        return self._json
