"""MaxPool2d in channels-last memory on the CPU, where torch's kernel is several times faster.

Pooling has no per-member state and would run unchanged on the member-folded batch; it has
a twin only for speed. torch's CPU kernel for contiguous (NCHW) inputs handles one channel
plane at a time, which is slow for the small feature maps of many channels that fused
arrays pass (``[B*N, C, 8, 8]``); its channels-last kernel vectorises across channels. Both
give the same values and the same indices (flat positions within a plane), so the twin
pools in channels-last memory and returns contiguous tensors, and its backward is torch's
own NCHW kernel on those indices: results are identical to ``nn.MaxPool2d``'s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _pair

from ._base import FusedLayer

#: Fewest channels for which the channels-last kernel pays (it vectorises across them);
#: measured on a 2-core x86 CPU, it was slower for 3 channels, 3-4x faster from 16 on.
CHANNELS_LAST_MIN_CHANNELS = 16


class _ChannelsLastMaxPool2d(torch.autograd.Function):
    """``max_pool2d_with_indices`` of an NCHW ``x``, pooled in channels-last memory.

    Returns contiguous (NCHW) output and indices; the backward is torch's NCHW kernel
    (differentiable, so double backward works as for ``F.max_pool2d``).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernel_size: list[int], stride: list[int], padding: list[int],
                dilation: list[int], ceil_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out, indices = torch.ops.aten.max_pool2d_with_indices(
            x.contiguous(memory_format=torch.channels_last), kernel_size, stride, padding, dilation, ceil_mode
        )
        out, indices = out.contiguous(), indices.contiguous()
        ctx.save_for_backward(x, indices)
        ctx.args = (kernel_size, stride, padding, dilation, ceil_mode)
        ctx.mark_non_differentiable(indices)
        return out, indices

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _grad_indices: Any) -> tuple[torch.Tensor | None, ...]:
        x, indices = ctx.saved_tensors
        grad_x = torch.ops.aten.max_pool2d_with_indices_backward(grad.contiguous(), x, *ctx.args, indices)
        return grad_x, None, None, None, None, None


class MaxPool2d(FusedLayer):
    """``nn.MaxPool2d`` for the member-folded batch, pooled in channels-last memory where
    that is faster (CPU, contiguous inputs of at least ``CHANNELS_LAST_MIN_CHANNELS``
    channels); otherwise exactly ``F.max_pool2d``."""

    twin_of = nn.MaxPool2d

    def __init__(self, num_members: int, pool: nn.MaxPool2d) -> None:
        super().__init__(num_members)
        self.kernel_size = pool.kernel_size
        self.stride = pool.stride
        self.padding = pool.padding
        self.dilation = pool.dilation
        self.return_indices = pool.return_indices
        self.ceil_mode = pool.ceil_mode

    def _channels_last(self, input: torch.Tensor) -> bool:
        return (
            input.device.type == "cpu" and input.dim() == 4 and input.shape[1] >= CHANNELS_LAST_MIN_CHANNELS
            and input.is_contiguous() and input.dtype in (torch.float32, torch.float64, torch.bfloat16)
            and not torch._C._are_functorch_transforms_active()
        )

    def forward(self, input: torch.Tensor) -> Any:
        if not self._channels_last(input):
            # torch's overloads of max_pool2d take return_indices as a literal True or False
            # only, though the function dispatches on the value: a bool held matches none.
            return F.max_pool2d(  # type: ignore[call-overload]
                input, self.kernel_size, self.stride, self.padding, self.dilation,
                ceil_mode=self.ceil_mode, return_indices=self.return_indices,
            )
        stride = self.stride if self.stride is not None else self.kernel_size
        args = (_pair(self.kernel_size), _pair(stride), _pair(self.padding), _pair(self.dilation), self.ceil_mode)
        out, indices = _ChannelsLastMaxPool2d.apply(input, *args)
        return (out, indices) if self.return_indices else out

    def extra_repr(self) -> str:
        return (
            f"num_members={self.num_members}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, ceil_mode={self.ceil_mode}"
        )
