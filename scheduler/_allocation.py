"""Fractional allocation: the fairness policies, solved as linear programs with HiGHS.

Unit of allocation: a *class* is the set of a tenant's trials that share one signature
(they are interchangeable and fuse together).  ``x[c, g, k]`` is the (fractional) number
of devices of type ``g`` that class ``c`` holds on average with array option ``k``; each
such device runs one array of ``members[c, g, k]`` trials and yields ``rate[c, g, k]``
units of *normalised* throughput (models·steps/s divided by the signature's best solo
steps/s on any type, so one unfused trial on its best device type = 1.0, and different
job types add up meaningfully).  Options are array sizes (1 = unfused, up to the sized
B): the LP itself picks when to fuse -- spreading trials unfused while devices are
plentiful (each trial runs at full speed) and fusing when devices are scarce.

Tenant ``i``'s utility is ``u_i(x) = Σ_{c∈i, g, k} rate[c,g,k] · x[c,g,k]``.  Its *equal share*
is ``s_i = w_i / Σ_{active} w`` of every device type (a weight replicates the share), and
``e_i`` is the best utility it could reach alone inside that share.

Policies (all LPs over ``x`` with capacity ``Σ_c x[c,g] ≤ N_g`` and demand
``Σ_{g,k} members[c,g,k] · x[c,g,k] ≤ n_c``):

* ``max_min`` (Gavel, OSDI'20): maximise ``min_i u_i / e_i`` by water-filling (tenants
  whose demand is met are frozen and the rest raised further), then maximise total
  utility without lowering anyone's level.
* ``oef`` (OEF, Middleware'24): maximise ``Σ_i u_i`` subject to sharing incentive
  ``u_i ≥ e_i`` and envy-freeness ``v_i·a_i / w_i ≥ v_i·a_j / w_j`` for every tenant
  ``i`` whose demand its equal share does not already meet (envy rows carry a heavily
  penalised slack: exact whenever demand caps allow it), where ``a_i[g] = Σ_{c∈i}
  x[c,g,k]`` is i's bundle and ``v_i[g] = max_{c∈i,k} rate[c,g,k]`` its per-device value.
* ``oef_noncooperative``: as ``oef`` but envy-freeness must hold for *every* valuation,
  i.e. per type ``a_i[g]/w_i ≥ a_j[g]/w_j``.  Unsaturated tenants' bundles then do not
  depend on reported speed-ups at all, so misreporting cannot buy more devices
  (strategy-proof); reports only decide how a tenant uses its own bundle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

__all__ = ["AllocationProblem", "Allocation", "FairnessPolicy", "solve_allocation", "equal_share_utilities"]

FairnessPolicy = Literal["max_min", "oef", "oef_noncooperative"]

_TOL = 1e-7
_ENVY_PENALTY = 1e3  # per unit of envy, relative to the largest per-device rate
_SI_HEADROOM = 0.02  # aim 2% above the equal share where capacity allows
_SI_PENALTY = 1e2  # per unit of missed headroom, relative to the largest per-device rate
_STICKINESS = 1e-3  # tie-break bonus for incumbent placements, relative to the mean rate


@dataclass(frozen=True)
class AllocationProblem:
    """One round's allocation instance (arrays indexed by class ``c`` and type ``g``).

    Attributes:
        weights: (T,) tenant weights, > 0.
        capacity: (G,) devices of each type.
        class_tenant: (C,) tenant index of each class.
        rate: (C, G, K) normalised throughput of one device of type g running class c
            with array option k.
        members: (C, G, K) trials such a device holds (0: option unusable).
        demand: (C,) trials in the class (pending + running).
    """

    weights: np.ndarray
    capacity: np.ndarray
    class_tenant: np.ndarray
    rate: np.ndarray
    members: np.ndarray
    demand: np.ndarray

    @property
    def n_tenants(self) -> int:
        return int(self.weights.shape[0])

    @property
    def n_classes(self) -> int:
        return int(self.class_tenant.shape[0])

    @property
    def n_types(self) -> int:
        return int(self.capacity.shape[0])


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


@dataclass(frozen=True)
class _Vars:
    """The usable LP variables: (class, type, option) triples with their rate/members."""

    cls: np.ndarray
    typ: np.ndarray
    opt: np.ndarray
    rate: np.ndarray
    members: np.ndarray

    @property
    def size(self) -> int:
        return int(self.cls.shape[0])


def _variables(p: AllocationProblem) -> _Vars:
    """Usable variables: members > 0, rate > 0 and the class has demand."""
    usable = (p.members > 0) & (p.rate > 0) & (p.demand[:, None, None] > 0)
    cls, typ, opt = np.nonzero(usable)
    return _Vars(cls, typ, opt, p.rate[cls, typ, opt], p.members[cls, typ, opt].astype(float))


def _scatter(p: AllocationProblem, v: _Vars, sol: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(C, G) devices and (C, G) trials held, from a solution vector over ``v``."""
    x = np.zeros((p.n_classes, p.n_types))
    held = np.zeros((p.n_classes, p.n_types))
    np.add.at(x, (v.cls, v.typ), sol)
    np.add.at(held, (v.cls, v.typ), sol * v.members)
    return x, held


