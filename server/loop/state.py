"""What the scheduling loop keeps in memory of the arrays it runs: one object, one owner.

Every part of the loop (``dispatch``, ``recorder``, ``lifecycle``) reads and changes this
state on the loop's one thread; nothing else touches it. It is never the truth (the
database is): it spares each array-epoch's transaction its reads, and it is rebuilt empty
by a new process, whose recovery re-queues what an earlier one left running.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fusetune.scheduler import Placement
from fusetune.server.db import StudyState, Trial
from fusetune.workers.spec import MemberSpec

if TYPE_CHECKING:
    from fusetune.workers.pool import WorkerHandle

__all__ = ["LOOKAHEAD_EPOCHS", "Awaiting", "Live", "LoopState", "class_of", "member_spec"]

#: Members this many epochs (or fewer) from their last are offered a successor at once, to
#: join where they leave: the offer must reach the worker before that boundary (dispatch),
#: and the recorder stretches the look-ahead to at least a quarter second of epochs. One, not
#: more: the scheduler counts such members as done, so their device looks free to it for that
#: long, and it may place a waiting class there instead of on an idle device (with two, the
#: live-vs-simulated test's fusetune studies took 8-17 % longer than simulated; with one, -2 to +7 %).
LOOKAHEAD_EPOCHS = 1


@dataclass
class Live:
    """What the control plane keeps of an array it started, so that its reports need no reads."""

    study_id: int
    optuna_ids: dict[int, int]  # fusetune trial id -> Optuna trial id, members and newcomers
    client_decides: bool = False  # a client-driven study: its client decides pruning
    tenant: str = "default"  # the study's, for its events
    announced: set[int] = field(default_factory=set)  # first members whose trial.started is written, until they join
    epochs_done: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    checkpoints: dict[int, int] = field(default_factory=dict)  # trial id -> checkpoint epoch stored in ft_trials
    steps: dict[int, int] = field(default_factory=dict)  # trial id -> the last step recorded of it in this array
    ahead: Counter[int] = field(default_factory=Counter)  # boundary -> newcomers offered to join there
    lookahead: int = LOOKAHEAD_EPOCHS  # epochs ahead a successor is offered (a quarter second of the last epoch's)
    near: set[int] = field(default_factory=set)  # members that came within the look-ahead
    unacked: int = 0  # recorded reports of a worker that does not wait, not acknowledged yet
    new_checkpoint: bool = False  # a recorded report named a checkpoint not acknowledged yet
    last_epoch: tuple[float, int] = (0.0, 0)  # the last epoch's seconds (training to report) and its members
    # Members whose trials the control plane ended while the worker went on: pruned by a
    # reply that came after the worker's deadline (workers/actor.py). Their later results are
    # the worker's, not the trial's any more, and are not recorded.
    ended: set[int] = field(default_factory=set)


@dataclass
class Awaiting:
    """An array-epoch of a client-driven study whose reply waits for the client's decisions."""

    worker: WorkerHandle
    steps: dict[int, int]  # fusetune trial id -> the step its decision is for
    prune: set[int] = field(default_factory=set)


@dataclass
class LoopState:
    """The arrays the loop runs and what is asked of them, by the loop's parts (see the module docstring)."""

    live: dict[int, Live] = field(default_factory=dict)  # array id -> what its reports need
    awaiting: dict[int, Awaiting] = field(default_factory=dict)  # array id -> its epoch waiting for a client
    running: dict[str, Placement] = field(default_factory=dict)  # device -> the array the scheduler placed there
    halting: dict[int, StudyState] = field(default_factory=dict)  # paused or stopping studies: their members leave
    leaving: dict[int, set[int]] = field(default_factory=dict)  # array id -> members asked to leave it
    moves: dict[str, list[int]] = field(default_factory=dict)  # idle device -> members leaving an array for it
    resumes: dict[int, int] = field(default_factory=dict)  # trial id -> times re-queued from a checkpoint
    worker_ids: dict[str, int] = field(default_factory=dict)  # worker name -> its ft_workers id


def class_of(trial: Trial | Any) -> str:
    """The scheduler's fusion key of a trial (an ORM trial, or a row of its columns): its
    signature, within its study.

    An array trains the trials of one study (its epochs, pruner and reports are the study's),
    so equal signatures of different studies are different classes.
    """
    return f"{trial.signature}@{trial.study_id}"


def member_spec(trial: Trial) -> MemberSpec:
    """A trial as a worker trains it: from the checkpoint its workers last reported, or from scratch."""
    return MemberSpec(trial.id, trial.optuna_trial_id, trial.number, dict(trial.params), resume_epoch=trial.checkpoint_epoch or 0)
