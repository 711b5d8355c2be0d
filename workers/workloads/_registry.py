"""Finding a workload by name: built-ins, the ``fusetune.workloads`` entry points, or a path."""

from __future__ import annotations

import importlib
from functools import lru_cache
from importlib.metadata import EntryPoint, entry_points

from ._base import Workload
from ._digits import DIGITS_CNN, DIGITS_MLP

ENTRY_POINT_GROUP = "fusetune.workloads"

_registered: dict[str, Workload] = {w.name: w for w in (DIGITS_MLP, DIGITS_CNN)}


class UnknownWorkloadError(LookupError):
    """No workload answers to the given name."""


class WorkloadImportsDisabled(UnknownWorkloadError):
    """The name is a module path, and the caller does not allow importing workloads."""


def register_workload(workload: Workload) -> Workload:
    """Make ``workload`` available under ``workload.name`` in this process."""
    _registered[workload.name] = workload
    return workload


@lru_cache(maxsize=1)
def _entry_points() -> tuple[EntryPoint, ...]:
    """The group's entry points, read once per process: scanning every installed
    distribution's metadata takes milliseconds, and listing a page of studies asks once per
    study. A package installed later is seen after a restart."""
    return tuple(entry_points(group=ENTRY_POINT_GROUP))


def _from_entry_points(name: str) -> Workload | None:
    for ep in _entry_points():
        if ep.name == name:
            return _check(ep.load(), name)
    return None


def _from_path(path: str) -> Workload:
    module_name, _, attr = path.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownWorkloadError(f"cannot import workload {path!r}: {exc}") from exc
    return _check(obj, path)


def _check(obj: object, name: str) -> Workload:
    if not isinstance(obj, Workload):
        raise UnknownWorkloadError(f"{name!r} is a {type(obj).__name__}, not a fusetune Workload")
    return obj


def get_workload(name: str, *, allow_imports: bool = True) -> Workload:
    """The workload called ``name``.

    Looked up among built-ins and registered workloads, then the ``fusetune.workloads``
    entry-point group, then as a ``package.module:attr`` import path (only with
    ``allow_imports``: importing runs the module's code). The server accepts import paths
    only when its operator enables them (``FUSETUNE_ALLOW_WORKLOAD_IMPORTS``); workers resolve
    whatever the server accepted.

    Raises:
        WorkloadImportsDisabled: ``name`` is an import path and ``allow_imports`` is off; nothing
            was imported.
        UnknownWorkloadError: nothing by that name exists.
    """
    if name in _registered:
        return _registered[name]
    found = _from_entry_points(name)
    if found is not None:
        return found
    if ":" in name:
        if not allow_imports:
            raise WorkloadImportsDisabled(
                f"workload {name!r} is a module path, and importing workloads is disabled on this server "
                "(its operator enables it with FUSETUNE_ALLOW_WORKLOAD_IMPORTS=1); "
                f"known workloads: {', '.join(available_workloads())}"
            )
        return _from_path(name)
    known = ", ".join(sorted(available_workloads()))
    raise UnknownWorkloadError(f"unknown workload {name!r}; known workloads: {known}")


def available_workloads() -> list[str]:
    """Names of the built-in, registered and entry-point workloads."""
    return sorted(set(_registered) | {ep.name for ep in _entry_points()})
