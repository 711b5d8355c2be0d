"""Turning a user's Optuna sampler or pruner object into the spec the service rebuilds it from.

The service stores a study's sampler and pruner as ``{"name": class name, "kwargs": ...}`` and
builds them again in every process that drives the study, so it accepts only what can be
rebuilt from its class and JSON constructor arguments. Optuna objects keep their constructor
arguments as private attributes (``TPESampler(n_startup_trials=5)._n_startup_trials``); this
module reads them back, rebuilds the object from what it read, and refuses any object the
rebuilt one does not equal (a ``constraints_func`` lambda, a custom crossover, a subclass).

A seed cannot be read back: Optuna seeds its random state and keeps no seed. The spec's seed is
drawn from a copy of the object's random state instead, so a seeded sampler always gives the
same seed, and the user's object is left untouched.
"""

from __future__ import annotations

import copy
import inspect
import json
import threading
import warnings
from typing import Any

import numpy as np
import optuna

__all__ = ["component_spec"]

_SEED_RANGE = 2**31
#: The seeds numpy's RandomState takes (QMCSampler passes its seed on to one).
_NUMPY_SEEDS = range(2**32)
# State that a sampler derives from the study it has seen, or keeps for its threads (NSGA-II's
# lock), not from its arguments.
_CACHES: tuple[type, ...] = (optuna.search_space.IntersectionSearchSpace, type(threading.Lock()), type(threading.RLock()))
# Arguments an object keeps shuffled by its random state: the same values in the rebuilt one,
# in the order the spec's seed gives them (GridSampler's points).
_SHUFFLED = {(optuna.samplers.GridSampler, "_all_grids")}


def component_spec(obj: optuna.samplers.BaseSampler | optuna.pruners.BasePruner) -> dict[str, Any]:
    """The ``{"name", "kwargs"}`` spec of an Optuna sampler or pruner object.

    Raises:
        ValueError: naming the object's class when it is not one of Optuna's own samplers or
            pruners, or when it cannot be rebuilt from its class and JSON arguments.
    """
    cls = type(obj)
    base = optuna.samplers if isinstance(obj, optuna.samplers.BaseSampler) else optuna.pruners
    if getattr(base, cls.__name__, None) is not cls:
        raise ValueError(
            f"{cls.__name__} is not one of optuna.{base.__name__.split('.')[-1]}'s classes, so the "
            "service cannot rebuild it; pass an Optuna sampler or pruner built from plain arguments"
        )
    defaults = _defaults(cls)
    kwargs: dict[str, Any] = {}
    for name, default in defaults.items():
        found, value = _read_argument(obj, name)
        if not found or _is_default(value, default) or not _is_json(value):
            continue  # a non-default object argument is caught by the rebuild check below
        kwargs[name] = value
    deprecated = _deprecated(cls, kwargs)
    if deprecated:
        raise ValueError(
            f"{cls.__name__} was built with {', '.join(deprecated)}, which Optuna deprecated (it warns "
            "FutureWarning and removes them in a later major version): the service does not take "
            "deprecated arguments, so that a stored study still rebuilds after an upgrade; build it without them"
        )
    drawn: frozenset[str] = frozenset()
    if "seed" in defaults:
        rng = _random_state(obj)
        if rng is not None:
            kwargs["seed"] = int(copy.deepcopy(rng).randint(_SEED_RANGE))
        elif isinstance(kwargs.get("seed"), int) and kwargs["seed"] not in _NUMPY_SEEDS:
            # An unseeded QMCSampler draws a 64-bit seed of its own, which it cannot be built
            # with: the service's copy draws its own too.
            del kwargs["seed"]
            drawn = frozenset({"_seed"})
    difference = _rebuild_difference(obj, kwargs, drawn)
    if difference is not None:
        raise ValueError(
            f"{cls.__name__} cannot be rebuilt from its class and JSON arguments: {difference} "
            "(callables and custom objects cannot be sent to the service)"
        )
    # Keep only the arguments the object needs: what the service shows is what the user wrote.
    for name in [k for k in kwargs if k != "seed"]:
        fewer = {k: v for k, v in kwargs.items() if k != name}
        if _rebuild_difference(obj, fewer, drawn) is None:
            kwargs = fewer
    return {"name": cls.__name__, "kwargs": kwargs}


