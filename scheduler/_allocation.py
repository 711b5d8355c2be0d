"""Fractional allocation: the fairness policies, solved as linear programs with HiGHS.

The instance (:class:`AllocationProblem`), utilities ``u_i``, equal shares ``s_i`` and the
equal-share utilities ``e_i`` are defined in :mod:`scheduler._lp`.  Policies (all over
``x`` with capacity ``Σ_c x[c,g] ≤ N_g`` and demand ``Σ_{g,k} members·x ≤ n_c``):

* ``max_min`` (our Gavel): maximise ``min_i u_i / e_i`` by water-filling (tenants whose
  demand is met are frozen and the rest raised further), then maximise total utility
  without lowering anyone's level.  Stronger than Gavel itself: ``e_i`` is the
  heterogeneity-aware equal share and leftover capacity goes to whoever gains most.
* ``max_min_paper`` (Gavel as published, ``MaxMinFairnessPolicyWithPerf``): one LP that
  maximises ``min_i u_i / p_i``, where ``p_i`` is Gavel's own normaliser: the throughput of
  an equal *time* share of every type, type-blind (:func:`proportional_utilities`).  No
  water-filling, no efficiency stage.
* ``oef`` (OEF, Middleware'24, cooperative): maximise ``Σ_i u_i`` subject to sharing
  incentive ``u_i ≥ e_i`` and envy-freeness for the classes that are still short of
  trials in the current solution, with one linear valuation per class.  Solved as a
  short sequence of LPs (:func:`_oef`).
* ``oef_noncooperative``: the strategy-proof fixed-price exchange of
  :mod:`scheduler._exchange`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import sparse

from fusetune.scheduler._exchange import exchange
from fusetune.scheduler._lp import (
    AllocationProblem,
    EqualShare,
    Vars,
    active_tenants,
    base_constraints,
    best_use,
    equal_share,
    equal_share_utilities,
    scatter,
    shares,
    short_classes,
    solve_lp,
    unmet_tenants,
    utility_matrix,
    variables,
)

__all__ = [
    "Allocation",
    "AllocationProblem",
    "FairnessPolicy",
    "equal_share_utilities",
    "proportional_utilities",
    "solve_allocation",
]

FairnessPolicy = Literal["max_min", "max_min_paper", "oef", "oef_noncooperative"]
FAIRNESS_POLICIES: tuple[str, ...] = ("max_min", "max_min_paper", "oef", "oef_noncooperative")

_TOL = 1e-7
_ENVY_PENALTY = 1e3  # per unit of envy, relative to the largest per-device rate
SI_HEADROOM = 0.02  # oef aims 2% above the equal share where capacity allows
_SI_PENALTY = 1.0  # per unit of missed headroom utility: the headroom never costs more throughput than it buys
_STICKINESS = 1e-3  # tie-break bonus for incumbent placements, relative to the mean rate
_OEF_PASSES = 12  # bound on oef's re-solves (rows are only added, classes only frozen)
_ENVY_RTOL = 1e-6  # envy below this fraction of the envier's own value is no envy
_PAIR_BUDGET = 2000  # (short class, tenant) pairs above which envy rows are per tenant


@dataclass(frozen=True)
class Allocation:
    """A fractional allocation and the fairness quantities it was judged by.

    Attributes:
        devices: (C, G) devices of each type per class (summed over options).
        members: (C, G) mean trials per array the allocation implies (0 where no devices).
        utility: (T,) u_i(x).
        equal_share: (T,) e_i, best utility within the weighted equal share.
        saturated: (T,) True where the equal share already meets the tenant's demand.
        unmet: (T,) True where this allocation leaves some of the tenant's trials unheld
            (only such tenants can envy: the others could not use more devices).
        solver_seconds: wall time spent in HiGHS for this allocation.
    """

    devices: np.ndarray
    members: np.ndarray
    utility: np.ndarray
    equal_share: np.ndarray
    saturated: np.ndarray
    unmet: np.ndarray
    solver_seconds: float


def _with_t(a: sparse.spmatrix) -> sparse.csr_matrix:
    """``a`` with one more (zero) column for the level variable t."""
    return sparse.hstack([a, sparse.csr_matrix((a.shape[0], 1))]).tocsr()


def _max_min(p: AllocationProblem, v: Vars, e: np.ndarray, prefer: np.ndarray) -> tuple[np.ndarray | None, float]:
    """Water-filling weighted max-min of u_i / e_i, then a total-utility stage."""
    n = v.size
    u_mat = utility_matrix(p, v)
    base_a, base_b = base_constraints(p, v, p.capacity.astype(float), per_tenant_caps=False)
    tenants = np.flatnonzero(e > _TOL)
    level = np.zeros(p.n_tenants)  # frozen minimum u_i / e_i
    frozen = np.zeros(p.n_tenants, dtype=bool)
    secs = 0.0
    x: np.ndarray | None = None
    for _ in range(4):
        active = tenants[~frozen[tenants]]
        if active.size == 0:
            break
        # Variables [x, t]; maximise t s.t. -u_i + t e_i <= 0 (active), -u_i <= -level_i e_i (frozen).
        rows = [_with_t(base_a), sparse.hstack([-u_mat[active], sparse.csr_matrix(e[active][:, None])])]
        rhs = [base_b, np.zeros(active.size)]
        fz = tenants[frozen[tenants]]
        if fz.size:
            rows.append(_with_t(-u_mat[fz]))
            rhs.append(-(level[fz] * e[fz]) * (1 - 1e-8))
        obj = np.zeros(n + 1)
        obj[-1] = -1.0
        sol, s = solve_lp(obj, sparse.vstack(rows).tocsr(), np.concatenate(rhs))
        secs += s
        if sol is None:
            break
        x, t = sol[:n], sol[-1]
        # Tenants whose every class is fully served cannot rise further: freeze them at
        # what they got and water-fill the rest.
        unmet = unmet_tenants(p, v, scatter(p, v, x)[1])
        newly = active[~unmet[active]]
        level[active] = t
        if newly.size == 0:
            break
        frozen[newly] = True
        level[newly] = (u_mat[newly] @ x) / e[newly]
    if x is None:
        return None, secs
    # Efficiency stage: use leftover capacity without lowering anyone's fair level.
    lv = np.maximum(level[tenants], 0.0)
    a = sparse.vstack([base_a, -u_mat[tenants]]).tocsr()
    b = np.concatenate([base_b, -(lv * e[tenants]) * (1 - 1e-8)])
    sol, s = solve_lp(-v.rate - prefer, a, b)
    secs += s
    return (sol if sol is not None else x), secs


def proportional_utilities(p: AllocationProblem) -> np.ndarray:
    """Gavel's normaliser ``p_i``: the utility of an equal time share, type-blind.

    Gavel's ``ProportionalPolicy`` gives every job the same fraction of every worker
    type, in proportion to the type's count, at most one device at a time.  Per tenant:
    its weighted share ``s_i`` of all devices, capped by the trials it has (one device
    each, unfused), spread over the types as the cluster is and over its classes as its
    trials are.  No heterogeneity awareness: a tenant whose jobs fly on V100s is
    normalised by what the average device gives it.
    """
    solo = np.where(p.members == 1, p.rate, 0.0).max(axis=2)  # (C, G) unfused rate
    trials = np.bincount(p.class_tenant, weights=p.demand, minlength=p.n_tenants)
    devices = np.minimum(trials, shares(p) * p.capacity.sum())
    with np.errstate(divide="ignore", invalid="ignore"):
        per_trial = np.where(trials > 0, devices / trials, 0.0)  # devices per trial
    mix = p.capacity / max(p.capacity.sum(), 1e-12)
    value = p.demand * per_trial[p.class_tenant] * (solo @ mix)
    return np.bincount(p.class_tenant, weights=value, minlength=p.n_tenants)


def _max_min_paper(p: AllocationProblem, v: Vars) -> tuple[np.ndarray | None, float]:
    """Gavel's single LP: maximise t s.t. u_i >= t·p_i, capacity and demand."""
    norm = proportional_utilities(p)
    tenants = np.flatnonzero(norm > _TOL)
    base_a, base_b = base_constraints(p, v, p.capacity.astype(float), per_tenant_caps=False)
    level = sparse.hstack([-utility_matrix(p, v)[tenants], sparse.csr_matrix(norm[tenants][:, None])])
    obj = np.zeros(v.size + 1)
    obj[-1] = -1.0
    sol, secs = solve_lp(obj, sparse.vstack([_with_t(base_a), level]).tocsr(), np.concatenate([base_b, np.zeros(tenants.size)]))
    return (sol[: v.size] if sol is not None else None), secs


