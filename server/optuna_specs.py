"""Turning a study's sampler and pruner specs ({"name", "kwargs"}) into Optuna objects.

A spec names an Optuna class by its class name (``"TPESampler"``) or its short alias
(``"tpe"``), and passes keyword arguments to its constructor. Specs are stored as JSON with
the study, so every process that touches the study rebuilds the same sampler or pruner.

Every spec comes from a tenant, and its sampler runs on the one scheduling thread that every
study shares, in the process that is also the API and the Ray driver. So the classes are an
explicit allow-list (:data:`SAMPLERS`, :data:`PRUNERS`), each with the kwargs it may take and
their types; the kwargs that size the sampler's work are capped by settings
(:class:`SpecLimits`, ``FUSETUNE_SAMPLER_MAX_*``), checked from the JSON without building
anything (a grid's size is the product of its lists' lengths, never the grid). Kwargs that
Optuna deprecated are not taken: they warn at every rebuild and go in Optuna 6, when a stored
study would no longer rebuild. Constructing the object is the last check, and runs on a
bounded pool of builder threads under a deadline (:func:`build_within`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import optuna

if TYPE_CHECKING:
    from fusetune.server.settings import Settings

T = TypeVar("T")

#: Largest integer a kwarg may hold (sizes, counts, steps): what Optuna's code and numpy take
#: as a plain int. A kwarg with a cap of its own is held to that instead.
MAX_INT = 2**31 - 1
#: numpy's RandomState takes seeds in [0, 2**32); Optuna seeds it lazily, at the first ask.
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class SpecLimits:
    """The caps on the kwargs that size a sampler's work, from the ``FUSETUNE_SAMPLER_*`` settings."""

    grid_points: int = 100_000
    ei_candidates: int = 256
    population: int = 1_000
    reference_points: int = 10_000
    cma_dimensions: int = 100
    build_timeout_s: float = 5.0

    @classmethod
    def of(cls, settings: Settings) -> SpecLimits:
        """The limits the settings set."""
        return cls(
            grid_points=settings.sampler_max_grid_points,
            ei_candidates=settings.sampler_max_ei_candidates,
            population=settings.sampler_max_population,
            reference_points=settings.sampler_max_reference_points,
            cma_dimensions=settings.sampler_max_cma_dimensions,
            build_timeout_s=settings.spec_build_timeout_s,
        )


#: Each limit's setting, named in the errors so that an operator knows what to raise.
_SETTING = {
    "grid_points": "FUSETUNE_SAMPLER_MAX_GRID_POINTS",
    "ei_candidates": "FUSETUNE_SAMPLER_MAX_EI_CANDIDATES",
    "population": "FUSETUNE_SAMPLER_MAX_POPULATION",
    "reference_points": "FUSETUNE_SAMPLER_MAX_REFERENCE_POINTS",
    "cma_dimensions": "FUSETUNE_SAMPLER_MAX_CMA_DIMENSIONS",
    "build_timeout_s": "FUSETUNE_SPEC_BUILD_TIMEOUT_S",
}


class SpecError(ValueError):
    """A sampler or pruner spec that the service does not take.

    ``loc`` is where the fault is, under the spec (``("name",)``, ``("kwargs",)``,
    ``("kwargs", "n_ei_candidates")``) or, from :func:`check_for_study`, under the study's
    request (``("search_space",)``, ``("sampler", "kwargs", "dividing_parameter")``).
    """

    def __init__(self, loc: tuple[str, ...] | str, message: str) -> None:
        super().__init__(message)
        self.loc = (loc,) if isinstance(loc, str) else tuple(loc)

    @property
    def part(self) -> str:
        """The spec key at fault: ``"name"`` or ``"kwargs"``."""
        return self.loc[0]


class _Bad(ValueError):
    """A kwarg's value that its rule refuses (the message says why; the caller adds where)."""


#: A kwarg's rule: raises :class:`_Bad` for a value it refuses.
Rule = Callable[[Any, SpecLimits], None]


