"""Fractional allocation: the fairness policies, solved as linear programs with HiGHS.

Unit of allocation: a *class* is the set of a tenant's trials that share one signature
(they are interchangeable and fuse together).  ``x[c, g]`` is the (fractional) number of
devices of type ``g`` that class ``c`` holds on average; each such device runs one array
of ``members[c, g]`` trials and yields ``rate[c, g]`` units of *normalised* throughput
(models·steps/s divided by the signature's best solo steps/s on any type, so one unfused
trial on its best device type = 1.0, and different job types add up meaningfully).

Tenant ``i``'s utility is ``u_i(x) = Σ_{c∈i, g} rate[c,g] · x[c,g]``.  Its *equal share*
is ``s_i = w_i / Σ_{active} w`` of every device type (a weight replicates the share), and
``e_i`` is the best utility it could reach alone inside that share.

Policies (all LPs over ``x`` with capacity ``Σ_c x[c,g] ≤ N_g`` and demand
``Σ_g members[c,g] · x[c,g] ≤ n_c``):

* ``max_min`` (Gavel, OSDI'20): maximise ``min_i u_i / e_i`` by water-filling (tenants
  whose demand is met are frozen and the rest raised further), then maximise total
  utility without lowering anyone's level.
* ``oef`` (OEF, Middleware'24): maximise ``Σ_i u_i`` subject to sharing incentive
  ``u_i ≥ e_i`` and envy-freeness ``v_i·a_i / w_i ≥ v_i·a_j / w_j`` for every tenant
  ``i`` whose demand its equal share does not already meet, where ``a_i[g] = Σ_{c∈i}
  x[c,g]`` is i's bundle and ``v_i[g] = max_{c∈i} rate[c,g]`` its per-device value.
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


@dataclass(frozen=True)
class AllocationProblem:
    """One round's allocation instance (arrays indexed by class ``c`` and type ``g``).

    Attributes:
        weights: (T,) tenant weights, > 0.
        capacity: (G,) devices of each type.
        class_tenant: (C,) tenant index of each class.
        rate: (C, G) normalised throughput of one device of type g running class c.
        members: (C, G) trials one such device holds (0: class cannot run on type g).
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
        devices: (C, G) x, devices of each type per class.
        utility: (T,) u_i(x).
        equal_share: (T,) e_i, best utility within the weighted equal share.
        saturated: (T,) True where the equal share already meets the tenant's demand.
        solver_seconds: wall time spent in HiGHS for this allocation.
    """

    devices: np.ndarray
    utility: np.ndarray
    equal_share: np.ndarray
    saturated: np.ndarray
    solver_seconds: float


def _variables(p: AllocationProblem) -> tuple[np.ndarray, np.ndarray]:
    """(class, type) index pairs of the usable variables (members > 0 and demand > 0)."""
    usable = (p.members > 0) & (p.rate > 0) & (p.demand[:, None] > 0)
    cls, typ = np.nonzero(usable)
    return cls, typ


def _base_constraints(
    p: AllocationProblem, cls: np.ndarray, typ: np.ndarray, caps: np.ndarray, per_tenant_caps: bool
) -> tuple[sparse.csr_matrix, np.ndarray]:
    """Capacity rows (per type, or per tenant×type) followed by per-class demand rows."""
    n = cls.shape[0]
    cols = np.arange(n)
    if per_tenant_caps:
        cap_rows = p.class_tenant[cls] * p.n_types + typ
        n_cap = p.n_tenants * p.n_types
    else:
        cap_rows = typ
        n_cap = p.n_types
    rows = np.concatenate([cap_rows, n_cap + cls])
    data = np.concatenate([np.ones(n), p.members[cls, typ].astype(float)])
    a = sparse.csr_matrix((data, (rows, np.concatenate([cols, cols]))), shape=(n_cap + p.n_classes, n))
    b = np.concatenate([caps.ravel(), p.demand.astype(float)])
    return a, b


def _utility_matrix(p: AllocationProblem, cls: np.ndarray, typ: np.ndarray) -> sparse.csr_matrix:
    """(T, n) matrix U with u = U @ x."""
    n = cls.shape[0]
    return sparse.csr_matrix(
        (p.rate[cls, typ], (p.class_tenant[cls], np.arange(n))), shape=(p.n_tenants, n)
    )


def _shares(p: AllocationProblem) -> np.ndarray:
    """Weighted equal share s_i among tenants with demand (0 for idle tenants)."""
    active = np.zeros(p.n_tenants, dtype=bool)
    active[p.class_tenant[p.demand > 0]] = True
    w = np.where(active, p.weights, 0.0)
    total = w.sum()
    return w / total if total > 0 else w


def _linprog(c: np.ndarray, a_ub: sparse.spmatrix, b_ub: np.ndarray) -> tuple[np.ndarray | None, float]:
    """Minimise c·x s.t. A x <= b, x >= 0 with HiGHS; (solution or None, seconds)."""
    t0 = time.perf_counter()
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=(0, None), method="highs")
    return (res.x if res.status == 0 else None), time.perf_counter() - t0


def equal_share_utilities(p: AllocationProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """e_i for every tenant, the per-class equal-share solution, saturation flags and time.

    All tenants are solved in one block-diagonal LP: blocks are independent, so the
    optimum of the sum is the optimum of each block.
    """
    cls, typ = _variables(p)
    share = _shares(p)
    e = np.zeros(p.n_tenants)
    y = np.zeros((p.n_classes, p.n_types))
    saturated = np.ones(p.n_tenants, dtype=bool)
    if cls.size == 0:
        return e, y, saturated, 0.0
    caps = share[:, None] * p.capacity[None, :]
    a, b = _base_constraints(p, cls, typ, caps, per_tenant_caps=True)
    sol, secs = _linprog(-p.rate[cls, typ], a, b)
    if sol is None:  # pragma: no cover - HiGHS does not fail on this always-feasible LP
        raise RuntimeError("equal-share LP failed")
    y[cls, typ] = sol
    e = _utility_matrix(p, cls, typ) @ sol
    served = (p.members * y).sum(axis=1)
    runnable = np.zeros(p.n_classes, dtype=bool)
    runnable[cls] = True  # a class that fits no device type cannot want more devices
    unmet = runnable & (p.demand - served > 1e-6 * np.maximum(1.0, p.demand))
    saturated[p.class_tenant[unmet]] = False
    return e, y, saturated, secs


def _max_min(p: AllocationProblem, cls: np.ndarray, typ: np.ndarray, e: np.ndarray) -> tuple[np.ndarray | None, float]:
    """Water-filling weighted max-min of u_i / e_i, then a total-utility stage."""
    n = cls.shape[0]
    u_mat = _utility_matrix(p, cls, typ)
    base_a, base_b = _base_constraints(p, cls, typ, p.capacity.astype(float), per_tenant_caps=False)
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
        sel = -u_mat[active]
        rows.append(sparse.hstack([sel, sparse.csr_matrix(e[active][:, None])]))
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
        served = np.zeros(p.n_classes)
        np.add.at(served, cls, p.members[cls, typ] * x)
        unmet_tenants = np.zeros(p.n_tenants, dtype=bool)
        unmet_tenants[p.class_tenant[p.demand - served > 1e-6 * np.maximum(1.0, p.demand)]] = True
        newly = active[~unmet_tenants[active]]
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
    sol, s = _linprog(-np.asarray(u_mat.sum(axis=0)).ravel(), a, b)
    secs += s
    return (sol if sol is not None else x), secs


def _oef(
    p: AllocationProblem,
    cls: np.ndarray,
    typ: np.ndarray,
    e: np.ndarray,
    saturated: np.ndarray,
    noncooperative: bool,
) -> tuple[np.ndarray | None, float]:
    """Max total utility s.t. sharing incentive and (weighted) envy-freeness."""
    n = cls.shape[0]
    T, G = p.n_tenants, p.n_types
    u_mat = _utility_matrix(p, cls, typ)
    base_a, base_b = _base_constraints(p, cls, typ, p.capacity.astype(float), per_tenant_caps=False)
    # Bundle per tenant and type, a[i,g] = Σ_{c∈i} x[c,g], as a (T*G, n) linear map.
    bundle = sparse.csr_matrix(
        (np.ones(n), (p.class_tenant[cls] * G + typ, np.arange(n))), shape=(T * G, n)
    )
    active = np.zeros(T, dtype=bool)
    active[p.class_tenant[p.demand > 0]] = True
    value = np.zeros((T, G))
    np.maximum.at(value, (p.class_tenant[cls], typ), p.rate[cls, typ])
    w = p.weights.astype(float)
    rows: list[sparse.spmatrix] = [base_a, -u_mat[active]]
    rhs: list[np.ndarray] = [base_b, -(e[active] - _TOL)]
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
        rows.append(coef @ bundle)
        rhs.append(np.full(coef.shape[0], _TOL))
    obj = -np.asarray(u_mat.sum(axis=0)).ravel()
    return _linprog(obj, sparse.vstack(rows).tocsr(), np.concatenate(rhs))


def solve_allocation(p: AllocationProblem, policy: FairnessPolicy) -> Allocation:
    """Solve one round's fractional allocation under ``policy``.

    If HiGHS reports a failure (numerically degenerate instance), the equal-share
    solution is returned: it is always feasible and satisfies sharing incentive and
    envy-freeness by construction.
    """
    e, y, saturated, secs = equal_share_utilities(p)
    cls, typ = _variables(p)
    x = np.zeros((p.n_classes, p.n_types))
    if cls.size:
        if policy == "max_min":
            sol, s = _max_min(p, cls, typ, e)
        elif policy in ("oef", "oef_noncooperative"):
            sol, s = _oef(p, cls, typ, e, saturated, noncooperative=policy == "oef_noncooperative")
        else:
            raise ValueError(f"unknown fairness policy {policy!r}")
        secs += s
        if sol is None:
            x = y
        else:
            x[cls, typ] = np.maximum(sol, 0.0)
    u = np.zeros(p.n_tenants)
    np.add.at(u, p.class_tenant, (p.rate * x).sum(axis=1))
    return Allocation(devices=x, utility=u, equal_share=e, saturated=saturated, solver_seconds=secs)
