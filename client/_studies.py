"""Creating and loading a service's studies as Optuna studies, from a user's own Optuna code."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import optuna

from ._client import Client, FusetuneError, service_url
from ._package import package
from ._specs import component_spec
from ._storage import Storage

if TYPE_CHECKING:
    from fusetune.workers.workloads import Workload

__all__ = ["create_study", "load_study"]

_CONFLICT = 409
_FORBIDDEN = 403

def create_study(
    *,
    workload: Workload | str,
    n_trials: int,
    epochs: int = 10,
    study_name: str | None = None,
    direction: str | optuna.study.StudyDirection | None = None,
    directions: Sequence[str | optuna.study.StudyDirection] | None = None,
    metrics: Sequence[str] | None = None,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    load_if_exists: bool = False,
    search_space: Mapping[str, optuna.distributions.BaseDistribution] | None = None,
    max_array_size: int | None = None,
    max_concurrent_trials: int | None = None,
    loader: Mapping[str, Any] | None = None,
    code: str | os.PathLike[str] | None = None,
    requirements: Sequence[str] | None = None,
    excludes: Sequence[str] | None = None,
    url: str | None = None,
    token: str | None = None,
) -> optuna.Study:
    """Start a study on the service, as ``optuna.create_study`` starts one on a storage.

    The service asks, fuses and trains its ``n_trials`` trials of ``workload`` in the
    background; the returned study reads them as they happen, through :class:`Storage`.
    ``workload`` is a workload of the service (its name), or the user's own: a ``Workload``
    object defined anywhere (a script, a notebook, a module of their project), or a
    ``module:attr`` path inside ``code=DIR``. The user's own is packaged here
    (:func:`fusetune.client.package`: the code, pip ``requirements``, ``excludes`` left out of
    ``code``), uploaded once (a second study of the same code uploads nothing) and trained by
    the service's workers; its define-by-run search space is stated as static distributions
    here (a conditional one is refused: run it with :func:`fusetune.client.optimize`).
    ``sampler`` and ``pruner`` are any of Optuna's own samplers and pruners built from plain
    arguments: the service rebuilds them from their class and arguments. ``metrics`` names the
    workload's metrics that are the objectives (several, with ``directions``, make the study
    multi-objective; the workload's first metric when omitted). ``max_concurrent_trials``
    caps the trials asked and not finished (Ray Tune's name): the sampler then learns from
    more finished trials, in smaller arrays.

    Raises:
        ValueError: naming the sampler's or pruner's class if it cannot be rebuilt, or the
            field the service rejected.
        PermissionError: the tenant may not upload code (the admin grants ``code_upload``).
        optuna.exceptions.DuplicatedStudyError: the name is taken and ``load_if_exists`` is
            False.
    """
    body: dict[str, Any] = {"workload": workload, "n_trials": n_trials, "epochs": epochs}
    packaged = None
    if code is not None or not isinstance(workload, str):
        packaged = package(workload, code=code, requirements=requirements, excludes=excludes, search_space=search_space)
        body.update(workload=packaged.workload_name, package=packaged.digest)
    body.update(_objectives(direction, directions, metrics))
    if study_name is not None:
        body["name"] = study_name
    if sampler is not None:
        body["sampler"] = component_spec(sampler)
    if pruner is not None:
        body["pruner"] = component_spec(pruner)
    if search_space is not None:
        body["search_space"] = {
            name: optuna.distributions.distribution_to_json(d) for name, d in search_space.items()
        }
    if max_array_size is not None:
        body["max_array_size"] = max_array_size
    extra = {"max_concurrent_trials": max_concurrent_trials, "loader": None if loader is None else dict(loader)}
    body.update({k: v for k, v in extra.items() if v is not None})  # loader: DataLoader options over the workload's
    url = service_url(url)
    with Client(url, token=token) as client:
        try:
            if packaged is not None:
                client.ensure_package(packaged)
            created = client.submit(body)
        except FusetuneError as exc:
            if exc.status_code == _CONFLICT and study_name is not None:
                if load_if_exists:
                    return load_study(study_name=study_name, url=url, token=token)
                raise optuna.exceptions.DuplicatedStudyError(f"a study named {study_name!r} already exists") from exc
            raise refusal(exc) from exc
    return load_study(study_name=created["name"], url=url, token=token)


def refusal(exc: FusetuneError) -> Exception:
    """What a refused package or study raises: PermissionError for a 403 (``code_upload``), else ValueError."""
    if exc.status_code == _FORBIDDEN:
        return PermissionError(f"the service refused the code: {exc.detail}")
    return ValueError(f"the service refused the study: {exc.detail}")


def _objectives(
    direction: str | optuna.study.StudyDirection | None,
    directions: Sequence[str | optuna.study.StudyDirection] | None,
    metrics: Sequence[str] | None,
) -> dict[str, Any]:
    if direction is not None and directions is not None:
        raise ValueError("give direction or directions, not both")
    if directions is not None and len(directions) == 1:
        direction, directions = directions[0], None
    out: dict[str, Any] = {}
    if direction is not None:
        out["direction"] = _direction(direction)
    if directions is not None:
        out["directions"] = [_direction(d) for d in directions]
    if metrics is not None:
        out["metrics"] = list(metrics)
    return out


def load_study(*, study_name: str, url: str | None = None, token: str | None = None) -> optuna.Study:
    """A service's study, read through :class:`Storage` (``optuna.load_study``'s twin)."""
    return optuna.load_study(study_name=study_name, storage=Storage(service_url(url), token=token))


def _direction(direction: str | optuna.study.StudyDirection) -> str:
    if isinstance(direction, optuna.study.StudyDirection):
        return direction.name.lower()
    if direction not in ("minimize", "maximize"):
        raise ValueError(f"direction must be 'minimize' or 'maximize', not {direction!r}")
    return direction
