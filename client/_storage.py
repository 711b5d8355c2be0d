"""Optuna's storage interface over fusetune's REST API.

``Storage(url, token)`` lets plain Optuna read a fusetune service's studies from a laptop, with
no database credentials: ``optuna.load_study(study_name=..., storage=Storage(...))``, then
``study.best_trial``, ``study.trials_dataframe()``, ``optuna.visualization`` or
``optuna_dashboard.wsgi(storage)``. It sees exactly what the token's tenant sees.

The service owns its studies' trials: it asks them, trains them and records every value, so
the trial-writing half of the interface raises :class:`ReadOnlyStorageError`. A study's user
attrs, which are the user's notes about it, can be written.
"""

from __future__ import annotations

import copy
import json
import math
import threading
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, json_to_distribution
from optuna.study import StudyDirection
from optuna.study._frozen import FrozenStudy
from optuna.trial import FrozenTrial, TrialState

from ._client import Client, FusetuneError

__all__ = ["ReadOnlyStorageError", "Storage"]

_NOT_FOUND = 404
_UNPROCESSABLE = 422


class ReadOnlyStorageError(optuna.exceptions.OptunaError):
    """A write that only the fusetune service makes: it asks, trains and records the trials."""


class Storage(optuna.storages.BaseStorage):
    """The studies of one fusetune tenant, as an Optuna storage.

    Args:
        url: the service, e.g. ``"http://127.0.0.1:8000"``; ``FUSETUNE_URL`` when omitted.
        token: the tenant's bearer token; ``FUSETUNE_TOKEN`` when omitted.
        timeout: seconds per HTTP request.
    """

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0) -> None:
        self._url, self._token, self._timeout = url, token, timeout
        self._client = Client(url, token=token, timeout=timeout)
        # Finished trials never change on the service, so they are parsed once.
        self._finished: dict[int, FrozenTrial] = {}
        # Each study's trials as last read, and the revision they are read up to: a later
        # get_all_trials downloads only the trials changed since (updated_since).
        self._trials: dict[int, _StudyTrials] = {}
        self._lock = threading.Lock()

    # Pickled for optuna's own multiprocessing helpers: the HTTP connection is not.
    def __getstate__(self) -> dict[str, Any]:
        return {"url": self._url, "token": self._token, "timeout": self._timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["token"], state["timeout"])  # type: ignore[misc]

    def close(self) -> None:
        self._client.close()

    # -- studies ---------------------------------------------------------------------------
    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        if study_name is not None:
            try:
                self.get_study_id_from_name(study_name)
            except KeyError:
                pass
            else:
                raise optuna.exceptions.DuplicatedStudyError(f"a study named {study_name!r} already exists")
        raise ReadOnlyStorageError(
            "a fusetune study needs a workload and a budget: create it with "
            "fusetune.client.create_study(workload=..., n_trials=...), or run trials of your own "
            "study with fusetune.client.optimize"
        )

    def delete_study(self, study_id: int) -> None:
        raise ReadOnlyStorageError("delete a fusetune study through the service's API")

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._found(lambda: self._client.set_study_user_attr(study_id, key, value), f"study {study_id}")

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        raise ReadOnlyStorageError("a fusetune study's system attrs are written by the service only")

    def get_study_id_from_name(self, study_name: str) -> int:
        try:
            found = self._client.studies(name=study_name)
        except FusetuneError as exc:
            if exc.status_code == _UNPROCESSABLE:  # a name no study can have (the service's pattern)
                raise KeyError(f"no study named {study_name!r}") from exc
            raise
        if not found:
            raise KeyError(f"no study named {study_name!r}")
        return int(found[0]["id"])

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._study(study_id)["name"]

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return [StudyDirection[d.upper()] for d in self._study(study_id)["directions"]]

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._study(study_id)["user_attrs"]

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._study(study_id)["system_attrs"]

    def get_all_studies(self) -> list[FrozenStudy]:
        return [
            FrozenStudy(
                study_name=s["name"],
                direction=None,
                directions=[StudyDirection[d.upper()] for d in s["directions"]],
                user_attrs=s["user_attrs"],
                system_attrs=s["system_attrs"],
                study_id=s["id"],
            )
            for s in self._client.studies()
        ]

    # -- trials ----------------------------------------------------------------------------
    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        raise ReadOnlyStorageError(
            "the service asks a fusetune study's trials; to train trials you ask yourself, "
            "use fusetune.client.optimize(study, workload, n_trials) on your own study"
        )

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float, distribution: BaseDistribution) -> None:
        raise ReadOnlyStorageError("the service sets a fusetune trial's params")

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        raise ReadOnlyStorageError("the service ends a fusetune trial")

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        raise ReadOnlyStorageError("the service reports a fusetune trial's intermediate values")

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        raise ReadOnlyStorageError("the service writes a fusetune trial's attrs")

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        raise ReadOnlyStorageError("the service writes a fusetune trial's attrs")

    def get_trial(self, trial_id: int) -> FrozenTrial:
        if trial_id in self._finished:
            return copy.deepcopy(self._finished[trial_id])
        return self._frozen(self._found(lambda: self._client.trial(trial_id), f"trial {trial_id}"))

    def get_all_trials(
        self, study_id: int, deepcopy: bool = True, states: Container[TrialState] | None = None
    ) -> list[FrozenTrial]:
        """Every trial of the study, by number. The first call reads them all; later calls
        download only the trials that changed since the previous one (``updated_since``)."""
        with self._lock:
            known = self._trials.get(study_id)
            since = known.revision if known is not None else 0
        try:
            rows, revision = self._found(lambda: self._client.changes(study_id, since), f"study {study_id}")
            if since and known is not None and _replaced(known, rows):
                # SQLite gives a deleted study's id (and its trials' ids) to the next ones
                # created: what was read of the old study is not this one's.
                with self._lock:
                    self._trials.pop(study_id, None)
                    for trial_id in known.trials:
                        self._finished.pop(trial_id, None)
                rows, revision = self._found(lambda: self._client.changes(study_id, 0), f"study {study_id}")
        except KeyError:
            with self._lock:
                self._trials.pop(study_id, None)  # deleted, or never this tenant's
            raise
        with self._lock:
            known = self._trials.setdefault(study_id, _StudyTrials())
            for row in rows:
                # A concurrent call may have merged a newer read of the trial already.
                if row["revision"] >= known.revisions.get(row["id"], -1):
                    known.trials[row["id"]] = self._frozen(row)  # it changed: parse it again
                    known.revisions[row["id"]] = row["revision"]
                    known.created[row["id"]] = row["created_at"]
            known.revision = max(known.revision, revision)
            trials = sorted(known.trials.values(), key=lambda t: t.number)
        if states is not None:
            trials = [t for t in trials if t.state in states]
        return copy.deepcopy(trials) if deepcopy else trials

    # -- wire -> Optuna --------------------------------------------------------------------
    def _study(self, study_id: int) -> dict[str, Any]:
        return self._found(lambda: self._client.study(study_id), f"study {study_id}")

    @staticmethod
    def _found(call: Any, what: str) -> Any:
        try:
            return call()
        except FusetuneError as exc:
            # An id outside the service's range (0, 2**31) is a 422 naming the path: no such one either.
            outside = exc.status_code == _UNPROCESSABLE and isinstance(exc.detail, list) and any(
                isinstance(d, dict) and list(d.get("loc") or [])[:1] == ["path"] for d in exc.detail
            )
            if exc.status_code == _NOT_FOUND or outside:
                raise KeyError(f"{what} does not exist") from exc  # what Optuna's storages raise
            raise

    def _frozen(self, row: dict[str, Any]) -> FrozenTrial:
        state = TrialState[row["state"]]
        distributions = {name: json_to_distribution(_json(d)) for name, d in row["distributions"].items()}
        values = row.get("values")
        if values is None and row.get("value") is not None:
            values = [row["value"]]
        trial = FrozenTrial(
            number=row["number"],
            state=state,
            value=None,
            values=values,
            datetime_start=_datetime(row.get("started_at")),
            datetime_complete=_datetime(row.get("completed_at")) if state.is_finished() else None,
            # Params the service recorded before their distribution was known are left out,
            # as Optuna stores only suggested params.
            params={k: v for k, v in row["params"].items() if k in distributions},
            distributions=distributions,
            user_attrs=row["user_attrs"],
            system_attrs=row["system_attrs"],
            # A non-finite value (a diverged epoch) comes as JSON's null: Optuna keeps it as NaN.
            intermediate_values={int(step): math.nan if v is None else v for step, v in row["intermediate_values"].items()},
            trial_id=row["id"],
        )
        if state.is_finished():
            self._finished[row["id"]] = trial
        return trial


@dataclass
class _StudyTrials:
    """One study's trials as a :class:`Storage` last read them."""

    revision: int = 0  # every change up to this revision has been read
    trials: dict[int, FrozenTrial] = field(default_factory=dict)  # by fusetune trial id
    revisions: dict[int, int] = field(default_factory=dict)  # each trial's revision as read
    created: dict[int, str] = field(default_factory=dict)  # each trial's created_at as read


def _replaced(known: _StudyTrials, rows: list[dict[str, Any]]) -> bool:
    """Whether changed trial rows belong to another study than the one read before under the
    same id: a trial id read before with another creation time, or a trial number read before
    under another trial id."""
    numbers = {t.number: trial_id for trial_id, t in known.trials.items()}
    for row in rows:
        before = known.trials.get(row["id"])
        if before is not None and known.created.get(row["id"]) != row["created_at"]:
            return True
        if numbers.get(row["number"], row["id"]) != row["id"]:
            return True
    return False


def _json(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _datetime(value: str | None) -> datetime | None:
    """The service's UTC time as Optuna's storages give one: naive, in local time
    (``datetime.now()``), so that it subtracts from ``datetime.now()``."""
    return None if value is None else datetime.fromisoformat(value).astimezone().replace(tzinfo=None)
