"""A search space entry's JSON Schema (what the OpenAPI document states) and its validation agree.

``server/distributions.py`` states Optuna's distribution JSON as pydantic models; requests are
checked against those models, then by Optuna for what relates two attributes. Here: every
distribution Optuna writes is accepted in both forms and kept as sent, and for generated
entries the document's schema and the validation agree: what the schema refuses is refused,
and what it allows is accepted unless Optuna's own rule (``low <= high``, ...) refuses it.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import jsonschema
import optuna.distributions as od
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, ValidationError

from fusetune.server.distributions import SearchSpaceEntry


class Space(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    entry: SearchSpaceEntry


SCHEMA = Space.model_json_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def _optuna_distributions() -> list[od.BaseDistribution]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # Optuna's older classes, which requests may still name
        return [
            od.FloatDistribution(0.001, 0.1, log=True), od.FloatDistribution(0.0, 1.0, step=0.25), od.FloatDistribution(-3, 3),
            od.IntDistribution(1, 8), od.IntDistribution(1, 64, log=True), od.IntDistribution(0, 100, step=5),
            od.CategoricalDistribution(["adam", 1, 2.5, None, True]), od.UniformDistribution(0, 1),
            od.LogUniformDistribution(0.1, 1), od.DiscreteUniformDistribution(0, 1, 0.5), od.IntUniformDistribution(1, 5),
            od.IntLogUniformDistribution(1, 8),
        ]


@pytest.mark.parametrize("distribution", _optuna_distributions(), ids=lambda d: type(d).__name__)
def test_what_optuna_writes_is_accepted_and_kept_as_sent(distribution: od.BaseDistribution) -> None:
    text = od.distribution_to_json(distribution)
    for sent in (text, json.loads(text)):
        assert Space(entry=sent).entry == sent
        assert VALIDATOR.is_valid({"entry": sent})


@pytest.mark.parametrize(
    "entry",
    [
        {"type": "float", "low": 0.001, "high": 0.1, "log": True},
        {"type": "float", "low": 0, "high": 1, "step": None},
        {"type": "int", "low": 1, "high": 8, "step": None},
        {"type": "int", "low": 2.0, "high": 8.0},  # JSON Schema's integers
        {"type": "categorical", "choices": ["relu", "tanh"]},
    ],
)
def test_optunas_short_forms_are_accepted(entry: dict[str, Any]) -> None:
    assert Space(entry=entry).entry == entry and Space(entry=json.dumps(entry)).entry == json.dumps(entry)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"type": "flaot", "low": 0, "high": 1}, "'flaot' found using 'type' does not match any of the expected tags: 'float'"),
        ({"name": "FlaotDistribution", "attributes": {}}, "'FlaotDistribution' found using 'name'"),
        ({"low": 0, "high": 1}, "names its distribution by 'name' (Optuna's form, e.g. FloatDistribution) or by 'type'"),
        ({"type": "float", "low": "a", "high": 1}, "low: Input should be a valid number"),
    ],
)
def test_a_refusal_speaks_of_the_form_the_entry_is_in(entry: dict[str, Any], says: str) -> None:
    """A typo in the short form's type is named as one, not as a missing Optuna 'name'."""
    for sent in (entry, json.dumps(entry)):
        message = _refusal(sent)
        assert message is not None and says in message and "Unable to extract tag" not in message, message


# Entries near the grammar: each form with values of the right types (required keys, some
# optional ones), then, half the time, one change: a value of another JSON type, a key too many
# or one missing.
_number = st.floats(-1e6, 1e6, allow_nan=False)
_int = st.integers(-1000, 1000)
_choice = st.one_of(st.none(), st.booleans(), _int, _number, st.text(max_size=3))
_float_attrs = ({"low": _number, "high": _number}, {"log": st.booleans(), "step": st.none() | st.floats(0.01, 10)})
_int_attrs = ({"low": _int, "high": _int}, {"log": st.booleans(), "step": st.integers(1, 5)})
_FORMS: list[tuple[str, str, tuple[dict[str, Any], dict[str, Any]]]] = [
    ("name", "FloatDistribution", _float_attrs),
    ("name", "IntDistribution", _int_attrs),
    ("name", "CategoricalDistribution", ({"choices": st.lists(_choice, min_size=1, max_size=4)}, {})),
    ("name", "UniformDistribution", ({"low": _number, "high": _number}, {})),
    ("name", "LogUniformDistribution", ({"low": _number, "high": _number}, {})),
    ("name", "DiscreteUniformDistribution", ({"low": _number, "high": _number, "q": st.floats(0.01, 10)}, {})),
    ("name", "IntUniformDistribution", ({"low": _int, "high": _int}, {"step": st.integers(1, 5)})),
    ("name", "IntLogUniformDistribution", ({"low": _int, "high": _int}, {"step": st.integers(1, 5)})),
    ("type", "float", _float_attrs),
    ("type", "int", ({"low": _int, "high": _int}, {"log": st.booleans(), "step": st.none() | st.integers(1, 5)})),
    ("type", "categorical", ({"choices": st.lists(_choice, min_size=1, max_size=4)}, {})),
]
_any_value = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**60), 2**60), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4), st.lists(_int, max_size=2), st.dictionaries(st.text(max_size=2), _int, max_size=1),
)


@st.composite
def _entries(draw: st.DrawFn) -> dict[str, Any]:
    key, tag, (required, optional) = draw(st.sampled_from(_FORMS))
    attrs = {k: draw(v) for k, v in required.items()}
    attrs |= {k: draw(v) for k, v in optional.items() if draw(st.booleans())}
    change = draw(st.sampled_from(["none", "none", "none", "value", "extra", "missing"]))
    if change == "value" and attrs:
        attrs[draw(st.sampled_from(sorted(attrs)))] = draw(_any_value)
    elif change == "extra":
        attrs[draw(st.sampled_from(["other", "low", "q", "choices", "log"]))] = draw(_any_value)
    elif change == "missing" and attrs:
        del attrs[draw(st.sampled_from(sorted(attrs)))]
    return {"name": tag, "attributes": attrs} if key == "name" else {"type": tag, **attrs}


def _refusal(entry: Any) -> str | None:
    """None when the models and Optuna accept ``entry``; else the refusal's message."""
    try:
        Space(entry=entry)
    except ValidationError as exc:
        return str(exc.errors()[0]["msg"])
    return None


@settings(max_examples=400, deadline=None)
@given(_entries(), st.booleans())
def test_the_schema_and_the_validation_agree(entry: dict[str, Any], as_text: bool) -> None:
    sent = json.dumps(entry) if as_text else entry
    refusal = _refusal(sent)
    if not VALIDATOR.is_valid({"entry": entry}):  # a string form's schema is its contentSchema
        assert refusal is not None, f"the schema refuses {entry!r}, the API accepted it"
    else:
        # Only what JSON Schema cannot relate is refused: Optuna's rules between attributes.
        assert refusal is None or refusal.startswith("not a valid Optuna distribution"), (entry, refusal)
