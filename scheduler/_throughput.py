"""Throughput model: models·steps/s of a fused array, per (signature, device type, B).

The model every policy decides with.  For an array of ``B`` members of one signature on a
device type, one fused step takes

    t(B) = t(1) · (1 + c · (B − 1))

seconds, i.e. a member costs a fraction ``c`` ∈ (0, 1] of a solo model (HFTA's fused
kernels amortise launch and memory-bound overheads, so small models have small ``c``).
The array then trains ``B`` models at

    T(B) = T1 · B / (1 + c · (B − 1))      models·steps/s,   T1 = solo steps/s,

which saturates at ``T1 / c``.  Each member runs at ``η(B) = 1 / (1 + c(B − 1))`` of its
solo speed.  Sources, most trusted first:

1. online measurements from workers (:meth:`ThroughputModel.observe`), exponentially
   averaged; a measurement at B > 1 updates ``c`` given the current ``T1``;
2. curves seeded from the fusion engine's dry runs (:func:`fit_curve` on its
   ``SizingResult``, then :meth:`ThroughputModel.set_curve`);
3. the documented prior: ``T1 = prior_solo[device_type]`` (1.0 steps/s if unknown) and
   ``c = prior_marginal_cost`` (0.5: a fused member costs half a solo model, a
   deliberately conservative value; HFTA's small models measure 0.04–0.1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["SpeedupCurve", "ThroughputModel", "DEFAULT_MARGINAL_COST", "fit_curve", "fit_points"]

DEFAULT_MARGINAL_COST = 0.5
_MIN_MARGINAL_COST = 1e-3  # keeps T(B) finite; no fused kernel is literally free
_MIN_MARGINAL_GAIN = 0.05  # an extra member must add >= 5% of a solo model's throughput


@dataclass(frozen=True)
class SpeedupCurve:
    """Fused-array speed of one signature on one device type.

    Attributes:
        solo_steps_per_s: T1, steps/s of one model alone on the device.
        marginal_cost: c, the fraction of a solo step one extra member adds (1 = no gain).
        base_bytes: device memory the array needs regardless of B (0 if unknown).
        member_bytes: extra device memory per member (0 if unknown: memory never binds).
    """

    solo_steps_per_s: float
    marginal_cost: float = DEFAULT_MARGINAL_COST
    base_bytes: int = 0
    member_bytes: int = 0

    def rate(self, members: int) -> float:
        """Aggregate models·steps/s of an array with ``members`` members."""
        if members <= 0:
            return 0.0
        c = min(1.0, max(_MIN_MARGINAL_COST, self.marginal_cost))
        return self.solo_steps_per_s * members / (1.0 + c * (members - 1))

    def member_efficiency(self, members: int) -> float:
        """η(B): the fraction of its solo speed each member keeps in an array of B."""
        if members <= 0:
            return 0.0
        return self.rate(members) / (members * self.solo_steps_per_s) if self.solo_steps_per_s > 0 else 0.0

    def memory_cap(self, memory_bytes: int) -> int:
        """Largest B whose arrays fit in ``memory_bytes`` (a large number if unknown)."""
        if self.base_bytes > memory_bytes:
            return 0
        if self.member_bytes <= 0:
            return 1 << 30
        return max(0, (memory_bytes - self.base_bytes) // self.member_bytes)


def fit_curve(
    solo_steps_per_s: float,
    throughput: Mapping[int, float],
    base_bytes: int = 0,
    member_bytes: int = 0,
) -> SpeedupCurve:
    """Fit a curve to dry-run measurements (the fusion engine's ``SizingResult``).

    ``throughput`` maps B to measured models·steps/s.  Each B > 1 implies a marginal cost
    ``c_B = (B·T1/T(B) − 1)/(B − 1)``; the median is robust to one noisy size.  Without
    any B > 1 the prior marginal cost is kept.
    """
    if solo_steps_per_s <= 0:
        raise ValueError(f"solo_steps_per_s must be > 0, got {solo_steps_per_s}")
    implied = sorted(
        min(1.0, max(_MIN_MARGINAL_COST, (b * solo_steps_per_s / t - 1.0) / (b - 1)))
        for b, t in throughput.items()
        if b > 1 and t > 0
    )
    if not implied:
        c = DEFAULT_MARGINAL_COST
    elif len(implied) % 2:
        c = implied[len(implied) // 2]
    else:
        c = 0.5 * (implied[len(implied) // 2 - 1] + implied[len(implied) // 2])
    return SpeedupCurve(solo_steps_per_s, c, base_bytes, member_bytes)


def fit_points(points: Mapping[int, float], prior_marginal_cost: float = DEFAULT_MARGINAL_COST) -> SpeedupCurve:
    """Fit a curve to measured models·steps/s of real arrays, by array size B.

    The curve is linear in B once inverted: ``B / T(B) = (1 − c) / T1 + (c / T1) · B``, so
    with two or more sizes measured a least-squares line through ``(B, B / T(B))`` gives
    both T1 and c. With one size only, c stays ``prior_marginal_cost`` and T1 follows from
    the measurement. A fit with c > 1 (fused arrays slower than a solo model) is c = 1: the
    scheduler then runs the class unfused. One with c < 0 (noise) keeps the prior c.

    Raises:
        ValueError: no point, or a point that is not a positive number.
    """
    if not points or any(b < 1 or not math.isfinite(t) or t <= 0 for b, t in points.items()):
        raise ValueError(f"points must map B >= 1 to positive models·steps/s, got {dict(points)}")
    sizes = sorted(points)
    if len(sizes) >= 2:
        xs = [float(b) for b in sizes]
        ys = [b / points[b] for b in sizes]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        intercept = mean_y - slope * mean_x
        if slope > 0 and intercept >= 0:
            solo = 1.0 / (intercept + slope)
            return SpeedupCurve(solo, min(1.0, max(_MIN_MARGINAL_COST, slope * solo)))
        if slope > 0:  # c > 1: larger arrays ran slower than one model alone, fusing does not pay
            return SpeedupCurve(points[sizes[0]], 1.0)
    b = sizes[0]
    c = prior_marginal_cost
    return SpeedupCurve(points[b] * (1.0 + c * (b - 1)) / b, c)


class ThroughputModel:
    """Per (signature, device type) speed-up curves, learned online on top of a prior.

    Args:
        prior_solo: solo steps/s assumed per device type when nothing is known about a
            signature (relative device speeds; missing types default to 1.0).
        prior_marginal_cost: ``c`` assumed when nothing is known.
        smoothing: weight of a new measurement in the exponential average (0 < s <= 1).
    """

    def __init__(
        self,
        prior_solo: Mapping[str, float] | None = None,
        prior_marginal_cost: float = DEFAULT_MARGINAL_COST,
        smoothing: float = 0.3,
    ) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if not 0.0 < prior_marginal_cost <= 1.0:
            raise ValueError(f"prior_marginal_cost must be in (0, 1], got {prior_marginal_cost}")
        self._prior_solo = dict(prior_solo or {})
        self._prior_c = prior_marginal_cost
        self._smoothing = smoothing
        self._curves: dict[tuple[str, str], SpeedupCurve] = {}

    def curve(self, signature: str, device_type: str) -> SpeedupCurve:
        """The current curve for ``signature`` on ``device_type`` (prior if never seen)."""
        known = self._curves.get((signature, device_type))
        if known is not None:
            return known
        return SpeedupCurve(self._prior_solo.get(device_type, 1.0), self._prior_c)

    def set_curve(self, signature: str, device_type: str, curve: SpeedupCurve) -> None:
        """Seed or replace a curve, e.g. from the fusion engine's dry run or a calibration."""
        self._curves[(signature, device_type)] = curve

    def rate(self, signature: str, device_type: str, members: int) -> float:
        """Aggregate models·steps/s of a ``members``-array of ``signature`` on the type."""
        return self.curve(signature, device_type).rate(members)

    def observe(
        self,
        signature: str,
        device_type: str,
        members: int,
        models_steps_per_s: float,
        *,
        learn_marginal_cost: bool = True,
    ) -> None:
        """Fold in a worker's measurement of an array's aggregate throughput.

        B = 1 updates the solo speed; B > 1 updates the marginal cost implied by the
        measurement and the current solo speed (solving T(B) = T for c). With
        ``learn_marginal_cost=False`` a B > 1 measurement updates the solo speed instead,
        keeping ``c`` (solving T(B) = T for T1): array sizes then stay what the dry runs
        decided, while how fast each device type runs the class is learned online.
        """
        if members < 1 or not math.isfinite(models_steps_per_s) or models_steps_per_s <= 0:
            raise ValueError(f"invalid measurement: members={members}, throughput={models_steps_per_s}")
        cur = self.curve(signature, device_type)
        s = self._smoothing
        known = (signature, device_type) in self._curves
        if members == 1 or not learn_marginal_cost:
            measured = models_steps_per_s * cur.solo_steps_per_s / cur.rate(members)  # T1 given c
            solo = measured if not known else (1 - s) * cur.solo_steps_per_s + s * measured
            self._curves[(signature, device_type)] = SpeedupCurve(solo, cur.marginal_cost, cur.base_bytes, cur.member_bytes)
            return
        implied = (members * cur.solo_steps_per_s / models_steps_per_s - 1.0) / (members - 1)
        implied = min(1.0, max(_MIN_MARGINAL_COST, implied))
        c = (1 - s) * cur.marginal_cost + s * implied
        self._curves[(signature, device_type)] = SpeedupCurve(cur.solo_steps_per_s, c, cur.base_bytes, cur.member_bytes)

    def array_size(
        self,
        signature: str,
        device_type: str,
        memory_bytes: int,
        max_members: int,
        min_member_efficiency: float,
    ) -> int:
        """Choose B for ``signature`` on a device: the fusion engine's sizing rule.

        The largest B <= ``max_members`` that fits in memory and keeps every member at
        least ``min_member_efficiency`` of its solo speed, while each added member still
        adds at least 5% of a solo model's throughput.  Fusing "does not pay" on a
        device when that is B = 1 (c close to 1: the solo model already saturates it); it
        is 0 when not even one model fits.
        """
        curve = self.curve(signature, device_type)
        cap = min(max_members, curve.memory_cap(memory_bytes))
        if cap <= 0:
            return 0
        best = 1
        for b in range(2, cap + 1):
            if curve.member_efficiency(b) + 1e-12 < min_member_efficiency:
                break
            if curve.rate(b) - curve.rate(b - 1) < _MIN_MARGINAL_GAIN * curve.solo_steps_per_s:
                break  # one more member would barely add throughput: not worth slowing the rest
            best = b
        return best
