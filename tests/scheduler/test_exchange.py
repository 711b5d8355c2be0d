"""The non-cooperative mechanism (``oef_noncooperative``): its claims, checked.

The setting of OEF's non-cooperative case: every tenant runs one job type, unfused, and
reports its speed-ups (the rates) itself.  Claims: no misreport gains a tenant true
throughput (strategy-proofness), every tenant gets at least its equal share's best use
(sharing incentive), and backlogged tenants envy nobody.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusetune.scheduler import AllocationProblem, solve_allocation
from tests.scheduler.gavel_speeds import one_type_problem
from tests.scheduler.problems import bundles

RATES = st.sampled_from([0.05, 0.2, 0.4, 0.6, 0.8, 1.0])


@st.composite
def reported(draw: st.DrawFn) -> tuple[AllocationProblem, np.ndarray]:
    """A one-type-per-tenant instance with public prices, and a misreport of tenant 0's rates."""
    n_t, n_g = draw(st.integers(2, 5)), draw(st.integers(2, 3))
    fits = np.array([[draw(st.integers(0, 9)) < 9 for _ in range(n_g)] for _ in range(n_t)])
    fits[:, 0] = True
    rate = np.array([[draw(RATES) for _ in range(n_g)] for _ in range(n_t)]) * fits
    rate /= rate.max(axis=1, keepdims=True)
    lie = np.array([draw(RATES) for _ in range(n_g)]) * fits[0]
    problem = AllocationProblem(
        weights=np.array([float(draw(st.sampled_from([1, 2, 3]))) for _ in range(n_t)]),
        capacity=np.array([float(draw(st.integers(1, 9))) for _ in range(n_g)]),
        class_tenant=np.arange(n_t),
        rate=rate[:, :, None],
        members=fits[:, :, None].astype(float),
        demand=np.array([float(draw(st.integers(1, 30))) for _ in range(n_t)]),
        prices=np.array([draw(st.sampled_from([1.0, 2.0, 3.5, 5.0])) for _ in range(n_g)]),
    )
    return problem, lie / max(lie.max(), 1e-9)


def _true_utility(problem: AllocationProblem, tenant: int, bundle: np.ndarray) -> float:
    """Tenant's best throughput on ``bundle`` with its true rates: fastest devices first, up to its trials."""
    rate = problem.rate[tenant, :, 0] * (problem.members[tenant, :, 0] > 0)
    left, total = problem.demand[tenant], 0.0
    for g in np.argsort(-rate, kind="stable"):
        take = min(left, bundle[g])
        total += take * rate[g]
        left -= take
    return float(total)


def _with_rates(problem: AllocationProblem, tenant: int, rates: np.ndarray) -> AllocationProblem:
    rate = problem.rate.copy()
    rate[tenant, :, 0] = rates
    return AllocationProblem(
        problem.weights, problem.capacity, problem.class_tenant, rate, problem.members, problem.demand, problem.prices
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=reported())
def test_misreporting_speedups_gains_nothing(case: tuple[AllocationProblem, np.ndarray]) -> None:
    """Tenant 0 reports other speed-ups; what it gets is worth no more to it than the truth."""
    problem, lie = case
    honest = solve_allocation(problem, "oef_noncooperative")
    lied = solve_allocation(_with_rates(problem, 0, lie), "oef_noncooperative")
    truth = _true_utility(problem, 0, bundles(problem, honest.devices)[0])
    gained = _true_utility(problem, 0, bundles(problem, lied.devices)[0])
    assert gained <= truth + 1e-6 * max(1.0, truth)
    # The mechanism uses each bundle as well as the (true) reports allow.
    assert abs(honest.utility[0] - truth) <= 1e-6 * max(1.0, truth)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=reported())
def test_sharing_incentive_and_no_envy_among_backlogged_tenants(case: tuple[AllocationProblem, np.ndarray]) -> None:
    """u_i ≥ e_i for all; a tenant with trials for every device envies no one's weight-scaled bundle."""
    problem, _ = case
    alloc = solve_allocation(problem, "oef_noncooperative")
    assert np.all(alloc.utility >= alloc.equal_share - 1e-6 * np.maximum(1.0, alloc.equal_share))
    held = bundles(problem, alloc.devices)
    backlogged = problem.demand >= problem.capacity.sum()
    for i in np.flatnonzero(backlogged):
        own = _true_utility(problem, int(i), held[i])
        for j in range(problem.n_tenants):
            if j != i:
                scaled = held[j] * problem.weights[i] / problem.weights[j]
                assert _true_utility(problem, int(i), scaled) <= own + 1e-6 * max(1.0, own), (i, j)


def test_with_equal_prices_and_equal_tastes_it_is_the_equal_split() -> None:
    """Everyone prefers V100s by the same ratio: nobody trades, everyone keeps a third of each type."""
    problem = one_type_problem(["A3C"] * 3, [100, 100, 100], (6, 6, 6))
    alloc = solve_allocation(problem, "oef_noncooperative")
    assert np.allclose(bundles(problem, alloc.devices), 2.0)


def test_trades_move_fast_devices_to_who_values_them_at_the_public_prices() -> None:
    """CycleGAN runs 8.8x faster on a V100 than a K80, LM (batch size 10) 3.4x; at prices
    in the ratio of peak FP32 (V100 / K80 = 3.6) the first buys V100s with its K80s and the
    second the other way, and both gain over the equal split."""
    problem = one_type_problem(
        ["CycleGAN", "LM (batch size 10)"], [200, 200], (10, 0, 10), prices=(4.37, 9.3, 15.7)
    )
    alloc = solve_allocation(problem, "oef_noncooperative")
    held = bundles(problem, alloc.devices)
    assert held[0, 2] > 5.0 and held[0, 0] < 5.0 and held[1, 0] > 5.0
    assert np.all(alloc.utility > alloc.equal_share + 1e-6)