def _base_constraints(
    p: AllocationProblem, v: _Vars, caps: np.ndarray, per_tenant_caps: bool
) -> tuple[sparse.csr_matrix, np.ndarray]:
    """Capacity rows (per type, or per tenant×type) followed by per-class demand rows."""
    n = v.size
    cols = np.arange(n)
    if per_tenant_caps:
        cap_rows = p.class_tenant[v.cls] * p.n_types + v.typ
        n_cap = p.n_tenants * p.n_types
    else:
        cap_rows = v.typ
        n_cap = p.n_types
    rows = np.concatenate([cap_rows, n_cap + v.cls])
    data = np.concatenate([np.ones(n), v.members])
    a = sparse.csr_matrix((data, (rows, np.concatenate([cols, cols]))), shape=(n_cap + p.n_classes, n))
    b = np.concatenate([caps.ravel(), p.demand.astype(float)])
    return a, b


def _utility_matrix(p: AllocationProblem, v: _Vars) -> sparse.csr_matrix:
    """(T, n) matrix U with u = U @ x."""
    return sparse.csr_matrix((v.rate, (p.class_tenant[v.cls], np.arange(v.size))), shape=(p.n_tenants, v.size))


def _shares(p: AllocationProblem) -> np.ndarray:
    """Weighted equal share s_i among tenants with demand (0 for idle tenants)."""
    active = np.zeros(p.n_tenants, dtype=bool)
    active[p.class_tenant[p.demand > 0]] = True
    w = np.where(active, p.weights, 0.0)
    total = w.sum()
    return w / total if total > 0 else w


def _linprog(
    c: np.ndarray,
    a_ub: sparse.spmatrix,
    b_ub: np.ndarray,
    a_eq: sparse.spmatrix | None = None,
    b_eq: np.ndarray | None = None,
) -> tuple[np.ndarray | None, float]:
    """Minimise c·x s.t. A x <= b (and A_eq x = b_eq), x >= 0 with HiGHS.

    Returns (solution or None, seconds).
    """
    t0 = time.perf_counter()
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    return (res.x if res.status == 0 else None), time.perf_counter() - t0


def _unmet_tenants(p: AllocationProblem, v: _Vars, held: np.ndarray) -> np.ndarray:
    """(T,) True where some runnable class of the tenant holds fewer trials than it has."""
    runnable = np.zeros(p.n_classes, dtype=bool)
    runnable[v.cls] = True  # a class that fits no device type cannot want more devices
    unmet = runnable & (p.demand - held.sum(axis=1) > 1e-6 * np.maximum(1.0, p.demand))
    out = np.zeros(p.n_tenants, dtype=bool)
    out[p.class_tenant[unmet]] = True
    return out


