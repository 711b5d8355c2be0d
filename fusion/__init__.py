"""fusion: train B copies of one model as a single horizontally fused model.

Typical use::

    fused = fusion.fuse(models)                       # B models, same class and shapes
    opt = fusion.optim.Adam(fused.parameters(), lr=[1e-3, 3e-4, ...])
    out = fused(fusion.broadcast(x, fused.num_members))  # [B, N, ...]
    fusion.per_member_loss(F.cross_entropy, out, fusion.broadcast(y, B)).sum().backward()
    opt.step()
    state_dict_of_member_2 = fused.member_state_dict(2)

Which models can share one fused model is decided by one rule, :func:`layout`:
models of the same class that can each be fused fuse together iff their layouts
(per submodule: class, parameter and buffer shapes, shared attributes) are
equal. ``fuse`` enforces it and the scheduler's shape signature hashes it.
"""

from . import amp, lr_scheduler, optim, sizing
from ._allocator import reuse_cpu_memory
from ._errors import FusionError, FusionWarning
from ._functional import broadcast, clip_grad_norm_, per_member_loss
from ._imports import import_torch_dynamo
from ._layout import ModuleLayout, layout
from ._model import FusedModel, fuse, fuse_from_state_dicts, fuse_seeded

__all__ = [
    "FusedModel",
    "ModuleLayout",
    "amp",
    "FusionError",
    "FusionWarning",
    "broadcast",
    "clip_grad_norm_",
    "fuse",
    "fuse_from_state_dicts",
    "fuse_seeded",
    "import_torch_dynamo",
    "layout",
    "lr_scheduler",
    "optim",
    "per_member_loss",
    "reuse_cpu_memory",
    "sizing",
]
