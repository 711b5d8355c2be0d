"""Pydantic models of the tenants' and tokens' routes (re-exported by ``server/schemas.py``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator, model_validator
from pydantic.json_schema import JsonDict

from fusetune.server.wire import NoNul, OptionalJsonInt

_WEIGHT = "Shares of the cluster (2.0 = twice a weight-1 tenant's)."
_MAX_RUNNING = "Most of its studies RUNNING at once; null: no limit."
_MAX_TRIALS = "Most trials (n_trials) one of its studies may have; null: no limit."
_CODE_UPLOAD = (
    "Whether it may upload code packages (PUT /api/v1/packages/{digest}) and run studies of them: its code then runs "
    "in the workers, never in the control plane (docs/security.md). Off unless the admin grants it."
)


class TenantCreate(BaseModel):
    """A new tenant (admin only); it gets its first token in the answer."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="Letters, digits, '.', '_' and '-', starting with a letter or digit.")
    weight: float = Field(1.0, gt=0, le=1e6, description=_WEIGHT)
    max_running_studies: OptionalJsonInt = Field(None, ge=0, le=1_000_000, description=_MAX_RUNNING)
    max_trials_per_study: OptionalJsonInt = Field(None, ge=1, le=100_000, description=_MAX_TRIALS)
    code_upload: bool = Field(False, description=_CODE_UPLOAD)
    token_label: NoNul | None = Field(None, max_length=255, description="A note on the first token (who holds it).")


def _without_default(schema: JsonDict) -> None:
    """A field's schema without its ``default`` (a field left out keeps the stored value)."""
    schema.pop("default", None)


class TenantUpdate(BaseModel):
    """Changes to a tenant's weight or quotas (admin only); fields left out stay as they are."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"minProperties": 1})

    # Not nullable in the document: null is refused (leave it out to keep the weight).
    weight: Annotated[float | None, WithJsonSchema({"type": "number", "exclusiveMinimum": 0, "maximum": 1e6})] = Field(
        None, gt=0, le=1e6, description=_WEIGHT, json_schema_extra=_without_default
    )
    max_running_studies: OptionalJsonInt = Field(None, ge=0, le=1_000_000, description=_MAX_RUNNING)
    max_trials_per_study: OptionalJsonInt = Field(None, ge=1, le=100_000, description=_MAX_TRIALS)
    # Not nullable: true or false (leave it out to keep it).
    code_upload: Annotated[bool | None, WithJsonSchema({"type": "boolean"})] = Field(
        None, description=_CODE_UPLOAD, json_schema_extra=_without_default
    )

    @field_validator("weight", "code_upload")
    @classmethod
    def _not_null(cls, value: float | bool | None, info: ValidationInfo) -> float | bool:
        if value is None:
            raise ValueError(f"{info.field_name} cannot be null; leave it out to keep the current value")
        return value

    @model_validator(mode="after")
    def _changes_something(self) -> TenantUpdate:
        if not self.model_fields_set:
            raise ValueError("name at least one of weight, max_running_studies, max_trials_per_study, code_upload")
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
    code_upload: bool = False


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    label: NoNul | None = Field(None, max_length=255, description="A note on the token (who holds it).")


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
