"""OEF (cooperative) against Gavel: idle devices, the headroom bound, and Gavel's published LP.

Policies compared (``solve_allocation``): ``oef`` (max total throughput s.t. sharing
incentive and envy-freeness for classes still short), ``max_min`` (our ``gavel``:
water-filled max-min plus an efficiency stage) and ``max_min_paper`` (``gavel-paper``:
Gavel's single max-min LP with its type-blind equal-time normaliser).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings

from fusetune.scheduler import AllocationProblem, solve_allocation
from fusetune.scheduler._allocation import SI_HEADROOM, proportional_utilities
from fusetune.scheduler._workload import backlog
from tests.scheduler.gavel_speeds import JOB_TYPES, one_type_problem
from tests.scheduler.problems import allocation_problems, envious, short_classes

# The issue's example: ten tenants, one Gavel job type each, uneven demand, 36 of each GPU.
EXAMPLE_TYPES = [
    "Transformer (batch size 64)", "ResNet-50 (batch size 16)", "LM (batch size 10)", "ResNet-18 (batch size 32)",
    "Recommendation (batch size 2048)", "CycleGAN", "A3C", "LM (batch size 40)", "Transformer (batch size 16)",
    "Recommendation (batch size 8192)",
]
EXAMPLE_DEMAND = [3, 11, 5, 31, 4, 1, 2, 1, 8, 1]


def _idle_while_waiting(problem: AllocationProblem, devices: np.ndarray, members: np.ndarray) -> list[int]:
    """Device types with a spare device while some class that fits the type has trials unheld."""
    short = short_classes(problem, devices, members)
    spare = devices.sum(axis=0) < problem.capacity - 1e-6
    fits = (problem.members > 0).any(axis=2)
    return [g for g in range(problem.n_types) if spare[g] and (short & fits[:, g]).any()]


def test_issue_example_oef_serves_every_trial() -> None:
    """67 trials on 108 GPUs: everyone fits, so nothing may wait.

    Before the fix, tenant 1's envy rows (kept because its equal share of 10.8 GPUs
    cannot hold its 11 trials) stayed in the LP after it was served in full, capped
    tenant 3 at the value of tenant 1's bundle, and OEF held 49.8 of the 67 trials
    (tenant 3: 13.8 of 31) with 58 GPUs idle.
    """
    problem = one_type_problem(EXAMPLE_TYPES, EXAMPLE_DEMAND, (36, 36, 36))
    oef = solve_allocation(problem, "oef")
    gavel = solve_allocation(problem, "max_min")
    held = (oef.devices * oef.members).sum(axis=1)
    assert np.allclose(held, EXAMPLE_DEMAND, atol=1e-6)
    assert abs(oef.devices.sum() - 67.0) < 1e-6
    assert not oef.unmet.any()
    assert oef.utility.sum() >= gavel.utility.sum() - SI_HEADROOM * gavel.equal_share.sum() - 1e-9


# Derandomized, as the headroom property below: a random draw met the counterexample of the
# next test in a CI run (6 December, after OEF's thawing), since fixed. These 200 are fixed,
# so the suite does not fail by chance; 3,000 random draws (two seeds) pass after the fix.
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(problem=allocation_problems())
def test_oef_leaves_no_device_idle_while_a_trial_that_fits_it_waits(problem: AllocationProblem) -> None:
    """Several classes per tenant, fused array options, types some classes do not fit."""
    oef = solve_allocation(problem, "oef")
    assert _idle_while_waiting(problem, oef.devices, oef.members) == []


def test_oef_fills_the_device_a_short_tenant_can_use_that_no_one_would_envy() -> None:
    """Found by the property above (hypothesis's ``find``): 3 + 1 devices, four tenants. OEF
    held 2.83 of the 3 type-0 devices; tenant 0 was short on type 0 (class 0 had half a
    device for its one trial), and no tenant values type 0 for a class still waiting, so
    nobody would envy it the rest. Tenant 2 had been thawed, then served in full again, and
    never frozen a second time: its envy row held tenant 0 to tenant 2's one device."""
    z, one = [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]
    problem = AllocationProblem(
        weights=np.array([1.0, 2.0, 1.0, 3.0]),
        capacity=np.array([3.0, 1.0]),
        class_tenant=np.array([0, 1, 2, 3, 0, 0, 0, 3]),
        rate=np.array([
            [one, one], [z, one], [one, one], [[1.0, 1.0, 0.0], z], [one, [1.0, 2.5, 4.0]],
            [[1.0, 20 / 11, 2.5], z], [z, one], [z, [1.0, 20 / 11, 0.0]],
        ]),
        members=np.array([
            [one, one], [z, one], [one, one], [[1.0, 2.0, 0.0], z], [one, [1.0, 3.0, 6.0]],
            [[1.0, 2.0, 3.0], z], [z, one], [z, [1.0, 2.0, 0.0]],
        ]),
        demand=np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 1.0]),
    )
    oef = solve_allocation(problem, "oef")
    assert _idle_while_waiting(problem, oef.devices, oef.members) == []