def _defaults(cls: type[object]) -> dict[str, Any]:
    """Each constructor argument's default as an object holds it: read back from one built
    without arguments, else the signature's. An argument Optuna deprecated defaults to None and
    holds what None stands for (TPESampler's ``prior_weight`` holds 1.0): compared with the
    signature's None, it read as set, and every rebuild passed it and warned."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # past self
    declared = {p.name: p.default for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # our reference object, not the user's: its notices are not theirs
            reference = cls()
    except (TypeError, ValueError):  # it requires an argument (GridSampler's search_space)
        return declared
    defaults = {}
    for name, default in declared.items():
        found, value = _read_argument(reference, name)
        defaults[name] = value if found else default
    return defaults


def _deprecated(cls: type, kwargs: dict[str, Any]) -> list[str]:
    """The arguments of ``kwargs`` whose use Optuna warns about with a FutureWarning naming them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cls(**kwargs)
        except (TypeError, ValueError):
            return []  # the rebuild check says what is wrong
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    named = [k for k in kwargs if any(f"`{k}`" in m for m in messages)]
    return named or ([f"arguments it warns about ({'; '.join(messages)})"] if messages else [])


def _rebuild_difference(obj: Any, kwargs: dict[str, Any], drawn: frozenset[str] = frozenset()) -> str | None:
    """Where ``type(obj)(**kwargs)`` differs from ``obj``, or None; ``drawn``: the object's own
    attributes that it drew at random when built (each copy draws its own)."""
    cls = type(obj)
    try:
        rebuilt = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        return f"{cls.__name__}(**{kwargs}) raises {exc}"
    for name in drawn:
        setattr(rebuilt, name, getattr(obj, name))
    difference = _difference(obj, rebuilt, cls.__name__)
    return None if difference is None else f"{difference} differs"


def _read_argument(obj: Any, name: str) -> tuple[bool, Any]:
    attrs = vars(obj)
    for key in (f"_{name}", name):
        if key in attrs:
            return True, attrs[key]
    # TPESampler keeps some arguments one level down, in its Parzen estimator's parameters.
    for value in attrs.values():
        if hasattr(value, "_fields") and name in value._fields:
            return True, getattr(value, name)
    return False, None


def _random_state(obj: Any) -> np.random.RandomState | None:
    for value in vars(obj).values():
        if isinstance(value, optuna.samplers._lazy_random_state.LazyRandomState):
            return value.rng
        if isinstance(value, np.random.RandomState):
            return value
    return None


def _is_default(value: Any, default: Any) -> bool:
    if default is inspect.Parameter.empty:
        return False
    try:
        return bool(value == default) and type(value) is type(default)
    except Exception:  # e.g. numpy arrays compare elementwise
        return False


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _difference(a: Any, b: Any, path: str) -> str | None:
    """The first attribute path where ``a`` and ``b`` differ, or None."""
    if isinstance(a, (optuna.samplers._lazy_random_state.LazyRandomState, np.random.RandomState)):
        return None if type(a) is type(b) else path
    if isinstance(a, _CACHES):
        return None if type(a) is type(b) else path
    if type(a) is not type(b):
        return path
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return path
        for key in a:
            found = _difference(a[key], b[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return path
        for i, (x, y) in enumerate(zip(a, b)):
            found = _difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, (str, bytes, int, float, bool, type(None), type)) or callable(a) and not hasattr(a, "__dict__"):
        return None if a == b else path
    if inspect.isfunction(a) or inspect.ismethod(a) or inspect.isbuiltin(a):
        return None if a == b else path
    if hasattr(a, "__dict__"):
        for key in vars(a).keys() | vars(b).keys():
            if key not in vars(a) or key not in vars(b):
                return f"{path}.{key}"
            if (type(a), key) in _SHUFFLED:
                found = None if sorted(map(repr, vars(a)[key])) == sorted(map(repr, vars(b)[key])) else f"{path}.{key}"
            else:
                found = _difference(vars(a)[key], vars(b)[key], f"{path}.{key}")
            if found:
                return found
        return None
    try:
        return None if bool(a == b) else path
    except Exception:
        return path
