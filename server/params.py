"""What every integer parameter of the API (path, query, header) shares: its text is an integer
in decimal digits, as the OpenAPI document's ``integer`` means.

pydantic, reading a parameter's text as an ``int``, would also take ``+1``, `` 1``, ``1_0``
and ``1.0``: no client that follows the document sends those, and a server that takes them
accepts what its document says it refuses (Schemathesis' negative checks send them).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BeforeValidator

__all__ = ["DECIMAL"]

_DECIMAL = re.compile(r"-?[0-9]+")


def _decimal_digits(value: Any) -> Any:
    if isinstance(value, str) and _DECIMAL.fullmatch(value) is None:
        raise ValueError("must be an integer in decimal digits")
    return value


#: The validator of an integer parameter: ``Annotated[int, DECIMAL] = Query(...)``.
DECIMAL = BeforeValidator(_decimal_digits)
