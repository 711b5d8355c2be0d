"""Fused Linear and Bilinear: one batched matmul for all members."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._base import FusedLayer, check_same_config, stack_param, stack_weight


class Linear(FusedLayer):
    """B ``nn.Linear`` layers computed by one ``baddbmm``.

    ``weight`` is ``[B, out, in]`` (each member's torch layout stacked) and is
    used transposed as a view, so no weight copy is made per step.
    """

    weight: nn.Parameter
    bias: nn.Parameter | None

    needs_batch_probe = True

    def __init__(self, num_members: int, in_features: int, out_features: int) -> None:
        super().__init__(num_members)
        self.in_features = in_features
        self.out_features = out_features

    @classmethod
    def from_members(cls, members: Sequence[nn.Module], path: str) -> Linear:
        check_same_config(members, path)
        first = members[0]
        assert isinstance(first, nn.Linear)
        layer = cls(len(members), first.in_features, first.out_features)
        layer.weight = stack_weight([m.weight for m in members])
        layer.bias = stack_param([m.bias for m in members])
        return layer

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

    weight: nn.Parameter
    bias: nn.Parameter | None

    needs_batch_probe = True

    def __init__(self, num_members: int, in1: int, in2: int, out: int) -> None:
        super().__init__(num_members)
        self.in1_features = in1
        self.in2_features = in2
        self.out_features = out

    @classmethod
    def from_members(cls, members: Sequence[nn.Module], path: str) -> Bilinear:
        check_same_config(members, path)
        first = members[0]
        assert isinstance(first, nn.Bilinear)
        layer = cls(len(members), first.in1_features, first.in2_features, first.out_features)
        layer.weight = stack_weight([m.weight for m in members])
        layer.bias = stack_param([m.bias for m in members])
        return layer

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
