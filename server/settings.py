"""The service's configuration: one typed object read from ``FUSETUNE_*`` environment variables."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url


class Settings(BaseSettings):
    """Everything the server, its scheduling loop and its workers are configured by.

    Each field is read from the environment variable ``FUSETUNE_<FIELD>`` (for example
    ``FUSETUNE_DATABASE_URL``), so the same code runs on the embedded default (SQLite and a
    local Ray instance) and in production (PostgreSQL and a Ray cluster).
    """

    # Errors name the field, never echo its value: admin_token and database_url hold secrets.
    model_config = SettingsConfigDict(env_prefix="FUSETUNE_", extra="ignore", hide_input_in_errors=True)

    database_url: str = Field(
        "sqlite:///./fusetune.db",
        description="SQLAlchemy URL of the database holding both fusetune's and Optuna's tables.",
    )
    scheduler_lock_url: str | None = Field(
        None,
        description="Where the scheduler lock's own connection goes, when not FUSETUNE_DATABASE_URL: "
        "behind a pooler in transaction mode (PgBouncer's default) a session's advisory lock does not "
        "hold, so point this at PostgreSQL itself or at a session-mode pool. Commits stay fenced either "
        "way (server/fencing.py).",
    )
    ray_address: str | None = Field(
        None, description="Address of an existing Ray cluster; unset starts a local Ray instance."
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token of the admin, who creates tenants, sets their weights and quotas and "
        "may act on every tenant's resources; at least 16 characters. Unset: no admin over HTTP "
        "(`fusetune tenants ... --database` manages tenants directly; `fusetune demo` makes one up).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING",
        description="Level of the service's own log (Python's logging names): INFO adds each array's "
        "start and end, the place to look when a sweep stalls.",
    )
    allow_workload_imports: bool = Field(
        False,
        description="Accept studies whose workload is a `package.module:attr` import path (the server "
        "imports that module). Off: only registered and entry-point workloads.",
    )
    max_tokens_per_tenant: int = Field(
        100,
        ge=1,
        le=1_000_000,
        description="Most live (unrevoked) tokens a tenant may hold; minting one more is a 409 naming "
        "the limit (revoke one first). Bounds the spares a leaked token could mint, and the token table.",
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    artifact_dir: Path = Field(
        Path("./artifacts"),
        description="The artifact store when FUSETUNE_ARTIFACT_STORE is unset: a local directory, where "
        "workers save checkpoints and each finished trial's weights (one node, or a path every node mounts).",
    )
    artifact_store: str | None = Field(
        None,
        description="The artifact store as a URI pyarrow.fs understands, like Ray's storage_path: "
        "file:///shared/fusetune (a filesystem every node mounts), s3://bucket/prefix, gs://..., hdfs://...; "
        "unset: FUSETUNE_ARTIFACT_DIR.",
    )
    ray_timeout_s: float = Field(
        60.0, gt=0, description="Longest wait for a Ray call that should answer at once (a worker's info, a restart)."
    )
    heartbeat_interval_s: float = Field(
        5.0, gt=0, description="How often the scheduling loop pings each busy worker."
    )
    heartbeat_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A busy worker that answers no ping for this long is hung: it is killed and replaced, "
        "and its members resume from their checkpoints.",
    )
    epoch_timeout_s: float | None = Field(
        3600.0,
        gt=0,
        description="Longest an array's epoch may run (its validation and checkpoint included; not the "
        "array's setup before its first epoch, which may take FUSETUNE_PACKAGE_LOAD_TIMEOUT_S more: loading its "
        "data, building and resuming its models, and a code package's environment and import). Preemption waits for epoch boundaries, so an epoch that never ends would hold its worker past "
        "its tenant's share for ever: past this the worker is killed and replaced, and the array's trials fail "
        "with an error naming this setting (a waiting pruning decision does not count). Unset: no deadline.",
    )
    db_retry_s: float = Field(
        1.0, gt=0, description="First wait before the scheduling loop retries a database that failed (doubling, up to 5 s)."
    )
    delete_batch_trials: int = Field(
        200,
        ge=1,
        description="Trials (with their every row: values, params, attrs, revisions) removed per "
        "transaction when a deleted study's rows go, on a thread of their own: small transactions "
        "interleave with the scheduling loop's (a study of 100,000 trials x 20 epochs is ~3 million rows).",
    )
    prune_reply_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long an array of a study with a pruner (or a client that decides pruning) waits "
        "at an epoch boundary for the decision. Past it the array goes on as if told to continue, and a "
        "decision that comes later applies at a later boundary: a control plane cut off from its "
        "database, or a client that never answers, never fails a trial or holds a device. Also the "
        "longest an array that ended waits for its last reports to be recorded before it removes the "
        "checkpoints of the members that ended in them (past it they stay).",
    )
    loop_call_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long a request that the scheduling loop must carry out (pause, resume, cancel, "
        "delete, more trials, enqueue, a pruning decision) waits for the loop to take it up. Past it "
        "the request is withdrawn, never carried out, and answered 503.",
    )
    leader_poll_s: float = Field(
        2.0,
        gt=0,
        description="How often a standby server (another one holds the database's scheduler lock) tries "
        "to take the lock over, and the scheduler checks that it still holds it.",
    )
    worker_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="Memory budget of each worker's arrays, in bytes: arrays are sized by the fusion "
        "engine's memory model (bytes(B) = base + B * member, fusion/sizing.py) to fit it, and a trial "
        "whose model needs more than it to train fails when asked. Unset: the device's memory, and on "
        "CUDA an array that runs out of memory is split in halves and retried.",
    )
    max_array_size: int = Field(
        64,
        ge=1,
        description="Most trials fused into one array. The scheduler picks each class's size from "
        "its measured speed-up curve up to this cap, and a class that fits one array is not split "
        "(docs/benchmarks.md: the digits MLP still gains from B = 32 to 64 on one CPU core).",
    )
    min_member_efficiency: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Fusing more members pays while each keeps at least this fraction of its solo "
        "speed: low favours the sweep's throughput, high each trial's latency.",
    )
    cpu_workers: int | None = Field(
        None,
        ge=1,
        description="CPU worker actors to start when no GPU is present; unset: one per CPU of the "
        "Ray cluster, one thread each (small fused models scale better over processes than threads).",
    )
    ask_batch: int | None = Field(
        None,
        ge=1,
        description="Most trials asked from a study's sampler ahead of being trained; unset: enough "
        "to fill every worker's array (workers x max_array_size). Smaller batches let the sampler "
        "learn from more finished trials.",
    )
    checkpoint_frequency: int = Field(
        1,
        ge=0,
        description="Checkpoint each running member at most every N epochs, in the background "
        "(Ray Tune's name); a crash loses at most the epochs since the last one. 0: never.",
    )
    checkpoint_interval_s: float = Field(
        10.0,
        ge=0,
        description="...and at most every this many seconds of its array's training, so that arrays "
        "of short epochs do not spend their time saving. 0: every checkpoint_frequency epochs.",
    )
    throughput_smoothing: float = Field(
        0.3, gt=0, le=1, description="Weight of a new throughput measurement in its running average."
    )
    scheduling_policy: Literal["fifo", "gavel-paper", "gavel", "oef", "oef-noncooperative", "fusion-greedy", "fusetune"] = Field(
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
    move_latency_s: float = Field(
        0.2,
        ge=0,
        description="What moving members to an idle device is assumed to cost besides their builds (the "
        "wait for the array's boundary, a scheduling round, the new array's start). A device idle with "
        "nothing waiting takes half of "
        "a running array's members when that is estimated to end them at least 25% sooner.",
    )
    poll_interval_s: float = Field(0.2, gt=0, description="Period of the scheduling loop.")
    device_refresh_s: float = Field(10.0, gt=0, description="How often to look for new accelerators in the Ray cluster.")
    max_body_bytes: int = Field(
        1024 * 1024,
        ge=1,
        description="Largest request body accepted, in bytes (chunked bodies included); larger ones get 413.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long a request's body may take to arrive, from its first read; past it the request "
        "gets 408. A connection that trickles its body, or stops sending it, holds what it sent no longer.",
    )
    header_timeout_s: float = Field(
        15.0,
        gt=0,
        description="How long a connection may take to send a request's line and headers, from when it "
        "opens or from its last response; past it the connection is closed. Connections count against "
        "FUSETUNE_MAX_CONNECTIONS while open, so ones that send nothing (or a header line now and then) "
        "would otherwise hold the server at 503 for everyone.",
    )
    max_connections: int = Field(
        1024,
        ge=1,
        description="Connections the HTTP server serves at once (uvicorn's limit_concurrency); more get 503. "
        "With FUSETUNE_MAX_BODY_BYTES and FUSETUNE_BODY_TIMEOUT_S, it bounds what unauthenticated "
        "connections can make the server hold. Each open event stream and dashboard holds one.",
    )
    package_max_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1,
        description="Largest code package (PUT /api/v1/packages/{digest}, a zip) accepted, in bytes; larger ones "
        "get 413 naming this setting. The package route has this limit instead of FUSETUNE_MAX_BODY_BYTES.",
    )
    package_max_files: int = Field(
        10_000,
        ge=1,
        description="Most entries a code package's zip may hold; more is a 413 naming this setting.",
    )
    package_max_unpacked_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1,
        description="Most bytes a code package's files may take unpacked (what workers unpack: a zip bomb "
        "is refused before any of it is written); more is a 413 naming this setting.",
    )
    package_call_timeout_s: float = Field(
        30.0,
        gt=0,
        description="How long a call to a code package's describer (the worker process that builds the "
        "package's models on the meta device for trial signatures) may take, from when it is sent, before the "
        "package's study fails. The scheduling loop does not wait for it; a model built on the meta device "
        "takes milliseconds. Setting up the package's environment and loading it do not count "
        "(FUSETUNE_PACKAGE_LOAD_TIMEOUT_S).",
    )
    package_load_timeout_s: float = Field(
        900.0,
        gt=0,
        description="How long a code package's describer may take to set its environment up (requirements "
        "installed by Ray) and import the package, before the package's study fails; a package whose import "
        "never returns would otherwise hold its describer, and idle workers started in its env, for ever. "
        "Also the longest an array's setup may take beyond FUSETUNE_EPOCH_TIMEOUT_S (its env and import, its "
        "data, its models built and resumed) before its first epoch starts.",
    )
    package_describers: int = Field(
        8,
        ge=1,
        description="Most code packages whose describer processes live at once (each holds torch and the "
        "package's modules); beyond it, the least recently used one that is idle is stopped (started again "
        "when needed), and a package waits for a place while every one is loading or answering.",
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="Bearer token that GET /metrics requires (Prometheus' `authorization` credentials); "
        "unset: /metrics is open, like /healthz. At least 16 characters.",
    )
    events_retention_s: float = Field(
        7 * 24 * 3600.0, gt=0, description="How long events (GET .../events) are kept before they are pruned."
    )
    events_poll_interval_s: float = Field(
        0.25, gt=0, description="How often an open event stream looks for new events that other processes wrote; "
        "events this process commits (its scheduling loop's) wake its streams at once."
    )
    events_max_stream_s: float = Field(
        300.0,
        gt=0,
        description="An event stream closes after this long; EventSource clients reconnect with "
        "Last-Event-ID and lose nothing (it frees connections behind proxies that keep them forever).",
    )
    events_max_streams_per_tenant: int = Field(
        32,
        ge=1,
        le=100_000,
        description="Most event streams one tenant (and the admin, counted apart) holds open at once in one API "
        "process; one more is a 429 with Retry-After naming this limit.",
    )
    events_auth_recheck_s: float = Field(
        2.0,
        gt=0,
        le=300,
        description="How often an open event stream checks that its token still authenticates: a revoked token's "
        "stream ends within this (one indexed read per stream each time).",
    )
    # A study's sampler runs on the scheduling thread every study shares, in the process that
    # is also the API and the Ray driver: the kwargs that size its work are capped
    # (server/optuna_specs.py), and a request over a cap is a 422 naming the kwarg and its limit.
    sampler_max_grid_points: int = Field(
        100_000,
        ge=1,
        description="Most points of a GridSampler grid (the product of its value lists' lengths, which "
        "GridSampler builds and shuffles) and most combinations BruteForceSampler walks in a request's "
        "search space. 100,000 is n_trials' own limit; 10^6 points take ~80 MB and 0.2 s to build.",
    )
    sampler_max_ei_candidates: int = Field(
        256,
        ge=1,
        description="Largest TPESampler n_ei_candidates (Optuna's default: 24). Each ask's time grows with "
        "it: at 1,000 trials x 10 params, 17 ms at 24, 78 ms at 256, 1.4 s at 4,096 (docs/benchmarks.md).",
    )
    sampler_max_population: int = Field(
        1_000,
        ge=2,
        description="Largest NSGAIISampler/NSGAIIISampler population_size and CmaEsSampler popsize.",
    )
    sampler_max_reference_points: int = Field(
        10_000,
        ge=1,
        description="Most NSGAIIISampler reference points: those a request lists, or those its "
        "dividing_parameter makes among its objectives (C(objectives + p - 1, p), each built by Optuna).",
    )
    sampler_max_cma_dimensions: int = Field(
        100,
        ge=1,
        description="Most parameters in the search space of a study with a full-covariance CmaEsSampler "
        "(a d x d covariance, decomposed each generation: 63 ms an ask at 100, 350 ms at 200); "
        "use_separable_cma is linear in them and not capped.",
    )
    spec_build_timeout_s: float = Field(
        5.0,
        gt=0,
        description="Longest a new study's sampler and pruner may take to build (off the event loop, once "
        "their kwargs passed the caps); past it the request is a 422.",
    )

    @field_validator("admin_token", "metrics_token", mode="before")
    @classmethod
    def _strong_admin_token(cls, value: object, info: ValidationInfo) -> object:
        if value is None or value == "":
            return None  # `FUSETUNE_ADMIN_TOKEN=` (e.g. docker compose passing an unset variable)
        secret = value.get_secret_value() if isinstance(value, SecretStr) else value
        if isinstance(secret, str) and len(secret) < 16:
            raise ValueError(
                f"{info.field_name} must have at least 16 characters; make one with "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return value

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


def artifact_uri(settings: Settings) -> str:
    """The artifact store workers write to: FUSETUNE_ARTIFACT_STORE, else FUSETUNE_ARTIFACT_DIR made absolute."""
    return settings.artifact_store or str(settings.artifact_dir.resolve())


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read from the environment once."""
    return Settings()
