"""Optuna's tables, as fusetune reads and writes them beside its own: the one module that
imports Optuna's private table models.

``optuna.storages._rdb.models`` is private API. It has kept its shape since Optuna 3.0, and
``tests/server/test_mirror.py`` reads every write back through Optuna's own RDB storage; if
it ever changes, this is the one import to follow. The control plane writes Optuna's rows
only through ``server/mirror.py`` (the mirror of each running study, a new study's rows, a
deleted study's removal), and reads them in bulk in ``server/reads.py``.
"""

from __future__ import annotations

from optuna.storages._rdb.models import (
    StudyDirectionModel,
    StudyModel,
    StudySystemAttributeModel,
    StudyUserAttributeModel,
    TrialHeartbeatModel,
    TrialIntermediateValueModel,
    TrialModel,
    TrialParamModel,
    TrialSystemAttributeModel,
    TrialUserAttributeModel,
    TrialValueModel,
)

__all__ = [
    "StudyDirectionModel",
    "StudyModel",
    "StudySystemAttributeModel",
    "StudyUserAttributeModel",
    "TrialHeartbeatModel",
    "TrialIntermediateValueModel",
    "TrialModel",
    "TrialParamModel",
    "TrialSystemAttributeModel",
    "TrialUserAttributeModel",
    "TrialValueModel",
]
