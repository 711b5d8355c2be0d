"""fusetune scheduler: which trials are fused together, and where each array runs.

Public surface (everything else lives in private modules). Classes of trials are opaque
strings here: the fusion key that makes them (``workers/signature.py``) takes torch, which the
scheduler never imports.

* :class:`PendingTrial`, :class:`ArrayPlan`, :func:`pack` -- balanced packing.
* :class:`Device`, :class:`Tenant`, :class:`Placement`, :class:`Decision` -- round I/O.
* :class:`ThroughputModel`, :class:`SpeedupCurve`, :func:`fit_curve` -- fused-array
  speed: documented prior, dry-run seeds, fits to measured arrays, online updates.
* :class:`Scheduler`, :func:`make_scheduler`, ``POLICIES`` -- the per-round decision.
* :class:`AllocationProblem`, :class:`Allocation`, :func:`solve_allocation` -- the LPs.
"""

from fusetune.scheduler._allocation import Allocation, AllocationProblem, FairnessPolicy, solve_allocation
from fusetune.scheduler._packing import ArrayPlan, PendingTrial, pack
from fusetune.scheduler._scheduler import POLICIES, PolicyName, Scheduler, make_scheduler
from fusetune.scheduler._throughput import SpeedupCurve, ThroughputModel, fit_curve, fit_points
from fusetune.scheduler._types import Decision, Device, Placement, Tenant

__all__ = [
    "Allocation",
    "AllocationProblem",
    "ArrayPlan",
    "Decision",
    "Device",
    "FairnessPolicy",
    "POLICIES",
    "PendingTrial",
    "Placement",
    "PolicyName",
    "Scheduler",
    "SpeedupCurve",
    "Tenant",
    "ThroughputModel",
    "fit_curve",
    "fit_points",
    "make_scheduler",
    "pack",
    "solve_allocation",
]
