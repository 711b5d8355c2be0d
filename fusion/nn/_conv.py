"""Fused Conv1d/2d/3d and ConvTranspose1d/2d/3d as grouped convolutions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import FusionError
from ._base import FusedLayer, recall_channel_major, remember_channel_major

_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T_FN = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _to_channels(x: torch.Tensor, b: int) -> torch.Tensor:
    """[B*N, C, *S] (member-major rows) -> [N, B*C, *S] for one grouped conv."""
    n = x.shape[0] // b
    return x.reshape(b, n, *x.shape[1:]).transpose(0, 1).reshape(n, b * x.shape[1], *x.shape[2:])


def _from_channels(y: torch.Tensor, b: int) -> torch.Tensor:
    """[N, B*C, *S] -> [B*N, C, *S], the inverse of :func:`_to_channels`."""
    n, bc = y.shape[:2]
    c = bc // b
    return y.reshape(n, b, c, *y.shape[2:]).transpose(0, 1).reshape(b * n, c, *y.shape[2:])


class _ConvBase(FusedLayer):
    """Shared code of fused convolutions: stacked ``[B, ...]`` weight and bias."""

    twin_of = nn.modules.conv._ConvNd
    stacked_params = ('weight', 'bias')

    weight: nn.Parameter
    bias: nn.Parameter | None
    # torch's convolutions take an unbatched [C, *S] input as a batch of one.
    folds_unbatched = True

    def __init__(self, num_members: int, conv: nn.modules.conv._ConvNd) -> None:
        super().__init__(num_members)
        self.in_channels = conv.in_channels
        self.out_channels = conv.out_channels
        self.kernel_size = conv.kernel_size
        self.stride = conv.stride
        self.padding = conv.padding
        self.dilation = conv.dilation
        self.output_padding = conv.output_padding
        self.groups = conv.groups
        self.padding_mode = conv.padding_mode
        self._reversed_padding_repeated_twice = conv._reversed_padding_repeated_twice
        self.dims = len(conv.kernel_size)

    def extra_repr(self) -> str:
        return (
            f"num_members={self.num_members}, {self.in_channels}, {self.out_channels}, "
            f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"
        )


class Conv(_ConvBase):
    """B ``nn.ConvNd`` layers, computed one of two ways (same result):

    - ``"grouped"``: the member axis moves from the batch into the channel axis
      and one grouped convolution (``groups * B``) runs for all members. One
      kernel call, but two layout copies and CPU grouped-conv kernels that are
      slow on large feature maps.
    - ``"loop"``: one convolution per member on its contiguous block of rows
      (``chunk``; the backward is a single ``cat``). Best where each
      convolution is big enough to keep the cores busy.

    ``impl="auto"`` (default) picks per call: grouped while a member's input
    sample is small (below ``GROUPED_MAX_SAMPLE`` elements, where per-call
    overhead dominates), loop above. Measured on a 2-core CPU; see
    docs/benchmarks.md.
    """

    #: Largest per-sample input (C*H*W elements) for which "auto" uses grouped.
    GROUPED_MAX_SAMPLE = 2048
    impl: str = "auto"

    def _use_grouped(self, input: torch.Tensor) -> bool:
        if self.impl != "auto":
            return self.impl == "grouped"
        return input[0].numel() <= self.GROUPED_MAX_SAMPLE

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() != self.dims + 2:
            raise FusionError(f"fused Conv{self.dims}d expects a batched {self.dims + 2}-D input")
        b = self.num_members
        self._check_batch(input)
        x = input
        padding: tuple[int, ...] | str | int = self.padding
        if self.padding_mode != "zeros":
            # Same as torch: pad explicitly, then convolve without padding.
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = 0 if isinstance(self.padding, str) else (0,) * self.dims
        conv = _CONV_FN[self.dims]
        if b == 1:
            # squeeze(0), not [0]: a view whose backward is a view too (select's backward
            # writes the gradient into a fresh zero tensor).
            bias1 = None if self.bias is None else self.bias.squeeze(0)
            return conv(x, self.weight.squeeze(0), bias1, self.stride, padding, self.dilation, self.groups)
        if not self._use_grouped(x):
            biases = [None] * b if self.bias is None else self.bias.unbind(0)
            return torch.cat([
                conv(xb, wb, bb, self.stride, padding, self.dilation, self.groups)
                for xb, wb, bb in zip(x.chunk(b), self.weight.unbind(0), biases)
            ])
        w = self.weight.reshape(b * self.out_channels, *self.weight.shape[2:])
        bias = None if self.bias is None else self.bias.reshape(-1)
        xc = recall_channel_major(x, b) if x is input else None
        if xc is None:
            xc = _to_channels(x, b)
        y = conv(xc, w, bias, self.stride, padding, self.dilation, self.groups * b)
        out = _from_channels(y, b)
        remember_channel_major(out, y, b)
        return out


class ConvTranspose(_ConvBase):
    """B ``nn.ConvTransposeNd`` layers as one grouped transposed convolution."""

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if output_size is not None:
            raise FusionError(
                "fused ConvTranspose does not accept output_size; set output_padding on the layer"
            )
        if input.dim() != self.dims + 2:
            raise FusionError(
                f"fused ConvTranspose{self.dims}d expects a batched {self.dims + 2}-D input"
            )
        b = self.num_members
        self._check_batch(input)
        # _ConvNd declares a padding string ("same") too; a transposed convolution's is a tuple.
        assert not isinstance(self.padding, str)
        # Transposed weights are [in, out/groups, *k]; member blocks stack along "in".
        w = self.weight.reshape(b * self.in_channels, *self.weight.shape[2:])
        bias = None if self.bias is None else self.bias.reshape(-1)
        y = _CONV_T_FN[self.dims](
            _to_channels(input, b),
            w,
            bias,
            self.stride,
            self.padding,
            self.output_padding,
            self.groups * b,
            self.dilation,
        )
        return _from_channels(y, b)