# Derandomized: a random draw of 200 problems met a counterexample (below, since fixed) in
# about one CI run of several. These 200 are fixed, so the suite does not fail by chance,
# and a change that breaks the bound on them still fails it.
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(problem=allocation_problems())
def test_oef_never_below_gavel_by_more_than_the_headroom_unless_gavel_is_envious(problem: AllocationProblem) -> None:
    """Σ_i u_i(oef) ≥ Σ_i u_i(gavel) − H, with H = h · Σ_i e_i, whenever gavel is envy-free.

    ``u_i`` is tenant i's normalised throughput in the fractional allocation, ``e_i`` its
    best throughput inside its weighted equal share of every type, and ``h = 0.02``
    (``SI_HEADROOM``) the sharing-incentive headroom: OEF asks ``u_i ≥ (1 + h) e_i``
    where capacity allows, and pays for a missed unit of it with at most one unit of
    total throughput (its penalty), so the headroom costs at most ``h · Σ_i e_i``.

    The premise: gavel's allocation is envy-free for OEF's valuations (no class it leaves
    short values another tenant's weight-scaled bundle above its own tenant's, with one
    linear value per device type and class).  Then gavel's allocation is one OEF may
    choose, and OEF gives up throughput only for the headroom.  When gavel's allocation
    is envious, OEF trades throughput for envy-freeness, which is its definition, and
    can fall further (``test_oef_pays_for_envy_freeness_where_gavel_is_envious``).
    """
    gavel = solve_allocation(problem, "max_min")
    if envious(problem, gavel.devices, gavel.members):
        return
    oef = solve_allocation(problem, "oef")
    headroom = SI_HEADROOM * float(gavel.equal_share.sum())
    assert oef.utility.sum() >= gavel.utility.sum() - headroom - 1e-6 * max(1.0, gavel.utility.sum())


def test_oef_meets_the_headroom_bound_where_a_frozen_tenant_once_kept_it_below() -> None:
    """Found by the property test above in a CI run (6 December): three tenants of one class
    each on 2 + 1 + 3 devices; gavel's allocation is envy-free and totals 13.714. OEF's
    water-filling froze a tenant the LP had served in full (at no cost to throughput then)
    and held it in full from then on, though an envier needed part of it: 13.442, below
    gavel less the headroom (13.523). A frozen owner that a short owner envies is now
    thawed once (its rows count again, and it may be left short): 13.714.
    """
    rate, members = np.zeros((3, 3, 3)), np.zeros((3, 3, 3))
    rate[0, 0, 0] = rate[0, 1, 0] = members[0, 0, 0] = members[0, 1, 0] = 1.0
    for c, solo in ((1, 1.0), (2, 0.4)):  # speeds as tests/scheduler/problems.py draws them
        rate[c, 0, 0], members[c, 0, 0] = solo, 1
        rate[c, 1, :2], members[c, 1, :2] = (0.4, 0.8 / 1.1), (1, 2)
        rate[c, 2, :], members[c, 2, :] = (1.0, 3 / 1.2, 5 / 1.4), (1, 3, 5)
    problem = AllocationProblem(weights=np.ones(3), capacity=np.array([2.0, 1.0, 3.0]), class_tenant=np.array([0, 1, 2]),
                                rate=rate, members=members, demand=np.array([1.0, 10.0, 9.0]))
    gavel = solve_allocation(problem, "max_min")
    assert not envious(problem, gavel.devices, gavel.members)
    oef = solve_allocation(problem, "oef")
    assert oef.utility.sum() >= gavel.utility.sum() - SI_HEADROOM * float(gavel.equal_share.sum()) - 1e-6


def test_oef_is_envy_free_where_gavel_is_envious_here_at_gavels_throughput() -> None:
    """Where gavel's allocation is envious, OEF's is envy-free, and here costs nothing.

    Two types, 2 A and 3 B devices.  Tenant a (2 trials) runs at 1.0 on A and 0.5 on B,
    b (3 trials) at 1.0 on A and 0.25 on B, c (2 trials) at 1.0 on both.  Gavel's
    allocation (total 4.5) gives a 0.9 A and 1 B and b 1.1 A: b, still short, values a's
    bundle at 1.15 against its own 1.1.  OEF gives a 0.875 A and 1 B and b 1.125 A (b
    values a's bundle at exactly its own) and also totals 4.5. (Before a frozen owner could
    be thawed, OEF held 4.33 here: it is not the price of envy-freeness.)
    """
    problem = _envious_instance()
    gavel = solve_allocation(problem, "max_min")
    oef = solve_allocation(problem, "oef")
    assert envious(problem, gavel.devices, gavel.members)
    assert not envious(problem, oef.devices, oef.members)
    assert abs(gavel.utility.sum() - 4.5) < 1e-6 and abs(oef.utility.sum() - 4.5) < 1e-4


