"""Fused PReLU, the one torch.nn activation with parameters (MultiheadAttention aside)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._base import FusedLayer


class PReLU(FusedLayer):
    """B ``nn.PReLU`` layers; slopes ``[B, num_parameters]`` on channel axis 1."""

    twin_of = nn.PReLU
    stacked_params = ('weight',)

    weight: nn.Parameter

    needs_batch_probe = True

    def __init__(self, num_members: int, prelu: nn.PReLU) -> None:
        super().__init__(num_members)
        self.num_parameters = prelu.num_parameters

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.num_members == 1:
            return F.prelu(input, self.weight.squeeze(0))
        x = self._to_front(input)
        self._check_batch(x)
        b = self.num_members
        xv = x.reshape(b, -1, *x.shape[1:])  # [B, N, C, ...]
        # torch's slope axis is the input's dim 1 (channels); a single slope broadcasts.
        shape = [b, 1] + [1] * (xv.dim() - 2)
        if self.num_parameters > 1:
            shape[2] = self.num_parameters
        w = self.weight.reshape(shape)
        y = torch.where(xv >= 0, xv, xv * w)
        return self._from_front(y.reshape(x.shape))
