"""The allocation instance and the LP pieces every fairness policy is built from.

Unit of allocation: a *class* is the set of a tenant's trials that share one signature
(they are interchangeable and fuse together).  ``x[c, g, k]`` is the (fractional) number
of devices of type ``g`` that class ``c`` holds on average with array option ``k``; each
such device runs one array of ``members[c, g, k]`` trials and yields ``rate[c, g, k]``
units of *normalised* throughput (models·steps/s divided by the signature's best solo
steps/s on any type, so one unfused trial on its best device type = 1.0).

Tenant ``i``'s utility is ``u_i(x) = Σ_{c∈i, g, k} rate[c,g,k] · x[c,g,k]``.  Its *equal
share* is ``s_i = w_i / Σ_{active} w`` of every device type, and ``e_i`` is the best
utility it could reach alone inside that share.  The policies themselves live in
:mod:`scheduler._allocation` (LP policies) and :mod:`scheduler._exchange` (the
non-cooperative mechanism); this module holds what they share.  Everything is solved
with scipy's HiGHS.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

__all__ = ["AllocationProblem", "equal_share_utilities"]

_DEMAND_RTOL = 1e-6  # a class holding all but this fraction of its trials is fully served


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
        prices: (G,) public price of one device of each type, or None (all equal).  Only
            the non-cooperative exchange uses it: tenants trade devices at these fixed
            rates, which must not come from what the tenants report.
    """

    weights: np.ndarray
    capacity: np.ndarray
    class_tenant: np.ndarray
    rate: np.ndarray
    members: np.ndarray
    demand: np.ndarray
    prices: np.ndarray | None = None

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
class Vars:
    """The usable LP variables: (class, type, option) triples with their rate/members."""

    cls: np.ndarray
    typ: np.ndarray
    opt: np.ndarray
    rate: np.ndarray
    members: np.ndarray

    @property
    def size(self) -> int:
        return int(self.cls.shape[0])


def variables(p: AllocationProblem) -> Vars:
    """Usable variables: members > 0, rate > 0 and the class has demand."""
    usable = (p.members > 0) & (p.rate > 0) & (p.demand[:, None, None] > 0)
    cls, typ, opt = np.nonzero(usable)
    return Vars(cls, typ, opt, p.rate[cls, typ, opt], p.members[cls, typ, opt].astype(float))


def scatter(p: AllocationProblem, v: Vars, sol: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(C, G) devices and (C, G) trials held, from a solution vector over ``v``."""
    x = np.zeros((p.n_classes, p.n_types))
    held = np.zeros((p.n_classes, p.n_types))
    np.add.at(x, (v.cls, v.typ), sol)
    np.add.at(held, (v.cls, v.typ), sol * v.members)
    return x, held


def base_constraints(
    p: AllocationProblem, v: Vars, caps: np.ndarray, per_tenant_caps: bool
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


def utility_matrix(p: AllocationProblem, v: Vars) -> sparse.csr_matrix:
    """(T, n) matrix U with u = U @ x."""
    return sparse.csr_matrix((v.rate, (p.class_tenant[v.cls], np.arange(v.size))), shape=(p.n_tenants, v.size))


def active_tenants(p: AllocationProblem) -> np.ndarray:
    """(T,) True for tenants with at least one class with demand."""
    active = np.zeros(p.n_tenants, dtype=bool)
    active[p.class_tenant[p.demand > 0]] = True
    return active


def shares(p: AllocationProblem) -> np.ndarray:
    """Weighted equal share s_i among tenants with demand (0 for idle tenants)."""
    w = np.where(active_tenants(p), p.weights, 0.0)
    total = w.sum()
    return w / total if total > 0 else w


def solve_lp(
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


def short_classes(p: AllocationProblem, v: Vars, held: np.ndarray) -> np.ndarray:
    """(C,) True for runnable classes that hold fewer trials than they have.

    A class that fits no device type cannot want more devices, so it is never short.
    """
    runnable = np.zeros(p.n_classes, dtype=bool)
    runnable[v.cls] = True
    return runnable & (p.demand - held.sum(axis=1) > _DEMAND_RTOL * np.maximum(1.0, p.demand))


def unmet_tenants(p: AllocationProblem, v: Vars, held: np.ndarray) -> np.ndarray:
    """(T,) True where some runnable class of the tenant holds fewer trials than it has."""
    out = np.zeros(p.n_tenants, dtype=bool)
    out[p.class_tenant[short_classes(p, v, held)]] = True
    return out


def best_use(p: AllocationProblem, v: Vars, caps: np.ndarray) -> tuple[np.ndarray | None, float]:
    """Each tenant's best use of its own (T, G) device bundle ``caps``: one block LP.

    Blocks are independent, so the optimum of the sum is every tenant's own optimum.
    """
    a, b = base_constraints(p, v, caps, per_tenant_caps=True)
    return solve_lp(-v.rate, a, b)


@dataclass(frozen=True)
class EqualShare:
    """The equal-share solution: what every tenant could do alone in its share.

    Attributes:
        utility: (T,) e_i.
        devices: (C, G) devices each class uses inside its tenant's share.
        short: (C,) classes their tenant's share cannot hold in full.
        saturated: (T,) tenants whose share holds every trial they have.
        seconds: HiGHS time.
    """

    utility: np.ndarray
    devices: np.ndarray
    short: np.ndarray
    saturated: np.ndarray
    seconds: float


def equal_share(p: AllocationProblem, v: Vars) -> EqualShare:
    """Solve the equal-share LP: :func:`best_use` of every tenant's weighted share."""
    if v.size == 0:
        return EqualShare(
            np.zeros(p.n_tenants), np.zeros((p.n_classes, p.n_types)), np.zeros(p.n_classes, dtype=bool),
            np.ones(p.n_tenants, dtype=bool), 0.0,
        )
    sol, secs = best_use(p, v, shares(p)[:, None] * p.capacity[None, :])
    if sol is None:  # pragma: no cover - HiGHS does not fail on this always-feasible LP
        raise RuntimeError("equal-share LP failed")
    y, held = scatter(p, v, sol)
    return EqualShare(utility_matrix(p, v) @ sol, y, short_classes(p, v, held), ~unmet_tenants(p, v, held), secs)


def equal_share_utilities(p: AllocationProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """e_i for every tenant, the (C, G) equal-share devices, saturation flags and time."""
    es = equal_share(p, variables(p))
    return es.utility, es.devices, es.saturated, es.seconds