def _show(value: Any) -> str:
    """A tenant's value as an error quotes it: its repr, cut short (the value may be a megabyte)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**60 else f"an integer of {len(str(abs(value)))} digits"
    return text if len(text) <= 80 else f"{text[:77]}..."


def over_limit(what: str, value: int, limits: SpecLimits, limit: str, *, at_least: bool = False) -> str:
    """The error text of a ``value`` over the ``limit`` of :class:`SpecLimits` (``at_least``:
    counting stopped once past it)."""
    return f"{what} is {'at least ' if at_least else ''}{_show(value)}, over its limit of {getattr(limits, limit)} ({_SETTING[limit]})"


def _integer(low: int, *, cap: str | None = None, nullable: bool = False) -> Rule:
    def rule(value: Any, limits: SpecLimits) -> None:
        if value is None and nullable:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad(f"must be an integer{' or null' if nullable else ''}, got {_show(value)}")
        if value < low:
            raise _Bad(f"must be at least {low}, got {_show(value)}")
        if cap is not None and value > getattr(limits, cap):
            raise _Bad(over_limit("it", value, limits, cap))
        if value > MAX_INT:
            raise _Bad(f"must be at most {MAX_INT}, got {_show(value)}")

    return rule


def _number(low: float | None = None, high: float | None = None, *, nullable: bool = False) -> Rule:
    def rule(value: Any, limits: SpecLimits) -> None:
        if value is None and nullable:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _Bad(f"must be a finite number{' or null' if nullable else ''}, got {_show(value)}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise _Bad(f"must be within [{low}, {high}], got {_show(value)}")

    return rule


def _flag(*, nullable: bool = False) -> Rule:
    def rule(value: Any, limits: SpecLimits) -> None:
        if not (isinstance(value, bool) or (value is None and nullable)):
            raise _Bad(f"must be true or false{' or null' if nullable else ''}, got {_show(value)}")

    return rule


def _one_of(*choices: Any) -> Rule:
    def rule(value: Any, limits: SpecLimits) -> None:
        if isinstance(value, bool) or value not in choices:
            raise _Bad(f"must be one of {list(choices)}, got {_show(value)}")

    return rule


def _auto_or(integer: Rule) -> Rule:
    def rule(value: Any, limits: SpecLimits) -> None:
        if value != "auto":
            try:
                integer(value, limits)
            except _Bad as exc:
                raise _Bad(f"must be \"auto\" or an integer: {exc}") from None

    return rule


def _seed(value: Any, limits: SpecLimits) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise _Bad(f"must be null or an integer in [0, {MAX_SEED}], got {_show(value)}")


def _grid(value: Any, limits: SpecLimits) -> None:
    """GridSampler's ``search_space``: an object of lists of JSON scalars, whose product (the
    number of grid points, which GridSampler materialises and shuffles) is within the cap."""
    if not isinstance(value, dict) or not value:
        raise _Bad(f"must be an object of parameter name -> list of values, got {_show(value)}")
    points = 1
    for name, values in value.items():
        if not isinstance(values, list):
            raise _Bad(f"{_show(name)} must be a list of values, got {type(values).__name__}")
        # Counted from the lists' lengths as it goes, and first: never built, and a bomb's
        # values are not even read. Two lists of 40,000 values are 1.6 billion points.
        points *= len(values)
        if points > limits.grid_points:
            raise _Bad(over_limit("its number of grid points (the product of its lists' lengths)", points, limits, "grid_points", at_least=True))
    for name, values in value.items():
        for item in values:
            if not (item is None or isinstance(item, (str, bool, int)) or (isinstance(item, float) and math.isfinite(item))):
                raise _Bad(f"{_show(name)} holds {_show(item)}: grid values are strings, numbers, booleans or null")


def _reference_points(value: Any, limits: SpecLimits) -> None:
    """NSGAIIISampler's ``reference_points``: null, or a list of lists of finite numbers of one length."""
    if value is None:
        return
    if not isinstance(value, list) or not value:
        raise _Bad("must be null or a non-empty list of non-empty lists of numbers")
    if len(value) > limits.reference_points:  # counted first: a bomb's points are not read
        raise _Bad(over_limit("their number", len(value), limits, "reference_points"))
    if not all(isinstance(p, list) and p for p in value):
        raise _Bad("must be null or a non-empty list of non-empty lists of numbers")
    if len({len(p) for p in value}) != 1:
        raise _Bad("every reference point must have the same number of coordinates (one per objective)")
    for point in value:
        for x in point:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise _Bad(f"coordinates are finite numbers, got {_show(x)}")