def _class_values(p: AllocationProblem, v: Vars) -> np.ndarray:
    """(C, G) OEF's linear valuation per class: a device's best rate for the class."""
    value = np.zeros((p.n_classes, p.n_types))
    np.maximum.at(value, (v.cls, v.typ), v.rate)
    return value


@dataclass(frozen=True)
class _Valuations:
    """Who envies, with which linear valuation: one row per *owner*.

    Owners are the classes (each with its own valuation), or, past ``_PAIR_BUDGET``
    (class, tenant) pairs, the tenants, valued by the maximum over their classes that
    the equal share leaves short (classes with nothing waiting are left out: they could
    not use another bundle).

    Attributes:
        value: (O, G) per-device value.
        tenant: (O,) the owner's tenant.
        of_class: (C,) each class's owner.
    """

    value: np.ndarray
    tenant: np.ndarray
    of_class: np.ndarray

    def short(self, short_classes: np.ndarray) -> np.ndarray:
        """(O,) owners with a short class."""
        out = np.zeros(self.tenant.shape[0], dtype=bool)
        out[self.of_class[short_classes]] = True
        return out


def _valuations(p: AllocationProblem, v: Vars, es: EqualShare) -> _Valuations:
    """Per-class valuations, or per-tenant ones where per-class rows would be too many."""
    value = _class_values(p, v)
    if es.short.sum() * active_tenants(p).sum() <= _PAIR_BUDGET:
        return _Valuations(value, p.class_tenant, np.arange(p.n_classes))
    per_tenant = np.zeros((p.n_tenants, p.n_types))
    np.maximum.at(per_tenant, p.class_tenant[es.short], value[es.short])
    return _Valuations(per_tenant, np.arange(p.n_tenants), p.class_tenant.copy())


