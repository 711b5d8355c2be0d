"""Which of a fusetune workload's parameters are non-fusible, by the service's own signature.

A parameter is non-fusible when changing it changes the trial's shape signature, the key by
which the service packs trials into arrays. The answer is not declared by hand: the
workload's search space runs with each parameter varied over probe values of its
distribution, every other parameter held, and ``scheduler.fusible_params`` compares the
signatures that ``workers.signature.trial_signature`` (the function the service packs
with) gives the results. This module imports torch and fusetune's server code, and only
when called.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

if TYPE_CHECKING:
    from fusetune.workers.workloads import Workload

__all__ = ["non_fusible_params"]

#: Values probed for a numeric distribution: its ends and this many points between them. A
#: parameter that shapes a model changes the signature between most pairs of its values.
_INTERIOR_PROBES = 3
#: An integer distribution with at most this many values is probed at every one.
_ALL_INTS_UP_TO = 16


@dataclass(frozen=True)
class _Digest:
    """What ``scheduler.fusible_params`` compares: the ``digest`` of a signature."""

    digest: str


def probe_values(distribution: BaseDistribution) -> list[Any]:
    """Values of ``distribution`` worth trying: every choice, or the ends and points between."""
    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    if isinstance(distribution, IntDistribution):
        low, high, step = distribution.low, distribution.high, distribution.step
        if (high - low) // step + 1 <= _ALL_INTS_UP_TO:
            return list(range(low, high + 1, step))
        points = _between(low, high, distribution.log)
        return sorted({low + round((p - low) / step) * step for p in points} | {low, high})
    if isinstance(distribution, FloatDistribution):
        points = _between(distribution.low, distribution.high, distribution.log)
        if distribution.step is not None:
            grid = distribution.step
            points = [distribution.low + round((p - distribution.low) / grid) * grid for p in points]
        return sorted({min(max(p, distribution.low), distribution.high) for p in points})
    raise TypeError(f"distribution must be an Optuna distribution, got {type(distribution).__name__}")


def _between(low: float, high: float, log: bool) -> list[float]:
    """``low``, ``high`` and ``_INTERIOR_PROBES`` evenly spaced points between (on a log scale if ``log``)."""
    n = _INTERIOR_PROBES + 1
    if log and low > 0:
        a, b = math.log(low), math.log(high)
        inside = [math.exp(a + (b - a) * i / n) for i in range(1, n)]
    else:
        inside = [low + (high - low) * i / n for i in range(1, n)]
    return [low, *inside, high]  # the ends exactly: exp(log(x)) is not always x


class _Prober:
    """Runs a search space with some parameters fixed; the others are drawn at random, seeded.

    An in-memory Optuna study does it, so the space sees a real ``optuna.Trial`` (enqueued
    values for the fixed parameters, as ``study.enqueue_trial`` gives them).
    """

    def __init__(
        self,
        space: Callable[[optuna.Trial], Mapping[str, Any]] | None,
        distributions: Mapping[str, BaseDistribution] | None,
        seed: int,
    ) -> None:
        self.space = space
        self.distributions = dict(distributions) if distributions else None
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # "a new study created in memory" is no news
        try:
            self.study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
        finally:
            optuna.logging.set_verbosity(verbosity)

    def run(
        self, fixed: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, BaseDistribution], dict[str, Any]] | None:
        """(Optuna params, their distributions, what the space returned), or None if it raised."""
        if fixed is not None:
            self.study.enqueue_trial(dict(fixed), skip_if_exists=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a fixed value outside a dynamic space's range, ...
            trial = self.study.ask(fixed_distributions=self.distributions)
            try:
                out = dict(trial.params) if self.space is None else dict(self.space(trial))
            except Exception:  # the space rejects these values: no evidence either way
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                return None
        self.study.tell(trial, state=optuna.trial.TrialState.FAIL)  # probes are no results
        return dict(trial.params), dict(trial.distributions), out


def non_fusible_params(
    workload: str | Workload,
    *,
    distributions: Mapping[str, BaseDistribution] | None = None,
    signature: Callable[[Mapping[str, Any]], str] | None = None,
    contexts: int = 8,
    seed: int = 0,
) -> frozenset[str]:
    """The parameters of ``workload``'s search space that change a trial's shape signature.

    Args:
        workload: a :class:`fusetune.workers.workloads.Workload` or its registry name.
        distributions: the study's own search space (the service's ``search_space``
            override), used instead of the workload's define-by-run space.
        signature: a trial's params (what the space returns) -> its signature digest.
            Default: the service's ``trial_signature`` for this workload.
        contexts: how many random trials of the space each parameter is varied around, so
            that a conditional parameter is seen in the branches that have it.
        seed: seeds those trials.

    Raises:
        TypeError: ``workload`` is neither a Workload nor a name.
        ValueError: ``contexts`` is below 1, or the space raised for every context.
    """
    from fusetune.workers.signature import fusible_params
    from fusetune.workers.workloads import Workload, get_workload

    if isinstance(workload, str):
        workload = get_workload(workload)
    elif not isinstance(workload, Workload):
        raise TypeError(f"workload must be a fusetune Workload or its name, got {type(workload).__name__}")
    if isinstance(contexts, bool) or not isinstance(contexts, int) or contexts < 1:
        raise ValueError(f"contexts must be an int >= 1, got {contexts!r}")
    if signature is None:
        signature = _service_signature(workload)

    prober = _Prober(None if distributions else workload.search_space, distributions, seed)
    non_fusible: set[str] = set()
    seen = 0
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # every probe is told FAIL; Optuna would log each
    try:
        for _ in range(contexts):
            context = prober.run()
            if context is None:
                continue
            params, dists, out = context
            try:
                base = signature(out)
            except Exception:  # the model rejects this context's values (the service fails such a trial)
                continue
            seen += 1

            def varied(trial_params: Mapping[str, Any], base: str = base) -> _Digest:
                if distributions:
                    # A static space returns the trial's params as they are, so the fixed
                    # values are the trial: no Optuna trial to run (each costs more as the
                    # in-memory study fills, quadratic in the space's size).
                    out: Mapping[str, Any] | None = trial_params
                else:
                    result = prober.run(trial_params)
                    out = None if result is None else result[2]
                if out is None:
                    return _Digest(base)
                try:
                    return _Digest(signature(out))
                except Exception:  # a value the model rejects says nothing about sharing an array
                    return _Digest(base)

            candidates = {name: probe_values(dists[name]) for name in params}
            fusible = fusible_params(varied, params, candidates)  # type: ignore[arg-type]
            non_fusible.update(name for name, ok in fusible.items() if not ok)
    finally:
        optuna.logging.set_verbosity(verbosity)
    if seen == 0:
        raise ValueError(f"workload {workload.name!r}: its search space or model rejected every one of {contexts} trials")
    return frozenset(non_fusible)


def _service_signature(workload: Workload) -> Callable[[Mapping[str, Any]], str]:
    """The service's signature function for ``workload``'s trials (imports the server's code)."""
    from fusetune.workers.signature import trial_signature

    return lambda params: trial_signature(workload, params)