@dataclass(frozen=True)
class _Component:
    """An allowed class: the kwargs it may take (each with its rule) and those it requires."""

    cls: type
    kwargs: Mapping[str, Rule]
    required: frozenset[str] = field(default_factory=frozenset)


_FLAG = _flag()
_STARTUP = _integer(0)  # trials sampled independently first: fewer model fits, never more work
_GA = {  # NSGA-II and NSGA-III (crossover, mutation and strategies are objects: not over JSON)
    "population_size": _integer(2, cap="population"),  # the non-dominated sort is quadratic in it
    "mutation_prob": _number(0.0, 1.0, nullable=True),
    "crossover_prob": _number(0.0, 1.0),
    "swapping_prob": _number(0.0, 1.0),
    "seed": _seed,
}
S, P = optuna.samplers, optuna.pruners
_SAMPLERS: dict[str, _Component] = {
    "RandomSampler": _Component(S.RandomSampler, {"seed": _seed}),
    "TPESampler": _Component(S.TPESampler, {
        "n_startup_trials": _STARTUP,
        "n_ei_candidates": _integer(1, cap="ei_candidates"),  # each ask scores this many per param
        "seed": _seed,
        "multivariate": _flag(nullable=True),
        "group": _FLAG,
        "constant_liar": _FLAG,
    }),
    "GridSampler": _Component(S.GridSampler, {"search_space": _grid, "seed": _seed}, frozenset({"search_space"})),
    "CmaEsSampler": _Component(S.CmaEsSampler, {
        "n_startup_trials": _STARTUP,
        "warn_independent_sampling": _FLAG,
        "seed": _seed,
        "consider_pruned_trials": _FLAG,
        "popsize": _integer(2, cap="population", nullable=True),  # cmaes refuses 1
        "use_separable_cma": _FLAG,
        "with_margin": _FLAG,
        "lr_adapt": _FLAG,
    }),
    "NSGAIISampler": _Component(S.NSGAIISampler, _GA),
    "NSGAIIISampler": _Component(S.NSGAIIISampler, {
        **_GA,
        "reference_points": _reference_points,
        # Its reference points are every way of splitting it among the objectives
        # (check_for_study counts them); alone it is the length of each.
        "dividing_parameter": _integer(1, cap="reference_points"),
    }),
    "QMCSampler": _Component(S.QMCSampler, {
        "qmc_type": _one_of("sobol", "halton"),
        "scramble": _FLAG,
        "seed": _seed,
        "warn_asynchronous_seeding": _FLAG,
        "warn_independent_sampling": _FLAG,
    }),
    "BruteForceSampler": _Component(S.BruteForceSampler, {"seed": _seed, "avoid_premature_stop": _FLAG}),
}
# Pruners decide from the values a study has, once per trial and epoch: none of their kwargs
# sizes that work, so they are checked for type and range only.
_WINDOW = {"n_startup_trials": _integer(0), "n_warmup_steps": _integer(0), "interval_steps": _integer(1), "n_min_trials": _integer(1)}
_PRUNERS: dict[str, _Component] = {
    "NopPruner": _Component(P.NopPruner, {}),
    "MedianPruner": _Component(P.MedianPruner, _WINDOW),
    "PercentilePruner": _Component(
        P.PercentilePruner, {"percentile": _number(0.0, 100.0), **_WINDOW}, frozenset({"percentile"})
    ),
    "SuccessiveHalvingPruner": _Component(P.SuccessiveHalvingPruner, {
        "min_resource": _auto_or(_integer(1)),
        "reduction_factor": _integer(2),
        "min_early_stopping_rate": _integer(0),
        "bootstrap_count": _integer(0),
    }),
    "HyperbandPruner": _Component(P.HyperbandPruner, {
        "min_resource": _integer(1),
        "max_resource": _auto_or(_integer(1)),  # its brackets: log(max / min) of them
        "reduction_factor": _integer(2),
        "bootstrap_count": _integer(0),
    }),
    "ThresholdPruner": _Component(P.ThresholdPruner, {
        "lower": _number(nullable=True), "upper": _number(nullable=True),
        "n_warmup_steps": _integer(0), "interval_steps": _integer(1),
    }),
    "WilcoxonPruner": _Component(P.WilcoxonPruner, {"p_threshold": _number(0.0, 1.0), "n_startup_steps": _integer(0)}),
}
del S, P
# Not offered: GPSampler (each ask fits a Gaussian process over every finished trial, cubic in
# their number: seconds an ask at a few hundred trials, on the thread every study shares;
# a client-driven study runs it in the client's own process), PartialFixedSampler and
# PatientPruner (they wrap another instance, which a JSON spec cannot carry).