def _envy_rows(p: AllocationProblem, val: _Valuations, pairs: np.ndarray) -> tuple[sparse.csr_matrix, np.ndarray]:
    """Envy rows over the bundles a[j, g] (a (m, T*G) matrix) and each row's tenant.

    One row per pair (owner o of tenant i, tenant j ≠ i) set in the (O, T) mask ``pairs``:
    ``Σ_g v_o[g] (a_j[g]/w_j − a_i[g]/w_i) ≤ slack_i``: o would not rather have j's
    (weight-scaled) bundle than its own tenant's.
    """
    T, G = p.n_tenants, p.n_types
    w = p.weights.astype(float)
    oo, jj = np.nonzero(pairs)
    ii = val.tenant[oo]
    keep = ii != jj
    oo, jj, ii = oo[keep], jj[keep], ii[keep]
    m = oo.size
    r = np.repeat(np.arange(m), G)
    g = np.tile(np.arange(G), m)
    vo = val.value[np.repeat(oo, G), g]
    coef = sparse.csr_matrix(
        (
            np.concatenate([-vo / w[np.repeat(ii, G)], vo / w[np.repeat(jj, G)]]),
            (np.concatenate([r, r]), np.concatenate([np.repeat(ii, G) * G + g, np.repeat(jj, G) * G + g])),
        ),
        shape=(m, T * G),
    )
    return coef, ii


def _envy(p: AllocationProblem, v: Vars, val: _Valuations, x: np.ndarray) -> np.ndarray:
    """(O, T) how much more owner o values tenant j's weight-scaled bundle than its own's.

    Relative to its value of its own tenant's bundle; ``-inf`` for its own tenant and
    for idle tenants.
    """
    bundle = np.zeros((p.n_tenants, p.n_types))
    np.add.at(bundle, p.class_tenant, scatter(p, v, x)[0])
    worth = val.value @ (bundle / p.weights[:, None]).T  # (O, T)
    rows = np.arange(val.tenant.shape[0])
    own = worth[rows, val.tenant]
    out = (worth - own[:, None]) / np.maximum(own, 1e-9)[:, None]
    out[rows, val.tenant] = -np.inf
    out[:, ~active_tenants(p)] = -np.inf
    return out


