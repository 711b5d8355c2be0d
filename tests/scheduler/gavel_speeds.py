"""Gavel's measured solo speeds (steps/s, scale factor 1) of its 26 job types on K80, P100, V100.

Test data, copied from ``gavel_isolated_throughputs.csv`` (shared/data, derived from
stanford-futuredata/gavel ``scheduler/simulation_throughputs.json``, MIT licence,
Copyright (c) 2020 Stanford Future Data Systems), so that the allocation tests run the
paper's setting without reading files.
"""

from __future__ import annotations

import numpy as np

from fusetune.scheduler import AllocationProblem

GPUS = ("k80", "p100", "v100")
SOLO: dict[str, tuple[float, float, float]] = {
    "A3C": (3.4388, 5.6813, 7.1758),
    "CycleGAN": (0.5048, 2.4027, 4.4261),
    "LM (batch size 10)": (23.7944, 77.0847, 81.6516),
    "LM (batch size 20)": (17.1423, 58.1727, 64.7425),
    "LM (batch size 40)": (11.4997, 35.7664, 45.2374),
    "LM (batch size 5)": (25.4855, 90.7759, 109.1666),
    "LM (batch size 80)": (6.0542, 21.1575, 28.2400),
    "Recommendation (batch size 1024)": (20.0500, 30.7444, 13.2826),
    "Recommendation (batch size 2048)": (10.4412, 16.5966, 7.4696),
    "Recommendation (batch size 4096)": (5.3002, 8.8967, 3.9061),
    "Recommendation (batch size 512)": (32.8593, 48.8824, 23.3176),
    "Recommendation (batch size 8192)": (2.6988, 5.5484, 2.8415),
    "ResNet-18 (batch size 128)": (1.8065, 11.6755, 17.9949),
    "ResNet-18 (batch size 16)": (4.7953, 35.8692, 32.3534),
    "ResNet-18 (batch size 256)": (0.8856, 7.7228, 10.3003),
    "ResNet-18 (batch size 32)": (7.1758, 35.8254, 29.9472),
    "ResNet-18 (batch size 64)": (7.0521, 22.3049, 24.0932),
    "ResNet-50 (batch size 128)": (0.3472, 1.5844, 2.4968),
    "ResNet-50 (batch size 16)": (2.3005, 9.0530, 11.3961),
    "ResNet-50 (batch size 32)": (1.2366, 4.8883, 7.7873),
    "ResNet-50 (batch size 64)": (0.6190, 2.6195, 4.3948),
    "Transformer (batch size 128)": (0.9816, 3.0735, 5.4461),
    "Transformer (batch size 16)": (5.4674, 9.5372, 11.0641),
    "Transformer (batch size 256)": (0.4583, 1.6777, 1.5951),
    "Transformer (batch size 32)": (3.5074, 7.8692, 10.6209),
    "Transformer (batch size 64)": (1.7522, 5.0918, 8.6178),
}
JOB_TYPES = tuple(sorted(SOLO))


def one_type_problem(
    job_types: list[str], demand: list[int], capacity: tuple[int, int, int], weights: list[float] | None = None,
    prices: tuple[float, float, float] | None = None,
) -> AllocationProblem:
    """Tenant i runs ``demand[i]`` unfused trials of ``job_types[i]`` on K80/P100/V100 ``capacity``.

    Rates are normalised as the scheduler does: a trial on its best GPU type is 1.0.
    """
    rate = np.array([[s / max(SOLO[j]) for s in SOLO[j]] for j in job_types])[:, :, None]
    n = len(job_types)
    return AllocationProblem(
        weights=np.array(weights if weights is not None else [1.0] * n, dtype=float),
        capacity=np.array(capacity, dtype=float),
        class_tenant=np.arange(n),
        rate=rate,
        members=np.ones((n, 3, 1)),
        demand=np.array(demand, dtype=float),
        prices=np.array(prices, dtype=float) if prices is not None else None,
    )
