"""The wire schema of a search space entry: Optuna's distribution JSON, as pydantic models.

A study's ``search_space`` maps each parameter to a distribution in the JSON that
``optuna.distributions.json_to_distribution`` reads: the full form that
``distribution_to_json`` writes (``{"name": "FloatDistribution", "attributes": {...}}``,
Optuna's older class names included) or the abbreviated one (``{"type": "float", "low": ...}``),
as an object or as a string holding it. The models here state that grammar exactly, so the
OpenAPI document says what an entry may be, and a request is checked against the very models
the document is made from: types are strict (no ``true`` for a number, no ``1.5`` for an
integer), numbers finite, integers within float's exact range (Optuna keeps every param as
a float), and no key beyond Optuna's. What JSON Schema cannot relate, ``low <= high``, a
positive ``low`` on a log scale and no ``step`` with ``log``, Optuna itself checks after.

:data:`SearchSpaceEntry` is the type of one entry: it validates against these models and
keeps the value as sent (a string stays the string), which is what the study stores.
"""

from __future__ import annotations

import json
import warnings
from typing import Annotated, Any, Literal

import optuna
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, GetPydanticSchema, Json, StrictBool
from pydantic_core import PydanticCustomError, ValidationError, core_schema

__all__ = ["Distribution", "SearchSpaceEntry"]

#: Integers a float holds exactly: Optuna stores a param's value as a float.
MAX_EXACT_INT = 2**53


def json_integer(value: Any) -> Any:
    """A JSON integer: 3 or 3.0 (JSON Schema's integers), never true, "3" or 3.5. None passes
    (an optional field's null; a required one refuses it after this)."""
    if value is None:
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be an integer")
    return value


