"""Random allocation instances for the property tests of the fairness policies."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from fusetune.scheduler import AllocationProblem


@st.composite
def allocation_problems(
    draw: st.DrawFn, *, one_class_per_tenant: bool = False, fused: bool = True, all_fit: bool = False
) -> AllocationProblem:
    """2-5 tenants (weights 1-3), 1-3 device types, 1-3 classes per tenant.

    Each (class, type) has a solo rate and, when ``fused``, half-sized and fully sized
    array options on the concave curve ``B / (1 + c (B - 1))``; a class fits a type with
    probability 0.85 unless ``all_fit``.  Rates are normalised so that a class's best solo
    rate is 1.0, as the scheduler builds them.
    """
    n_t, n_g = draw(st.integers(2, 5)), draw(st.integers(1, 3))
    owners = list(range(n_t))
    if not one_class_per_tenant:
        owners += draw(st.lists(st.integers(0, n_t - 1), max_size=4))
    n_c, n_k = len(owners), (3 if fused else 1)
    members = np.zeros((n_c, n_g, n_k))
    rate = np.zeros((n_c, n_g, n_k))
    for c in range(n_c):
        solo = [draw(st.sampled_from([0.1, 0.25, 0.5, 0.8, 1.0])) for _ in range(n_g)]
        fits = [all_fit or draw(st.integers(0, 19)) < 17 for _ in range(n_g)]
        if not any(fits):
            fits[draw(st.integers(0, n_g - 1))] = True
        top = max(s for s, f in zip(solo, fits, strict=True) if f)
        for g in range(n_g):
            if not fits[g]:
                continue
            b = draw(st.integers(1, 8)) if fused else 1
            cost = draw(st.sampled_from([0.1, 0.5, 1.0]))
            for k, size in enumerate(sorted({1, (b + 1) // 2, b}) if fused else [1]):
                members[c, g, k] = size
                rate[c, g, k] = solo[g] / top * size / (1 + cost * (size - 1))
    return AllocationProblem(
        weights=np.array([float(draw(st.sampled_from([1, 2, 3]))) for _ in range(n_t)]),
        capacity=np.array([float(draw(st.integers(1, 8))) for _ in range(n_g)]),
        class_tenant=np.array(owners),
        rate=rate,
        members=members,
        demand=np.array([float(draw(st.integers(1, 25))) for _ in range(n_c)]),
    )


def bundles(problem: AllocationProblem, devices: np.ndarray) -> np.ndarray:
    """(T, G) devices per tenant from an allocation's (C, G) devices per class."""
    out = np.zeros((problem.n_tenants, problem.n_types))
    np.add.at(out, problem.class_tenant, devices)
    return out


def class_values(problem: AllocationProblem) -> np.ndarray:
    """(C, G) OEF's linear valuation: a device's best rate for the class (0 where it does not fit)."""
    return np.where(problem.members > 0, problem.rate, 0.0).max(axis=2)


def short_classes(problem: AllocationProblem, devices: np.ndarray, members: np.ndarray) -> np.ndarray:
    """(C,) classes an allocation leaves with trials unheld."""
    held = (devices * members).sum(axis=1)
    return problem.demand - held > 1e-6 * np.maximum(1.0, problem.demand)


def envious(problem: AllocationProblem, devices: np.ndarray, members: np.ndarray, tol: float = 1e-6) -> bool:
    """Whether some short class values another tenant's (weight-scaled) bundle above its own tenant's."""
    value, bundle, w = class_values(problem), bundles(problem, devices), problem.weights
    for c in np.flatnonzero(short_classes(problem, devices, members)):
        i = problem.class_tenant[c]
        for j in range(problem.n_tenants):
            if j != i and value[c] @ (bundle[j] / w[j] - bundle[i] / w[i]) > tol * max(1.0, value[c] @ bundle[i] / w[i]):
                return True
    return False
