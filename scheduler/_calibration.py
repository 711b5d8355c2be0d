"""Calibrated fused-array speed-up curves for the simulator's job types.

Solo speeds come from Gavel's measurements (steps/s of 26 job types on K80, P100, V100).
The marginal cost ``c`` of one more fused member (see :mod:`scheduler._throughput`) is

    c(job, gpu) = max(c_floor(gpu), c_pair(job, gpu))

* ``c_pair`` is measured: Gavel co-located two copies of the same job on one GPU; their
  combined normalised throughput ``S2 = (own + other) / solo`` is ``T(2)/T(1) = 2/(1+c)``,
  so ``c_pair = 2/S2 − 1`` (clamped to [0, 1]).  Co-location is a *lower bound* on what
  horizontal fusion achieves (HFTA fuses kernels instead of time-slicing them), so this
  is conservative.  ``S2 = 0`` means the pair ran out of memory: that job never fuses.
* ``c_floor`` caps the best case at HFTA's measured curves: PointNet gains about 5× at
  B = 9 on a V100 (``c = 0.1``) and about 13× at B = 25 on an A100 (``c = 1/26``).  A model
  occupies a fraction of a GPU inversely proportional to the GPU's speed, so
  ``c_floor(gpu) = 0.1 · peak(V100) / peak(gpu)`` with FP32 peaks K80 (one GK210 die)
  4.37, P100 9.3, V100 15.7 TFLOPS; the A100 point gives it an effective peak of 40.8.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fusetune.scheduler._throughput import SpeedupCurve

__all__ = [
    "GPU_MEMORY_BYTES",
    "HFTA_POINTNET_V100_MARGINAL_COST",
    "PEAK_TFLOPS",
    "JobTypeCurves",
    "job_type_curves",
    "marginal_cost_floor",
    "parse_job_key",
]

HFTA_POINTNET_V100_MARGINAL_COST = 0.1  # 9 / (1 + 8c) = 5  =>  c = 0.1
PEAK_TFLOPS: Mapping[str, float] = {"k80": 4.37, "p100": 9.3, "v100": 15.7, "a100": 40.8}
GPU_MEMORY_BYTES: Mapping[str, int] = {"k80": 12 << 30, "p100": 16 << 30, "v100": 16 << 30, "a100": 40 << 30}


def marginal_cost_floor(gpu: str) -> float:
    """Smallest c any job reaches on ``gpu`` (HFTA's PointNet, scaled by GPU speed)."""
    return min(1.0, HFTA_POINTNET_V100_MARGINAL_COST * PEAK_TFLOPS["v100"] / PEAK_TFLOPS[gpu])


@dataclass(frozen=True)
class JobTypeCurves:
    """Speed-up curves of every job type on every GPU type, plus the raw pair factors."""

    curves: Mapping[tuple[str, str], SpeedupCurve]  # (job type, gpu) -> curve
    pair_speedup: Mapping[tuple[str, str], float]  # (job type, gpu) -> S2 (0 = OOM)

    @property
    def job_types(self) -> tuple[str, ...]:
        return tuple(sorted({j for j, _ in self.curves}))

    @property
    def gpus(self) -> tuple[str, ...]:
        return tuple(sorted({g for _, g in self.curves}))


def job_type_curves(
    simulation_throughputs: Mapping[str, Mapping[str, Any]], solo: Mapping[tuple[str, str], float]
) -> JobTypeCurves:
    """Build the calibrated curves from Gavel's measurements, given as plain data.

    Args:
        simulation_throughputs: ``gavel_simulation_throughputs.json`` as parsed:
            ``{gpu: {"(job type, scale)": {"null": solo, "(other, scale)": [own, other]}}}``.
        solo: solo steps/s per (job type, gpu) at scale factor 1 (the isolated CSV).
    """
    curves: dict[tuple[str, str], SpeedupCurve] = {}
    pair: dict[tuple[str, str], float] = {}
    for (job, gpu), t1 in solo.items():
        key = str((job, 1))
        entry = simulation_throughputs[gpu][key]
        own, other = entry.get(key, [0.0, 0.0])
        s2 = (own + other) / entry["null"] if entry["null"] > 0 else 0.0
        pair[(job, gpu)] = s2
        memory = GPU_MEMORY_BYTES[gpu]
        if s2 <= 0:
            # Two copies did not fit: one member takes the whole device.
            curves[(job, gpu)] = SpeedupCurve(t1, 1.0, base_bytes=0, member_bytes=memory)
            continue
        c_pair = min(1.0, max(0.0, 2.0 / s2 - 1.0))
        curves[(job, gpu)] = SpeedupCurve(t1, max(marginal_cost_floor(gpu), c_pair))
    return JobTypeCurves(curves=curves, pair_speedup=pair)


def parse_job_key(key: str) -> tuple[str, int]:
    """Parse Gavel's ``"('ResNet-18 (batch size 32)', 1)"`` keys."""
    job, scale = ast.literal_eval(key)
    return str(job), int(scale)
