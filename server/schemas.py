"""Pydantic models of what goes over the wire in the REST API."""

from __future__ import annotations

import json
from datetime import datetime
from collections.abc import Mapping
from typing import Any, Literal

import optuna
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from fusetune.server.db import ArrayState, StudyState, TrialState
from fusetune.server.optuna_specs import PRUNERS, SAMPLERS, SpecError, make_pruner, make_sampler
from fusetune.workers.workloads import UnknownWorkloadError, WorkloadImportsDisabled, get_workload


class ComponentSpec(BaseModel):
    """An Optuna sampler or pruner: class name (or short alias) and constructor kwargs."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(examples=["TPESampler", "random", "MedianPruner"])
    kwargs: dict[str, Any] = Field(default_factory=dict)


def _spec_validators(table: dict[str, Any], make: Any, kind: str) -> tuple[Any, Any]:
    def known(cls: type, name: str) -> str:
        if name not in table:
            names = ", ".join(sorted(k for k in table if k[0].isupper()))
            raise ValueError(f"unknown {kind} {name!r}; use one of: {names}")
        return name

    def constructible(cls: type, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "name" in info.data:  # otherwise the name already failed
            try:
                make(info.data["name"], kwargs)
            except SpecError as exc:
                raise ValueError(str(exc)) from exc
        return kwargs

    return field_validator("name")(classmethod(known)), field_validator("kwargs")(classmethod(constructible))


class SamplerSpec(ComponentSpec):
    """An Optuna sampler, e.g. ``{"name": "TPESampler", "kwargs": {"seed": 0}}``."""

    _known, _constructible = _spec_validators(SAMPLERS, make_sampler, "sampler")


class PrunerSpec(ComponentSpec):
    """An Optuna pruner, e.g. ``{"name": "MedianPruner", "kwargs": {"n_warmup_steps": 2}}``."""

    _known, _constructible = _spec_validators(PRUNERS, make_pruner, "pruner")


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


class StudyCreate(BaseModel):
    """A request to run a tuning study.

    ``search_space`` maps each parameter to an Optuna distribution in the JSON form of
    ``optuna.distributions.distribution_to_json`` (as a string or as the object it encodes);
    when given it replaces the workload's default search space entirely.
    """

    model_config = ConfigDict(extra="forbid")

    workload: str = Field(examples=["digits-mlp"])
    n_trials: int = Field(gt=0, le=100_000)
    epochs: int = Field(10, gt=0, le=10_000)
    direction: Literal["minimize", "maximize"] | None = Field(
        None, description="Defaults to the workload's metric direction."
    )
    # The name is also a folder under the artifact directory (saved members, checkpoints).
    name: str | None = Field(None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                             description="Letters, digits, '.', '_' and '-', starting with a letter or digit.")
    tenant: str | None = Field(
        None, min_length=1, max_length=255,
        description="The tenant the study belongs to. A tenant's token: its own (the default). "
        "The admin's: any tenant; default `default`.",
    )
    search_space: dict[str, str | dict[str, Any]] | None = None
    sampler: SamplerSpec = Field(default_factory=lambda: SamplerSpec(name="TPESampler"))
    pruner: PrunerSpec | None = None
    max_array_size: int | None = Field(None, gt=0, le=4096)
    fusion_sampler: bool = Field(
        True,
        description="Wrap the sampler in fusetune.client.FusionSampler: the parameters that change "
        "a trial's shapes are sampled once per group of up to max_array_size trials, so the trials "
        "asked together fuse into few arrays. false: the sampler alone.",
    )

    @field_validator("workload")
    @classmethod
    def _workload_exists(cls, name: str) -> str:
        try:
            get_workload(name, allow_imports=False)  # never imports: the service decides on paths
        except WorkloadImportsDisabled:
            pass
        except UnknownWorkloadError as exc:
            raise ValueError(str(exc)) from exc
        return name

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



class BestTrial(BaseModel):
    number: int
    value: float
    params: dict[str, Any]


class StudyOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    tenant: str
    workload: str
    n_trials: int
    epochs: int
    direction: str
    search_space: dict[str, Any] | None
    sampler: dict[str, Any]
    pruner: dict[str, Any] | None
    max_array_size: int | None
    state: StudyState
    created_at: datetime
    completed_at: datetime | None
    trial_counts: dict[str, int] = Field(default_factory=dict)
    best_trial: BestTrial | None = None
    fusion_sampler: bool = True

    @model_validator(mode="after")
    def _fusion_flag_of_the_sampler_spec(self) -> StudyOut:
        # Stored in the sampler spec ({"fusion": false} only when opted out), shown on its own.
        if "fusion" in self.sampler:
            self.fusion_sampler = bool(self.sampler["fusion"])
            self.sampler = {k: v for k, v in self.sampler.items() if k != "fusion"}
        return self


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
    array_id: int | None
    signature: str
    error: str | None
    created_at: datetime
    started_at: datetime | None
    completed_at: datetime | None


class ArrayOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    study_id: int
    signature: str
    state: ArrayState
    size: int
    trial_ids: list[int] = Field(description="Members, by slot.")
    worker: str | None = Field(validation_alias="worker_name")
    device_type: str | None
    epochs_done: int
    models_steps_per_s: float | None
    timings: dict[str, float] | None = Field(
        None, description="Seconds the worker spent by phase: train_s, eval_s, report_s, checkpoint_s, build_s, ..."
    )
    error: str | None
    created_at: datetime
    completed_at: datetime | None


_WEIGHT = {"gt": 0, "le": 1e6, "description": "Shares of the cluster (2.0 = twice a weight-1 tenant's)."}
_MAX_RUNNING = {"ge": 0, "le": 1_000_000, "description": "Most of its studies RUNNING at once; null: no limit."}
_MAX_TRIALS = {"ge": 1, "le": 100_000, "description": "Most trials (n_trials) one of its studies may have; null: no limit."}


class TenantCreate(BaseModel):
    """A new tenant (admin only); it gets its first token in the answer."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="Letters, digits, '.', '_' and '-', starting with a letter or digit.")
    weight: float = Field(1.0, **_WEIGHT)
    max_running_studies: int | None = Field(None, **_MAX_RUNNING)
    max_trials_per_study: int | None = Field(None, **_MAX_TRIALS)
    token_label: str | None = Field(None, max_length=255, description="A note on the first token (who holds it).")


