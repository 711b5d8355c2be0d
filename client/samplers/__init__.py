"""Optuna samplers for fusetune: :class:`FusionSampler` makes any sampler's trials fuse.

The sampler itself lives beside the fusion key it reads (``workers/samplers``), where the
service's scheduling loop uses it too; this is where a plain Optuna user finds it
(``README.md`` here). Importing it needs only Optuna.
"""

from fusetune.workers.samplers import ATTR, FusionSampler, fusion_group, non_fusible_params

__all__ = ["ATTR", "FusionSampler", "fusion_group", "non_fusible_params"]
