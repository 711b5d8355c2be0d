"""fusetune scheduler: which trials are fused together, and where each array runs.

Public surface (everything else lives in private modules):

* :func:`shape_signature`, :class:`Signature`, :func:`fusible_params` -- fusion keys.
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
from fusetune.scheduler._signature import Signature, fusible_params, shape_signature
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
    "Signature",
    "SpeedupCurve",
    "Tenant",
    "ThroughputModel",
    "fit_curve",
    "fit_points",
    "fusible_params",
    "make_scheduler",
    "pack",
    "shape_signature",
    "solve_allocation",
]
