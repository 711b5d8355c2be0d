"""The non-cooperative mechanism: demand-capped equal shares, then fixed-price exchanges.

OEF's non-cooperative setting: tenants report their speed-ups themselves and may lie to
get more.  A mechanism is *strategy-proof* when no report gains a tenant more (true)
throughput than the truth.  This one is, for tenants running one job type unfused (the
paper's model: a linear valuation per tenant), and it also gives every tenant the
sharing incentive and envy-freeness among backlogged single-type tenants.  It is our
construction in that setting, not a transcription of the paper's formulation:

1. **Shares** (:func:`_water_fill`).  Every tenant with demand starts from its weighted
   equal share of every type.  A tenant whose share holds all its trials (*saturated*,
   decided by trial and device counts, not by speeds) keeps the devices its best use
   needs and releases the rest, which is shared again among the others in proportion
   to weight; repeated until nobody else saturates.  The unsaturated tenants then hold
   the same bundle per unit of weight (the *endowment*).
2. **Exchanges** (:func:`_trades`).  For every pair of types (lo, hi), ordered by a
   public price per device (``AllocationProblem.prices``, never from reports; all equal
   when absent), each unsaturated tenant with one job type puts a fixed slice of its
   endowment, ``1/(G−1)`` of each type (G: the types present), into that pair's
   market; a tenant with several job types keeps its endowment.  A tenant whose reported value per price is
   higher on hi sells lo for hi at the price ratio, the others the other way; the short
   side trades in full and the long side is rationed by the weighted uniform rule.
   A trade that adds devices is capped by the tenant's trials (its *headroom*, split
   evenly over the markets), so a backlogged tenant can always use what it gets.
3. Each tenant's bundle is then used as well as its reports allow (one block LP).

Why no misreport pays: a saturated tenant's bundle is its best pick from a share that
its report does not change.  An unsaturated tenant's endowment, slices and trade caps
depend on counts and on others' reports only; its report only sets its side in each
market.  Its true utility is linear in its bundle (it can use every device: headroom),
so it is its endowment's value plus one gain per market; on its true side a market's
gain is ≥ 0 whatever the others do, on the other side ≤ 0.  Markets trade disjoint
slices, so one market's side cannot buy a better ration in another.
(``tests/scheduler/test_exchange.py`` checks this with random misreports.)
"""

from __future__ import annotations

import itertools

import numpy as np

from fusetune.scheduler._lp import (
    AllocationProblem,
    Vars,
    active_tenants,
    best_use,
    scatter,
    unmet_tenants,
)

__all__ = ["exchange"]

_REL_TOL = 1e-9


def _tenant_devices(p: AllocationProblem, x: np.ndarray) -> np.ndarray:
    """(T, G) devices each tenant uses, from (C, G) class devices."""
    out = np.zeros((p.n_tenants, p.n_types))
    np.add.at(out, p.class_tenant, x)
    return out


def _water_fill(p: AllocationProblem, v: Vars) -> tuple[np.ndarray, np.ndarray, float]:
    """Demand-capped weighted equal shares: (T, G) bundles, unsaturated flags, seconds."""
    w = p.weights.astype(float)
    unsat = active_tenants(p)
    bundle = np.zeros((p.n_tenants, p.n_types))
    if not unsat.any():
        return bundle, unsat, 0.0
    level = p.capacity / w[unsat].sum()  # devices per unit of weight, per type
    secs = 0.0
    for _ in range(p.n_tenants):
        caps = np.where(unsat[:, None], w[:, None] * level[None, :], bundle)
        sol, s = best_use(p, v, caps)
        secs += s
        if sol is None:  # pragma: no cover - always feasible
            break
        used = _tenant_devices(p, scatter(p, v, sol)[0])
        newly = unsat & ~unmet_tenants(p, v, scatter(p, v, sol)[1])
        if not newly.any():
            break
        bundle[newly] = np.minimum(used[newly], caps[newly])
        released = (caps[newly] - bundle[newly]).sum(axis=0)
        unsat &= ~newly
        if not unsat.any():
            break
        level = level + released / w[unsat].sum()
    bundle[unsat] = w[unsat, None] * level[None, :]
    return bundle, unsat, secs


