"""``fusetune.client.optimize``: train the trials of a user's own Optuna study on the service.

The user's study stays where it is (any storage, any sampler, any pruner). Trials are asked
in the user's process, with :class:`~fusetune.client.samplers.FusionSampler` around the
study's sampler so that they come out in fusible groups; each goes to the service as an
enqueued trial of a *client-driven* service study. Their intermediate values, values and
states come back into the user's study as the service records them, and after every epoch
the user's pruner decides, in the user's process, whether the trial goes on; the service's
array waits for that answer at the epoch boundary.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from ._client import Client, FusetuneError
from ._package import Package, _entry, package

if TYPE_CHECKING:
    from fusetune.workers.workloads import Workload

__all__ = ["optimize"]

_CONFLICT = 409
_FORBIDDEN = 403
_UNPROCESSABLE = 422
_DEFAULT_GROUP = 8
#: Studies some optimize call runs on (by id): the calls on each, and the user's own sampler.
_WRAPPED: dict[int, tuple[int, optuna.samplers.BaseSampler]] = {}
_WRAPPED_LOCK = threading.Lock()
#: What a study's name may not hold (the service's pattern: letters, digits, '.', '_' and '-').
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass
class _Tracked:
    trial: optuna.Trial
    reported: set[int] = field(default_factory=set)
    decided: set[int] = field(default_factory=set)


def optimize(
    study: optuna.Study,
    workload: Workload | str,
    n_trials: int | None,
    *,
    code: str | os.PathLike[str] | None = None,
    requirements: Sequence[str] | None = None,
    excludes: Sequence[str] | None = None,
    epochs: int = 10,
    search_space: Mapping[str, optuna.distributions.BaseDistribution] | None = None,
    metrics: Sequence[str] | None = None,
    max_array_size: int | None = None,
    n_concurrent: int | None = None,
    fusion_sampler: bool = True,
    timeout: float | None = None,
    callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] | None = None,
    show_progress_bar: bool = False,
    poll_interval: float = 0.05,
    url: str | None = None,
    token: str | None = None,
) -> None:
    """Run ``n_trials`` trials of ``study`` on the service, as ``study.optimize`` runs them here.

    Args:
        study: the user's own Optuna study, on any storage.
        workload: the workload that trains each trial (its model, data and metric): one of the
            service's, by name, or the user's own, a ``Workload`` object or a ``module:attr`` path
            inside ``code``, packaged and uploaded once (:func:`fusetune.client.package`). Its
            define-by-run space runs here, conditional or not.
        n_trials: how many trials to ask and train; None: until ``timeout`` or ``study.stop()``
            (the service study's budget grows as trials are asked).
        code, requirements, excludes: the user's own workload's folder, pip requirements and
            what to leave out of the folder (gitignore patterns).
        epochs: epochs per trial; the user's pruner decides after each.
        search_space: fixed distributions to ask with; the workload's define-by-run space
            (run here, on the user's trials) when omitted.
        metrics: the workload's metrics that are the study's objectives, one per direction
            (needed for a multi-objective study; the workload's first metric by default).
        max_array_size: the most trials one array fuses; also FusionSampler's group size.
        n_concurrent: trials in flight at once (default: two arrays' worth).
        fusion_sampler: wrap the study's sampler in FusionSampler while this runs.
        timeout: seconds from the call after which no new trial is asked; those in flight
            still finish.
        callbacks: called with the study and each trial as it ends there (COMPLETE, PRUNED or
            FAIL), in this process, as ``study.optimize`` calls them. One that calls
            ``study.stop()`` (Optuna's ``MaxTrialsCallback`` does) ends the asking; the
            trials in flight still finish.
        show_progress_bar: a tqdm bar of trials done and the best value.
        poll_interval: seconds between reads of the service's records.
        url, token: the service and the tenant's token (``FUSETUNE_URL``, ``FUSETUNE_TOKEN``).

    Raises:
        ValueError: naming ``n_trials``, ``epochs`` or ``n_concurrent`` if not positive, or
            the field the service rejected.
        PermissionError: the tenant may not upload code (the admin grants ``code_upload``).
    """
    deadline = None if timeout is None else time.monotonic() + timeout  # as study.optimize: from the call
    _check(n_trials, epochs, n_concurrent, callbacks)
    group = max_array_size or _DEFAULT_GROUP
    n_concurrent = n_concurrent or 2 * group
    # An open-ended run's service study is given trials as they are asked, and what was asked at the end.
    budget = n_trials or 2 * n_concurrent
    workload, packaged = _own_workload(workload, code, requirements, excludes, search_space)
    body = _service_study(study, workload, budget, epochs, search_space, metrics, max_array_size, packaged)
    wrap = (lambda own: _fusion_sampler(own, workload, group, search_space)) if fusion_sampler else None
    bar = _progress_bar(n_trials) if show_progress_bar else None
    # The user's sampler comes back and the bar closes however this ends, a refused or
    # unreachable service included: the study is the user's, not this call's.
    try:
        with _sampler_wrapped(study, wrap), Client(url, token=token) as client:
            created = _submit(client, body, packaged)
            run = _Run(study, client, created["id"], _space(workload), search_space, len(study.directions) > 1, bar,
                       list(callbacks or ()), budget=budget, more=0 if n_trials else budget)
            run.run(n_trials, n_concurrent, deadline, poll_interval)
    finally:
        if bar is not None:
            bar.close()


def _check(n_trials: int | None, epochs: int, n_concurrent: int | None, callbacks: Sequence[Any] | None) -> None:
    """optimize's arguments checked before anything is packaged or sent (a ValueError naming one)."""
    for name, value in (("n_trials", n_trials), ("epochs", epochs), ("n_concurrent", n_concurrent)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int{' or None' if name != 'epochs' else ''}, not {value!r}")
    if not all(callable(c) for c in callbacks or ()):
        raise ValueError("callbacks must be callables of (study, frozen_trial)")


@contextlib.contextmanager
def _sampler_wrapped(study: optuna.Study, wrap: Callable[[optuna.samplers.BaseSampler], optuna.samplers.BaseSampler] | None) -> Iterator[None]:
    """The study's sampler wrapped (FusionSampler) while any optimize call on it runs, and the
    user's own back after the last: threads may run calls on one study, as ``n_jobs`` does."""
    key = id(study)
    with _WRAPPED_LOCK:
        calls, own = _WRAPPED.get(key, (0, study.sampler))
        if not calls and wrap is not None:
            study.sampler = wrap(own)
        _WRAPPED[key] = (calls + 1, own)
    try:
        yield
    finally:
        with _WRAPPED_LOCK:
            calls, own = _WRAPPED.pop(key)
            if calls > 1:
                _WRAPPED[key] = (calls - 1, own)
            else:
                study.sampler = own


@contextlib.contextmanager
def _optimizing(study: optuna.Study) -> Iterator[None]:
    """The study is in an optimize loop meanwhile, as ``study.optimize`` marks it, so that
    ``study.stop()`` from a callback is allowed and ends the asking. Optuna keeps both marks
    private (``_thread_local.in_optimize_loop``, ``_stop_flag``) and reads them only there."""
    local = study._thread_local
    if getattr(local, "in_optimize_loop", False):
        raise RuntimeError("Nested optimization is not allowed.")  # as study.optimize refuses it
    local.in_optimize_loop, study._stop_flag = True, False
    try:
        yield
    finally:
        local.in_optimize_loop = False


def _submit(client: Client, body: dict[str, Any], packaged: Package | None) -> dict[str, Any]:
    """The service study, created (the package uploaded first, once); a refusal as the
    exception the user would expect of it."""
    try:
        if packaged is not None:
            client.ensure_package(packaged)
        return client.submit(body)
    except FusetuneError as exc:
        if exc.status_code == _FORBIDDEN:
            raise PermissionError(f"the service refused the code: {exc.detail}") from exc
        raise ValueError(f"the service refused the study: {exc.detail}") from exc


def _own_workload(
    workload: Workload | str,
    code: str | os.PathLike[str] | None,
    requirements: Sequence[str] | None,
    excludes: Sequence[str] | None,
    search_space: Mapping[str, optuna.distributions.BaseDistribution] | None,
) -> tuple[Workload | str, Package | None]:
    """The workload whose space runs here, and the user's own workload's package (None for
    the service's). The define-by-run space runs in this process, conditional or not: the
    package states the union of what its runs suggest."""
    if code is None and isinstance(workload, str):
        return workload, None
    packaged = package(workload, code=code, requirements=requirements, excludes=excludes, search_space=search_space, conditional=True)
    return (_entry(workload, Path(code or ".")) if isinstance(workload, str) else workload), packaged


def service_study_name(study_name: str) -> str:
    """The name of a call's service study: the user's study's, made to fit the service's name
    pattern, and 8 hex digits (one service study per call: its records are the service's)."""
    stem = _NOT_IN_NAMES.sub("-", study_name).strip("-._")[:200] or "study"
    return f"{stem}-{uuid.uuid4().hex[:8]}"


def _service_study(
    study: optuna.Study,
    workload: Workload | str,
    n_trials: int,
    epochs: int,
    search_space: Mapping[str, optuna.distributions.BaseDistribution] | None,
    metrics: Sequence[str] | None,
    max_array_size: int | None,
    packaged: Package | None = None,
) -> dict[str, Any]:
    """The request body of the client-driven service study that trains the user's trials."""
    body: dict[str, Any] = {
        "workload": packaged.workload_name if packaged is not None else workload,
        "n_trials": n_trials,
        "epochs": epochs,
        "driver": "client",
        "name": service_study_name(study.study_name),
    }
    if packaged is not None:
        body["package"] = packaged.digest
    if metrics is not None:
        body["metrics"] = list(metrics)
    if len(study.directions) > 1:
        body["directions"] = [d.name.lower() for d in study.directions]
    else:
        body["direction"] = study.direction.name.lower()
    if search_space is not None:
        body["search_space"] = {k: optuna.distributions.distribution_to_json(d) for k, d in search_space.items()}
    if max_array_size is not None:
        body["max_array_size"] = max_array_size
    return body


@dataclass
class _Run:
    """One call's trials in flight: asked in the user's study, enqueued on the service study
    ``service_id``, and followed back from its records until each has ended."""

    study: optuna.Study
    client: Client
    service_id: int
    space: Callable[[optuna.Trial], Mapping[str, Any]]
    search_space: Mapping[str, optuna.distributions.BaseDistribution] | None
    multi: bool
    bar: Any
    callbacks: Sequence[Callable[[optuna.Study, FrozenTrial], None]] = ()
    budget: int = 0  # the service study's n_trials
    more: int = 0  # trials it is given at a time when they run out (0: n_trials was given)
    inflight: dict[int, _Tracked] = field(default_factory=dict)
    asked: int = 0
    done: int = 0

    def run(self, n_trials: int | None, n_concurrent: int, deadline: float | None, poll_interval: float) -> None:
        """:meth:`until_done` as ``study.optimize`` runs its loop, then :meth:`close`; however
        else it ends (Ctrl-C, a refused enqueue, the service gone), :meth:`abandon`."""
        try:
            with _optimizing(self.study):
                self.until_done(n_trials, n_concurrent, deadline, poll_interval)
        except BaseException:
            self.abandon()
            raise
        self.close()

    def until_done(self, n_trials: int | None, n_concurrent: int, deadline: float | None, poll_interval: float) -> None:
        """Keep ``n_concurrent`` trials in flight until ``n_trials`` were asked (or the
        deadline passed, or a callback stopped the study), then until every asked trial has ended."""

        def may_ask() -> bool:
            stopped = getattr(self.study, "_stop_flag", False)  # study.stop(), from a callback
            return ((n_trials is None or self.asked < n_trials) and not stopped
                    and (deadline is None or time.monotonic() < deadline) and self._room())

        while self.done < self.asked or may_ask():
            while len(self.inflight) < n_concurrent and may_ask():
                self.ask()
            self.follow()
            if self.inflight:
                time.sleep(poll_interval)

    def ask(self) -> None:
        """One more trial of the user's study, enqueued on the service with its params."""
        params: Mapping[str, Any]
        trial = self.study.ask(dict(self.search_space)) if self.search_space is not None else self.study.ask()
        try:
            params = trial.params if self.search_space is not None else self.space(trial)
            row = self.client.enqueue_trial(self.service_id, _plain(params), {"client_trial_number": trial.number})
        except BaseException:  # the space's own code, or the service, refused it: as study.optimize does
            self.study.tell(trial, state=TrialState.FAIL)
            raise
        self.inflight[row["id"]] = _Tracked(trial)
        self.asked += 1

    def _room(self) -> bool:
        """Whether the service study takes another trial; an open-ended run gives it more
        (False once the service refuses them: the tenant's ``max_trials_per_study``)."""
        if self.asked < self.budget:
            return True
        if not self.more:
            return False
        try:
            self.client.update_study(self.service_id, self.budget + self.more)
        except FusetuneError as exc:
            if exc.status_code != _UNPROCESSABLE:
                raise
            warnings.warn(f"fusetune: no more trials after {self.asked}: {exc.detail}", stacklevel=2)
            self.more = 0
            return False
        self.budget += self.more
        return True

    def close(self) -> None:
        """The asking is over and every trial has ended: the service study's n_trials becomes
        what was asked, so that it completes rather than waiting for trials that never come
        (nothing asked: it is cancelled)."""
        if self.asked < self.budget:
            if self.asked:
                self.client.update_study(self.service_id, self.asked)
            else:
                self.client.cancel_study(self.service_id)
            self.budget = self.asked

    def abandon(self) -> None:
        """This call ends before its trials did: fail them in the user's study, as
        ``study.optimize`` fails the trial it was running, and cancel the service study, whose
        arrays would otherwise wait at each epoch boundary for pruning answers that never come
        (``FUSETUNE_PRUNE_REPLY_TIMEOUT_S``), holding their workers from every other study.
        Best effort: the service may be what failed."""
        for tracked in self.inflight.values():
            with contextlib.suppress(Exception):  # it ended in the user's storage meanwhile
                self.study.tell(tracked.trial, state=TrialState.FAIL)
        self.inflight.clear()
        with contextlib.suppress(Exception):  # unreachable, or the study ended meanwhile
            self.client.cancel_study(self.service_id)

    def follow(self) -> None:
        """One read of the service study's trials, brought into the user's trials in flight."""
        for row in self.client.trials(self.service_id):
            tracked = self.inflight.get(row["id"])
            if tracked is None:
                continue
            ended = _follow(self.study, self.client, row, tracked, self.multi)
            if ended is not None:
                del self.inflight[row["id"]]
                self.done += 1
                if self.bar is not None:
                    self.bar.update(1)
                    _show_best(self.bar, self.study, self.multi)
                for callback in self.callbacks:
                    callback(self.study, ended)


def _follow(study: optuna.Study, client: Client, row: dict[str, Any], tracked: _Tracked, multi: bool) -> FrozenTrial | None:
    """Bring one service trial's news into the user's trial; the trial as it ended, once it has."""
    trial = tracked.trial
    # JSON keys are strings, and a non-finite value (a diverged epoch) is JSON's null.
    values_by_step = {int(step): math.nan if value is None else value for step, value in row["intermediate_values"].items()}
    steps = sorted(values_by_step)
    if not multi:  # Optuna's Trial.report is single-objective
        for step in steps:
            if step not in tracked.reported:
                trial.report(values_by_step[step], step)
                tracked.reported.add(step)
    state = row["state"]
    if state == "COMPLETE":
        return study.tell(trial, row["values"] or row["value"])
    if state == "FAIL":
        return study.tell(trial, state=TrialState.FAIL)
    if state == "PRUNED":
        return study.tell(trial, state=TrialState.PRUNED)
    if state == "RUNNING" and steps and steps[-1] not in tracked.decided:
        step = steps[-1]
        prune = False if multi else bool(trial.should_prune())  # pruners may answer numpy.bool_
        try:
            client.decide_pruning(row["id"], step, prune)
        except FusetuneError as exc:
            if exc.status_code != _CONFLICT:
                raise
            return None  # it ended meanwhile (its last epoch): the next read says how
        tracked.decided.add(step)
        if prune:
            return study.tell(trial, state=TrialState.PRUNED)
    return None


def _plain(params: Mapping[str, Any]) -> dict[str, Any]:
    # Samplers may suggest numpy scalars (a categorical's numpy.bool_); the wire takes JSON.
    return {name: value.item() if hasattr(value, "item") else value for name, value in params.items()}


def _space(workload: Workload | str) -> Callable[[optuna.Trial], Mapping[str, Any]]:
    # The workload's define-by-run space is Python: it runs here, on the user's trials.
    from fusetune.workers.workloads import get_workload

    return (get_workload(workload) if isinstance(workload, str) else workload).search_space


def _fusion_sampler(
    base: optuna.samplers.BaseSampler,
    workload: Workload | str,
    group: int,
    search_space: Mapping[str, optuna.distributions.BaseDistribution] | None,
) -> optuna.samplers.BaseSampler:
    from .samplers import FusionSampler

    distributions = dict(search_space) if search_space is not None else None
    return FusionSampler.for_workload(base, workload, group_size=group, distributions=distributions)


def _progress_bar(total: int | None) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="fusetune trials")


def _show_best(bar: Any, study: optuna.Study, multi: bool) -> None:
    try:
        if multi:
            bar.set_postfix(pareto_front=len(study.best_trials))
        else:
            bar.set_postfix(best_value=study.best_value)
    except ValueError:  # no trial completed yet
        pass
