"""Pydantic models of what goes over the wire in the REST API."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, Literal, Protocol

import optuna
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fusetune.server.db import ArrayState, StudyState, TrialState
from fusetune.server.distributions import Choice, SearchSpaceEntry
from fusetune.server.optuna_specs import SpecError, check_for_study, default_limits, sampler_class
from fusetune.server.specs import LoaderSpec, LRSchedulerSpec, OptimizerSpec, PrunerSpec, SamplerSpec, field_error, json_enum

# The tenants' and tokens' models live in tenant_schemas, re-exported here (their routes, the CLI, tests).
from fusetune.server.tenant_schemas import (  # noqa: F401
    TenantCreate,
    TenantCreated,
    TenantOut,
    TenantUpdate,
    TokenCreate,
    TokenCreated,
    TokenOut,
)
from fusetune.server.wire import NO_NUL_KEYS, JsonInt, NoNul, NoNulKeys, OptionalJsonInt  # noqa: F401
from fusetune.workers.optimization import (
    OptionError,
    lr_scheduler_name,
    optimizer_name,
)
from fusetune.workers.spec import TrainingSpec
from fusetune.workers.workloads import UnknownWorkloadError, Workload, WorkloadImportsDisabled, available_workloads, get_workload

#: A code package's digest: the SHA-256 of its zip's bytes, in lower-case hex (``server/packages.py``).
DIGEST_PATTERN = r"^[0-9a-f]{64}$"
#: Study names the service keeps for itself: a study's name is also its folder in the artifact
#: store, and the code packages live under ``packages/`` there.
RESERVED_STUDY_NAMES = frozenset({"packages"})

#: The Optuna study system attr that says why a study FAILED (``StudyOut.error``).
FAILURE_ATTR = "fusetune:failure"
#: The Optuna study's system attr holding what its user should know of how its trials train
#: (``server/loop/notices.py``), shown as ``StudyOut.warnings``.
WARNINGS_ATTR = "fusetune:warnings"


#: The most parameters a study's ``search_space`` may have. The scheduling loop, which every
#: tenant shares, probes a new space for the params that change a model's shapes: about
#: 8 x params x values signatures, half a second at 256 params of digits-mlp on the 2-core box,
#: seconds beyond (and Optuna's own samplers slow down long before).
MAX_SEARCH_SPACE_PARAMS = 256


#: The most bytes, as JSON, of one study's or one trial's user attrs. Each read of a study or a
#: trial carries them, and a page holds up to 1,000: without a bound one tenant's attrs made
#: answers of a gigabyte, built in the server's memory that every tenant shares.
MAX_USER_ATTRS_BYTES = 64 * 1024


def user_attrs_bytes(attrs: Mapping[str, Any]) -> int:
    """The size of ``attrs`` as the service stores and answers them (compact JSON, UTF-8)."""
    return len(json.dumps(attrs, separators=(",", ":"), ensure_ascii=False).encode())


def parse_search_space(
    space: Mapping[str, str | dict[str, Any]],
) -> dict[str, optuna.distributions.BaseDistribution]:
    """A search space in Optuna's distribution JSON (strings or objects) as distributions.

    Raises:
        ValueError: naming the parameter whose entry is not a distribution.
    """
    out = {}
    for param, encoded in space.items():
        text = encoded if isinstance(encoded, str) else json.dumps(encoded)
        try:
            out[param] = optuna.distributions.json_to_distribution(text)
        except Exception as exc:  # Optuna raises ValueError, KeyError or JSONDecodeError
            raise ValueError(f"search_space[{param!r}] is not an Optuna distribution JSON: {exc!r}") from exc
    return out


def training_choice_error(
    space: Mapping[str, optuna.distributions.BaseDistribution],
) -> tuple[tuple[str, ...], str, Any] | None:
    """Where a search space's ``optimizer`` or ``lr_scheduler`` names what cannot be built: the
    param's path, the message and the choice; None when both name fused torch classes."""
    for param, check in (("optimizer", optimizer_name), ("lr_scheduler", lr_scheduler_name)):
        if param not in space:
            continue
        choices = getattr(space[param], "choices", None)
        if choices is None:
            return (param,), f"{param} must be a CategoricalDistribution", None
        for choice in choices:
            if choice is None and param == "lr_scheduler":
                continue  # no scheduler
            try:
                check(choice)
            except OptionError as exc:
                return (param,), str(exc), choice
    return None