def _oef_lp(
    p: AllocationProblem,
    v: Vars,
    e: np.ndarray,
    rows: tuple[_Valuations, np.ndarray],
    frozen: np.ndarray,
    prefer: np.ndarray,
) -> tuple[np.ndarray | None, float]:
    """One OEF LP over [x, z, a, s]: max Σu − penalties, s.t. SI, envy rows, frozen demand.

    ``z_i`` is tenant i's missed sharing-incentive headroom (``u_i ≥ (1 + h) e_i − z_i``,
    ``0 ≤ z_i ≤ h e_i``: so ``u_i ≥ e_i`` always and a little more where capacity allows;
    the headroom absorbs later rounds' integer rounding).  ``a`` are the bundles, tied to
    x by equalities so each envy row touches 2G entries.  ``s_i ≥ 0`` is tenant i's envy
    slack: demand caps can make exact envy-freeness and sharing incentive jointly
    infeasible, so envy is penalised (above any throughput) rather than forbidden.
    Classes in ``frozen`` hold all their trials.
    """
    n, T, G = v.size, p.n_tenants, p.n_types
    act = np.flatnonzero(active_tenants(p))
    coef, row_tenant = _envy_rows(p, *rows)
    slack_tenants = np.unique(row_tenant)
    slack_col = np.searchsorted(slack_tenants, row_tenant)
    n_z, n_a, n_s, m = act.size, T * G, slack_tenants.size, coef.shape[0]
    width = n + n_z + n_a + n_s

    def block(a: sparse.spmatrix, col: int) -> sparse.csr_matrix:
        """``a`` placed at column ``col`` of a full-width row block."""
        parts = [sparse.csr_matrix((a.shape[0], col)), a, sparse.csr_matrix((a.shape[0], width - col - a.shape[1]))]
        return sparse.hstack(parts).tocsr()

    base_a, base_b = base_constraints(p, v, p.capacity.astype(float), per_tenant_caps=False)
    eye_z = sparse.identity(n_z, format="csr")
    held = sparse.csr_matrix((v.members, (v.cls, np.arange(n))), shape=(p.n_classes, n))[np.flatnonzero(frozen)]
    slack = sparse.csr_matrix((np.full(m, -1.0), (np.arange(m), slack_col)), shape=(m, n_s))
    ub = [
        block(base_a, 0),
        sparse.hstack([-utility_matrix(p, v)[act], -eye_z, sparse.csr_matrix((n_z, n_a + n_s))]).tocsr(),
        block(eye_z, n),
        block(sparse.hstack([coef, slack]), n + n_z),
        block(-held, 0),
    ]
    rhs = [
        base_b, -((1 + SI_HEADROOM) * e[act] - _TOL), SI_HEADROOM * e[act], np.full(m, _TOL),
        -p.demand[frozen] * (1 - 1e-6),
    ]
    owner = p.class_tenant[v.cls]
    bundle = sparse.csr_matrix((np.ones(n), (owner * G + v.typ, np.arange(n))), shape=(n_a, n))
    a_eq = sparse.hstack([bundle, sparse.csr_matrix((n_a, n_z)), -sparse.identity(n_a), sparse.csr_matrix((n_a, n_s))])
    top = max(1.0, float(v.rate.max()))
    obj = np.concatenate([-v.rate - prefer, np.full(n_z, _SI_PENALTY), np.zeros(n_a), np.full(n_s, _ENVY_PENALTY * top)])
    sol, secs = solve_lp(obj, sparse.vstack(ub).tocsr(), np.concatenate(rhs), a_eq.tocsr(), np.zeros(n_a))
    return (sol[:n] if sol is not None else None), secs


def _oef(p: AllocationProblem, v: Vars, es: EqualShare, prefer: np.ndarray) -> tuple[np.ndarray | None, float]:
    """OEF with envy rows only where classes still short envy, re-solved as classes fill up.

    A class can envy only while it has trials waiting: a fully served class could not
    use another bundle.  The first LP has no envy rows.  After each solve, every pair
    (short owner o, tenant j) where o envies j gets its row (rows are added where they
    are violated, most pairs never bind), and an owner with rows whose classes the
    solution now serves in full is frozen: its classes held in full from then on, its
    rows dropped (water-filling).  Keeping a served class's rows would cap the others at
    what it can use and leave devices idle.  But the LP may have served it in full only
    because that cost no throughput then, and held in full it can keep what a short owner
    needs to stop envying it: a frozen owner that a short owner envies is thawed, once (its
    rows count again and it may be left short).  A thawed owner the LP serves in full again
    is frozen again, for good: kept unfrozen, its rows would cap the others at what it can
    use once more.  Rows are only added, and each owner is thawed at most once and frozen
    at most twice, so this ends;
    ``_OEF_PASSES`` bounds it (the last solution is kept, with whatever envy is left,
    which the simulator's metric reports).
    """
    val = _valuations(p, v, es)
    n_o = val.tenant.shape[0]
    pairs = np.zeros((n_o, p.n_tenants), dtype=bool)
    frozen = np.zeros(n_o, dtype=bool)
    thawed = np.zeros(n_o, dtype=bool)
    secs = 0.0
    x: np.ndarray | None = None
    for _ in range(_OEF_PASSES):
        sol, s = _oef_lp(p, v, es.utility, (val, pairs & ~frozen[:, None]), frozen[val.of_class], prefer)
        secs += s
        if sol is None:
            break
        x = sol
        short = val.short(short_classes(p, v, scatter(p, v, x)[1]))
        envy = _envy(p, v, val, x) > _ENVY_RTOL
        served = pairs.any(axis=1) & ~frozen & ~short
        violated = (short & ~frozen)[:, None] & envy & ~pairs
        # A frozen owner that a short owner envies: held in full, it may keep what the
        # envier needs (tests/scheduler/test_oef.py has two such problems).
        thaw = frozen & ~thawed & (short[:, None] & ~frozen[:, None] & envy)[:, val.tenant].any(axis=0)
        if not served.any() and not violated.any() and not thaw.any():
            break
        frozen = (frozen | served) & ~thaw
        thawed |= thaw
        pairs |= violated
    return x, secs


