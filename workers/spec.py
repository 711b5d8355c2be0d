"""What a worker is asked to train and what it says back: plain data, sent through Ray.

A worker talks only to the control plane, never to the database: it is handed an
:class:`ArraySpec`, sends one :class:`EpochReport` per array-epoch and, when the study has a
pruner, waits for the :class:`EpochReply` with its decisions; it ends with an
:class:`ArrayOutcome`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError

#: A report is read back as the tenant's code may have made it (workers/untrusted.py admits
#: its classes only): each is checked against its fields' types, and its sizes are bounded,
#: before the control plane writes any of it (:func:`checked`).
_CHECKED = ConfigDict(revalidate_instances="always")
_MAX_MEMBERS = 4096  # the most an array has (a study's max_array_size)
_MAX_ITEMS = 64  # objectives, timing phases, warnings


def _cut(limit: int) -> BeforeValidator:
    return BeforeValidator(lambda v: v[:limit] if isinstance(v, str) else v)


_Text = Annotated[str, _cut(16_384)]  # an error, a traceback, a warning: its beginning
_Path = Annotated[str, Field(max_length=4096)]


@dataclass(frozen=True)
class MemberSpec:
    """One trial in an array."""

    trial_id: int  # fusetune's trial id
    optuna_trial_id: int
    number: int  # the trial's number in its Optuna study
    params: dict[str, Any]
    # Where it starts: from scratch (0), from its checkpoint after that many epochs (the one
    # the control plane recorded), or None: its newest checkpoint in the store, if any.
    resume_epoch: int | None = None


@dataclass(frozen=True)
class TrainingSpec:
    """A study's training settings, as its request chose them; None or empty: the workload's.

    A trial's own params override them (``workers/optimization.py``).
    """

    optimizer: str | None = None  # a torch.optim class name, e.g. "AdamW"
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)  # its constructor's arguments
    lr_scheduler: str | None = None  # a torch.optim.lr_scheduler class name, e.g. "StepLR"
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    warmup_epochs: int | None = None
    max_norm: float | None = None  # gradient clipping, per member
    amp: bool | None = None  # CUDA autocast + per-member GradScaler (ignored on CPU workers)
    metrics: tuple[str, ...] = ()  # the study's objectives, in order; (): the workload's metric
    # The DataLoader's options for a dataset that is not a TensorDataset (num_workers,
    # persistent_workers, prefetch_factor, pin_memory, ...), each over the workload's ``loader``.
    loader: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The settings as the study stores them: the request's own fields."""
        return {
            "optimizer": None if self.optimizer is None else {"name": self.optimizer, "kwargs": dict(self.optimizer_kwargs)},
            "lr_scheduler": None
            if self.lr_scheduler is None
            else {"name": self.lr_scheduler, "kwargs": dict(self.lr_scheduler_kwargs)},
            "warmup_epochs": self.warmup_epochs,
            "max_norm": self.max_norm,
            "amp": self.amp,
            "metrics": list(self.metrics),
            "loader": dict(self.loader),
        }

    @classmethod
    def from_json(cls, stored: dict[str, Any] | None) -> TrainingSpec:
        """What :meth:`to_json` stored (None: a study that set nothing)."""
        if not stored:
            return cls()
        optimizer, scheduler = stored.get("optimizer") or {}, stored.get("lr_scheduler") or {}
        return cls(
            optimizer=optimizer.get("name"),
            optimizer_kwargs=dict(optimizer.get("kwargs") or {}),
            lr_scheduler=scheduler.get("name"),
            lr_scheduler_kwargs=dict(scheduler.get("kwargs") or {}),
            warmup_epochs=stored.get("warmup_epochs"),
            max_norm=stored.get("max_norm"),
            amp=stored.get("amp"),
            metrics=tuple(stored.get("metrics") or ()),
            loader=dict(stored.get("loader") or {}),
        )


@dataclass(frozen=True)
class ArraySpec:
    """An array to train: its members and their study's settings."""

    array_id: int
    signature: str  # the scheduler's class of the members: equal shapes, one study
    study_name: str
    workload: str
    epochs: int
    members: tuple[MemberSpec, ...]
    # The study's seed: member n starts from weights drawn with seed + n, and the array's data
    # order is drawn with seed + its first member's number.
    seed: int = 0
    # The artifact store (workers/store.py): a local directory or a pyarrow.fs URI that every
    # node sees; members' weights and checkpoints go there.
    artifact_dir: str | None = None
    checkpoint_frequency: int = 1  # checkpoint at most every N epochs (Ray Tune's name); 0: never
    checkpoint_interval_s: float = 0.0  # ...and at most every this many seconds
    probe_solo: bool = False  # also time one member unfused once: the class's B = 1 speed
    prunes: bool = True  # the study has a pruner: each epoch waits for the control plane's decision
    training: TrainingSpec = field(default_factory=TrainingSpec)  # the study's optimizer, schedule, metrics, ...
    # How long an epoch boundary waits for the pruning reply (``prunes``) before it goes on
    # as if told to continue; a late reply's decisions apply at a later boundary.
    reply_timeout_s: float = 60.0
    # False: the class fuses by neither path (an earlier array of it could not run fused, and
    # the plain model trains): the array trains its one member as the plain model, unfused.
    fused: bool = True
    # The digest of the tenant's code package the workload comes from (None: a registered
    # workload): the worker runs in that package's runtime_env (workers/package.py).
    package: str | None = None


