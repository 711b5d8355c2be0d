"""Packing: group pending trials with equal signatures into balanced fused arrays."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PendingTrial", "ArrayPlan", "pack", "balanced_sizes"]


@dataclass(frozen=True)
class PendingTrial:
    """A trial waiting to run (or running), as the scheduler sees it.

    ``signature`` is a :class:`~scheduler.Signature` digest; ``remaining_epochs`` is the
    work left, ``priority`` orders trials of one signature (higher first).
    """

    trial_id: int
    signature: str
    tenant: str = "default"
    study_id: int = 0
    priority: float = 0.0
    remaining_epochs: int = 1


@dataclass(frozen=True)
class ArrayPlan:
    """One fused array: trials that share ``signature`` and train together on one device."""

    signature: str
    trial_ids: tuple[int, ...]


def balanced_sizes(n: int, max_members: int) -> list[int]:
    """Split ``n`` items into ``ceil(n / max_members)`` parts whose sizes differ by <= 1.

    Balanced arrays matter because a fused array runs at the pace of its size: 11 trials
    with a cap of 8 are better as 6 + 5 than as 8 + 3 (the 3-array wastes most of a device).
    """
    if max_members < 1:
        raise ValueError(f"max_members must be >= 1, got {max_members}")
    if n <= 0:
        return []
    k = math.ceil(n / max_members)
    q, r = divmod(n, k)
    return [q + 1] * r + [q] * (k - r)


def pack(trials: Sequence[PendingTrial], max_members: int) -> list[ArrayPlan]:
    """Pack ``trials`` into fused arrays of at most ``max_members`` trials each.

    Only trials with equal signatures share an array.  Each signature group is ordered by
    priority (descending) then input order, and split into ``ceil(n / max_members)``
    contiguous arrays of balanced sizes.  Groups appear in the order their highest-priority
    trial appears in that same ordering, so the result is fully deterministic.

    Raises:
        ValueError: if ``max_members < 1`` or a trial id occurs twice.
    """
    if max_members < 1:
        raise ValueError(f"max_members must be >= 1, got {max_members}")
    seen: set[int] = set()
    for t in trials:
        if t.trial_id in seen:
            raise ValueError(f"duplicate trial_id {t.trial_id} in pack() input")
        seen.add(t.trial_id)

    # Stable sort: equal priorities keep their input order.
    ordered = sorted(range(len(trials)), key=lambda i: -trials[i].priority)
    groups: dict[str, list[int]] = {}
    for i in ordered:
        groups.setdefault(trials[i].signature, []).append(trials[i].trial_id)

    plans: list[ArrayPlan] = []
    for signature, ids in groups.items():
        start = 0
        for size in balanced_sizes(len(ids), max_members):
            plans.append(ArrayPlan(signature=signature, trial_ids=tuple(ids[start : start + size])))
            start += size
    return plans
