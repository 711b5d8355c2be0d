"""Plain value types of the scheduling API (inputs and the decision)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fusetune.scheduler._allocation import Allocation

__all__ = ["Device", "Tenant", "Placement", "Decision"]

GIB = 1 << 30


@dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU worker slot in local mode) that runs one array at a time."""

    device_id: str
    device_type: str
    memory_bytes: int = 16 * GIB
    node: str = "local"


@dataclass(frozen=True)
class Tenant:
    """A party sharing the cluster; ``weight`` replicates its equal share (2.0 = two shares)."""

    name: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name!r}: weight must be > 0, got {self.weight}")


@dataclass(frozen=True)
class Placement:
    """One fused array running on one device until at least ``lease_expires``.

    A lease that has expired (``lease_expires <= now``) is revocable: the next round may
    keep it (and extend the lease) or preempt it.  Work-conserving "backfill" arrays get
    an already-expired lease, so they never block a tenant's fair share.
    """

    device_id: str
    signature: str
    tenant: str
    trial_ids: tuple[int, ...]
    lease_expires: float


@dataclass(frozen=True)
class Decision:
    """What to run until the next round.

    Attributes:
        placements: every array that should be running now, one per busy device
            (kept arrays keep their device; their ``trial_ids`` may have grown by
            epoch-boundary refills).
        started: the subset of ``placements`` that is new or whose membership changed
            (the worker must (re)start these arrays).
        preempted: trial ids that were running and now are not (checkpoint and requeue).
        allocation: the fractional allocation the placements round (None for FIFO, or
            when there are no trials or no devices).
        classes: ``(tenant, signature)`` of each row of ``allocation.devices``.
        device_types: the column order of ``allocation.devices``.
        solver_seconds: time spent in HiGHS this round.
        decide_seconds: total time of :meth:`Scheduler.decide` this round.
    """

    placements: tuple[Placement, ...]
    started: tuple[Placement, ...]
    preempted: tuple[int, ...]
    allocation: Allocation | None
    classes: tuple[tuple[str, str], ...] = field(default=())
    device_types: tuple[str, ...] = field(default=())
    solver_seconds: float = 0.0
    decide_seconds: float = 0.0