class Objectives(Protocol):
    """What a study's objectives are checked against: a registered workload, or the metadata
    a code package's manifest states (``server/packages.WorkloadInfo``)."""

    @property
    def metric_name(self) -> str: ...

    def metric_named(self, name: str) -> Any: ...


def _metric_names() -> list[str]:
    """Every metric a registered workload declares (a study's must be its own workload's)."""
    names = set()
    for name in available_workloads():
        try:
            names |= {m.name for m in get_workload(name).metrics}
        except Exception:  # a broken entry point: its studies get a 422 naming workload anyway
            continue
    return sorted(names)


class StudyCreate(BaseModel):
    """A request to run a tuning study.

    ``search_space`` maps each parameter to an Optuna distribution in the JSON form of
    ``optuna.distributions.distribution_to_json`` (as a string or as the object it encodes);
    when given it replaces the workload's default search space entirely.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    # Before workload: its check reads it.
    package: str | None = Field(
        None, pattern=DIGEST_PATTERN,
        description="A code package the tenant uploaded (PUT /api/v1/packages/{digest}), by its digest: the study "
        "trains the workload the package's manifest states. `workload` is then the manifest's workload name (for "
        "display; it must not name a registered workload), `search_space` defaults to the manifest's, and the "
        "tenant needs the admin's `code_upload` grant (403 otherwise).",
    )
    workload: str = Field(
        examples=["digits-mlp"],
        description="A registered workload (or, where the server allows imports, a `package.module:attr` path); "
        "with `package`, the name of the package's workload.",
        json_schema_extra=json_enum(available_workloads()),
    )
    n_trials: JsonInt = Field(gt=0, le=100_000)
    epochs: JsonInt = Field(10, gt=0, le=10_000)
    direction: Literal["minimize", "maximize"] | None = Field(
        None, description="Defaults to the workload's metric direction."
    )
    # The name is also a folder under the artifact directory (saved members, checkpoints).
    name: str | None = Field(None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                             description="Letters, digits, '.', '_' and '-', starting with a letter or digit.")
    tenant: str | None = Field(
        None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="The tenant the study belongs to. A tenant's token: its own (the default). "
        "The admin's: any tenant; default `default`.",
    )
    search_space: Annotated[dict[str, SearchSpaceEntry] | None, NoNulKeys] = Field(
        None, max_length=MAX_SEARCH_SPACE_PARAMS, json_schema_extra={"minProperties": 1, **NO_NUL_KEYS},
        description="Each parameter's Optuna distribution JSON (server/distributions.py), as an object or a string "
        "holding it. Beyond its schema Optuna requires low <= high, a positive low on a log scale (at least 1 for "
        "integers) and no step with log: a 422 naming the parameter otherwise.",
    )
    sampler: SamplerSpec = Field(default_factory=lambda: SamplerSpec(name="TPESampler"))
    pruner: PrunerSpec | None = None
    driver: Literal["service", "client"] = Field(
        "service",
        description="Who asks the trials and decides pruning. `service`: the study's sampler and "
        "pruner, here. `client`: the client enqueues every trial (POST /studies/{id}/trials) and "
        "decides pruning after each epoch (POST /trials/{id}/pruning); the study names no sampler "
        "or pruner. fusetune.client.optimize drives a user's own Optuna study this way.",
    )
    max_array_size: OptionalJsonInt = Field(None, gt=0, le=4096)
    max_concurrent_trials: OptionalJsonInt = Field(
        None, gt=0, le=100_000,
        description="Most of the study's trials asked and not yet finished at once (Ray Tune's "
        "max_concurrent_trials): the sampler asks the next ones as trials finish, so it learns from "
        "more finished trials, at the price of smaller arrays. Default: enough to fill every worker's array.",
    )
    optimizer: OptimizerSpec | None = Field(
        None, description="The trials' optimizer; default: the workload's. A trial param `optimizer` overrides it."
    )
    lr_scheduler: LRSchedulerSpec | None = Field(
        None, description="An LR scheduler, stepped once per epoch; default: the workload's (none for digits)."
    )
    warmup_epochs: OptionalJsonInt = Field(
        None, ge=0, le=10_000,
        description="Linear LR warm-up over this many epochs (torch's LinearLR(1/(W+1), total_iters=W) chained "
        "with the scheduler); a trial param `warmup_epochs` overrides it.",
    )
    max_norm: float | None = Field(
        None, gt=0, description="Clip each member's gradient norm to this (clip_grad_norm_); a trial param overrides it."
    )
    amp: bool | None = Field(
        None, description="Mixed precision (float16 autocast, per-member GradScaler) on GPU workers; CPU workers "
        "ignore it and train in float32.",
    )
    loader: LoaderSpec | None = Field(
        None, description="DataLoader options over the workload's own, for data that is not a TensorDataset.",
    )
    metrics: list[str] | None = Field(
        None, min_length=1, max_length=16,
        json_schema_extra={"uniqueItems": True, "items": {"type": "string", **json_enum(_metric_names())}},
        description="The objectives, workload metrics by name (digits: accuracy, n_params); several make a "
        "multi-objective study (NSGA-II by default, no pruner). The first is each epoch's intermediate value. "
        "Default: the workload's metric.",
    )
    directions: list[Literal["minimize", "maximize"]] | None = Field(
        None, min_length=1, description="One per metric; default: each metric's own direction."
    )
    fusion_sampler: bool = Field(
        True,
        description="Wrap the sampler in fusetune.client.FusionSampler: the parameters that change "
        "a trial's shapes are sampled once per group of up to max_array_size trials, so the trials "
        "asked together fuse into few arrays. false: the sampler alone.",
    )

    @field_validator("workload")
    @classmethod
    def _workload_exists(cls, name: str, info: ValidationInfo) -> str:
        packaged = info.data.get("package") is not None
        try:
            get_workload(name, allow_imports=False)  # never imports: the service decides on paths
        except WorkloadImportsDisabled:
            return name
        except UnknownWorkloadError as exc:
            if packaged:
                return name  # the service checks it is the package's workload
            raise ValueError(str(exc)) from exc
        if packaged:
            raise ValueError(f"{name!r} is a registered workload of the service; a package's workload needs a name of its own")
        return name

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str | None) -> str | None:
        if name is not None and name.lower() in RESERVED_STUDY_NAMES:
            raise ValueError(f"the study name {name!r} is the service's own (its code packages' folder); choose another")
        return name

    @model_validator(mode="after")
    def _client_driven_names_no_sampler_or_pruner(self) -> StudyCreate:
        if self.driver == "client":
            for name in ("sampler", "pruner", "max_concurrent_trials"):
                if name in self.model_fields_set:
                    raise ValueError(f"{name}: a client-driven study has none; its client asks and prunes")
        return self

    @model_validator(mode="after")
    def _objectives_and_training_choices(self) -> StudyCreate:
        """Metrics the workload declares, one direction each; a multi-objective study has no
        pruner and defaults to NSGA-II; searched optimizer and scheduler names exist."""
        title = "StudyCreate"
        workload = _workload_here(self.workload)
        if self.metrics is not None:
            if len(set(self.metrics)) != len(self.metrics):
                raise field_error(title, ("metrics",), f"metrics repeat a name: {self.metrics}", self.metrics)
            for i, name in enumerate(self.metrics):
                if workload is None:
                    break  # a module-path workload: the service checks its metrics when it imports it
                try:
                    workload.metric_named(name)
                except KeyError as exc:
                    raise field_error(title, ("metrics", i), str(exc.args[0]), name) from exc
        count = len(self.metrics or [None])
        if self.directions is not None and len(self.directions) != count:
            raise field_error(
                title, ("directions",), f"directions has {len(self.directions)} entries for {count} metrics", self.directions
            )
        if count > 1 or len(self.directions or ()) > 1:
            if self.pruner is not None:
                raise field_error(
                    title, ("pruner",),
                    "a multi-objective study takes no pruner: Optuna's pruners are single-objective", self.pruner.model_dump(),
                )
            if self.direction is not None:
                raise field_error(title, ("direction",), "a multi-objective study takes directions, one per metric", self.direction)
            if "sampler" not in self.model_fields_set:
                self.sampler = SamplerSpec(name="NSGAIISampler")
                self.model_fields_set.discard("sampler")  # still the default: the multi-objective one
        if self.search_space:
            wrong = training_choice_error(parse_search_space(self.search_space))
            if wrong is not None:
                raise field_error(title, ("search_space", *wrong[0]), wrong[1], wrong[2])
        return self

    @model_validator(mode="after")
    def _sampler_fits_the_study(self) -> StudyCreate:
        """The sampler's caps that depend on the study too: BruteForceSampler's walk of the search
        space, CMA-ES's covariance over it, NSGA-III's reference points among the objectives."""
        objectives = max(len(self.metrics or [None]), len(self.directions or ()))
        space: Any = None
        if self.search_space is not None:
            # Only BruteForceSampler reads the distributions (parsed here: it alone needs them).
            brute = sampler_class(self.sampler.name) == "BruteForceSampler"
            space = parse_search_space(self.search_space) if brute else self.search_space
        try:
            check_for_study(self.sampler.name, self.sampler.kwargs, space, objectives, default_limits())
        except SpecError as exc:
            raise field_error("StudyCreate", exc.loc, str(exc), None) from exc
        return self

    def training_spec(self) -> TrainingSpec:
        """The request's training settings, as workers get them (None or empty: the workload's)."""
        return TrainingSpec(
            optimizer=self.optimizer.name if self.optimizer else None,
            optimizer_kwargs=dict(self.optimizer.kwargs) if self.optimizer else {},
            lr_scheduler=self.lr_scheduler.name if self.lr_scheduler else None,
            lr_scheduler_kwargs=dict(self.lr_scheduler.kwargs) if self.lr_scheduler else {},
            warmup_epochs=self.warmup_epochs,
            max_norm=self.max_norm,
            amp=self.amp,
            metrics=tuple(self.metrics or ()),
            loader=self.loader.options() if self.loader is not None else {},
        )

    def objective_directions(self, workload: Objectives) -> list[str]:
        """One direction per objective: the request's, else each metric's own.

        Raises:
            KeyError: a metric the workload does not declare (its message names the known ones).
        """
        names = self.metrics or [workload.metric_name]
        if self.directions is not None:
            return list(self.directions)
        if self.direction is not None:
            return [self.direction]
        return [workload.metric_named(name).direction for name in names]

    @field_validator("search_space")
    @classmethod
    def _distributions(
        cls, space: dict[str, str | dict[str, Any]] | None
    ) -> dict[str, str | dict[str, Any]] | None:
        if space is None:
            return None
        if not space:
            raise ValueError("search_space must name at least one parameter (or be omitted)")
        parse_search_space(space)
        return space



def _workload_here(name: str) -> Workload | None:
    """The workload, when it resolves without importing a module path (else the service checks)."""
    if name not in available_workloads():
        return None
    try:
        return get_workload(name)
    except UnknownWorkloadError:
        return None


class BestTrial(BaseModel):
    number: int
    value: float = Field(description="The first objective's value.")
    params: dict[str, Any]
    values: list[float] | None = Field(None, description="Every objective's value, in the study's order.")


class StudyOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    tenant: str
    workload: str
    n_trials: int
    epochs: int
    direction: Literal["minimize", "maximize"]
    directions: list[Literal["minimize", "maximize"]] = Field(
        default_factory=list, description="Optuna's directions, one per objective (the Optuna study's own)."
    )
    search_space: dict[str, Any] | None
    sampler: dict[str, Any]
    pruner: dict[str, Any] | None
    driver: Literal["service", "client"] = "service"
    max_array_size: int | None
    max_concurrent_trials: int | None
    package: str | None = Field(None, description="The digest of the code package the study runs (null: a registered workload).")
    package_url: str | None = Field(
        None, description="Where the tenant downloads that package: GET /api/v1/packages/{digest} (null without one)."
    )
    state: StudyState = Field(
        description="RUNNING; PAUSED (POST .../resume runs it again); COMPLETE (PATCH n_trials may reopen it); "
        "CANCELLED; FAILED (every trial failed, or its workload cannot be loaded: see `error`); DELETING "
        "(DELETE came while arrays of it trained: it goes once they stop)."
    )
    error: str | None = Field(None, description="Why a FAILED study failed.")
    warnings: list[str] = Field(
        default_factory=list,
        description="How its trials train, where fusion could not do its best: a module the fused model runs once per "
        "member (exact, without fusion's speed-up), or a model that fuses by neither path (its trials train unfused, "
        "one per array). None fails a trial.",
    )
    created_at: datetime
    completed_at: datetime | None = Field(description="When it ended and no trial of it ran any more.")
    trial_counts: dict[str, int] = Field(default_factory=dict)
    best_trial: BestTrial | None = Field(None, description="Single-objective studies: the best COMPLETE trial.")
    best_trials: list[BestTrial] = Field(
        default_factory=list, description="Multi-objective studies: the Pareto front of COMPLETE trials (Optuna's best_trials)."
    )
    metrics: list[str] = Field(default_factory=list, description="The objectives, in order; the first is the intermediate value.")
    optimizer: dict[str, Any] | None = None
    lr_scheduler: dict[str, Any] | None = None
    warmup_epochs: int | None = None
    max_norm: float | None = None
    amp: bool | None = None
    loader: dict[str, Any] = Field(default_factory=dict, description="The study's DataLoader options (over its workload's).")
    user_attrs: dict[str, Any] = Field(default_factory=dict, description="The Optuna study's user attrs.")
    system_attrs: dict[str, Any] = Field(default_factory=dict, description="The Optuna study's system attrs.")
    fusion_sampler: bool = True


class TrialOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    number: int
    optuna_trial_id: int
    state: TrialState
    params: dict[str, Any]
    value: float | None
    intermediate_values: dict[int, float] = Field(
        default_factory=dict, description="Validation metric after each epoch (epoch index -> value)."
    )
    values: list[float] | None = Field(None, description="Optuna's values: one per objective, once finished.")
    distributions: dict[str, Any] = Field(
        default_factory=dict, description="Each param's distribution, as optuna.distributions.distribution_to_json."
    )
    user_attrs: dict[str, Any] = Field(default_factory=dict)
    system_attrs: dict[str, Any] = Field(default_factory=dict)
    array_id: int | None
    signature: str
    error: str | None
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None
    revision: int = Field(
        0, description="The trial's last change, in commit order: poll with updated_since=<the highest revision read>."
    )


class ArrayOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    study_id: int
    signature: str
    state: ArrayState
    size: int = Field(
        description="Trials it trained. An array whose members end goes on with their successors, "
        "so it can train more trials over its life than it holds at once (never more than it started with)."
    )
    trial_ids: list[int] = Field(description="Members, in the order they joined.")
    worker: str | None = Field(validation_alias="worker_name")
    device_type: str | None
    node: str | None = Field(None, description="The Ray node (its id) the array trained on.")
    epochs_done: int
    models_steps_per_s: float | None
    timings: dict[str, float] | None = Field(
        None, description="Seconds the worker spent by phase: train_s, eval_s, report_s, checkpoint_s, build_s, ..."
    )
    error: str | None
    created_at: datetime
    completed_at: datetime | None


class StudyUpdate(BaseModel):
    """Changes to a study (``PATCH /studies/{id}``): more trials, or fewer (never fewer than asked)."""

    model_config = ConfigDict(extra="forbid")

    n_trials: int = Field(
        gt=0, le=100_000,
        description="The study's new n_trials: at least the trials asked so far, within the tenant's "
        "max_trials_per_study. A COMPLETE study given more runs again.",
    )


class TrialEnqueue(BaseModel):
    """Optuna's ``study.enqueue_trial``: a trial with fixed params, asked at once."""

    model_config = ConfigDict(extra="forbid", strict=True)

    params: Annotated[dict[str, Choice], NoNulKeys] = Field(
        max_length=MAX_SEARCH_SPACE_PARAMS, json_schema_extra=NO_NUL_KEYS,
        description="Fixed params, each a number, a string, a boolean or null; any the search space "
        "suggests besides are sampled.",
    )
    user_attrs: Annotated[dict[str, Any], NoNulKeys] = Field(
        default_factory=dict, json_schema_extra=NO_NUL_KEYS,
        description=f"The trial's user attrs: at most {MAX_USER_ATTRS_BYTES} bytes as JSON.",
    )

    @field_validator("user_attrs")
    @classmethod
    def _bounded(cls, attrs: dict[str, Any]) -> dict[str, Any]:
        size = user_attrs_bytes(attrs)
        if size > MAX_USER_ATTRS_BYTES:
            raise ValueError(f"the user attrs take {size} bytes as JSON, more than {MAX_USER_ATTRS_BYTES}")
        return attrs


class PruningDecision(BaseModel):
    """A client-driven study's decision on a trial's intermediate value at ``step``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    step: JsonInt = Field(ge=0, le=2**31 - 1)
    prune: bool


class AttrValue(BaseModel):
    """The value of one user attr: any JSON value, as Optuna's ``set_user_attr`` takes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    value: Any


class Health(BaseModel):
    status: Literal["ok"]
    database: str
    workers: int


class EventOut(BaseModel):
    """One event of a study's trials or arrays, the `data` of a server-sent event whose `id`
    is `id` and whose `event` is `kind`."""

    model_config = ConfigDict(from_attributes=True)

    id: int = Field(description="Increasing; send the last one seen as Last-Event-ID to resume after it.")
    kind: Literal[
        "trial.asked", "trial.started", "trial.reported", "trial.ended",
        "array.started", "array.changed", "array.ended", "study.completed", "study.deleted",
    ]
    tenant: str
    study_id: int
    trial_id: int | None
    array_id: int | None
    data: dict[str, Any] = Field(description="What happened: e.g. trial.reported's step and value, trial.ended's state.")
    created_at: datetime
