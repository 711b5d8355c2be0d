"""Fused Linear and Bilinear: one batched matmul for all members."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._base import FusedLayer


class _BatchedLinear(torch.autograd.Function):
    """``x @ weight^T + bias`` per member (``x`` ``[B, M, in]``, ``weight`` ``[B, out, in]``).

    The forward is the ``baddbmm`` of the plain path; the backward computes the weight
    gradient as ``grad^T @ x``, which has the weight's own layout, where autograd's
    ``baddbmm`` backward yields the transpose of ``x^T @ grad`` and AccumulateGrad then
    copies it into the weight's layout (a strided copy as large as the weight, per step).
    Written in the classic ``forward(ctx, ...)`` form, whose call costs a third of the
    ``setup_context`` form's; that form alone works under torch.func transforms, so the
    layer takes the plain path there. The backward is differentiable (double backward)
    and ``jvp`` serves forward-mode AD.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.save_for_forward(x, weight)
        ctx.has_bias = bias is not None
        if bias is None:
            return torch.bmm(x, weight.transpose(1, 2))
        return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = torch.bmm(grad.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b

    @staticmethod
    def jvp(ctx: Any, x_t: torch.Tensor | None, w_t: torch.Tensor | None, b_t: torch.Tensor | None) -> torch.Tensor:
        x, weight = ctx.saved_tensors
        out = torch.zeros(x.shape[0], x.shape[1], weight.shape[1], dtype=x.dtype, device=x.device)
        if x_t is not None:
            out = out + torch.bmm(x_t, weight.transpose(1, 2))
        if w_t is not None:
            out = out + torch.bmm(x, w_t.transpose(1, 2))
        if b_t is not None:
            out = out + b_t.unsqueeze(1)
        return out


#: Smallest fused weight (elements) for which :class:`_BatchedLinear` pays: it saves a
#: strided copy of the weight gradient per step but its Python call costs ~15 us
#: forward and backward. Measured on a 2-core CPU with one thread: ~2-4% faster steps of
#: the digits MLP from 16 members of 64x64 weights on, ~3% slower at 4-8 members.
CUSTOM_BACKWARD_MIN_NUMEL = 65536


def _plain_autograd(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused Linear should leave the backward to autograd's own formulas.

    Without gradients there is no backward to improve; small weights copy too little
    to pay for a Python autograd function; under autocast the forward's casts belong
    to autograd's graph (the custom backward would see mixed dtypes); torch.func
    transforms need the ``setup_context`` form of a custom function.
    """
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
        return True
    if weight.numel() < CUSTOM_BACKWARD_MIN_NUMEL:
        return True
    return torch.is_autocast_enabled(x.device.type) or torch._C._are_functorch_transforms_active()


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
    folds_unbatched = True

    def __init__(self, num_members: int, linear: nn.Linear) -> None:
        super().__init__(num_members)
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.num_members == 1:
            # A single member is an ordinary layer: no batched matmul overhead. squeeze(0),
            # not [0]: a view whose backward is a view too (select's backward writes the
            # gradient into a fresh zero tensor).
            return F.linear(input, self.weight.squeeze(0), None if self.bias is None else self.bias.squeeze(0))
        x = self._to_front(input)
        self._check_batch(x)
        lead = x.shape[:-1]
        # [B*N, ..., F] -> [B, N*..., F]: a view for contiguous inputs because
        # the folded batch is member-major.
        xv = x.reshape(self.num_members, -1, self.in_features)
        weight, bias = self.weight, self.bias
        if not _plain_autograd(xv, weight):
            out = _BatchedLinear.apply(xv, weight, bias)
        elif bias is None:
            out = torch.bmm(xv, weight.transpose(1, 2))
        else:
            out = torch.baddbmm(bias.unsqueeze(1), xv, weight.transpose(1, 2))
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
