"""The round-based scheduler: allocation, rounding into placements, leases, backfill.

One implementation serves the live server and the simulator: both call
:meth:`Scheduler.decide` once per round with the current trials, devices, tenants and
running arrays; only the clock and the devices differ.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fusetune.scheduler._allocation import (
    Allocation,
    AllocationProblem,
    FairnessPolicy,
    solve_allocation,
)
from fusetune.scheduler._packing import PendingTrial
from fusetune.scheduler._rounding import Rounding
from fusetune.scheduler._throughput import SpeedupCurve, ThroughputModel
from fusetune.scheduler._types import Decision, Device, Placement, Tenant

__all__ = ["POLICIES", "PolicyName", "Scheduler", "make_scheduler"]

PolicyName = Literal["fifo", "gavel-paper", "gavel", "oef", "oef-noncooperative", "fusion-greedy", "fusetune"]


@dataclass(frozen=True)
class _Preset:
    fairness: FairnessPolicy | None  # None: FIFO order, heterogeneity-unaware, no preemption
    fusion: bool


POLICIES: Mapping[str, _Preset] = {
    "fifo": _Preset(None, False),
    "gavel-paper": _Preset("max_min_paper", False),
    "gavel": _Preset("max_min", False),
    "oef": _Preset("oef", False),
    "oef-noncooperative": _Preset("oef_noncooperative", False),
    "fusion-greedy": _Preset(None, True),
    "fusetune": _Preset("oef", True),
}

_DEBT_LIMIT = 0.5  # a tenant can be owed at most half a round's equal-share utility

Class = tuple[str, str]
Running = tuple[Placement, Device, list[int]]


def _index_trials(trials: Sequence[PendingTrial]) -> dict[int, PendingTrial]:
    """Trials by id; a duplicate id is the caller's bug."""
    by_id: dict[int, PendingTrial] = {}
    for t in trials:
        if t.trial_id in by_id:
            raise ValueError(f"duplicate trial_id {t.trial_id}")
        by_id[t.trial_id] = t
    return by_id


def _class_members(trials: Sequence[PendingTrial]) -> dict[Class, list[int]]:
    """Classes, a tenant's interchangeable trials (same signature), by priority then age."""
    order = {t.trial_id: i for i, t in enumerate(trials)}
    members_of: dict[Class, list[int]] = {}
    for t in sorted(trials, key=lambda t: (-t.priority, order[t.trial_id])):
        members_of.setdefault((t.tenant, t.signature), []).append(t.trial_id)
    return members_of


def _alive(
    running: Sequence[Placement], by_id: Mapping[int, PendingTrial], device_by_id: Mapping[str, Device]
) -> tuple[list[Running], set[int]]:
    """Running arrays whose device and trials still exist, and the trials they hold."""
    current: list[Running] = []
    busy: set[int] = set()
    used_devices: set[str] = set()
    for p in running:
        d = device_by_id.get(p.device_id)
        alive = [i for i in p.trial_ids if i in by_id and i not in busy]
        if d is None or not alive or p.device_id in used_devices:
            continue
        if any((by_id[i].tenant, by_id[i].signature) != (p.tenant, p.signature) for i in alive):
            # The caller's record disagrees with the trials (e.g. a trial was re-keyed):
            # treat the array as gone so its trials are placed afresh, never mixed.
            continue
        used_devices.add(p.device_id)
        busy.update(alive)
        current.append((p, d, alive))
    return current, busy


