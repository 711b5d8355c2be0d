"""fusetune: hyper-parameter tuning that trains many trials at once as horizontally fused models.

``from fusetune import Workload, Metric`` are the workload protocol's two classes (they live in
``fusetune.workers.workloads``); the rest is in the subpackages: ``fusetune.client`` (the
Python client), ``fusetune.server``, ``fusetune.workers``, ``fusetune.fusion``,
``fusetune.scheduler``.

This module is the ``fusetune`` package's own ``__init__``, kept in ``client/_top`` (the
repository's top-level folders are the subpackages; ``pyproject.toml`` maps this folder to
``fusetune``). Its names are imported on first use (PEP 562), so ``import fusetune.client``
imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusetune.workers.workloads import Metric, Workload

__all__ = ["Metric", "Workload"]

_LAZY = {"Metric": "fusetune.workers.workloads", "Workload": "fusetune.workers.workloads"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fusetune' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