def _aliases(table: dict[str, _Component]) -> dict[str, str]:
    """Class name and short alias (``tpe``, ``median``) -> class name."""
    names = {}
    for name in table:
        names[name] = name
        names[name.removesuffix("Sampler").removesuffix("Pruner").lower()] = name
    return names


_SAMPLER_NAMES, _PRUNER_NAMES = _aliases(_SAMPLERS), _aliases(_PRUNERS)
#: The samplers a spec may name (class names and aliases) -> their class.
SAMPLERS: dict[str, type[optuna.samplers.BaseSampler]] = {k: _SAMPLERS[v].cls for k, v in _SAMPLER_NAMES.items()}
#: The pruners a spec may name (class names and aliases) -> their class.
PRUNERS: dict[str, type[optuna.pruners.BasePruner]] = {k: _PRUNERS[v].cls for k, v in _PRUNER_NAMES.items()}


def allowed_kwargs(kind: str) -> dict[str, tuple[str, ...]]:
    """The allowed classes of ``kind`` (``"sampler"`` or ``"pruner"``), each with the kwargs it takes."""
    table = _SAMPLERS if kind == "sampler" else _PRUNERS
    return {name: tuple(component.kwargs) for name, component in table.items()}


def _component(kind: str, names: dict[str, str], table: dict[str, _Component], name: Any) -> _Component:
    if not isinstance(name, str) or name not in names:
        known = ", ".join(sorted(table))
        raise SpecError("name", f"unknown {kind} {_show(name)}; use one of: {known}")
    return table[names[name]]


def _check(kind: str, names: dict[str, str], table: dict[str, _Component], name: Any, kwargs: Any, limits: SpecLimits) -> _Component:
    component = _component(kind, names, table, name)
    cls = component.cls.__name__
    if not isinstance(kwargs, dict):
        raise SpecError("kwargs", f"{cls}'s kwargs must be an object, got {type(kwargs).__name__}")
    for key, value in kwargs.items():
        rule = component.kwargs.get(key)
        if rule is None:
            taken = ", ".join(sorted(component.kwargs)) or "none"
            raise SpecError(("kwargs", str(key)), f"{cls} takes no kwarg {_show(key)} here; it takes: {taken}")
        try:
            rule(value, limits)
        except _Bad as exc:
            raise SpecError(("kwargs", key), f"{cls}'s {key}: {exc}") from None
    missing = sorted(component.required - kwargs.keys())
    if missing:
        raise SpecError(("kwargs", missing[0]), f"{cls} requires the kwarg {missing[0]!r}")
    return component


def check_sampler(name: Any, kwargs: Any, limits: SpecLimits) -> None:
    """Raise :class:`SpecError` unless the sampler is allowed and every kwarg is one it takes,
    of its type and within its cap. Builds nothing: its time is that of reading the JSON."""
    _check("sampler", _SAMPLER_NAMES, _SAMPLERS, name, kwargs, limits)


def check_pruner(name: Any, kwargs: Any, limits: SpecLimits) -> None:
    """:func:`check_sampler` for a pruner."""
    _check("pruner", _PRUNER_NAMES, _PRUNERS, name, kwargs, limits)


def sampler_class(name: str) -> str:
    """The class name of an allowed sampler's name or alias (``tpe`` -> ``TPESampler``)."""
    return _component("sampler", _SAMPLER_NAMES, _SAMPLERS, name).cls.__name__