Finite = Annotated[float, Field(allow_inf_nan=False)]
Step = Annotated[float, Field(gt=0, allow_inf_nan=False)]
# Field before the validator: after one, pydantic writes its bounds into the JSON Schema as
# "ge"/"le", which no validator reads, instead of "minimum"/"maximum".
Integer = Annotated[int, Field(ge=-MAX_EXACT_INT, le=MAX_EXACT_INT), BeforeValidator(json_integer)]
IntStep = Annotated[int, Field(ge=1, le=MAX_EXACT_INT), BeforeValidator(json_integer)]
#: Characters in a categorical choice or a param's string value: every read of a trial carries it.
MAX_CHOICE_CHARS = 4096
#: Choices of one categorical param: its study's mirror, and each sampler, holds them all.
MAX_CHOICES = 10_000
Choice = Annotated[
    None | StrictBool | Annotated[int, Field(ge=-MAX_EXACT_INT, le=MAX_EXACT_INT)] | Finite
    | Annotated[str, Field(max_length=MAX_CHOICE_CHARS)],
    Field(union_mode="left_to_right"),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FloatAttributes(_Strict):
    """``FloatDistribution(low, high, log, step)``: ``low <= high``; with ``log``, ``low > 0`` and no ``step``."""

    low: Finite
    high: Finite
    log: StrictBool = False
    step: Step | None = None


class IntAttributes(_Strict):
    """``IntDistribution(low, high, log, step)``: ``low <= high``; with ``log``, ``low >= 1`` and ``step`` 1."""

    low: Integer
    high: Integer
    log: StrictBool = False
    step: IntStep = 1


class CategoricalAttributes(_Strict):
    """``CategoricalDistribution(choices)``: null, booleans, numbers and strings."""

    choices: list[Choice] = Field(min_length=1, max_length=MAX_CHOICES)


class UniformAttributes(_Strict):
    """``UniformDistribution`` and ``LogUniformDistribution`` (Optuna's older names): ``low <= high``."""

    low: Finite
    high: Finite


class DiscreteUniformAttributes(_Strict):
    """``DiscreteUniformDistribution(low, high, q)`` (Optuna's older name): ``low <= high``."""

    low: Finite
    high: Finite
    q: Step


class IntUniformAttributes(_Strict):
    """``IntUniformDistribution`` and ``IntLogUniformDistribution`` (Optuna's older names): ``low <= high``."""

    low: Integer
    high: Integer
    step: IntStep = 1


class FloatDistribution(_Strict):
    name: Literal["FloatDistribution"]
    attributes: FloatAttributes


class IntDistribution(_Strict):
    name: Literal["IntDistribution"]
    attributes: IntAttributes


class CategoricalDistribution(_Strict):
    name: Literal["CategoricalDistribution"]
    attributes: CategoricalAttributes


class UniformDistribution(_Strict):
    name: Literal["UniformDistribution", "LogUniformDistribution"]
    attributes: UniformAttributes


class DiscreteUniformDistribution(_Strict):
    name: Literal["DiscreteUniformDistribution"]
    attributes: DiscreteUniformAttributes


class IntUniformDistribution(_Strict):
    name: Literal["IntUniformDistribution", "IntLogUniformDistribution"]
    attributes: IntUniformAttributes


class FloatShorthand(_Strict):
    """The abbreviated float form: ``{"type": "float", "low": 0.001, "high": 0.1, "log": true}``."""

    type: Literal["float"]
    low: Finite
    high: Finite
    log: StrictBool = False
    step: Step | None = None


class IntShorthand(_Strict):
    """The abbreviated integer form: ``{"type": "int", "low": 1, "high": 8}`` (``step`` null: 1)."""

    type: Literal["int"]
    low: Integer
    high: Integer
    log: StrictBool = False
    step: IntStep | None = None


class CategoricalShorthand(_Strict):
    """The abbreviated categorical form: ``{"type": "categorical", "choices": ["adam", "sgd"]}``."""

    type: Literal["categorical"]
    choices: list[Choice] = Field(min_length=1, max_length=MAX_CHOICES)


FullForm = Annotated[
    FloatDistribution | IntDistribution | CategoricalDistribution | UniformDistribution
    | DiscreteUniformDistribution | IntUniformDistribution,
    Field(discriminator="name"),
]
Shorthand = Annotated[FloatShorthand | IntShorthand | CategoricalShorthand, Field(discriminator="type")]
#: One distribution, as an object: Optuna's full form (by ``name``) or its abbreviated one (by ``type``).
Distribution = FullForm | Shorthand


def _keep_as_sent(value: Any, validate: core_schema.ValidatorFunctionWrapHandler) -> Any:
    """``value`` once the models and then Optuna accept it (Optuna checks what relates two
    attributes); a string stays the string: it is what the study stores and shows."""
    try:
        validate(value)
    except ValidationError as exc:
        raise PydanticCustomError("distribution", "not an Optuna distribution JSON: {reason}", {"reason": _reason(exc, value)}) from None
    try:
        with warnings.catch_warnings():
            # Optuna's older names still read, and a range not divisible by the step is
            # narrowed as the study will narrow it: neither is the request's error.
            warnings.simplefilter("ignore")
            optuna.distributions.json_to_distribution(value if isinstance(value, str) else json.dumps(value))
    except (ValueError, ArithmeticError) as exc:  # a step Optuna's Decimal arithmetic cannot divide the range by
        reason = str(exc) if isinstance(exc, ValueError) else f"Optuna cannot use this step over this range ({type(exc).__name__})"
        raise PydanticCustomError("distribution", "not a valid Optuna distribution: {reason}", {"reason": reason}) from None
    return value


def _reason(exc: ValidationError, value: Any) -> str:
    """The most specific of the union's errors, for the form ``value`` was sent in (string or
    object), its location without pydantic's union tags: ``attributes.low: Input should be a valid number``."""
    as_json = [e for e in exc.errors() if e["loc"] and str(e["loc"][0]).startswith("json[")]
    errors = (as_json if isinstance(value, str) else [e for e in exc.errors() if e not in as_json]) or exc.errors()
    # The form whose tag the entry has ('name' or 'type') says what is wrong; the other form's
    # "Unable to extract tag" only says the entry is not of that form.
    tagged = [e for e in errors if e["type"] != "union_tag_not_found"]
    if not tagged and all(e["type"] == "union_tag_not_found" for e in errors):
        return (
            "an entry names its distribution by 'name' (Optuna's form, e.g. FloatDistribution) or by "
            "'type' (the short form: float, int or categorical)"
        )
    deepest = max(tagged or errors, key=lambda e: len(e["loc"]))
    where = ".".join(str(part) for part in deepest["loc"] if "[" not in str(part))
    return f"{where}: {deepest['msg']}" if where else deepest["msg"]


#: A search space entry: a :data:`Distribution`, or a string of its JSON; validated against
#: the models, then by Optuna, and kept as sent. Its JSON Schema is the models' (the string form's through
#: ``contentMediaType``/``contentSchema``).
SearchSpaceEntry = Annotated[
    str | dict[str, Any],
    GetPydanticSchema(
        lambda _, handler: core_schema.no_info_wrap_validator_function(_keep_as_sent, handler(Json[Distribution] | Distribution))
    ),
]
