"""The types of a request's fields that several models share: stored text, JSON integers."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, StringConstraints
from pydantic.json_schema import JsonDict

from fusetune.server.distributions import json_integer

__all__ = ["NO_NUL_KEYS", "JsonInt", "NoNul", "NoNulKeys", "OptionalJsonInt"]

#: Text a request stores (names, keys, labels): anything but NUL, which PostgreSQL's text refuses.
NoNul = Annotated[str, StringConstraints(pattern=r"^[^\x00]*$")]
#: The OpenAPI words for an object whose keys are NoNul (pydantic would say patternProperties).
NO_NUL_KEYS: JsonDict = {"propertyNames": {"pattern": r"^[^\x00]*$"}}


def _no_nul_keys(value: Any) -> Any:
    for key in value or ():
        if "\x00" in key:
            raise ValueError(f"key {key!r} contains NUL")
    return value


#: An object whose keys are stored as text (Optuna's param and attr names).
NoNulKeys = AfterValidator(_no_nul_keys)

#: An integer field of a request body (its model is strict: no strings or booleans for numbers).
JsonInt = Annotated[int, BeforeValidator(json_integer)]
OptionalJsonInt = Annotated[int | None, BeforeValidator(json_integer)]  # (constraints then apply to the int)
