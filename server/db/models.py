"""SQLAlchemy models of fusetune's own state.

Optuna's study, trial, param and intermediate-value tables live in the same database (through
Optuna's RDB storage); fusetune's tables are prefixed ``ft_`` so the two never collide, and each
fusetune trial points at its Optuna trial.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    ColumnElement,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    false,
    func,
    or_,
    select,
    true,
)
from sqlalchemy.ext.hybrid import hybrid_property
from sqlalchemy.orm import DeclarativeBase, Mapped, column_property, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from fusetune.server.db.text import StorableText
from fusetune.workers.spec import TrainingSpec


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored as ``DateTime(timezone=True)`` and always read back aware, in UTC.

    PostgreSQL keeps the offset; SQLite keeps none and hands back naive datetimes, which the
    API would serialise without an offset. Values are written in UTC (a naive one is taken
    to be UTC already), so both databases read back the same aware datetime.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC)
            if dialect.name == "sqlite":
                value = value.replace(tzinfo=None)  # SQLite stores the text; keep it in one form
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


#: Ids of tables that grow without bound (events): 64-bit on PostgreSQL; on SQLite every
#: INTEGER PRIMARY KEY is a 64-bit rowid already (and only INTEGER autoincrements there).
BigId = BigInteger().with_variant(Integer(), "sqlite")


def table_of(model: Any) -> Table:
    """A model's table, typed as one (SQLAlchemy types ``__table__`` as any ``FromClause``):
    the Core statements that write many rows at once take it."""
    return cast(Table, model.__table__)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON}


class StudyState(str, enum.Enum):
    """A study's life: RUNNING (asking and training), PAUSED (nothing new starts), then an end.

    COMPLETE: all ``n_trials`` trials ended and not every one failed. FAILED: every trial
    failed, or the study's workload could not be loaded (the Optuna study's system attr
    ``fusetune:failure`` says why). CANCELLED: a client cancelled it. DELETING: a client
    deleted it while arrays of it still trained; its rows go once they have stopped. An
    ended study's ``completed_at`` is set once no trial of it runs any more.
    """

    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    COMPLETE = "COMPLETE"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    DELETING = "DELETING"


class TrialState(str, enum.Enum):
    """A trial's life in fusetune: WAITING for an array, RUNNING in one, then an end state."""

    WAITING = "WAITING"
    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    PRUNED = "PRUNED"
    FAIL = "FAIL"

    @property
    def is_finished(self) -> bool:
        return self in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


class ArrayState(str, enum.Enum):
    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    FAIL = "FAIL"


def _enum(cls: type[enum.Enum]) -> Enum:
    # Stored as plain strings (no native enum type) so SQLite and PostgreSQL agree and new
    # states need no ALTER TYPE.
    return Enum(cls, native_enum=False, length=16, validate_strings=True)


