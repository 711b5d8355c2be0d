"""Parameter importances of a study, from Optuna's own evaluators, computed here and cached.

The dashboard's parameters view asks for them; computing them takes seconds (fANOVA fits a
random forest), so each answer is kept per (database, study, evaluator, objective) until the
study's finished trials change: the cache key's version is the count of COMPLETE trials and
the latest completion time, both read with one SQL query. A study with more COMPLETE trials
than ``max_trials`` is evaluated on a seeded random sample of that many, so the answer stays
within seconds at 100,000 trials; the answer says how many it used.
"""

from __future__ import annotations

import random
import threading
import warnings
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Literal

import optuna
from pydantic import BaseModel, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from fusetune.server.db import Trial, TrialState, get_optuna_storage
from fusetune.server.errors import Invalid
from fusetune.server.service import _study

Evaluator = Literal["fanova", "mdi", "ped_anova"]

#: Optuna's evaluators by the name the API takes; seeded, so one study gives one answer.
EVALUATORS: dict[str, Callable[[], optuna.importance.BaseImportanceEvaluator]] = {
    "fanova": lambda: optuna.importance.FanovaImportanceEvaluator(seed=0),
    "mdi": lambda: optuna.importance.MeanDecreaseImpurityImportanceEvaluator(seed=0),
    "ped_anova": lambda: optuna.importance.PedAnovaImportanceEvaluator(),
}

#: Most COMPLETE trials one evaluation reads; larger studies are sampled (seeded).
MAX_TRIALS = 2000


class ImportancesOut(BaseModel):
    study_id: int
    evaluator: Evaluator
    objective: int = Field(description="Index of the objective the importances are of (0: the first).")
    importances: dict[str, float] = Field(
        description="Each param's importance, normalised to sum to 1, most important first; empty "
        "with fewer than two COMPLETE trials."
    )
    n_complete: int = Field(description="COMPLETE trials of the study.")
    n_used: int = Field(description="COMPLETE trials the evaluator read (a seeded sample above max_trials).")
    computed_at: datetime
    cached: bool = Field(description="Answered from the cache: no trial finished since it was computed.")


_cache: dict[tuple[str, int, str, int, int], tuple[tuple[int, datetime | None], ImportancesOut]] = {}
_locks: dict[tuple[str, int, str, int, int], threading.Lock] = {}
_guard = threading.Lock()


def clear_cache() -> None:
    with _guard:
        _cache.clear()
        _locks.clear()


def param_importances(
    session: Session,
    url: str,
    study_id: int,
    *,
    evaluator: Evaluator = "fanova",
    objective: int = 0,
    max_trials: int = MAX_TRIALS,
    as_tenant: str | None = None,
) -> ImportancesOut:
    """The study's parameter importances for one objective, from the cache while no trial finished."""
    study = _study(session, study_id, as_tenant)
    storage = get_optuna_storage(url)
    n_objectives = len(storage.get_study_directions(study.optuna_study_id))
    if not 0 <= objective < n_objectives:
        raise Invalid("objective", f"objective must be in [0, {n_objectives}) for study {study_id}", where="query")
    n_complete, latest = session.execute(
        select(func.count(), func.max(Trial.completed_at)).where(
            Trial.study_id == study_id, Trial.state == TrialState.COMPLETE
        )
    ).one()
    version = (n_complete, latest)
    key = (url, study_id, evaluator, objective, max_trials)
    with _guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:  # one computation per key at a time; the others wait and read its answer
        hit = _cache.get(key)
        if hit is not None and hit[0] == version:
            return hit[1].model_copy(update={"cached": True})
        out = _compute(storage, study.optuna_study_id, study_id, evaluator, objective, max_trials, n_complete)
        _cache[key] = (version, out)
        return out


def _compute(
    storage: optuna.storages.BaseStorage,
    optuna_study_id: int,
    study_id: int,
    evaluator: Evaluator,
    objective: int,
    max_trials: int,
    n_complete: int,
) -> ImportancesOut:
    trials = storage.get_all_trials(optuna_study_id, deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(trials) > max_trials:
        trials = random.Random(0).sample(trials, max_trials)
    importances: dict[str, float] = {}
    if len(trials) >= 2:
        directions = storage.get_study_directions(optuna_study_id)
        # An in-memory copy of the (sampled) trials: Optuna's evaluators take a Study.
        copy = optuna.create_study(storage=optuna.storages.InMemoryStorage(), directions=directions)
        copy.add_trials(trials)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            try:
                importances = optuna.importance.get_param_importances(
                    copy,
                    evaluator=EVALUATORS[evaluator](),
                    target=(lambda t: t.values[objective]) if len(directions) > 1 else None,
                )
            except (ValueError, RuntimeError):  # e.g. no param common to every trial
                importances = {}
    return ImportancesOut(
        study_id=study_id,
        evaluator=evaluator,
        objective=objective,
        importances={k: float(v) for k, v in importances.items()},
        n_complete=n_complete,
        n_used=len(trials),
        computed_at=datetime.now(UTC),
        cached=False,
    )