def equal_share_utilities(p: AllocationProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """e_i for every tenant, the (C, G) equal-share devices, saturation flags and time.

    All tenants are solved in one block-diagonal LP: blocks are independent, so the
    optimum of the sum is the optimum of each block.
    """
    v = _variables(p)
    share = _shares(p)
    if v.size == 0:
        return np.zeros(p.n_tenants), np.zeros((p.n_classes, p.n_types)), np.ones(p.n_tenants, dtype=bool), 0.0
    caps = share[:, None] * p.capacity[None, :]
    a, b = _base_constraints(p, v, caps, per_tenant_caps=True)
    sol, secs = _linprog(-v.rate, a, b)
    if sol is None:  # pragma: no cover - HiGHS does not fail on this always-feasible LP
        raise RuntimeError("equal-share LP failed")
    y, held = _scatter(p, v, sol)
    e = _utility_matrix(p, v) @ sol
    return e, y, ~_unmet_tenants(p, v, held), secs


def _max_min(p: AllocationProblem, v: _Vars, e: np.ndarray, prefer: np.ndarray) -> tuple[np.ndarray | None, float]:
    """Water-filling weighted max-min of u_i / e_i, then a total-utility stage."""
    n = v.size
    u_mat = _utility_matrix(p, v)
    base_a, base_b = _base_constraints(p, v, p.capacity.astype(float), per_tenant_caps=False)
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
        rows = [sparse.hstack([base_a, sparse.csr_matrix((base_a.shape[0], 1))])]
        rhs = [base_b]
        rows.append(sparse.hstack([-u_mat[active], sparse.csr_matrix(e[active][:, None])]))
        rhs.append(np.zeros(active.size))
        fz = tenants[frozen[tenants]]
        if fz.size:
            rows.append(sparse.hstack([-u_mat[fz], sparse.csr_matrix((fz.size, 1))]))
            rhs.append(-(level[fz] * e[fz]) * (1 - 1e-8))
        obj = np.zeros(n + 1)
        obj[-1] = -1.0
        sol, s = _linprog(obj, sparse.vstack(rows).tocsr(), np.concatenate(rhs))
        secs += s
        if sol is None:
            break
        x, t = sol[:n], sol[-1]
        # Tenants whose every class is fully served cannot rise further: freeze them at
        # what they got and water-fill the rest.
        _, held = _scatter(p, v, x)
        unmet = _unmet_tenants(p, v, held)
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
    sol, s = _linprog(-v.rate - prefer, a, b)
    secs += s
    return (sol if sol is not None else x), secs


def _oef(
    p: AllocationProblem,
    v: _Vars,
    e: np.ndarray,
    saturated: np.ndarray,
    noncooperative: bool,
    prefer: np.ndarray,
) -> tuple[np.ndarray | None, float]:
    """Max total utility s.t. sharing incentive and (weighted) envy-freeness."""
    n = v.size
    T, G = p.n_tenants, p.n_types
    u_mat = _utility_matrix(p, v)
    base_a, base_b = _base_constraints(p, v, p.capacity.astype(float), per_tenant_caps=False)
    owner = p.class_tenant[v.cls]
    # Bundle per tenant and type, a[i,g] = Σ_{c∈i,k} x[c,g,k], as a (T*G, n) linear map.
    bundle = sparse.csr_matrix((np.ones(n), (owner * G + v.typ, np.arange(n))), shape=(T * G, n))
    active = np.zeros(T, dtype=bool)
    active[p.class_tenant[p.demand > 0]] = True
    value = np.zeros((T, G))
    np.maximum.at(value, (owner, v.typ), v.rate)
    w = p.weights.astype(float)
    # Sharing incentive with headroom: u_i >= (1 + h) e_i - z_i with 0 <= z_i <= h e_i,
    # so u_i >= e_i always and, where capacity allows, a little more.  The headroom
    # absorbs the integer rounding of later rounds (a realised share that dips below
    # the fractional one), the shortfall z is penalised between throughput and envy.
    act = np.flatnonzero(active)
    n_z = act.size
    eye_z = sparse.identity(n_z, format="csr")
    rows: list[sparse.spmatrix] = [
        sparse.hstack([base_a, sparse.csr_matrix((base_a.shape[0], n_z))]),
        sparse.hstack([-u_mat[act], -eye_z]),
        sparse.hstack([sparse.csr_matrix((n_z, n)), eye_z]),
    ]
    rhs: list[np.ndarray] = [base_b, -((1 + _SI_HEADROOM) * e[act] - _TOL), _SI_HEADROOM * e[act]]
    si_penalty = _SI_PENALTY * max(1.0, float(v.rate.max()))
    x_obj = np.concatenate([-v.rate - prefer, np.full(n_z, si_penalty)])
    n_x = n + n_z
    enviers = np.flatnonzero(active & ~saturated)
    others = np.flatnonzero(active)
    if enviers.size and others.size > 1:
        pairs_i, pairs_j = np.meshgrid(enviers, others, indexing="ij")
        keep = pairs_i != pairs_j
        pi, pj = pairs_i[keep], pairs_j[keep]
        if noncooperative:
            # One row per (i, j, g): a_j[g]/w_j - a_i[g]/w_i <= 0.
            pi_g = np.repeat(pi, G)
            pj_g = np.repeat(pj, G)
            gg = np.tile(np.arange(G), pi.size)
            # A type the envier cannot use at all is worthless to it under any valuation.
            usable = value[pi_g, gg] > 0
            pi_g, pj_g, gg = pi_g[usable], pj_g[usable], gg[usable]
            m = pi_g.size
            coef = sparse.csr_matrix(
                (
                    np.concatenate([np.full(m, -1.0) / w[pi_g], np.full(m, 1.0) / w[pj_g]]),
                    (np.concatenate([np.arange(m)] * 2), np.concatenate([pi_g * G + gg, pj_g * G + gg])),
                ),
                shape=(m, T * G),
            )
        else:
            # One row per (i, j): Σ_g v_i[g] (a_j[g]/w_j - a_i[g]/w_i) <= 0.
            m = pi.size
            r = np.repeat(np.arange(m), G)
            gi = np.tile(np.arange(G), m)
            vi = value[np.repeat(pi, G), gi]
            coef = sparse.csr_matrix(
                (
                    np.concatenate([-vi / w[np.repeat(pi, G)], vi / w[np.repeat(pj, G)]]),
                    (np.concatenate([r, r]), np.concatenate([np.repeat(pi, G) * G + gi, np.repeat(pj, G) * G + gi])),
                ),
                shape=(m, T * G),
            )
        # The bundles a[i, g] get variables of their own (tied to x by equalities) so each
        # envy row touches 2G bundle entries instead of every variable of two tenants.
        # Demand caps can make exact envy-freeness and sharing incentive jointly
        # infeasible (a tenant that can use only 3 devices "envies" a 4-device bundle it
        # could not use), so every envier i gets one slack s_i >= its envy of anyone,
        # with a penalty that dominates any throughput gain: the LP always has a
        # solution, is exactly envy-free whenever demand allows, and otherwise minimises
        # the envy.
        n_a = T * G
        slack_of = {int(i): k for k, i in enumerate(enviers)}
        m = coef.shape[0]
        row_envier = pi if not noncooperative else pi_g
        n_s = enviers.size
        s_col = sparse.csr_matrix(
            (np.full(m, -1.0), (np.arange(m), [slack_of[int(i)] for i in row_envier])), shape=(m, n_s)
        )
        ub = [sparse.hstack([r, sparse.csr_matrix((r.shape[0], n_a + n_s))]) for r in rows]
        ub.append(sparse.hstack([sparse.csr_matrix((m, n_x)), coef, s_col]))
        rhs.append(np.full(m, _TOL))
        a_eq = sparse.hstack(
            [bundle, sparse.csr_matrix((n_a, n_z)), -sparse.identity(n_a, format="csr"), sparse.csr_matrix((n_a, n_s))]
        ).tocsr()
        penalty = _ENVY_PENALTY * max(1.0, float(v.rate.max()))
        obj = np.concatenate([x_obj, np.zeros(n_a), np.full(n_s, penalty)])
        sol, secs = _linprog(obj, sparse.vstack(ub).tocsr(), np.concatenate(rhs), a_eq, np.zeros(n_a))
        return (sol[:n] if sol is not None else None), secs
    sol, secs = _linprog(x_obj, sparse.vstack(rows).tocsr(), np.concatenate(rhs))
    return (sol[:n] if sol is not None else None), secs


def solve_allocation(
    p: AllocationProblem,
    policy: FairnessPolicy,
    incumbent: np.ndarray | None = None,
) -> Allocation:
    """Solve one round's fractional allocation under ``policy``.

    ``incumbent`` (C, G) marks where classes run now; among allocations of (nearly)
    equal value the LP then prefers those, so degenerate LPs do not reshuffle devices
    from one round to the next (a tie-break worth 0.1% of a device's rate).

    If HiGHS fails (numerically degenerate instance), the equal-share solution is used:
    it is always feasible and satisfies the sharing incentive.
    """
    if policy not in ("max_min", "oef", "oef_noncooperative"):
        raise ValueError(f"unknown fairness policy {policy!r}")
    v = _variables(p)
    sol: np.ndarray | None = None
    prefer = np.zeros(v.size)
    if incumbent is not None and v.size:
        prefer = _STICKINESS * float(v.rate.mean()) * (np.asarray(incumbent)[v.cls, v.typ] > 0)
    if v.size and np.unique(p.class_tenant[p.demand > 0]).size == 1:
        # One tenant with demand: its equal share is every device, so the sharing incentive
        # and envy-freeness hold for any allocation and every policy is the max-utility LP
        # over the whole cluster, the equal-share LP itself: solved once (with the incumbent
        # tie-break) instead of twice. A sweep of one user pays this every scheduling round.
        caps = _shares(p)[:, None] * p.capacity[None, :]
        a, b = _base_constraints(p, v, caps, per_tenant_caps=True)
        sol, secs = _linprog(-(v.rate + prefer), a, b)
        if sol is not None:
            sol = np.maximum(sol, 0.0)
            x, held = _scatter(p, v, sol)
            e = np.asarray(_utility_matrix(p, v) @ sol).ravel()
            return _allocation(p, v, sol, x, held, e, ~_unmet_tenants(p, v, held), secs)
    e, _, saturated, secs = equal_share_utilities(p)
    if v.size:
        if policy == "max_min":
            sol, s = _max_min(p, v, e, prefer)
        else:
            noncoop = policy == "oef_noncooperative"
            sol, s = _oef(p, v, e, saturated, noncoop, prefer)
        secs += s
        if sol is None:
            # Re-solve the equal-share LP's vector form (cheap, always feasible).
            caps = _shares(p)[:, None] * p.capacity[None, :]
            a, b = _base_constraints(p, v, caps, per_tenant_caps=True)
            sol, s = _linprog(-v.rate, a, b)
            secs += s
    sol = np.maximum(sol, 0.0) if sol is not None else np.zeros(v.size)
    x, held = _scatter(p, v, sol)
    return _allocation(p, v, sol, x, held, e, saturated, secs)


def _allocation(
    p: AllocationProblem, v: _Vars, sol: np.ndarray, x: np.ndarray, held: np.ndarray,
    e: np.ndarray, saturated: np.ndarray, secs: float,
) -> Allocation:
    u = np.asarray(_utility_matrix(p, v) @ sol).ravel() if v.size else np.zeros(p.n_tenants)
    with np.errstate(divide="ignore", invalid="ignore"):
        members = np.where(x > 1e-9, held / np.where(x > 1e-9, x, 1.0), 0.0)
    return Allocation(
        devices=x,
        members=members,
        utility=u,
        equal_share=e,
        saturated=saturated,
        unmet=_unmet_tenants(p, v, held),
        solver_seconds=secs,
    )
