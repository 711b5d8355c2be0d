"""Fused Linear and Bilinear: one batched matmul for all members."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ._base import FusedLayer


class Linear(FusedLayer):
    """B ``nn.Linear`` layers computed by one ``baddbmm``.

    ``weight`` is ``[B, out, in]`` (each member's torch layout stacked) and is
    used transposed as a view, so no weight copy is made per step.
    """

    twin_of = nn.Linear
    stacked_params = ('weight', 'bias')

    weight: nn.Parameter
    bias: nn.Parameter | None

    needs_batch_probe = True

    def __init__(self, num_members: int, linear: nn.Linear) -> None:
        super().__init__(num_members)
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.num_members == 1:
            # A single member is an ordinary layer: no batched matmul overhead.
            return F.linear(input, self.weight[0], None if self.bias is None else self.bias[0])
        x = self._to_front(input)
        self._check_batch(x)
        lead = x.shape[:-1]
        # [B*N, ..., F] -> [B, N*..., F]: a view for contiguous inputs because
        # the folded batch is member-major.
        xv = x.reshape(self.num_members, -1, self.in_features)
        wt = self.weight.transpose(1, 2)
        if self.bias is None:
            out = torch.bmm(xv, wt)
        else:
            out = torch.baddbmm(self.bias.unsqueeze(1), xv, wt)
        return self._from_front(out.reshape(*lead, self.out_features))

    def extra_repr(self) -> str:
        return (
            f"num_members={self.num_members}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )


class Bilinear(FusedLayer):
    """B ``nn.Bilinear`` layers computed by one einsum."""

    twin_of = nn.Bilinear
    stacked_params = ('weight', 'bias')

    weight: nn.Parameter
    bias: nn.Parameter | None

    needs_batch_probe = True

    def __init__(self, num_members: int, bilinear: nn.Bilinear) -> None:
        super().__init__(num_members)
        self.in1_features = bilinear.in1_features
        self.in2_features = bilinear.in2_features
        self.out_features = bilinear.out_features

    def forward(self, input1: torch.Tensor, input2: torch.Tensor) -> torch.Tensor:
        x1 = self._to_front(input1)
        x2 = self._to_front(input2)
        self._check_batch(x1)
        lead = x1.shape[:-1]
        b = self.num_members
        x1v = x1.reshape(b, -1, self.in1_features)
        x2v = x2.reshape(b, -1, self.in2_features)
        out = torch.einsum("bmi,boij,bmj->bmo", x1v, self.weight, x2v)
        if self.bias is not None:
            out = out + self.bias.unsqueeze(1)
        return self._from_front(out.reshape(*lead, self.out_features))
