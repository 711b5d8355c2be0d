"""The text of the API's integer and boolean parameters (path, query, header): what the OpenAPI
document's ``integer`` and ``boolean`` mean, and nothing else.

pydantic, reading a parameter's text as an ``int``, would also take ``+1``, `` 1``, ``1_0``
and ``1.0``, and as a ``bool`` ``yes``, ``on``, ``t`` or ``n``: no client that follows the
document sends those, and a server that takes them accepts what its document says it refuses
(Schemathesis' negative checks send them).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BeforeValidator

__all__ = ["BOOLEAN", "DECIMAL"]

_DECIMAL = re.compile(r"-?[0-9]+")


def _decimal_digits(value: Any) -> Any:
    if isinstance(value, str) and _DECIMAL.fullmatch(value) is None:
        raise ValueError("must be an integer in decimal digits")
    return value


#: The validator of an integer parameter: ``Annotated[int, Query(...), DECIMAL] = default``.
DECIMAL = BeforeValidator(_decimal_digits)

#: A boolean parameter's texts: JSON's words, and the 1 and 0 that clients commonly send.
_BOOLEANS = {"true": True, "false": False, "1": True, "0": False}


def _boolean_words(value: Any) -> Any:
    if isinstance(value, str):
        if value not in _BOOLEANS:
            raise ValueError("must be true or false")
        return _BOOLEANS[value]
    return value


#: The validator of a boolean parameter: ``Annotated[bool, Query(...), BOOLEAN] = default``.
BOOLEAN = BeforeValidator(_boolean_words)