def _cardinality(distribution: optuna.distributions.BaseDistribution) -> int | None:
    """How many values BruteForceSampler enumerates for a distribution; None: infinitely many."""
    D = optuna.distributions
    if isinstance(distribution, D.CategoricalDistribution):
        return len(distribution.choices)
    if isinstance(distribution, D.IntDistribution):
        return (distribution.high - distribution.low) // distribution.step + 1
    if isinstance(distribution, D.FloatDistribution) and distribution.step is not None:
        return math.floor((distribution.high - distribution.low) / distribution.step) + 1
    return None


def check_for_study(
    name: str, kwargs: Mapping[str, Any], search_space: Mapping[str, Any] | None,
    n_objectives: int | None, limits: SpecLimits,
) -> None:
    """The caps that depend on the study as well as the sampler: BruteForceSampler's walk of the
    search space, CMA-ES's covariance over it, NSGA-III's reference points among the objectives.

    ``search_space``: the request's, parameter -> distribution (BruteForceSampler reads the
    distributions; for the others only its size counts); None is the workload's own space (the
    operator's code, not a tenant's). ``n_objectives`` None: not known here. Raises
    :class:`SpecError` whose ``loc`` is under the study's request.
    """
    cls = sampler_class(name)
    if cls == "BruteForceSampler" and search_space is not None:
        combinations = 1
        for param, distribution in search_space.items():
            count = _cardinality(distribution)
            if count is None:
                raise SpecError(("search_space", param), f"BruteForceSampler enumerates each parameter: {_show(param)} is continuous (give it a step)")
            combinations *= count
            if combinations > limits.grid_points:  # never multiplied past the cap
                raise SpecError(("search_space",), over_limit(
                    "the number of combinations BruteForceSampler walks", combinations, limits, "grid_points", at_least=True
                ))
    if cls == "CmaEsSampler" and search_space is not None and not kwargs.get("use_separable_cma"):
        # Full CMA-ES keeps a d x d covariance and decomposes it, O(d^3), each generation.
        if len(search_space) > limits.cma_dimensions:
            raise SpecError(("search_space",), over_limit(
                "the number of parameters CmaEsSampler's covariance spans (use_separable_cma: linear)",
                len(search_space), limits, "cma_dimensions",
            ))
    if cls == "NSGAIIISampler" and n_objectives is not None and kwargs.get("reference_points") is None:
        p = kwargs.get("dividing_parameter", 3)
        points = math.comb(n_objectives + p - 1, p)  # Optuna builds every one of them
        if points > limits.reference_points:
            raise SpecError(("sampler", "kwargs", "dividing_parameter"), over_limit(
                f"with {n_objectives} objectives, dividing_parameter={p} makes reference points whose number",
                points, limits, "reference_points",
            ))


#: Builds run here, never on the event loop: two threads, so that builds a deadline gave up on
#: (a thread cannot be stopped; it runs to its end) hold at most two, and later builds queue
#: behind them and time out too, instead of each stranding one more thread.
_BUILDERS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fusetune-spec-build")


def build_within(build: Callable[[], T], deadline_s: float, what: str) -> T:
    """``build()`` on a builder thread; :class:`SpecError` at ``kwargs`` if it takes longer
    than ``deadline_s``, or raises TypeError or ValueError (Optuna's refusals).

    The caps make every allowed build cheap: the deadline is the second line of defence.
    """
    future = _BUILDERS.submit(build)
    try:
        return future.result(timeout=deadline_s)
    except FutureTimeout:
        future.cancel()  # one still queued never runs; one running ends on its own
        raise SpecError("kwargs", f"building {what} took longer than {deadline_s:g} s ({_SETTING['build_timeout_s']})") from None
    except (TypeError, ValueError, AssertionError) as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError("kwargs", f"{what} rejects these kwargs: {exc}") from exc


def _build(kind: str, names: dict[str, str], table: dict[str, _Component], name: str, kwargs: dict[str, Any], limits: SpecLimits) -> Any:
    cls = _check(kind, names, table, name, kwargs, limits).cls
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise SpecError("kwargs", f"{cls.__name__} rejects these kwargs: {exc}") from exc


