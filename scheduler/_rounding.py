"""Rounding one round's fractional allocation into placements on devices.

:class:`Rounding` holds the round's working state (queues, counts, what is placed) and
runs the steps in order: integer targets, keep running arrays, new arrays, backfill,
then the rounding debt carried to the next round.  The :class:`Scheduler` owns what
persists between rounds (the carry) and the per-device array sizes (``size_of``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from fusetune.scheduler._allocation import Allocation
from fusetune.scheduler._types import Device, Placement

__all__ = ["Rounding", "integer_targets"]

Class = tuple[str, str]
Running = tuple[Placement, Device, list[int]]

_CARRY_LIMIT = 3.0  # bounds how much past over/under-service a class can bank
_HYSTERESIS = 0.5  # device-rounds of debt another class needs to take a spare device over


def integer_targets(
    x: np.ndarray, carry: np.ndarray, owed: np.ndarray, incumbent: np.ndarray, demand: np.ndarray, capacity: np.ndarray
) -> np.ndarray:
    """(C, G) arrays per (class, type): floors of ``x``, then each type's spare devices.

    Spare devices go to the classes with the largest fractional part plus rounding
    debt (``carry``) plus what their tenant is ``owed``, never more arrays than trials.
    Debt only reorders who gets the spare devices, so a target never exceeds ceil(x)
    and classes that were short in earlier rounds are repaid first.
    """
    n_c, n_g = x.shape
    # HiGHS returns 3.9999999 for 4: snap within 1e-3 of an integer before flooring.
    target = np.minimum(np.floor(x + 1e-3).astype(int), demand[:, None])
    for gi in range(n_g):
        col = target[:, gi]
        while col.sum() > capacity[gi]:  # only possible through the snap above
            col[int(np.argmax(np.where(col > 0, col - x[:, gi], -np.inf)))] -= 1
        spare = int(capacity[gi] - col.sum())
        if spare <= 0 or n_c == 0:
            continue
        frac = x[:, gi] - col
        eligible = (frac > 1e-3) & (col < demand)
        # Hysteresis: a class already running its extra array here keeps it unless
        # another is owed clearly more, so fractional shares rotate in stints rather
        # than every round (fewer restarts at the same long-run shares).
        holds = incumbent[:, gi] > col
        priority = np.where(eligible, frac + carry[:, gi] + owed + _HYSTERESIS * holds, -np.inf)
        for j in np.argsort(-priority, kind="stable")[:spare]:
            if eligible[j]:
                col[j] += 1
    return target


class Rounding:
    """One round's rounding of ``allocation`` into placements.

    Args:
        now: the round's time (leases are compared with it).
        allocation: the fractional allocation to round.
        classes, types: the row and column order of ``allocation.devices``.
        members_of: each class's trial ids, in priority then age order.
        current: the running arrays that still exist, with their device and live trials.
        busy: trial ids running in ``current``.
        carry: (C, G) rounding debt from earlier rounds.
        owed: (C,) 1 + the tenant's owed utility for classes of owed tenants, else 0.
        size_of: the array size (B) a class's signature gets on a device.
        lease_seconds: the lease granted to new and extended arrays.
    """

    def __init__(
        self,
        now: float,
        allocation: Allocation,
        classes: Sequence[Class],
        types: Sequence[str],
        members_of: Mapping[Class, list[int]],
        current: Sequence[Running],
        busy: set[int],
        carry: np.ndarray,
        owed: np.ndarray,
        size_of: Callable[[str, Device], int],
        lease_seconds: float,
    ) -> None:
        self.now, self.classes, self.types, self.current = now, classes, types, current
        self.size_of, self.lease_seconds = size_of, lease_seconds
        self.x, self.carry, self.owed = allocation.devices, carry, owed
        self.allocation = allocation
        self.type_index = {g: i for i, g in enumerate(types)}
        self.class_index = {c: i for i, c in enumerate(classes)}
        self.desired = np.maximum(self.x + carry, 0.0)
        self.demand = np.array([len(members_of[c]) for c in classes])
        self.queues: dict[Class, list[int]] = {c: [i for i in members_of[c] if i not in busy] for c in classes}
        shape = (len(classes), len(types))
        self.placed_count = np.zeros(shape, dtype=int)
        self.budget_used = np.zeros(shape, dtype=int)
        self.target = np.zeros(shape, dtype=int)
        self.budget = np.zeros(shape, dtype=int)
        self.placements: list[Placement] = []
        self.used: set[str] = set()

    def run(self, devices: Sequence[Device], backfill: bool) -> list[Placement]:
        """All steps; ``backfill=False`` leaves devices the allocation did not fill idle."""
        capacity = np.array([sum(1 for d in devices if d.device_type == g) for g in self.types])
        incumbent = np.zeros_like(self.placed_count)
        for p, d, _ in self.current:
            incumbent[self.class_index[(p.tenant, p.signature)], self.type_index[d.device_type]] += 1
        self.target = integer_targets(self.x, self.carry, self.owed, incumbent, self.demand, capacity)
        # Trials each (class, type) should hold: as many as the fractional allocation put
        # there (at least one per array).  Arrays are then sized to split that evenly
        # (sizes differ by at most one), which is what the concave T(B) rewards.
        self.budget = np.maximum(self.target, np.rint(self.allocation.members * self.x).astype(int))
        self._keep_running()
        free_by_type: dict[str, list[Device]] = {g: [] for g in self.types}
        for d in devices:
            if d.device_id not in self.used:
                free_by_type[d.device_type].append(d)
        self._new_arrays(free_by_type)
        if backfill:
            self._backfill(free_by_type)
        return self.placements

    def _next_size(self, ci: int, gi: int, cap: int) -> int:
        """Size of the next array of class ci on type gi: an even split of its budget."""
        arrays_left = max(1, int(self.target[ci, gi] - self.placed_count[ci, gi]))
        left = int(self.budget[ci, gi] - self.budget_used[ci, gi])
        return max(1, min(cap, -(-left // arrays_left)))

    def _fill(self, c: Class, ids: list[int], want: int) -> list[int]:
        """``ids`` topped up to ``want`` trials from the front of the class's queue."""
        q = self.queues[c]
        take = max(0, want - len(ids))
        ids = ids + q[:take]
        del q[:take]
        return ids

    def _keep_running(self) -> None:
        """Keep running arrays: unexpired leases always, expired ones while entitled.

        Unexpired first, so they count against the target before revocable ones.  An
        expired lease is extended while the class is still entitled to that many arrays
        on the type; at lease end an array is also resized to what the allocation chose:
        surplus members move back to the queue (and onto devices of their own later).
        """
        survivors: list[tuple[Placement, Device, list[int], int, float]] = []
        for p, d, alive in sorted(self.current, key=lambda e: (e[0].lease_expires <= self.now, e[0].device_id)):
            ci = self.class_index[(p.tenant, p.signature)]
            gi = self.type_index[d.device_type]
            unexpired = p.lease_expires > self.now
            if not unexpired and self.placed_count[ci, gi] >= self.target[ci, gi]:
                continue  # preempted: the lease ran out and the class is over its share
            want = self._next_size(ci, gi, self.size_of(p.signature, d))
            members = list(alive) if unexpired else list(alive)[:want]
            lease = p.lease_expires if unexpired else self.now + self.lease_seconds
            survivors.append((p, d, members, want, lease))
            self.budget_used[ci, gi] += max(want, len(members))
            self.placed_count[ci, gi] += 1
            self.used.add(d.device_id)
        # Preempted and moved trials go back to the front of their queues (they were
        # running), before any refill, so that surviving arrays can take them back.
        kept = {i for _, _, members, _, _ in survivors for i in members}
        for p, _, alive in self.current:
            back = [i for i in alive if i not in kept]
            if back:
                c = (p.tenant, p.signature)
                self.queues[c] = back + self.queues[c]
        for p, d, members, want, lease in survivors:
            ids = self._fill((p.tenant, p.signature), members, want)  # epoch-boundary refill
            self.placements.append(Placement(d.device_id, p.signature, p.tenant, tuple(ids), lease))

    def _new_arrays(self, free_by_type: dict[str, list[Device]]) -> None:
        """New arrays up to the targets, most under-served (class, type) first."""
        gaps = [
            (float(self.desired[ci, gi] - self.placed_count[ci, gi]), ci, gi)
            for ci in range(len(self.classes))
            for gi in range(len(self.types))
            if self.target[ci, gi] > self.placed_count[ci, gi]
        ]
        for _, ci, gi in sorted(gaps, key=lambda e: (-e[0], e[1], e[2])):
            c, g = self.classes[ci], self.types[gi]
            while self.placed_count[ci, gi] < self.target[ci, gi] and self.queues[c] and free_by_type[g]:
                d = free_by_type[g].pop(0)
                cap = self.size_of(c[1], d)
                if cap < 1:
                    continue
                b = self._next_size(ci, gi, cap)
                ids = self._fill(c, [], b)
                self.budget_used[ci, gi] += b
                self.placements.append(Placement(d.device_id, c[1], c[0], tuple(ids), self.now + self.lease_seconds))
                self.placed_count[ci, gi] += 1

    def _backfill(self, free_by_type: dict[str, list[Device]]) -> None:
        """Work conservation: every still-free device gets the waiting class most behind.

        Ties go to classes the allocation put on this type.  Backfill leases are already
        expired, so the next round can reclaim the device.
        """
        behind = (self.x + self.carry).sum(axis=1) - self.placed_count.sum(axis=1)
        free_left = sum(len(v) for v in free_by_type.values())
        for g in self.types:
            gi = self.type_index[g]
            heap = [(-float(behind[ci]), -float(self.x[ci, gi] > 0), ci) for ci, c in enumerate(self.classes) if self.queues[c]]
            heapq.heapify(heap)
            for d in free_by_type[g]:
                free_left -= 1
                chosen = self._pop_fitting(heap, d)
                if chosen is None:
                    continue
                c = self.classes[chosen]
                # Spread the backlog over the free devices: fuse only as much as needed.
                spread = math.ceil(sum(len(q) for q in self.queues.values()) / (free_left + 1))
                ids = self._fill(c, [], max(1, min(self.size_of(c[1], d), spread)))
                self.placements.append(Placement(d.device_id, c[1], c[0], tuple(ids), self.now))
                self.placed_count[chosen, gi] += 1
                behind[chosen] -= 1.0
                if self.queues[c]:
                    heapq.heappush(heap, (-float(behind[chosen]), -float(self.x[chosen, gi] > 0), chosen))

    def _pop_fitting(self, heap: list[tuple[float, float, int]], d: Device) -> int | None:
        """The first class on ``heap`` with waiting trials that fit ``d`` (others stay)."""
        skipped: list[tuple[float, float, int]] = []
        chosen: int | None = None
        while heap:
            entry = heapq.heappop(heap)
            c = self.classes[entry[2]]
            if not self.queues[c]:
                continue  # drained by an earlier device
            if self.size_of(c[1], d) < 1:
                skipped.append(entry)  # does not fit this device; maybe the next
                continue
            chosen = entry[2]
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return chosen

    def next_carry(self, old: np.ndarray) -> dict[tuple[Class, str], float]:
        """Rounding debt for the next round (classes that vanished are forgotten).

        A class whose every trial is placed, each on a type the allocation gave it, is
        owed nothing (it could not have used more).  One placed beyond its allocation on
        some type (backfill onto a slower type) keeps its debt on the others.
        """
        displaced = (self.placed_count - self.x > 1e-6).any(axis=1)
        return {
            (c, g): float(np.clip(self.desired[ci, gi] - self.placed_count[ci, gi], -_CARRY_LIMIT, _CARRY_LIMIT))
            for ci, c in enumerate(self.classes)
            for gi, g in enumerate(self.types)
            if (self.queues[c] or displaced[ci])
            and (self.x[ci, gi] > 0 or self.placed_count[ci, gi] > 0 or abs(old[ci, gi]) > 1e-9)
        }
