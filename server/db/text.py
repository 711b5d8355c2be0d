"""Text that every database stores and every answer can write back.

Python's ``str`` holds any code point, a lone UTF-16 surrogate (``"\\udcff"``) among them;
UTF-8 holds none. A request cannot bring one (``server/api/json_body.py`` refuses it), but a
tenant's code can: an exception whose message has one, a warning that names a class whose
name has one. Stored as it is, such text fails the transaction that writes it (SQLite's and
psycopg's encoders refuse it, PostgreSQL's ``json`` refuses its escape), and an array's whole
outcome was lost with it: its trials stayed RUNNING. Stored as a JSON escape (Optuna's attrs,
SQLite's JSON columns), it read back as the surrogate, and every answer that carried it was a
500. So what the service writes goes through :func:`storable`: a lone surrogate becomes the
six characters of its escape, visible and harmless, and all other text is left as it is.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Text
from sqlalchemy.types import TypeDecorator

__all__ = ["StorableText", "dumps", "storable"]


def storable(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings (dict keys too) written as its
    backslash escape; lists and tuples come back as lists, everything else as it is."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """JSON text of ``value`` that every database stores (the engines' JSON serializer, and
    the Optuna attrs the service writes)."""
    text = json.dumps(value)
    # ASCII only: any character past the BMP, or a lone surrogate, is a \\ud... escape. Only
    # then can there be one to make storable (a valid pair comes out the same).
    return json.dumps(storable(value)) if "\\ud" in text else text


class StorableText(TypeDecorator[str]):
    """``Text`` whose values are made :func:`storable` on the way in (errors from a tenant's code)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        return None if value is None else storable(value)
