"""The wire models of a study's components: its sampler and pruner (Optuna's), its optimizer
and LR scheduler (torch's), each a ``{"name", "kwargs"}`` spec checked where it arrives.

A sampler or pruner must be on the service's allow-list with kwargs its constructor takes,
within the caps that size its work (``server/optuna_specs.py``); nothing is built here, on
the event loop (the service builds them under a deadline). An optimizer or LR scheduler
must be one the fusion engine fuses, with arguments its torch twin accepts
(``workers/optimization.py``). A refusal is a 422 whose ``loc`` names the kwarg.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, model_validator
from pydantic.json_schema import JsonDict

from fusetune.server.optuna_specs import PRUNERS, SAMPLERS, SpecError, check_pruner, check_sampler, default_limits
from fusetune.workers.optimization import (
    LR_SCHEDULERS,
    OPTIMIZERS,
    OptionError,
    check_lr_scheduler_spec,
    check_optimizer_spec,
    lr_scheduler_name,
    optimizer_name,
)

__all__ = ["ComponentSpec", "LRSchedulerSpec", "LoaderSpec", "OptimizerSpec", "PrunerSpec", "SamplerSpec", "field_error", "json_enum"]


def json_enum(values: Iterable[str]) -> JsonDict:
    """An OpenAPI ``enum`` of ``values``, sorted: what a field that names one of them states."""
    listed: list[JsonValue] = [*sorted(values)]
    return {"enum": listed}


class ComponentSpec(BaseModel):
    """An Optuna sampler or pruner: class name (or short alias) and constructor kwargs."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(examples=["TPESampler", "random", "MedianPruner"])
    kwargs: dict[str, Any] = Field(default_factory=dict)


def _echo(value: Any) -> Any:
    """A refused kwarg's value as a 422 shows it: a list or object is summarised, not echoed
    (a refused grid is the very thing that is too large)."""
    if isinstance(value, (list, dict)):
        return f"{type(value).__name__} of {len(value)} entries"
    return f"{value[:77]}..." if isinstance(value, str) and len(value) > 80 else value


def _spec_checked(check: Any, title: str) -> Any:
    """The model validator of a sampler or pruner spec: allowed class, kwargs it takes, of their
    types and within the ``FUSETUNE_SAMPLER_*`` caps (``server/optuna_specs.py``). Nothing is
    built here, on the event loop: the service builds the spec under a deadline."""

    def checked(self: ComponentSpec) -> ComponentSpec:
        try:
            check(self.name, self.kwargs, default_limits())
        except SpecError as exc:
            value = self.name if exc.loc == ("name",) else self.kwargs.get(exc.loc[-1]) if len(exc.loc) > 1 else None
            raise field_error(title, exc.loc, str(exc), _echo(value)) from exc
        return self

    return model_validator(mode="after")(checked)


class SamplerSpec(ComponentSpec):
    """An Optuna sampler from the service's allow-list, e.g. ``{"name": "TPESampler", "kwargs":
    {"seed": 0}}``; the kwargs that size its work are capped (``FUSETUNE_SAMPLER_MAX_*``)."""

    name: str = Field(examples=["TPESampler", "random"], json_schema_extra=json_enum(SAMPLERS))

    _allowed = _spec_checked(check_sampler, "SamplerSpec")


class PrunerSpec(ComponentSpec):
    """An Optuna pruner from the service's allow-list, e.g. ``{"name": "MedianPruner", "kwargs":
    {"n_warmup_steps": 2}}``."""

    name: str = Field(examples=["MedianPruner", "hyperband"], json_schema_extra=json_enum(PRUNERS))

    _allowed = _spec_checked(check_pruner, "PrunerSpec")




def field_error(title: str, loc: tuple[str | int, ...], message: str, value: Any) -> ValidationError:
    """A validation error at ``loc`` (under the model being validated): a 422 naming that field."""
    from pydantic_core import InitErrorDetails, PydanticCustomError

    error = PydanticCustomError("value_error", "{message}", {"message": message})
    return ValidationError.from_exception_data(title, [InitErrorDetails(type=error, loc=loc, input=value)])


