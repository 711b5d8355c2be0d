"""fusetune scheduler: which trials are fused together, and where each array runs.

Public surface (everything else lives in private modules):

* :func:`shape_signature`, :class:`Signature`, :func:`fusible_params` -- fusion keys.
* :class:`PendingTrial`, :class:`ArrayPlan`, :func:`pack` -- balanced packing.
"""

from scheduler._packing import ArrayPlan, PendingTrial, pack
from scheduler._signature import Signature, fusible_params, shape_signature

__all__ = [
    "ArrayPlan",
    "PendingTrial",
    "Signature",
    "fusible_params",
    "pack",
    "shape_signature",
]