class TenantUpdate(BaseModel):
    """Changes to a tenant's weight or quotas (admin only); fields left out stay as they are."""

    model_config = ConfigDict(extra="forbid")

    weight: float | None = Field(None, **_WEIGHT)
    max_running_studies: int | None = Field(None, **_MAX_RUNNING)
    max_trials_per_study: int | None = Field(None, **_MAX_TRIALS)

    @field_validator("weight")
    @classmethod
    def _weight_not_null(cls, weight: float | None) -> float:
        if weight is None:
            raise ValueError("weight cannot be null; leave it out to keep the current weight")
        return weight

    @model_validator(mode="after")
    def _changes_something(self) -> TenantUpdate:
        if not self.model_fields_set:
            raise ValueError("name at least one of weight, max_running_studies, max_trials_per_study")
        return self

    def changes(self) -> dict[str, Any]:
        """The fields the request set (a quota set to null: no limit)."""
        return {field: getattr(self, field) for field in self.model_fields_set}


class TenantOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    weight: float
    max_running_studies: int | None = None
    max_trials_per_study: int | None = None


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str | None = Field(None, max_length=255, description="A note on the token (who holds it).")


class TokenOut(BaseModel):
    """A token's record; the token itself is shown only once, when it is created."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    tenant: str
    label: str | None
    created_at: datetime
    revoked_at: datetime | None


class TokenCreated(TokenOut):
    token: str = Field(description="The bearer token. Shown this once: fusetune keeps only its hash.")


class TenantCreated(BaseModel):
    tenant: TenantOut
    token: TokenCreated


class Health(BaseModel):
    status: Literal["ok"]
    database: str
    workers: int
