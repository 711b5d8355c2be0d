"""Fused Dropout/Dropout1d/2d/3d with a dropout probability per member."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from ._base import FusedLayer, check_same_config

_FEATURE_FN: dict[type[nn.Module], Callable[..., torch.Tensor]] = {nn.Dropout1d: F.dropout1d, nn.Dropout2d: F.dropout2d, nn.Dropout3d: F.dropout3d}


class Dropout(FusedLayer):
    """B dropout layers whose ``p`` may differ (a tuned hyper-parameter).

    Masks are drawn from the global RNG like torch's, but not in the same
    order as B separate models would draw them, so fused dropout matches
    separate training in distribution, not sample by sample.
    """

    needs_batch_probe = True
    per_member_attrs = frozenset({"p"})

    def __init__(self, num_members: int, kind: type[nn.Module], p: list[float], inplace: bool) -> None:
        super().__init__(num_members)
        self.kind = kind
        # Elementwise dropout treats any input alike; the channel-wise kinds read an
        # unbatched input's axes differently.
        self.folds_unbatched = kind is nn.Dropout
        self.p = list(p)
        self.inplace = inplace

    @classmethod
    def from_members(cls, members: Sequence[nn.Module], path: str) -> Self:
        check_same_config(members, path, ignore=cls.per_member_attrs)
        dropouts = [m for m in members if isinstance(m, nn.modules.dropout._DropoutNd)]
        assert len(dropouts) == len(members)  # check_same_config: the members are of one class
        return cls(len(members), type(dropouts[0]), [float(m.p) for m in dropouts], dropouts[0].inplace)

    def select_members(self, index: list[int]) -> None:
        super().select_members(index)
        self.p = [self.p[i] for i in index]

    def append_members(self, other: FusedLayer) -> None:
        super().append_members(other)
        assert isinstance(other, Dropout)
        self.p = self.p + other.p

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or all(p == 0.0 for p in self.p):
            return input
        feature_fn = _FEATURE_FN.get(self.kind)
        if all(p == self.p[0] for p in self.p):
            if feature_fn is not None:
                return feature_fn(input, self.p[0], True, self.inplace)
            return F.dropout(input, self.p[0], True, self.inplace)
        x = self._to_front(input)
        self._check_batch(x)
        b = self.num_members
        keep = 1.0 - torch.tensor(self.p, dtype=x.dtype, device=x.device)
        # Elementwise dropout masks every element; feature dropout whole channels.
        mask_shape = x.shape if feature_fn is None else (*x.shape[:2], *([1] * (x.dim() - 2)))
        rows = torch.rand(mask_shape, dtype=x.dtype, device=x.device).reshape(b, -1)
        keep_b = keep.unsqueeze(1)
        # Scale 1/(1-p), and 0 (not NaN) for members with p == 1, as torch does.
        scale = torch.where(keep_b > 0, 1.0 / keep_b.clamp_min(torch.finfo(x.dtype).tiny), 0.0)
        mask = (rows < keep_b).to(x.dtype) * scale
        y = x * mask.reshape(mask_shape)
        return self._from_front(y)