def solve_allocation(
    p: AllocationProblem,
    policy: FairnessPolicy,
    incumbent: np.ndarray | None = None,
) -> Allocation:
    """Solve one round's fractional allocation under ``policy``.

    ``incumbent`` (C, G) marks where classes run now; among allocations of (nearly)
    equal value the LP then prefers those, so degenerate LPs do not reshuffle devices
    from one round to the next (a tie-break worth 0.1% of a device's rate; Gavel's
    published LP has none and gets none).

    If HiGHS fails (numerically degenerate instance), the equal-share solution is used:
    it is always feasible and satisfies the sharing incentive.
    """
    if policy not in FAIRNESS_POLICIES:
        raise ValueError(f"unknown fairness policy {policy!r}")
    v = variables(p)
    prefer = np.zeros(v.size)
    sol: np.ndarray | None
    if incumbent is not None and v.size:
        prefer = _STICKINESS * float(v.rate.mean()) * (np.asarray(incumbent)[v.cls, v.typ] > 0)
    if v.size and np.unique(p.class_tenant[p.demand > 0]).size == 1:
        # One tenant with demand: its equal share is every device, so the sharing incentive
        # and envy-freeness hold for any allocation and every policy is the max-utility LP
        # over the whole cluster, the equal-share LP itself: solved once (with the incumbent
        # tie-break) instead of twice. A sweep of one user pays this every scheduling round.
        a, b = base_constraints(p, v, shares(p)[:, None] * p.capacity[None, :], per_tenant_caps=True)
        sol, secs = solve_lp(-(v.rate + prefer), a, b)
        if sol is not None:
            sol = np.maximum(sol, 0.0)
            e = np.asarray(utility_matrix(p, v) @ sol).ravel()
            return _allocation(p, v, sol, e, ~unmet_tenants(p, v, scatter(p, v, sol)[1]), secs)
    es = equal_share(p, v)
    secs = es.seconds
    sol = None
    if v.size:
        if policy == "max_min":
            sol, s = _max_min(p, v, es.utility, prefer)
        elif policy == "max_min_paper":
            sol, s = _max_min_paper(p, v)
        elif policy == "oef":
            sol, s = _oef(p, v, es, prefer)
        else:
            sol, s = exchange(p, v)
        secs += s
        if sol is None:
            # Re-solve the equal-share LP's vector form (cheap, always feasible).
            sol, s = best_use(p, v, shares(p)[:, None] * p.capacity[None, :])
            secs += s
    sol = np.maximum(sol, 0.0) if sol is not None else np.zeros(v.size)
    return _allocation(p, v, sol, es.utility, es.saturated, secs)


def _allocation(
    p: AllocationProblem, v: Vars, sol: np.ndarray, e: np.ndarray, saturated: np.ndarray, secs: float
) -> Allocation:
    """Package a solution vector over ``v`` as an :class:`Allocation`."""
    x, held = scatter(p, v, sol)
    u = np.asarray(utility_matrix(p, v) @ sol).ravel() if v.size else np.zeros(p.n_tenants)
    with np.errstate(divide="ignore", invalid="ignore"):
        members = np.where(x > 1e-9, held / np.where(x > 1e-9, x, 1.0), 0.0)
    return Allocation(
        devices=x,
        members=members,
        utility=u,
        equal_share=e,
        saturated=saturated,
        unmet=unmet_tenants(p, v, held),
        solver_seconds=secs,
    )
