"""Fused BatchNorm (per-member statistics), LayerNorm and GroupNorm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import FusionError, UnsupportedByTwin
from ._base import FusedLayer, recall_channel_major, remember_channel_major


class BatchNorm(FusedLayer):
    """B ``nn.BatchNorm1d/2d/3d`` layers; statistics never mix members.

    Running statistics are ``[B, C]`` buffers. The normalisation itself is one
    ``F.batch_norm`` over ``B*C`` channels of the input with the member axis
    moved next to the channels, so batch statistics, the unbiased running
    variance update and the eval path are exactly torch's own kernels.
    ``momentum`` may differ per member; ``momentum=None`` (cumulative average)
    is kept per member too, since members added later have seen fewer batches.
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None
    running_mean: torch.Tensor | None
    running_var: torch.Tensor | None
    num_batches_tracked: torch.Tensor | None

    twin_of = nn.modules.batchnorm._BatchNorm
    stacked_params = ("weight", "bias")
    stacked_buffers = ("running_mean", "running_var", "num_batches_tracked")
    per_member_attrs = frozenset({"momentum"})
    #: "channels": one F.batch_norm over [N, B*C, ...] (two layout copies);
    #: "loop": one F.batch_norm per member on its contiguous rows (no copies
    #: but B kernel calls); "auto" picks loop for large per-sample inputs.
    impl: str = "auto"
    LOOP_MIN_SAMPLE = 2048

    def __init__(self, num_members: int, bn: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__(num_members)
        self.num_features = bn.num_features
        self.eps = bn.eps
        self.affine = bn.affine
        self.track_running_stats = bn.track_running_stats
        self.momentum: list[float | None] = [bn.momentum] * num_members
        # Input ranks torch accepts for this BatchNorm kind (batched only).
        self._ranks = (2, 3) if isinstance(bn, nn.BatchNorm1d) else ((4,) if isinstance(bn, nn.BatchNorm2d) else (5,))

    @classmethod
    def from_members(cls, members: Sequence[nn.Module], path: str) -> Self:
        layer = super().from_members(members, path)
        assert isinstance(layer, BatchNorm)
        layer.momentum = [m.momentum for m in members]  # type: ignore[misc]
        return layer

    def select_members(self, index: list[int]) -> None:
        super().select_members(index)
        self.momentum = [self.momentum[i] for i in index]

    def append_members(self, other: FusedLayer) -> None:
        super().append_members(other)
        assert isinstance(other, BatchNorm)
        self.momentum = self.momentum + other.momentum

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() not in self._ranks:
            raise FusionError(
                f"fused BatchNorm expected a batched input of rank {self._ranks}, got rank {input.dim()}"
            )
        b = self.num_members
        n = self._check_batch(input)
        c = self.num_features
        update = self.training and self.track_running_stats
        factors: list[float] | None = None
        if update and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if any(m is None for m in self.momentum):
                counts = self.num_batches_tracked.tolist()
                factors = [1.0 / float(k) if m is None else m for m, k in zip(self.momentum, counts)]
            else:
                factors = [float(m) for m in self.momentum]  # type: ignore[arg-type]
        elif update:
            factors = [0.0 if m is None else float(m) for m in self.momentum]
        use_batch_stats = self.training or self.running_mean is None
        weight = None if self.weight is None else self.weight.reshape(-1)
        bias = None if self.bias is None else self.bias.reshape(-1)
        running_mean = running_var = None
        # Running statistics come in pairs: both buffers or neither (track_running_stats).
        if self.running_mean is not None and self.running_var is not None and (not self.training or self.track_running_stats):
            running_mean = self.running_mean.view(-1)
            running_var = self.running_var.view(-1)
        uniform = factors is None or all(f == factors[0] for f in factors)
        use_loop = b == 1 or self.impl == "loop" or (
            self.impl == "auto" and input[0].numel() >= self.LOOP_MIN_SAMPLE
        )
        if use_loop and (not update or uniform):
            return self._forward_loop(input, use_batch_stats, 0.0 if factors is None else factors[0])
        # [B*N, C, *S] -> [N, B*C, *S]: one normalisation over all members' channels (taken
        # from the layer before where it left this layout behind).
        x = recall_channel_major(input, b)
        if x is None:
            x = input.reshape(b, n, c, *input.shape[2:]).transpose(0, 1).reshape(n, b * c, *input.shape[2:])
        if not update or uniform:
            y = F.batch_norm(
                x, running_mean, running_var, weight, bias, use_batch_stats,
                0.0 if factors is None else factors[0], self.eps,
            )
        else:
            # Per-member momentum: let the kernel write the batch statistics into
            # scratch buffers (momentum 1), then blend each member with its own factor.
            assert running_mean is not None and running_var is not None and factors is not None
            batch_mean = torch.empty_like(running_mean)
            batch_var = torch.empty_like(running_var)
            y = F.batch_norm(x, batch_mean, batch_var, weight, bias, True, 1.0, self.eps)
            with torch.no_grad():
                f = torch.tensor(factors, dtype=running_mean.dtype, device=running_mean.device)
                f = f.repeat_interleave(c)
                running_mean.mul_(1 - f).add_(batch_mean * f)
                running_var.mul_(1 - f).add_(batch_var * f)
        out = y.reshape(n, b, c, *input.shape[2:]).transpose(0, 1).reshape(input.shape)
        remember_channel_major(out, y, b)
        return out

    def _forward_loop(self, input: torch.Tensor, use_batch_stats: bool, factor: float) -> torch.Tensor:
        """One F.batch_norm per member on its rows; running stats updated in place via row views."""
        b = self.num_members
        track = self.running_mean is not None and (not self.training or self.track_running_stats)
        if b == 1:
            # One member: the ordinary kernel on the input itself, no cat. squeeze(0), not [0]:
            # views whose backward is a view too (select's writes into a fresh zero tensor).
            def one(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else t.squeeze(0)

            return F.batch_norm(
                input, one(self.running_mean) if track else None, one(self.running_var) if track else None,
                one(self.weight), one(self.bias), use_batch_stats, factor, self.eps,
            )
        means = self.running_mean.unbind(0) if track and self.running_mean is not None else [None] * b
        varis = self.running_var.unbind(0) if track and self.running_var is not None else [None] * b
        weights = self.weight.unbind(0) if self.weight is not None else [None] * b
        biases = self.bias.unbind(0) if self.bias is not None else [None] * b
        return torch.cat([
            F.batch_norm(xb, rm, rv, w, bb, use_batch_stats, factor, self.eps)
            for xb, rm, rv, w, bb in zip(input.chunk(b), means, varis, weights, biases)
        ])


class LayerNorm(FusedLayer):
    """B ``nn.LayerNorm`` layers: one normalisation, per-member affine."""

    twin_of = nn.LayerNorm
    stacked_params = ('weight', 'bias')

    weight: nn.Parameter | None
    bias: nn.Parameter | None

    needs_batch_probe = True
    folds_unbatched = True

    def __init__(self, num_members: int, ln: nn.LayerNorm) -> None:
        super().__init__(num_members)
        self.normalized_shape = tuple(ln.normalized_shape)
        self.eps = ln.eps
        self.elementwise_affine = ln.elementwise_affine

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.num_members == 1:
            return F.layer_norm(
                input, self.normalized_shape, None if self.weight is None else self.weight.squeeze(0),
                None if self.bias is None else self.bias.squeeze(0), self.eps,
            )
        x = self._to_front(input)
        self._check_batch(x)
        b = self.num_members
        xv = x.reshape(b, -1, *self.normalized_shape)
        y = F.layer_norm(xv, self.normalized_shape, None, None, self.eps)
        if self.weight is not None:
            y = y * self.weight.reshape(b, 1, *self.normalized_shape)
        if self.bias is not None:
            y = y + self.bias.reshape(b, 1, *self.normalized_shape)
        return self._from_front(y.reshape(x.shape))


class GroupNorm(FusedLayer):
    """B ``nn.GroupNorm`` layers: one per-sample normalisation, per-member affine."""

    twin_of = nn.GroupNorm
    stacked_params = ('weight', 'bias')

    weight: nn.Parameter | None
    bias: nn.Parameter | None

    def __init__(self, num_members: int, gn: nn.GroupNorm) -> None:
        super().__init__(num_members)
        self.num_groups = gn.num_groups
        self.num_channels = gn.num_channels
        self.eps = gn.eps
        self.affine = gn.affine

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_batch(input)
        b = self.num_members
        y = F.group_norm(input, self.num_groups, None, None, self.eps)
        if self.weight is None:
            return y
        spatial = (1,) * (input.dim() - 2)
        yv = y.reshape(b, -1, self.num_channels, *input.shape[2:])
        yv = yv * self.weight.reshape(b, 1, self.num_channels, *spatial)
        if self.bias is not None:
            yv = yv + self.bias.reshape(b, 1, self.num_channels, *spatial)
        return yv.reshape(input.shape)


class InstanceNorm(FusedLayer):
    """B ``nn.InstanceNorm1d/2d/3d`` layers with affine parameters.

    The normalisation is per sample and so runs once for all members; the
    affine part is per member. Running statistics (``track_running_stats``)
    average over a member's batch and are not supported: such a layer raises
    :class:`FusionError` when fused.
    """

    twin_of = nn.modules.instancenorm._InstanceNorm
    stacked_params = ("weight", "bias")

    weight: nn.Parameter | None
    bias: nn.Parameter | None

    def __init__(self, num_members: int, norm: nn.modules.instancenorm._InstanceNorm) -> None:
        super().__init__(num_members)
        self.num_features = norm.num_features
        self.eps = norm.eps
        self.affine = norm.affine

    @classmethod
    def from_members(cls, members: Sequence[nn.Module], path: str) -> Self:
        first = members[0]
        if getattr(first, "track_running_stats", False):
            raise UnsupportedByTwin(
                f"submodule '{path}' ({type(first).__name__}): track_running_stats=True is not supported"
            )
        return super().from_members(members, path)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_batch(input)
        y = F.instance_norm(input, None, None, None, None, True, 0.0, self.eps)
        if self.weight is None:
            return y
        b, c = self.num_members, self.num_features
        spatial = (1,) * (input.dim() - 2)
        yv = y.reshape(b, -1, c, *input.shape[2:]) * self.weight.reshape(b, 1, c, *spatial)
        if self.bias is not None:  # affine gives both; a missing bias is skipped, as in GroupNorm
            yv = yv + self.bias.reshape(b, 1, c, *spatial)
        return yv.reshape(input.shape)
