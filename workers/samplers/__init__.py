"""FusionSampler: any Optuna sampler's trials, grouped so that they fuse.

It samples the params that change a trial's fusion key (``workers/signature.py``) once per
group of trials asked together, the others per trial. Its home is beside the key it reads:
the scheduling loop wraps every study's sampler in it, and the client offers it to plain
Optuna as ``fusetune.client.FusionSampler`` (``client/samplers``, its documentation).

Importing this package needs only Optuna; :meth:`FusionSampler.for_workload` and
:func:`non_fusible_params` import torch and the workload's code when called.
"""

from ._fusion import ATTR, FusionSampler, fusion_group
from ._workload import non_fusible_params

__all__ = ["ATTR", "FusionSampler", "fusion_group", "non_fusible_params"]
