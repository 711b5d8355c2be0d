"""Turning a study's sampler and pruner specs ({"name", "kwargs"}) into Optuna objects.

A spec names an Optuna class by its class name (``"TPESampler"``) or its short alias
(``"tpe"``), and passes keyword arguments to its constructor. Specs are stored as JSON with
the study, so every process that touches the study rebuilds the same sampler or pruner.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

import optuna

T = TypeVar("T")


def _classes(module: Any, base: type[T], unusable: set[str]) -> dict[str, type[T]]:
    found: dict[str, type[T]] = {}
    for name in module.__all__:
        cls = getattr(module, name)
        if (
            inspect.isclass(cls)
            and issubclass(cls, base)
            and not inspect.isabstract(cls)
            and not name.startswith("Base")
            and name not in unusable
        ):
            found[name] = cls
            for suffix in ("Sampler", "Pruner"):
                if name.endswith(suffix):
                    found[name[: -len(suffix)].lower()] = cls
    return found


# PartialFixedSampler and PatientPruner wrap another instance, which a JSON spec cannot carry.
SAMPLERS = _classes(optuna.samplers, optuna.samplers.BaseSampler, {"PartialFixedSampler"})
PRUNERS = _classes(optuna.pruners, optuna.pruners.BasePruner, {"PatientPruner"})


class SpecError(ValueError):
    """A sampler or pruner spec names no usable class or has arguments its constructor rejects.

    ``part`` is the spec key at fault: ``"name"`` or ``"kwargs"``.
    """

    def __init__(self, part: str, message: str) -> None:
        super().__init__(message)
        self.part = part


def _build(kind: str, table: dict[str, type[T]], name: str, kwargs: dict[str, Any]) -> T:
    cls = table.get(name)
    if cls is None:
        known = ", ".join(sorted(k for k in table if k[0].isupper()))
        raise SpecError("name", f"unknown {kind} {name!r}; use one of: {known}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise SpecError("kwargs", f"{cls.__name__} rejects these kwargs: {exc}") from exc


def make_sampler(name: str, kwargs: dict[str, Any] | None = None) -> optuna.samplers.BaseSampler:
    """A fresh sampler from its spec; raises :class:`SpecError`."""
    return _build("sampler", SAMPLERS, name, dict(kwargs or {}))


def make_pruner(name: str, kwargs: dict[str, Any] | None = None) -> optuna.pruners.BasePruner:
    """A fresh pruner from its spec; raises :class:`SpecError`."""
    return _build("pruner", PRUNERS, name, dict(kwargs or {}))