def _uniform_rule(limits: np.ndarray, weights: np.ndarray, total: float) -> np.ndarray:
    """Split ``total`` as ``min(limit_i, λ w_i)`` with one λ (the weighted uniform rule)."""
    out = np.zeros_like(limits)
    if total <= 0 or limits.size == 0:
        return out
    left, wsum = float(total), float(weights.sum())
    for i in np.argsort(limits / weights, kind="stable"):
        if wsum <= 0:
            break
        if limits[i] * wsum <= left * weights[i]:  # capped below the common level
            out[i] = limits[i]
            left -= limits[i]
            wsum -= weights[i]
        else:
            out[i] = left * weights[i] / wsum
            left -= out[i]
            wsum -= weights[i]
    return out


def _values(p: AllocationProblem, v: Vars) -> np.ndarray:
    """(T, G) a tenant's reported value of one device of each type: its class's best rate.

    (Only tenants with one class trade; for the others this is the demand-weighted mean
    of their classes' values, unused.)
    """
    per_class = np.zeros((p.n_classes, p.n_types))
    np.maximum.at(per_class, (v.cls, v.typ), v.rate)
    trials = np.bincount(p.class_tenant, weights=p.demand, minlength=p.n_tenants)
    out = np.zeros((p.n_tenants, p.n_types))
    np.add.at(out, p.class_tenant, per_class * p.demand[:, None])
    return out / np.maximum(trials, 1e-12)[:, None]


def _trades(p: AllocationProblem, v: Vars, endow: np.ndarray, unsat: np.ndarray) -> np.ndarray:
    """(T, G) net devices each trading tenant gains in the pairwise markets.

    Traders are the unsaturated tenants with one job type (one class with demand): a
    linear valuation describes them exactly.  A tenant with several job types keeps its
    endowment (a trade priced by one averaged valuation could cost it throughput).
    """
    kinds = np.bincount(p.class_tenant[p.demand > 0], minlength=p.n_tenants)
    unsat = unsat & (kinds == 1)
    prices = np.ones(p.n_types) if p.prices is None else np.asarray(p.prices, dtype=float)
    w = p.weights.astype(float)
    value = _values(p, v)
    trials = np.bincount(p.class_tenant, weights=p.demand, minlength=p.n_tenants)
    present = [g for g in np.argsort(prices, kind="stable") if p.capacity[g] > 0]
    markets = list(itertools.combinations(present, 2))
    headroom = np.maximum(trials - endow.sum(axis=1), 0.0) / max(len(markets), 1)
    piece = 1.0 / max(len(present) - 1, 1)  # each type's endowment is split over its markets
    delta = np.zeros_like(endow)
    for lo, hi in markets:
        ratio = prices[hi] / prices[lo]
        per_lo, per_hi = value[:, lo] / prices[lo], value[:, hi] / prices[hi]
        buys_hi = unsat & (per_hi > per_lo * (1 + _REL_TOL))
        buys_lo = unsat & (per_lo > per_hi * (1 + _REL_TOL))
        sell_lo = prices[lo] * endow[:, lo] * piece  # value a hi-buyer can sell
        cap = headroom / (ratio - 1) if ratio > 1 + _REL_TOL else np.full(p.n_tenants, np.inf)
        sell_hi = prices[hi] * np.minimum(endow[:, hi] * piece, cap)  # value a lo-buyer can sell
        volume = min(sell_lo[buys_hi].sum(), sell_hi[buys_lo].sum())
        t_hi = np.zeros(p.n_tenants)
        t_lo = np.zeros(p.n_tenants)
        t_hi[buys_hi] = _uniform_rule(sell_lo[buys_hi], w[buys_hi], volume)
        t_lo[buys_lo] = _uniform_rule(sell_hi[buys_lo], w[buys_lo], volume)
        delta[:, lo] += (t_lo - t_hi) / prices[lo]
        delta[:, hi] += (t_hi - t_lo) / prices[hi]
    return delta


def exchange(p: AllocationProblem, v: Vars) -> tuple[np.ndarray | None, float]:
    """The non-cooperative allocation as a solution vector over ``v`` (and seconds)."""
    endow, unsat, secs = _water_fill(p, v)
    bundles = endow + _trades(p, v, endow, unsat)
    sol, s = best_use(p, v, np.maximum(bundles, 0.0))
    return sol, secs + s