def test_a_tenant_served_in_full_gives_back_what_an_envier_needs() -> None:
    """Found by tests/scheduler/test_scheduler.py's envy property: 7 devices of one type,
    tenants of weights 3, 1 and 2 with 5, 2 and 1 trials. The first LP gives t1 1.19 and t1
    envies t0 (t0's 4.81 / 3 = 1.6 per weight); with t1's row the LP gives t1 its 2 trials
    (as good for throughput as 1.5) and t1, served, was frozen in full, so t0 (4 devices,
    short) envied t1 (2 x 3 = 6) with nothing left to give. Thawed, the envy-free
    allocation is the only one: 4.5, 1.5 and 1."""
    rate = np.ones((3, 1, 1))
    problem = AllocationProblem(weights=np.array([3.0, 1.0, 2.0]), capacity=np.array([7.0]), class_tenant=np.arange(3),
                                rate=rate, members=np.ones((3, 1, 1)), demand=np.array([5.0, 2.0, 1.0]))
    oef = solve_allocation(problem, "oef")
    assert not envious(problem, oef.devices, oef.members)
    assert np.allclose(oef.devices[:, 0], [4.5, 1.5, 1.0], atol=1e-4)


def _envious_instance() -> AllocationProblem:
    """The instance of ``test_oef_pays_for_envy_freeness_where_gavel_is_envious``."""
    return AllocationProblem(
        weights=np.ones(3),
        capacity=np.array([2.0, 3.0]),
        class_tenant=np.arange(3),
        rate=np.array([[1.0, 0.5], [1.0, 0.25], [1.0, 1.0]])[:, :, None],
        members=np.ones((3, 2, 1)),
        demand=np.array([2.0, 3.0, 2.0]),
    )


def test_gavel_paper_normaliser_is_an_equal_time_share_type_blind() -> None:
    """Gavel's p_i: the tenant's share of all devices (capped at its trials), spread as the cluster is."""
    rate = np.array([[0.25, 1.0], [1.0, 1.0]])[:, :, None]
    problem = AllocationProblem(
        weights=np.ones(2), capacity=np.array([2.0, 6.0]), class_tenant=np.arange(2), rate=rate,
        members=np.ones((2, 2, 1)), demand=np.array([100.0, 2.0]),
    )
    # a: 4 of the 8 devices, 1/4 of them K80s: 4 · (0.25 · 0.25 + 0.75 · 1.0) = 3.25.
    # b: only 2 trials, so 2 devices' worth, at 1.0 anywhere = 2.0.
    assert np.allclose(proportional_utilities(problem), [3.25, 2.0])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=allocation_problems())
def test_gavel_paper_maximises_the_smallest_normalised_throughput(problem: AllocationProblem) -> None:
    """No policy's allocation has a larger min_i u_i / p_i than gavel-paper's single LP."""
    norm = proportional_utilities(problem)
    has = norm > 1e-9
    level = {
        pol: float(np.min(solve_allocation(problem, pol).utility[has] / norm[has]))
        for pol in ("max_min_paper", "max_min", "oef")
    }
    assert level["max_min_paper"] >= max(level["max_min"], level["oef"]) - 1e-6


def test_oef_gains_over_gavel_paper_on_one_type_per_tenant_loads() -> None:
    """≥ 15% more total throughput than Gavel's single LP, on backlogs at half load.

    Ten tenants, one Gavel job type each, waiting trials 0.08 to 1.6 times their equal
    share (mean 0.5: the cluster could hold every trial), on the three mixes, five seeds
    each.  Where the gain comes from: Gavel's LP stops at the max-min level and is
    indifferent to the devices that level does not need, so its optimum (as HiGHS
    returns it) leaves devices idle while trials of tenants above the level wait;
    OEF maximises the total.  At high load the gap closes (docs/scheduling.md).
    """
    oef = paper = 0.0
    idle = []
    for capacity in ((36, 36, 36), (60, 30, 18), (24, 24, 60)):
        for seed in range(5):
            waiting = backlog(JOB_TYPES, sum(capacity), low=0.5 * 0.5 / 3.17, high=10 * 0.5 / 3.17, seed=seed)
            problem = one_type_problem([j for _, j, _ in waiting], [n for _, _, n in waiting], capacity)
            oef += solve_allocation(problem, "oef").utility.sum()
            gp = solve_allocation(problem, "max_min_paper")
            paper += gp.utility.sum()
            idle.append(bool(_idle_while_waiting(problem, gp.devices, gp.members)))
    assert oef >= 1.15 * paper, (oef, paper)
    assert sum(idle) >= len(idle) // 2
