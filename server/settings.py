"""The service's configuration: one typed object read from ``FUSETUNE_*`` environment variables."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url


class Settings(BaseSettings):
    """Everything the server, its scheduling loop and its workers are configured by.

    Each field is read from the environment variable ``FUSETUNE_<FIELD>`` (for example
    ``FUSETUNE_DATABASE_URL``), so the same code runs on the embedded default (SQLite and a
    local Ray instance) and in production (PostgreSQL and a Ray cluster).
    """

    model_config = SettingsConfigDict(env_prefix="FUSETUNE_", extra="ignore")

    database_url: str = Field(
        "sqlite:///./fusetune.db",
        description="SQLAlchemy URL of the database holding both fusetune's and Optuna's tables.",
    )
    ray_address: str | None = Field(
        None, description="Address of an existing Ray cluster; unset starts a local Ray instance."
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    artifact_dir: Path = Field(
        Path("./artifacts"),
        description="Where workers save each finished trial's weights; shared storage when workers run on other nodes.",
    )
    max_array_size: int = Field(8, ge=1, description="Most trials fused into one array.")
    cpu_workers: int = Field(1, ge=1, description="CPU worker actors to start when no GPU is present.")
    ask_batch: int = Field(
        16,
        ge=1,
        description="Most trials asked from a study's sampler ahead of being trained. Larger "
        "batches fill arrays better; smaller ones let the sampler learn from more finished trials.",
    )
    scheduling_policy: Literal["fifo", "gavel", "oef", "oef-noncooperative", "fusion-greedy", "fusetune"] = Field(
        "fusetune", description="The scheduler's policy (see docs/scheduling.md)."
    )
    prior_marginal_cost: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Fraction of a solo model's step time one more fused member is assumed to add "
        "before anything is measured (HFTA measures 0.04-0.1 for small models).",
    )
    lease_s: float = Field(360.0, ge=0, description="How long a placement is guaranteed before it may be revised.")
    poll_interval_s: float = Field(0.2, gt=0, description="Period of the scheduling loop.")
    device_refresh_s: float = Field(10.0, gt=0, description="How often to look for new accelerators in the Ray cluster.")

    @field_validator("database_url")
    @classmethod
    def _absolute_sqlite_path(cls, value: str) -> str:
        # Ray workers may run in another working directory: pin a relative SQLite file to the
        # directory the service was started from, so every process opens the same database.
        url = make_url(value)
        if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
            path = Path(url.database)
            if not path.is_absolute():
                url = url.set(database=str(Path(os.getcwd(), path).resolve()))
                return url.render_as_string(hide_password=False)
        return value


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read from the environment once."""
    return Settings()