@dataclass(frozen=True)
class MemberReport:
    """One member's result at an epoch boundary.

    ``state`` is set when the member ended on the worker's side: ``COMPLETE`` after its last
    epoch (its weights saved at ``state_dict``), ``FAIL`` when its loss stopped being
    finite. Pruning is the control plane's decision, sent back in the :class:`EpochReply`.
    ``value`` is the study's first objective (the intermediate value); ``values``, set when
    the member completed, holds every objective in the study's order (Optuna's values).
    ``checkpoint_epoch`` is the epochs done of the member's newest checkpoint that is
    completely written to the artifact store (None: none yet): the control plane resumes the
    trial from it after a crash, and never looks into the store itself.
    """

    __pydantic_config__ = _CHECKED

    trial_id: int
    step: int  # the member's own epoch index: members of one array can be at different epochs
    value: float
    state: Literal["COMPLETE", "FAIL"] | None = None
    error: _Text | None = None
    state_dict: _Path | None = None
    values: Annotated[tuple[float, ...], Field(max_length=_MAX_ITEMS)] = ()
    checkpoint_epoch: int | None = None


@dataclass(frozen=True)
class Joined:
    """A member that started training in this array at the last boundary."""

    __pydantic_config__ = _CHECKED

    trial_id: int
    resumed_at_epoch: int | None = None  # the checkpoint's epochs done, when it resumed from one


@dataclass(frozen=True)
class EpochReport:
    """Everything one array-epoch produced: the control plane writes it in one transaction."""

    __pydantic_config__ = _CHECKED

    array_id: int
    members: Annotated[tuple[MemberReport, ...], Field(max_length=_MAX_MEMBERS)]
    joined: Annotated[tuple[Joined, ...], Field(max_length=_MAX_MEMBERS)] = ()  # started since the previous report
    released: Annotated[tuple[int, ...], Field(max_length=_MAX_MEMBERS)] = ()  # preempted trial ids that left checkpointed
    size: int = 0  # B that trained this epoch
    member_steps: int = 0  # models·steps done this epoch
    train_seconds: float = 0.0
    solo_steps_per_s: float | None = None  # the unfused probe's speed, when the spec asked for it
    timings: Annotated[dict[str, float], Field(max_length=_MAX_ITEMS)] = field(default_factory=dict)  # seconds by phase, this epoch
    # What the study's user should know of how this array trains, new since its last report:
    # modules the fused model runs once per member (exact, but without fusion's speed-up).
    warnings: Annotated[tuple[_Text, ...], Field(max_length=_MAX_ITEMS)] = ()


@dataclass(frozen=True)
class EpochReply:
    """The control plane's answer to an :class:`EpochReport`."""

    prune: frozenset[int] = frozenset()  # trial ids whose pruner says stop
    # How many of the array's reports the control plane has recorded since the last reply
    # (each of its replies acknowledges one): their checkpoints are known, older ones can go.
    acked: int = 1


@dataclass
class ArrayOutcome:
    """How an array ended, member by member (trial ids)."""

    __pydantic_config__ = _CHECKED

    array_id: int
    completed: Annotated[list[int], Field(max_length=_MAX_MEMBERS)] = field(default_factory=list)
    pruned: Annotated[list[int], Field(max_length=_MAX_MEMBERS)] = field(default_factory=list)
    failed: Annotated[dict[int, _Text], Field(max_length=_MAX_MEMBERS)] = field(default_factory=dict)
    released: Annotated[list[int], Field(max_length=_MAX_MEMBERS)] = field(default_factory=list)  # preempted: checkpointed and waiting again
    epochs_done: int = 0
    models_steps_per_s: float | None = None
    members: int = 0  # how many members trained (B)
    timings: Annotated[dict[str, float], Field(max_length=_MAX_ITEMS)] = field(default_factory=dict)  # seconds by phase, whole array
    error: _Text | None = None
    oom: bool = False  # the device ran out of memory: the control plane splits the array and retries
    # Why the members cannot train fused (naming the module), when the fused model failed its
    # first step or evaluation and the plain model trains: the members were not failed (they
    # wait again), and the control plane trains their class unfused, in arrays of one.
    unfusible: _Text | None = None
    # The tenant's code package failed to load in the worker (its traceback): the control plane
    # fails the study, whose every array would fail the same way.
    package_error: _Text | None = None


_ADAPTERS: dict[type, TypeAdapter[Any]] = {EpochReport: TypeAdapter(EpochReport), ArrayOutcome: TypeAdapter(ArrayOutcome)}


def checked(message: EpochReport | ArrayOutcome) -> EpochReport | ArrayOutcome:
    """A worker's report or outcome as the control plane may read it: its fields of their
    types and within their bounds (long texts cut), a new object.

    Raises:
        ValueError: naming the first field that is not, without printing its value (a list
            sharing one inner list many times over prints for ever).
    """
    adapter = _ADAPTERS.get(type(message))
    if adapter is None:
        raise ValueError(f"{type(message).__name__} is not a report or an outcome")
    try:
        found: EpochReport | ArrayOutcome = adapter.validate_python(message)
    except ValidationError as exc:
        first = exc.errors(include_input=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{type(message).__name__}.{where}: {first['msg']}") from None
    return found