class OptimizerSpec(BaseModel):
    """A fused ``torch.optim`` optimizer for a study's trials: torch's class name and
    constructor kwargs, e.g. ``{"name": "AdamW", "kwargs": {"weight_decay": 0.05}}``.

    The kwargs are torch's names; ``betas`` is a pair. A trial param of the same name
    overrides them for that trial (``beta1``/``beta2`` override ``betas``' elements).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(
        examples=["AdamW", "SGD", "RMSprop"], description="A torch.optim class name (lower case accepted).",
        json_schema_extra=json_enum({*OPTIMIZERS, *(n.lower() for n in OPTIMIZERS)}),
    )
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _constructible(self) -> OptimizerSpec:
        try:
            self.name = optimizer_name(self.name)
        except OptionError as exc:
            raise field_error("OptimizerSpec", ("name",), str(exc), self.name) from exc
        try:
            check_optimizer_spec(self.name, self.kwargs)
        except OptionError as exc:
            loc = ("kwargs", exc.param) if exc.param in self.kwargs else ("kwargs",)
            raise field_error("OptimizerSpec", loc, str(exc), self.kwargs.get(exc.param, self.kwargs)) from exc
        return self


class LRSchedulerSpec(BaseModel):
    """A fused ``torch.optim.lr_scheduler`` scheduler for a study's trials, stepped once per
    epoch: torch's class name and constructor kwargs, e.g. ``{"name": "StepLR", "kwargs":
    {"step_size": 5, "gamma": 0.5}}``. A trial param of the same name overrides a kwarg
    (unless the optimizer takes that name too: then it is the optimizer's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(
        examples=["StepLR", "CosineAnnealingLR", "ReduceLROnPlateau"], description="A torch.optim.lr_scheduler class name.",
        json_schema_extra=json_enum({*LR_SCHEDULERS, *(n.lower() for n in LR_SCHEDULERS)}),
    )
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _constructible(self) -> LRSchedulerSpec:
        try:
            self.name = lr_scheduler_name(self.name)
        except OptionError as exc:
            raise field_error("LRSchedulerSpec", ("name",), str(exc), self.name) from exc
        try:
            check_lr_scheduler_spec(self.name, self.kwargs)
        except OptionError as exc:
            loc = ("kwargs", exc.param) if exc.param in self.kwargs else ("kwargs",)
            raise field_error("LRSchedulerSpec", loc, str(exc), self.kwargs.get(exc.param, self.kwargs)) from exc
        return self




#: The most DataLoader worker processes a study may ask for per array: each is a process on
#: the worker's node, next to every other tenant's arrays there.
MAX_LOADER_WORKERS = 16


class LoaderSpec(BaseModel):
    """A study's ``torch.utils.data.DataLoader`` options, over its workload's ``loader``, for a
    dataset that is not a ``TensorDataset`` (``workers/data.py``): torch's argument names. The
    array sets the batch size, the order's generator and the sampler itself."""

    model_config = ConfigDict(extra="forbid", strict=True)

    num_workers: int | None = Field(
        None, ge=0, le=MAX_LOADER_WORKERS,
        description=f"Loader worker processes per array (0: the batches are read in the training process; at most {MAX_LOADER_WORKERS}).",
    )
    pin_memory: bool | None = Field(None, description="Pinned host memory for the copies to a GPU (default: on for CUDA workers).")
    prefetch_factor: int | None = Field(None, ge=1, le=64, description="Batches each loader worker reads ahead (with num_workers > 0).")
    persistent_workers: bool | None = Field(None, description="Keep the loader's workers between epochs (with num_workers > 0).")

    def options(self) -> dict[str, Any]:
        """The options it sets, as DataLoader's keyword arguments."""
        return {k: v for k, v in self.model_dump().items() if v is not None}