def make_sampler(name: str, kwargs: dict[str, Any] | None = None, limits: SpecLimits | None = None) -> optuna.samplers.BaseSampler:
    """A fresh sampler from its spec, checked against ``limits`` first (default: the settings');
    raises :class:`SpecError`."""
    return _build("sampler", _SAMPLER_NAMES, _SAMPLERS, name, dict(kwargs or {}), limits or default_limits())


def make_pruner(name: str, kwargs: dict[str, Any] | None = None, limits: SpecLimits | None = None) -> optuna.pruners.BasePruner:
    """A fresh pruner from its spec, checked first; raises :class:`SpecError`."""
    return _build("pruner", _PRUNER_NAMES, _PRUNERS, name, dict(kwargs or {}), limits or default_limits())


def default_limits() -> SpecLimits:
    """The limits of this process's settings (``FUSETUNE_*`` variables)."""
    from fusetune.server.settings import get_settings

    return SpecLimits.of(get_settings())


def service_sampler_kwargs(name: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The kwargs the service builds a study's sampler with: the spec's, and for TPE
    ``constant_liar=True`` unless the spec sets it, passed only where it is not Optuna's default.

    The service asks trials in batches that fill arrays: the constant liar makes TPE count the
    running ones, so a batch spreads out instead of repeating itself.
    """
    out = dict(kwargs)
    if sampler_class(name) == "TPESampler" and "constant_liar" not in out:
        default = inspect.signature(optuna.samplers.TPESampler).parameters["constant_liar"].default
        if default is not True:  # Optuna 4 (False); Optuna 5 defaults to it
            out["constant_liar"] = True
    return out


def build_for_study(sampler: Mapping[str, Any], pruner: Mapping[str, Any] | None, limits: SpecLimits) -> None:
    """Build a new study's sampler and pruner as the scheduling loop will, each on a builder
    thread under ``limits.build_timeout_s``: Optuna's own checks of kwargs that passed the caps
    (TPE's ``group`` without ``multivariate``, CMA-ES ``with_margin`` with ``use_separable_cma``).

    Raises:
        SpecError: whose ``loc`` starts with ``"sampler"`` or ``"pruner"``.
    """
    parts = [("sampler", sampler, make_sampler), ("pruner", pruner, make_pruner)]
    for part, spec, make in parts:
        if spec is None:
            continue
        name = spec["name"]
        kwargs = service_sampler_kwargs(name, spec.get("kwargs") or {}) if part == "sampler" else dict(spec.get("kwargs") or {})
        try:
            build_within(lambda: make(name, kwargs, limits), limits.build_timeout_s, name)  # noqa: B023 (waited for here)
        except SpecError as exc:
            raise SpecError((part, *exc.loc), str(exc)) from exc


def check_stored(
    sampler: Mapping[str, Any], pruner: Mapping[str, Any] | None, *,
    search_space: Callable[[], Mapping[str, Any]] | None, objectives: Callable[[], int], limits: SpecLimits,
) -> None:
    """A stored study's sampler and pruner against the allow-list and caps of this process, before
    anything is built from them: a study stored before the caps existed, or under larger ones,
    is refused here (its scheduling loop fails it alone) instead of being rebuilt.

    ``search_space`` (its distributions) is called only for BruteForceSampler and CmaEsSampler,
    ``objectives`` (their number) only for NSGAIIISampler. Raises :class:`SpecError`.
    """
    for part, spec, check in (("sampler", sampler, check_sampler), ("pruner", pruner, check_pruner)):
        if spec is None:
            continue
        try:
            check(spec.get("name"), spec.get("kwargs") or {}, limits)
        except SpecError as exc:
            raise SpecError((part, *exc.loc), str(exc)) from exc
    cls = sampler_class(sampler["name"])
    space = search_space() if search_space is not None and cls in ("BruteForceSampler", "CmaEsSampler") else None
    check_for_study(cls, sampler.get("kwargs") or {}, space, objectives() if cls == "NSGAIIISampler" else None, limits)