class Tenant(Base):
    """A party sharing the cluster; its weight replicates its fair share (2.0 = two shares)."""

    __tablename__ = "ft_tenants"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    #: Most of its studies RUNNING at once; None: no limit.
    max_running_studies: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: Most trials one of its studies may ask for (``n_trials``); None: no limit.
    max_trials_per_study: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: Whether it may upload code packages and run studies of them (the admin grants it; off by default).
    code_upload: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Package(Base):
    """A code package a tenant uploaded (``server/packages.py``): a zip in the artifact store at
    ``packages/<digest>.zip``, named by the SHA-256 of its bytes. One row per tenant that
    uploaded it (a tenant may use only its own rows), one stored object for all of them."""

    __tablename__ = "ft_packages"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(
        ForeignKey("ft_tenants.name", name="fk_ft_packages_tenant", ondelete="CASCADE"), primary_key=True
    )
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    #: Entries of its zip.
    files: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Token(Base):
    """A tenant's bearer token, stored as the SHA-256 of the token (the token is shown once).

    Tokens are ``secrets.token_urlsafe(32)`` strings (256 random bits), so an unsalted hash is
    as good as a password hash here and lets a request find its token by an indexed lookup.
    A revoked token keeps its row (``revoked_at``) so that its id still names it.
    ``minted_by`` is the token whose bearer created this one (None: the admin or the operator
    did): revoking a token revokes every token minted from it, transitively
    (``server/tenants.py``), so spares minted with a leaked token die with it.
    """

    __tablename__ = "ft_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant: Mapped[str] = mapped_column(
        ForeignKey("ft_tenants.name", name="fk_ft_tokens_tenant", ondelete="CASCADE"), index=True
    )
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    label: Mapped[str | None] = mapped_column(String(255), nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(nullable=True)
    minted_by: Mapped[int | None] = mapped_column(
        ForeignKey("ft_tokens.id", name="fk_ft_tokens_minted_by", ondelete="CASCADE"), nullable=True, index=True
    )


@dataclass(frozen=True)
class StudyConfig:
    """A study's configuration, as its request chose it: one typed record, kept in one place
    (its ``ft_studies`` row) and read whole by the scheduling loop. Its sampler and pruner are
    specs (``{"name", "kwargs"}``); its training settings the workers' own record."""

    workload: str
    n_trials: int
    epochs: int
    search_space: dict[str, Any] | None
    sampler: dict[str, Any]
    pruner: dict[str, Any] | None
    fusion_sampler: bool
    training: TrainingSpec
    max_array_size: int | None
    max_concurrent_trials: int | None
    driver: str
    #: The digest of the code package its workload comes from (None: a registered workload).
    package: str | None = None


class Study(Base):
    """A tuning study: which workload, how many trials, and how to sample and prune them."""

    __tablename__ = "ft_studies"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    tenant: Mapped[str] = mapped_column(
        ForeignKey("ft_tenants.name", name="fk_ft_studies_tenant"), default="default", index=True
    )
    workload: Mapped[str] = mapped_column(String(255))
    n_trials: Mapped[int] = mapped_column(Integer)
    epochs: Mapped[int] = mapped_column(Integer)
    direction: Mapped[str] = mapped_column(String(16))
    search_space: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    sampler: Mapped[dict[str, Any]] = mapped_column(JSON)
    pruner: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    #: Whether the sampler is wrapped in FusionSampler (the request's ``fusion_sampler``).
    fusion_sampler: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    #: How its trials train, as its request chose (``workers.spec.TrainingSpec.to_json``); None: the workload's.
    training: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    max_array_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: Most trials asked and not finished at once (None: enough to fill the workers' arrays).
    max_concurrent_trials: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: "service": its sampler and pruner run here; "client": its client enqueues trials and prunes.
    driver: Mapped[str] = mapped_column(String(16), default="service", server_default="service")
    #: The digest of the code package it runs (``ft_packages``; None: a registered workload).
    package: Mapped[str | None] = mapped_column(String(64), nullable=True)
    optuna_study_id: Mapped[int] = mapped_column(Integer, unique=True)
    state: Mapped[StudyState] = mapped_column(_enum(StudyState), default=StudyState.RUNNING, index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    completed_at: Mapped[datetime | None] = mapped_column(nullable=True)

    trials: Mapped[list[Trial]] = relationship(back_populates="study", order_by="Trial.number")

    @property
    def config(self) -> StudyConfig:
        """The study's configuration as one typed record: what its request chose."""
        return StudyConfig(
            workload=self.workload, n_trials=self.n_trials, epochs=self.epochs, search_space=self.search_space,
            sampler=dict(self.sampler), pruner=dict(self.pruner) if self.pruner else None, fusion_sampler=self.fusion_sampler,
            training=TrainingSpec.from_json(self.training), max_array_size=self.max_array_size,
            max_concurrent_trials=self.max_concurrent_trials, driver=self.driver, package=self.package,
        )

    @hybrid_property
    def visible(self) -> bool:
        """Whether the API shows the study: not once it is deleted and nothing of it runs
        (DELETING with ``completed_at`` set), while its rows are removed (server/purge.py)."""
        return self.state != StudyState.DELETING or self.completed_at is None

    @visible.inplace.expression
    @classmethod
    def _visible_expression(cls) -> ColumnElement[bool]:
        return or_(cls.state != StudyState.DELETING, cls.completed_at.is_(None))


class Trial(Base):
    """One trial of a study, linked to its Optuna trial and to the array that trained it."""

    __tablename__ = "ft_trials"
    __table_args__ = (
        # A study's trials in pages (server/service.py list_trials): by number, and per state
        # by value (best trials, counts per state). By revision: ft_trial_revisions.
        Index("ix_ft_trials_study_number", "study_id", "number", "id"),
        Index("ix_ft_trials_study_state_value", "study_id", "state", "value"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("ft_studies.id", ondelete="CASCADE"))
    optuna_trial_id: Mapped[int] = mapped_column(Integer, unique=True)
    number: Mapped[int] = mapped_column(Integer)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    signature: Mapped[str] = mapped_column(String(64))
    state: Mapped[TrialState] = mapped_column(_enum(TrialState), default=TrialState.WAITING, index=True)
    value: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(StorableText, nullable=True)
    array_id: Mapped[int | None] = mapped_column(
        ForeignKey("ft_arrays.id", ondelete="SET NULL"), nullable=True, index=True
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(nullable=True)
    #: Epochs done of the trial's newest checkpoint in the artifact store, as its worker
    #: reported it (None: none). A trial whose array died, or whose service restarted,
    #: resumes from it; the control plane never looks into the store itself.
    checkpoint_epoch: Mapped[int | None] = mapped_column(Integer, nullable=True)

    study: Mapped[Study] = relationship(back_populates="trials")
    array: Mapped[Array | None] = relationship(back_populates="trials", foreign_keys=[array_id])


class Array(Base):
    """A fused array: trials with one shape signature trained together as one model on one worker."""

    __tablename__ = "ft_arrays"

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("ft_studies.id", ondelete="CASCADE"), index=True)
    signature: Mapped[str] = mapped_column(String(64))
    state: Mapped[ArrayState] = mapped_column(_enum(ArrayState), default=ArrayState.RUNNING, index=True)
    worker_id: Mapped[int | None] = mapped_column(ForeignKey("ft_workers.id"), nullable=True)
    #: The Ray node the array trained on (its worker's node then; workers move when nodes leave).
    node: Mapped[str | None] = mapped_column(String(64), nullable=True)
    epochs_done: Mapped[int] = mapped_column(Integer, default=0)
    models_steps_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    #: Seconds the worker spent by phase (train_s, eval_s, report_s, checkpoint_s, ...).
    timings: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    error: Mapped[str | None] = mapped_column(StorableText, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    completed_at: Mapped[datetime | None] = mapped_column(nullable=True)

    members: Mapped[list[ArrayMember]] = relationship(
        back_populates="array", order_by="ArrayMember.slot", cascade="all, delete-orphan"
    )
    trials: Mapped[list[Trial]] = relationship(back_populates="array", foreign_keys=[Trial.array_id])
    worker: Mapped[Worker | None] = relationship()

    @property
    def trial_ids(self) -> list[int]:
        """Member trial ids, by slot."""
        return [m.trial_id for m in self.members]

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def worker_name(self) -> str | None:
        return self.worker.name if self.worker else None

    @property
    def device_type(self) -> str | None:
        return self.worker.device_type if self.worker else None


class ArrayMember(Base):
    """Which trial sits in which slot of an array (the history stays when a trial is re-queued)."""

    __tablename__ = "ft_array_members"

    array_id: Mapped[int] = mapped_column(ForeignKey("ft_arrays.id", ondelete="CASCADE"), primary_key=True)
    slot: Mapped[int] = mapped_column(Integer, primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("ft_trials.id", ondelete="CASCADE"), index=True)

    array: Mapped[Array] = relationship(back_populates="members")
    trial: Mapped[Trial] = relationship()


class Worker(Base):
    """A Ray actor that owns one accelerator (or the CPU) and trains one array at a time."""

    __tablename__ = "ft_workers"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    device_type: Mapped[str] = mapped_column(String(64))
    node: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16), default="IDLE")
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)


class Throughput(Base):
    """Measured speed of one shape signature on one device type at one array size B.

    Every array-epoch updates its (signature, device type, B) row, an exponential average
    of the models·steps/s the worker measured (B = 1 also from the unfused probe a class's
    first array runs). The scheduler fits each class's speed-up curve to these rows, so a
    restarted service, or a second study of the same shapes, sizes its arrays from what was
    measured instead of measuring again.
    """

    __tablename__ = "ft_throughput"

    signature: Mapped[str] = mapped_column(String(64), primary_key=True)
    device_type: Mapped[str] = mapped_column(String(64), primary_key=True)
    members: Mapped[int] = mapped_column(Integer, primary_key=True)
    models_steps_per_s: Mapped[float] = mapped_column(Float)
    samples: Mapped[int] = mapped_column(Integer, default=1)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Event(Base):
    """Something that happened to a study's trials or arrays, for ``GET .../events`` (SSE).

    Only the scheduling loop writes events, inside the transactions that make them true (a
    trial's report and its ``trial.reported`` commit together), one transaction after the
    other: ids are therefore committed in increasing order, and a reader that has seen id N
    has seen every event before it (``Last-Event-ID`` resumes exactly there). ``tenant`` is
    the study's, kept here so that a tenant's stream needs no join and outlives the study;
    old events are pruned after ``FUSETUNE_EVENTS_RETENTION_S``.
    """

    __tablename__ = "ft_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(255), index=True)
    study_id: Mapped[int] = mapped_column(Integer, index=True)
    #: trial.asked, trial.started, trial.reported, trial.ended, array.started, array.changed,
    #: array.ended, study.completed, study.deleted (its rows are gone)
    kind: Mapped[str] = mapped_column(String(32))
    trial_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    array_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)


class TrialRevision(Base):
    """A trial's last change, in the order changes were committed (server/db/revisions.py):
    every change to the trial's row or to its Optuna trial (a reported value, attrs) stamps it.
    Read as ``Trial.revision``; the ``updated_since`` polls page this table's index.

    A table of its own, not a column of ``ft_trials``: the scheduling loop stamps every member
    of every array at every epoch, and PostgreSQL writes an updated row anew with an entry in
    each of its indexes. Restamping 1,024 trials costs about 7 ms here, 18 to 55 ms as a
    column of the wide, seven-index trial row (measured on the 2-core box).
    """

    __tablename__ = "ft_trial_revisions"
    __table_args__ = (Index("ix_ft_trial_revisions_study_revision", "study_id", "revision", "trial_id"),)

    trial_id: Mapped[int] = mapped_column(ForeignKey("ft_trials.id", ondelete="CASCADE"), primary_key=True)
    #: The trial's study (a trial never moves): a study's changes are one index range.
    study_id: Mapped[int] = mapped_column(Integer)
    revision: Mapped[int] = mapped_column(BigInteger)


#: 0 until the trial's first commit writes its row.
Trial.revision = column_property(
    func.coalesce(
        select(TrialRevision.revision).where(TrialRevision.trial_id == Trial.id).correlate_except(TrialRevision).scalar_subquery(),
        0,
    )
)


class Revision(Base):
    """The one counter that numbers committed changes to trials (server/db/revisions.py).

    A transaction that changes a trial takes the next value by updating this row, and holds
    the row's lock until it commits: revisions are therefore committed in increasing order,
    and a reader that sees revision N sees every change numbered below it.
    """

    __tablename__ = "ft_revision"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)


class SchedulerFence(Base):
    """The scheduler of record: one row, whose ``epoch`` each new scheduler increments.

    Every commit of the scheduling loop first checks, in its own transaction, that the epoch
    is still the one its scheduler took (``server/fencing.py``). A scheduler that lost the
    database's lock without noticing (a killed lock session, a database restart, a pooler
    that does not keep session locks) and goes on writing is refused by the database itself,
    from the moment another scheduler has taken over.
    """

    __tablename__ = "ft_scheduler"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
    #: host:pid of the scheduler that took the epoch, and when.
    leader: Mapped[str | None] = mapped_column(String(255), nullable=True)
    since: Mapped[datetime | None] = mapped_column(nullable=True)