class Scheduler:
    """Decides, each round, which arrays run on which devices.

    Args:
        fairness: policy for the fractional allocation (``"max_min"``,
            ``"max_min_paper"``, ``"oef"``, ``"oef_noncooperative"``), or None for FIFO (arrival order, first free device,
            arrays run to completion -- the Ray Tune way).
        fusion: whether trials of equal signature are fused (B chosen per device type by
            :meth:`ThroughputModel.array_size`); False runs one trial per device.
        throughput: the model to decide with (updated by the caller via ``observe``).
        max_members: hard cap on B.
        min_member_efficiency: fusing pays while each member keeps at least this fraction
            of its solo speed (bounds how much fusion may slow a single trial down).  The
            LP still picks smaller arrays (down to unfused) whenever devices are free, so
            this only caps how far fusion may go when devices are scarce.
        lease_seconds: how long a placement is guaranteed once granted or extended.
        backfill: whether devices the allocation leaves idle are filled with waiting
            trials (work conservation).  Off, the placements follow the allocation alone,
            as an LP policy defines it (``gavel-paper`` without backfill in the simulator).
        prices: public price of one device per type, for ``oef_noncooperative``'s
            exchanges (never from tenants' reports; all equal when None).
    """

    def __init__(
        self,
        fairness: FairnessPolicy | None = "oef",
        fusion: bool = True,
        throughput: ThroughputModel | None = None,
        *,
        max_members: int = 16,
        min_member_efficiency: float = 0.3,
        lease_seconds: float = 360.0,
        backfill: bool = True,
        prices: Mapping[str, float] | None = None,
    ) -> None:
        if max_members < 1:
            raise ValueError(f"max_members must be >= 1, got {max_members}")
        if not 0.0 < min_member_efficiency <= 1.0:
            raise ValueError(f"min_member_efficiency must be in (0, 1], got {min_member_efficiency}")
        if lease_seconds < 0:
            raise ValueError(f"lease_seconds must be >= 0, got {lease_seconds}")
        self.fairness = fairness
        self.fusion = fusion
        self.throughput = throughput if throughput is not None else ThroughputModel()
        self.max_members = max_members if fusion else 1
        self.min_member_efficiency = min_member_efficiency
        self.lease_seconds = lease_seconds
        self.backfill = backfill
        self.prices = dict(prices) if prices is not None else None
        # Cumulative (allocated - placed) devices per (class, type): rounding debt that
        # later rounds repay, so small fractional shares are honoured over time.
        self._carry: dict[tuple[tuple[str, str], str], float] = {}
        self._sizes: dict[tuple[SpeedupCurve, int], int] = {}
        # Per-tenant utility still owed: Σ over rounds of (equal-share utility - realised
        # utility), signed (a round above the share repays one below it).  Integer
        # rounding of a fractional allocation swings a tenant's utility around its share
        # from round to round; owed tenants get the spare devices of the next rounding
        # first, the most owed relative to their share first, so the sharing incentive
        # holds over time, not only in the fractional solution.
        self._debt: dict[str, float] = {}
        self._owed_share: dict[str, float] = {}  # debt / equal-share utility, where debt > 0

    # -- helpers -----------------------------------------------------------------------

    def _members(self, signature: str, device_type: str, memory_bytes: int) -> int:
        """B for ``signature`` on a device (memoised per curve: sizing is a hot path)."""
        curve = self.throughput.curve(signature, device_type)
        key = (curve, memory_bytes)
        b = self._sizes.get(key)
        if b is None:
            b = self.throughput.array_size(
                signature, device_type, memory_bytes, self.max_members, self.min_member_efficiency
            )
            if len(self._sizes) > 100_000:
                self._sizes.clear()
            self._sizes[key] = b
        return b

    def problem(
        self,
        classes: Sequence[tuple[str, str]],
        demand: Sequence[int],
        devices: Sequence[Device],
        tenants: Mapping[str, float],
    ) -> tuple[AllocationProblem, tuple[str, ...], np.ndarray]:
        """Build the allocation LP instance for ``classes``; also returns types and options."""
        types = tuple(sorted({d.device_type for d in devices}))
        capacity = np.array([sum(1 for d in devices if d.device_type == g) for g in types], dtype=float)
        memory = {g: min(d.memory_bytes for d in devices if d.device_type == g) for g in types}
        tenant_names = tuple(tenants)
        tenant_index = {t: i for i, t in enumerate(tenant_names)}
        n_c, n_g = len(classes), len(types)
        # Array options per (class, type): unfused, half-sized and fully sized arrays, so
        # the LP can trade per-trial speed (small B) against throughput (large B).
        members = np.zeros((n_c, n_g, 3))
        rate = np.zeros((n_c, n_g, 3))
        dem = np.asarray(demand, dtype=float)
        best_solo: dict[str, float] = {}
        for ci, (_, sig) in enumerate(classes):
            if sig not in best_solo:
                best_solo[sig] = max((self.throughput.curve(sig, g).solo_steps_per_s for g in types), default=0.0)
            for gi, g in enumerate(types):
                b = min(self._members(sig, g, memory[g]), int(dem[ci]))
                if b < 1 or best_solo[sig] <= 0:
                    continue
                for k, size in enumerate(sorted({1, (b + 1) // 2, b})):
                    members[ci, gi, k] = size
                    rate[ci, gi, k] = self.throughput.rate(sig, g, size) / best_solo[sig]
        problem = AllocationProblem(
            weights=np.array([tenants[t] for t in tenant_names], dtype=float),
            capacity=capacity,
            class_tenant=np.array([tenant_index[t] for t, _ in classes], dtype=int),
            rate=rate,
            members=members,
            demand=dem,
            prices=np.array([self.prices.get(g, 1.0) for g in types]) if self.prices is not None else None,
        )
        return problem, types, members

    # -- the round ---------------------------------------------------------------------

    def decide(
        self,
        now: float,
        trials: Sequence[PendingTrial],
        devices: Sequence[Device],
        tenants: Sequence[Tenant],
        running: Sequence[Placement] = (),
    ) -> Decision:
        """Decide this round's placements.

        Args:
            now: current time in seconds (any monotone clock; leases are compared to it).
            trials: every unfinished trial, pending or running.  Trials absent from this
                list are treated as finished and leave their arrays.
            devices: devices currently available (a device that disappeared loses its array).
            tenants: tenants and weights; trials of unlisted tenants get weight 1.0.
            running: the arrays running now (normally the previous decision's placements).

        Returns:
            A :class:`Decision`.  Invariants: at most one array per device, arrays only
            hold trials of one tenant and one signature, no more members than the device's
            memory allows, and (with backfill, the default) no device is left idle while
            a waiting trial fits on it.
        """
        t_start = time.perf_counter()
        by_id = _index_trials(trials)
        weights: dict[str, float] = {t.name: t.weight for t in tenants}
        for t in trials:
            weights.setdefault(t.tenant, 1.0)
        device_by_id = {d.device_id: d for d in devices}
        if len(device_by_id) != len(devices):
            raise ValueError("duplicate device_id in devices")
        members_of = _class_members(trials)
        classes = tuple(sorted(members_of))
        current, busy = _alive(running, by_id, device_by_id)

        allocation: Allocation | None = None
        types: tuple[str, ...] = tuple(sorted({d.device_type for d in devices}))
        if not devices or not trials:
            placements: list[Placement] = []  # nothing to run, or nowhere to run it
        elif self.fairness is None:
            placements = self._fifo(now, trials, by_id, current, busy, devices)
        else:
            allocation, types = self._allocate(classes, members_of, current, devices, weights)
            placements = self._round(now, allocation, classes, types, members_of, current, busy, devices)
            self._update_debt(tuple(weights), allocation, placements, device_by_id, types)

        placed = {i for p in placements for i in p.trial_ids}
        before = {p.device_id: p for p, _, _ in current}
        started = tuple(
            p for p in placements
            if p.device_id not in before or before[p.device_id].trial_ids != p.trial_ids
            or before[p.device_id].signature != p.signature
        )
        # Every trial that was running (per the caller) and is not placed now, including
        # those whose device disappeared or whose record was not trusted.
        was_running = {i for p in running for i in p.trial_ids if i in by_id}
        return Decision(
            placements=tuple(sorted(placements, key=lambda p: p.device_id)),
            started=started,
            preempted=tuple(sorted(was_running - placed)),
            allocation=allocation,
            classes=classes,
            device_types=types,
            solver_seconds=allocation.solver_seconds if allocation is not None else 0.0,
            decide_seconds=time.perf_counter() - t_start,
        )

    def _allocate(
        self,
        classes: tuple[Class, ...],
        members_of: Mapping[Class, list[int]],
        current: Sequence[Running],
        devices: Sequence[Device],
        weights: Mapping[str, float],
    ) -> tuple[Allocation, tuple[str, ...]]:
        """The round's fractional allocation (with the incumbent tie-break) and its types."""
        problem, types, _ = self.problem(classes, [len(members_of[c]) for c in classes], devices, weights)
        incumbent = np.zeros((len(classes), len(types)))
        class_row = {c: i for i, c in enumerate(classes)}
        type_col = {g: i for i, g in enumerate(types)}
        for p, d, _ in current:
            incumbent[class_row[(p.tenant, p.signature)], type_col[d.device_type]] += 1
        return solve_allocation(problem, self.fairness, incumbent), types  # type: ignore[arg-type]

    def _update_debt(
        self,
        names: Sequence[str],
        allocation: Allocation,
        placements: Sequence[Placement],
        device_by_id: Mapping[str, Device],
        types: Sequence[str],
    ) -> None:
        """Carry each tenant's shortfall against its equal share into the next round."""
        realised: dict[str, float] = {}
        best: dict[str, float] = {}
        for p in placements:
            if p.signature not in best:
                best[p.signature] = max(self.throughput.curve(p.signature, g).solo_steps_per_s for g in types)
            g = device_by_id[p.device_id].device_type
            if best[p.signature] > 0:
                realised[p.tenant] = realised.get(p.tenant, 0.0) + (
                    self.throughput.rate(p.signature, g, len(p.trial_ids)) / best[p.signature]
                )
        debt: dict[str, float] = {}
        owed_share: dict[str, float] = {}
        for i, name in enumerate(names):
            e = float(allocation.equal_share[i])
            if e <= 0:
                continue  # no pending work: nothing is owed any more
            owed = self._debt.get(name, 0.0) + e - realised.get(name, 0.0)
            # Bounded both ways so that one stretch cannot demand, or bank, more than half
            # a round's share.  Signed: clipped at zero, every tenant's debt would ratchet
            # up on the rounds below its share and never come down, so every tenant would
            # sit at the bound and the bound (largest for the largest shares) would pick
            # who is repaid.
            owed = min(max(owed, -_DEBT_LIMIT * e), _DEBT_LIMIT * e)
            if owed != 0:
                debt[name] = owed
            if owed > 0:
                owed_share[name] = owed / e
        self._debt, self._owed_share = debt, owed_share

    def _fifo(
        self,
        now: float,
        trials: Sequence[PendingTrial],
        by_id: Mapping[int, PendingTrial],
        current: Sequence[tuple[Placement, Device, list[int]]],
        busy: set[int],
        devices: Sequence[Device],
    ) -> list[Placement]:
        """Arrival order onto the first free device; running arrays are never preempted."""
        waiting = [t for t in sorted(trials, key=lambda t: -t.priority) if t.trial_id not in busy]
        queue_by_class: dict[tuple[str, str], list[int]] = {}
        for t in waiting:
            queue_by_class.setdefault((t.tenant, t.signature), []).append(t.trial_id)
        taken: set[int] = set()
        placements: list[Placement] = []
        used: set[str] = set()
        for p, d, alive in current:
            ids: list[int] = list(alive)
            if self.fusion:
                # Epoch-boundary refill of freed slots with same-signature trials.
                want = self._members(p.signature, d.device_type, d.memory_bytes)
                queue = queue_by_class.get((p.tenant, p.signature), [])
                while len(ids) < want and queue:
                    i = queue.pop(0)
                    if i not in taken:
                        taken.add(i)
                        ids.append(i)
            placements.append(Placement(d.device_id, p.signature, p.tenant, tuple(ids), math.inf))
            used.add(d.device_id)
        free = [d for d in devices if d.device_id not in used]
        for t in waiting:
            if not free:
                break
            if t.trial_id in taken:
                continue
            # First free device (in device order, type-blind) that the trial fits on.
            fit = next((d for d in free if self._members(t.signature, d.device_type, d.memory_bytes) >= 1), None)
            if fit is None:
                continue
            free.remove(fit)
            b = self._members(t.signature, fit.device_type, fit.memory_bytes)
            queue = queue_by_class[(t.tenant, t.signature)]
            ids = []
            for i in queue:
                if len(ids) >= b:
                    break
                if i not in taken:
                    taken.add(i)
                    ids.append(i)
            queue_by_class[(t.tenant, t.signature)] = [i for i in queue if i not in taken]
            placements.append(Placement(fit.device_id, t.signature, t.tenant, tuple(ids), math.inf))
        return placements

    def _round(
        self,
        now: float,
        allocation: Allocation,
        classes: Sequence[Class],
        types: Sequence[str],
        members_of: Mapping[Class, list[int]],
        current: Sequence[Running],
        busy: set[int],
        devices: Sequence[Device],
    ) -> list[Placement]:
        """Round the fractional allocation into placements, honouring leases (see _rounding)."""
        n_c, n_g = len(classes), len(types)
        carry = np.array([[self._carry.get((c, g), 0.0) for g in types] for c in classes]).reshape(n_c, n_g)
        # Tenants owed utility (rounding fell short of their equal share) come first for
        # spare devices, in order of their shortfall as a fraction of their share (the
        # sharing-incentive ratio's unit): it is repaid from tenants above their share.
        owed = np.array([1.0 + self._owed_share[c[0]] if c[0] in self._owed_share else 0.0 for c in classes])
        rounding = Rounding(
            now, allocation, classes, types, members_of, current, busy, carry, owed,
            lambda sig, d: self._members(sig, d.device_type, d.memory_bytes), self.lease_seconds,
        )
        placements = rounding.run(devices, self.backfill)
        self._carry = rounding.next_carry(carry)
        return placements


def make_scheduler(policy: str, throughput: ThroughputModel | None = None, **kwargs: object) -> Scheduler:
    """A :class:`Scheduler` configured as one of the named ``POLICIES``.

    ``fifo`` (one trial per device, arrival order), ``gavel-paper`` (Gavel's published
    max-min LP, unfused), ``gavel`` (our stronger heterogeneity-aware max-min, unfused), ``oef`` / ``oef-noncooperative`` (unfused), ``fusion-greedy``
    (fusion, FIFO, heterogeneity-unaware) and ``fusetune`` (fusion + OEF fairness +
    heterogeneity).  Extra keyword arguments go to :class:`Scheduler`.
    """
    try:
        preset = POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}") from None
    return Scheduler(preset.fairness, preset.fusion, throughput, **kwargs)  # type: ignore[arg-type]
