"""Learning curves for plots: a trial's intermediate values downsampled to at most N points."""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["MIN_POINTS", "downsample"]

#: The fewest points a downsampled curve may ask for: its first, last, lowest and highest.
MIN_POINTS = 4


def downsample(curve: Mapping[int, float], max_points: int) -> dict[int, float]:
    """At most ``max_points`` points of ``curve`` (step -> value) by min/max buckets.

    The first and the last step are kept; the steps between are split into
    ``(max_points - 2) // 2`` buckets of consecutive steps, and each bucket keeps its lowest
    and its highest value (one point when they are the same step). So the curve's overall
    minimum and maximum are always kept, and every spike shows, which averaging or taking
    every k-th point would hide. A curve of at most ``max_points`` points comes back whole.
    NaN values count as neither low nor high; a bucket of only NaNs keeps its first.
    """
    if max_points < MIN_POINTS:
        raise ValueError(f"max_points must be at least {MIN_POINTS} (first, last, min and max)")
    steps = sorted(curve)
    if len(steps) <= max_points:
        return {step: curve[step] for step in steps}
    inner = steps[1:-1]
    buckets = (max_points - 2) // 2
    kept = {steps[0], steps[-1]}
    for b in range(buckets):
        chunk = inner[b * len(inner) // buckets : (b + 1) * len(inner) // buckets]
        finite = [s for s in chunk if not math.isnan(curve[s])]
        if not finite:
            kept.add(chunk[0])
            continue
        kept.add(min(finite, key=lambda s: curve[s]))
        kept.add(max(finite, key=lambda s: curve[s]))
    return {step: curve[step] for step in sorted(kept)}
