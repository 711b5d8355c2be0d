"""Optuna samplers for fusetune: :class:`FusionSampler` makes any sampler's trials fuse.

Importing this package needs only Optuna; :meth:`FusionSampler.for_workload` and
:func:`non_fusible_params` import torch and fusetune's server code when called.
"""

from ._fusion import ATTR, FusionSampler, fusion_group
from ._workload import non_fusible_params

__all__ = ["ATTR", "FusionSampler", "fusion_group", "non_fusible_params"]
