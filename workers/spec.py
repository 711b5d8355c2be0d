"""What a worker is asked to train and what it answers: plain data, sent through Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MemberSpec:
    """One trial in an array."""

    trial_id: int  # fusetune's trial id
    optuna_trial_id: int
    number: int  # the trial's number in its Optuna study
    params: dict[str, Any]


@dataclass(frozen=True)
class ArraySpec:
    """An array to train: its members, their study and where to report."""

    array_id: int
    signature: str  # the scheduler's class of the members: equal shapes, one study
    database_url: str
    study_name: str
    workload: str
    epochs: int
    members: tuple[MemberSpec, ...]
    pruner: dict[str, Any] | None = None
    seed: int = 0
    artifact_dir: str | None = None  # where each finished member's state_dict is saved


@dataclass
class ArrayOutcome:
    """How an array ended, member by member (trial ids)."""

    array_id: int
    completed: list[int] = field(default_factory=list)
    pruned: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    released: list[int] = field(default_factory=list)  # preempted: checkpointed and waiting again
    epochs_done: int = 0
    models_steps_per_s: float | None = None
    members: int = 0  # how many members trained (B)
    sizing: dict[str, Any] | None = None  # fusion.sizing's dry-run result for this device type
    error: str | None = None
